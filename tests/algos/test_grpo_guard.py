"""GRPO-Guard pinned to verl-omni's formula (``GRPOGuardLoss`` at a1139ba, ``docs/algo/grpo_guard.md``), written
out below independently of the implementation, on the same tensors; and the property the regulation exists for."""

import math

import pytest
import torch

from omni_async.algos.grpo_guard import grpo_guard_loss
from omni_async.algos.sde import sde_step_with_logprob

torch.set_num_threads(1)


def reference(lp, old_lp, adv, mu, mu_old, std_dev_t, sqrt_dt, clip_ratio, adv_clip_max):
    """The doc's formula, sample by sample: S = mean(sqrt_dt) mean(std_dev_t), b = mean(d^2) / (2 S^2),
    rho = exp((log-ratio + b) S), loss = mean(max(-A rho, -A clip(rho))) / mean(sqrt_dt)^2."""
    n = lp.shape[0]
    sdt = sum(float(sqrt_dt[i]) for i in range(n)) / n
    sig = sum(float(std_dev_t[i].mean()) for i in range(n)) / n
    s = sdt * sig
    total = 0.0
    for i in range(n):
        a = max(-adv_clip_max, min(adv_clip_max, float(adv[i])))
        b = float(((mu[i] - mu_old[i]) ** 2).mean()) / (2 * s * s)
        rho = math.exp((float(lp[i]) - float(old_lp[i]) + b) * s)
        total += max(-a * rho, -a * min(max(rho, 1 - clip_ratio), 1 + clip_ratio))
    return total / n / sdt**2


def make(n=6, seed=0, drift=0.05):
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(n, 4, 3, 3, generator=g)
    mu = mu_old + drift * torch.randn(mu_old.shape, generator=g)
    old_lp = torch.randn(n, generator=g)
    lp = old_lp + 0.3 * torch.randn(n, generator=g)
    adv = 3.0 * torch.randn(n, generator=g)
    # per-sample windows: each sample at its own denoising step, so the scales differ per sample
    std_dev_t = (0.5 + torch.rand(n, generator=g))[:, None, None, None].expand_as(mu)
    sqrt_dt = 0.2 + 0.2 * torch.rand(n, generator=g)
    return lp, old_lp, adv, mu, mu_old, std_dev_t, sqrt_dt


@pytest.mark.parametrize("clip_ratio", [0.5, 1e-3])  # the second clips most samples
def test_matches_verl_omni_formula(clip_ratio):
    lp, old_lp, adv, mu, mu_old, sd, sq = make()
    loss, m = grpo_guard_loss(
        lp,
        old_lp,
        adv,
        torch.ones(6),
        mean=mu,
        old_mean=mu_old,
        std_dev_t=sd,
        sqrt_dt=sq,
        clip_ratio=clip_ratio,
        adv_clip_max=2.0,
    )
    want = reference(lp, old_lp, adv, mu, mu_old, sd, sq, clip_ratio, 2.0)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert m["actor/pg_loss"].item() == pytest.approx(want, rel=1e-5)
    assert m["actor/ppo_kl"].item() == pytest.approx(float((old_lp - lp).mean()), rel=1e-5)
    if clip_ratio < 0.01:
        assert m["actor/pg_clipfrac"].item() > 0  # the clipped branch is taken for some samples


def test_gradient_matches_the_formula_through_mean_and_log_prob():
    lp, old_lp, adv, mu, mu_old, sd, sq = make(seed=1)
    lp, mu = lp.clone().requires_grad_(), mu.clone().requires_grad_()
    loss, _ = grpo_guard_loss(
        lp, old_lp, adv, torch.ones(6), mean=mu, old_mean=mu_old, std_dev_t=sd, sqrt_dt=sq, clip_ratio=0.5
    )
    loss.backward()
    # the same formula in torch ops, differentiated by autograd
    lp2, mu2 = lp.detach().clone().requires_grad_(), mu.detach().clone().requires_grad_()
    s = sq.mean() * sd.mean()
    b = ((mu2 - mu_old) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)
    rho = torch.exp((lp2 - old_lp + b) * s)
    want = torch.maximum(-adv * rho, -adv * rho.clamp(0.5, 1.5)).mean() / sq.mean() ** 2
    want.backward()
    assert torch.allclose(lp.grad, lp2.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(mu.grad, mu2.grad, rtol=1e-5, atol=1e-9)
    assert mu.grad.abs().sum() > 0  # the bias term carries gradient into the mean


def test_at_old_policy_ratio_is_one_and_gradient_is_scaled():
    """theta = old: rho = 1; d loss / d logp_i = -A_i S / (n |dt|), the S and 1 / |dt| of the regulation."""
    lp, _, adv, mu, _, sd, sq = make(seed=2)
    lp = lp.clone().requires_grad_()
    loss, m = grpo_guard_loss(
        lp, lp.detach(), adv, torch.ones(6), mean=mu, old_mean=mu, std_dev_t=sd, sqrt_dt=sq, clip_ratio=0.1
    )
    assert m["actor/ratio_mean"].item() == pytest.approx(1.0) and m["actor/ratio_std"].item() == 0.0
    assert m["actor/ratio_mean_bias"].item() == 0.0
    dt = float(sq.mean()) ** 2
    assert loss.item() == pytest.approx(float(-adv.mean()) / dt, rel=1e-6)
    loss.backward()
    s = float(sq.mean() * sd.mean())
    assert torch.allclose(lp.grad, -adv * s / (6 * dt), rtol=1e-5)


def test_masked_samples_leave_loss_scale_and_metrics():
    lp, old_lp, adv, mu, mu_old, sd, sq = make(n=5, seed=3)
    keep = torch.tensor([1, 0, 1, 1, 0])
    # garbage in the dropped samples, scales included: they must not reach S, the loss or the metrics
    lp[1], mu[4], sq[1], sd = 50.0, mu[4] + 100.0, 9.0, sd.clone()
    sd[4] = 40.0
    loss, m = grpo_guard_loss(lp, old_lp, adv, keep, mean=mu, old_mean=mu_old, std_dev_t=sd, sqrt_dt=sq, clip_ratio=0.3)
    k = keep.bool()
    want = reference(lp[k], old_lp[k], adv[k], mu[k], mu_old[k], sd[k], sq[k], 0.3, float("inf"))
    assert loss.item() == pytest.approx(want, rel=1e-5)
    _, m_sub = grpo_guard_loss(
        lp[k],
        old_lp[k],
        adv[k],
        torch.ones(3),
        mean=mu[k],
        old_mean=mu_old[k],
        std_dev_t=sd[k],
        sqrt_dt=sq[k],
        clip_ratio=0.3,
    )
    for key, v in m_sub.items():
        assert m[key].item() == pytest.approx(v.item(), rel=1e-5, abs=1e-9), key


def test_regulated_log_ratio_is_centred_on_real_sde_steps():
    """On Flow-SDE transitions drawn from pi_old, the raw log-ratio averages -b (the ratio sits below 1); adding b
    centres it: the reason for the regulation, checked with SDEStep's own std_dev_t and sqrt_dt."""
    g = torch.Generator().manual_seed(4)
    n = 4000
    x = torch.randn(1, 64, generator=g).expand(n, 64)
    v_old = torch.randn(1, 64, generator=g).expand(n, 64)
    v_new = v_old + 2.0 * torch.randn(1, 64, generator=g)
    kw = dict(noise_level=0.7, sde_type="sde", sigma_max=0.9)
    old = sde_step_with_logprob(v_old, x, 0.6, 0.5, noise=torch.randn(n, 64, generator=g), **kw)
    new = sde_step_with_logprob(v_new, x, 0.6, 0.5, prev_sample=old.prev_sample, **kw)
    assert torch.allclose(new.std_dev_t * new.sqrt_dt, new.std)  # S is the transition std on sde steps
    raw = new.log_prob - old.log_prob
    s = float(new.std[0, 0])
    b = float(((new.mean - old.mean) ** 2).mean(dim=1)[0]) / (2 * s * s)
    assert b > 0.05
    se = float(raw.std()) / math.sqrt(n)
    assert float(raw.mean()) == pytest.approx(-b, abs=4 * se)
    _, m = grpo_guard_loss(
        new.log_prob,
        old.log_prob,
        torch.ones(n),
        torch.ones(n),
        mean=new.mean,
        old_mean=old.mean,
        std_dev_t=new.std_dev_t,
        sqrt_dt=new.sqrt_dt,
        clip_ratio=10.0,
    )
    assert m["actor/ratio_mean_bias"].item() == pytest.approx(b, rel=1e-4)
    # rho = exp(S * centred log-ratio): its mean is 1 up to the second-order term exp(S^2 var / 2)
    centred = (raw + b) * s
    assert float(centred.mean()) == pytest.approx(0.0, abs=4 * float(centred.std()) / math.sqrt(n))
    assert m["actor/ratio_mean"].item() == pytest.approx(float(torch.exp(centred).mean()), rel=1e-5)


def test_noise_level_zero_is_finite():
    lp = torch.zeros(3, requires_grad=True)
    mu = torch.randn(3, 2)
    loss, m = grpo_guard_loss(
        lp,
        torch.zeros(3),
        torch.ones(3),
        torch.ones(3),
        mean=mu,
        old_mean=mu + 1.0,
        std_dev_t=0.0,
        sqrt_dt=torch.full((3,), 0.3),
        clip_ratio=0.2,
    )
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert m["actor/ratio_mean"].item() == 1.0


def test_kl_and_is_weights():
    lp, old_lp, adv, mu, mu_old, sd, sq = make(n=4, seed=5)
    w = torch.tensor([1.0, 0.5, 2.0, 0.0])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4])
    base = dict(mean=mu, old_mean=mu_old, std_dev_t=sd, sqrt_dt=sq, clip_ratio=0.4)
    loss, m = grpo_guard_loss(lp, old_lp, adv, torch.ones(4), kl=kl, kl_coef=0.5, is_weights=w, **base)
    s = sq.mean() * sd.mean()
    b = ((mu - mu_old) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)
    rho = torch.exp((lp - old_lp + b) * s)
    pg = (w * torch.maximum(-adv * rho, -adv * rho.clamp(0.6, 1.4))).mean() / sq.mean() ** 2
    assert loss.item() == pytest.approx(float(pg + 0.5 * kl.mean()), rel=1e-5)
    assert m["actor/kl_loss"].item() == pytest.approx(0.25)
