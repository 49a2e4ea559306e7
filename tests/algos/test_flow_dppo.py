"""Flow-DPPO pinned to verl-omni's formula (``FlowDPPOLoss`` at a1139ba, ``docs/algo/flowdppo.md``), written out
sample by sample below, on the same tensors; and its divergence checked against the KL of real SDE steps."""

import math

import pytest
import torch

from omni_async.algos.flow_dppo import flow_dppo_loss, new_old_divergence
from omni_async.algos.sde import sde_step_with_logprob

torch.set_num_threads(1)


def reference(lp, old_lp, adv, mu, mu_old, std_dev_t, sqrt_dt, tau, add_kl_coefficient=True):
    """Per sample: D = mean((mu - mu_old)^2 / (2 (std_dev_t sqrt_dt)^2)) (or / 2), drop when D >= tau and the
    update moves away (A > 0, rho > 1 or A < 0, rho < 1), loss = mean of -A rho over the rest (dropped count 0)."""
    n = lp.shape[0]
    total, dropped, divs = 0.0, [], []
    for i in range(n):
        rho = math.exp(float(lp[i]) - float(old_lp[i]))
        a = float(adv[i])
        d2 = ((mu[i] - mu_old[i]) ** 2).flatten().tolist()
        s = float(std_dev_t[i]) * float(sqrt_dt[i]) if add_kl_coefficient else 1.0
        div = sum(x / (2 * s * s) for x in d2) / len(d2)
        drop = div >= tau and ((a > 0 and rho > 1) or (a < 0 and rho < 1))
        total += 0.0 if drop else -a * rho
        dropped.append(drop)
        divs.append(div)
    return total / n, dropped, divs


def make():
    """Six samples, one per branch of the mask: far/near x A sign x ratio side."""
    g = torch.Generator().manual_seed(0)
    mu_old = torch.randn(6, 3, 4, generator=g)
    far, near = 0.5, 1e-3
    step = torch.tensor([far, far, far, far, near, near])[:, None, None]
    mu = mu_old + step * torch.randn(mu_old.shape, generator=g).sign()
    old_lp = torch.zeros(6)
    lp = torch.log(torch.tensor([1.3, 0.8, 0.7, 1.2, 1.5, 0.6]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0])
    std_dev_t = torch.tensor([0.9, 0.8, 1.1, 1.0, 0.7, 1.2])
    sqrt_dt = torch.tensor([0.3, 0.3, 0.25, 0.25, 0.4, 0.4])
    return lp, old_lp, adv, mu, mu_old, std_dev_t, sqrt_dt


def test_matches_verl_omni_formula_every_branch():
    lp, old_lp, adv, mu, mu_old, sd, sq = make()
    tau = 0.1
    want, dropped, divs = reference(lp, old_lp, adv, mu, mu_old, sd, sq, tau)
    assert dropped == [True, False, True, False, False, False]  # the test covers each branch
    lp = lp.clone().requires_grad_()
    loss, m = flow_dppo_loss(
        lp, old_lp, adv, torch.ones(6), mean=mu, old_mean=mu_old, std_dev_t=sd, sqrt_dt=sq, kl_mask_threshold=tau
    )
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    rho = torch.exp(lp.detach())
    keep = torch.tensor([not d for d in dropped])
    # kept: d/dlogp (-A rho) / n; dropped: no gradient at all
    assert torch.allclose(lp.grad, torch.where(keep, -adv * rho / 6, torch.zeros(6)), rtol=1e-6)
    assert m["actor/kl_mask_fraction"].item() == pytest.approx(4 / 6)
    assert m["actor/pos_rm_fraction"].item() == pytest.approx(1 / 6)
    assert m["actor/neg_rm_fraction"].item() == pytest.approx(1 / 6)
    assert m["actor/masked_fraction"].item() == pytest.approx(2 / 6)
    assert m["actor/unmasked_fraction"].item() == pytest.approx(4 / 6)
    assert m["actor/kl_new_old_mean"].item() == pytest.approx(sum(divs) / 6, rel=1e-5)
    assert m["actor/kl_new_old_max"].item() == pytest.approx(max(divs), rel=1e-5)
    r = rho.tolist()
    assert m["actor/ratio_min"].item() == pytest.approx(min(r)) and m["actor/ratio_max"].item() == pytest.approx(max(r))
    assert m["actor/ratio_std"].item() == pytest.approx(float(rho.std(unbiased=False)), rel=1e-5)
    assert m["actor/approx_kl"].item() == pytest.approx(float((0.5 * lp.detach() ** 2).mean()), rel=1e-5)


def test_without_kl_coefficient_the_drift_is_not_normalised():
    lp, old_lp, adv, mu, mu_old, sd, sq = make()
    tau = 0.005
    want, dropped, divs = reference(lp, old_lp, adv, mu, mu_old, sd, sq, tau, add_kl_coefficient=False)
    loss, m = flow_dppo_loss(
        lp,
        old_lp,
        adv,
        torch.ones(6),
        mean=mu,
        old_mean=mu_old,
        std_dev_t=None,
        sqrt_dt=None,
        kl_mask_threshold=tau,
        add_kl_coefficient=False,
    )
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["actor/kl_new_old_max"].item() == pytest.approx(max(divs), rel=1e-5)
    # with sigma < 1 the normalised divergence is larger: the same threshold drops more there
    normalised = new_old_divergence(mu, mu_old, sd, sq)
    assert torch.all(normalised > new_old_divergence(mu, mu_old, None, None, add_kl_coefficient=False))


def test_divergence_is_the_kl_of_the_two_sde_transitions():
    """D with SDEStep's std_dev_t and sqrt_dt is KL(pi_theta step || pi_old step) per element, averaged: checked
    against E_{x ~ pi_theta}[log p_theta(x) - log p_old(x)] with the full Gaussian log-density."""
    g = torch.Generator().manual_seed(1)
    n = 4000
    x = torch.randn(1, 32, generator=g).expand(n, 32)
    v_old = torch.randn(1, 32, generator=g).expand(n, 32)
    v_new = v_old + 1.5 * torch.randn(1, 32, generator=g)
    kw = dict(noise_level=0.8, sde_type="sde", sigma_max=0.95)
    new = sde_step_with_logprob(v_new, x, 0.7, 0.55, noise=torch.randn(n, 32, generator=g), **kw)
    old = sde_step_with_logprob(v_old, x, 0.7, 0.55, prev_sample=new.prev_sample, **kw)
    div = new_old_divergence(new.mean, old.mean, new.std_dev_t, new.sqrt_dt)
    mc = new.log_prob - old.log_prob  # mean over dims of the per-element log-density ratio
    assert float(div[0]) > 0.05
    assert float(div[0]) == pytest.approx(float(mc.mean()), abs=4 * float(mc.std()) / math.sqrt(n))
    # a [B] scale and the broadcast [B, ...] one give the same D
    d_vec = new_old_divergence(new.mean[:3], old.mean[:3], new.std_dev_t[:3, 0], new.sqrt_dt[:3, 0])
    assert torch.allclose(d_vec, div[:3])


def test_masked_samples_are_left_out_even_when_not_finite():
    lp, old_lp, adv, mu, mu_old, sd, sq = make()
    keep = torch.tensor([1, 1, 0, 1, 1, 0])
    lp, mu = lp.clone(), mu.clone()
    lp[2], mu[5] = 500.0, float("inf")
    lp.requires_grad_()
    loss, m = flow_dppo_loss(
        lp, old_lp, adv, keep, mean=mu, old_mean=mu_old, std_dev_t=sd, sqrt_dt=sq, kl_mask_threshold=0.1
    )
    loss.backward()
    k = keep.bool()
    want, _, _ = reference(lp.detach()[k], old_lp[k], adv[k], mu[k], mu_old[k], sd[k], sq[k], 0.1)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert torch.isfinite(lp.grad).all() and lp.grad[2] == 0 and lp.grad[5] == 0
    assert all(torch.isfinite(v) for v in m.values())
    assert m["actor/masked_fraction"].item() == pytest.approx(1 / 4)


def test_zero_noise_has_zero_divergence_and_needs_scales():
    mu = torch.randn(2, 3)
    d = new_old_divergence(mu, mu + 1.0, torch.zeros(2), torch.full((2,), 0.3))
    assert torch.equal(d, torch.zeros(2))
    with pytest.raises(ValueError, match="std_dev_t and sqrt_dt"):
        new_old_divergence(mu, mu, None, None)


def test_kl_and_is_weights():
    lp, old_lp, adv, mu, mu_old, sd, sq = make()
    w = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 1.0])
    kl = torch.arange(6.0) / 10
    loss, m = flow_dppo_loss(
        lp,
        old_lp,
        adv,
        torch.ones(6),
        mean=mu,
        old_mean=mu_old,
        std_dev_t=sd,
        sqrt_dt=sq,
        kl_mask_threshold=0.1,
        kl=kl,
        kl_coef=0.2,
        is_weights=w,
    )
    rho = torch.exp(lp)
    keep = torch.tensor([0.0, 1, 0, 1, 1, 1])
    want = (w * keep * -adv * rho).mean() + 0.2 * kl.mean()
    assert loss.item() == pytest.approx(float(want), rel=1e-6)
    assert m["actor/kl_loss"].item() == pytest.approx(0.25)
