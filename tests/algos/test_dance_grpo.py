"""DanceGRPO pinned to verl-omni's formula (a1139ba: ``FlowMatchSDEDiscreteScheduler.sample_previous_step`` with
``sde_type="dance_sde"``, ``FlowGRPOLoss`` registered as ``dance_grpo``), written out below in verl-omni's own form
(the score-based correction) independently of the implementation, on random fp64 tensors; and the registry's
dispatch of it."""

import math

import pytest
import torch

from omni_async.algos.dance_grpo import dance_grpo_loss, dance_sde_mean_std
from omni_async.algos.loss_modes import LOSS_MODES
from omni_async.algos.sde import kl_to_reference, sde_step_with_logprob
from omni_async.algos.window_losses import WindowStepInputs

torch.set_num_threads(1)
F64 = torch.float64


def reference_step(v, x, x_next, sigma, sigma_next, eta):
    """verl-omni's dance_sde: mu = x + dsigma v + (-eta^2 / 2 score) dsigma, score = -(x - x0 (1 - sigma)) / sigma^2,
    x0 = x - sigma v; std = eta sqrt(sigma - sigma_next); log-prob the Gaussian density, mean over dims."""
    dsigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mu = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    std = eta * math.sqrt(sigma - sigma_next)
    lp = -((x_next - mu) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return mu, std, lp.mean(dim=tuple(range(1, lp.ndim)))


def reference_loss(lp, old_lp, adv, clip_ratio, adv_clip_max):
    """verl-omni's FlowGRPOLoss, sample by sample: A clipped, rho = exp(lp - old), mean max(-A rho, -A clip(rho))."""
    total = 0.0
    for i in range(lp.shape[0]):
        a = max(-adv_clip_max, min(adv_clip_max, float(adv[i])))
        rho = math.exp(float(lp[i]) - float(old_lp[i]))
        total += max(-a * rho, -a * min(max(rho, 1 - clip_ratio), 1 + clip_ratio))
    return total / lp.shape[0]


# (sigma, sigma_next): the first step (sigma = 1, where Flow-GRPO's sde needs its sigma_max guard), a middle one and
# the last (sigma_next = 0)
STEPS = [(1.0, 0.9), (0.6, 0.45), (0.2, 0.0)]


@pytest.mark.parametrize(("sigma", "sigma_next"), STEPS)
def test_step_matches_verl_omni_dance_sde(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    eta = 1.2  # verl-omni's recipe's noise_level
    v, x = torch.randn(3, 4, 5, 5, generator=g, dtype=F64), torch.randn(3, 4, 5, 5, generator=g, dtype=F64)
    x_next = x + (sigma_next - sigma) * v + 0.3 * torch.randn(x.shape, generator=g, dtype=F64)
    mu_ref, std_ref, lp_ref = reference_step(v, x, x_next, sigma, sigma_next, eta)

    mean, std = dance_sde_mean_std(v, x, torch.tensor(sigma, dtype=F64), torch.tensor(sigma_next, dtype=F64), eta)
    assert mean.dtype == F64 and torch.allclose(mean, mu_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(std, torch.full_like(mean, std_ref), rtol=1e-12)

    # the step the trainer runs (fp32 inside, as the references assert): same numbers at fp32 precision
    out = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=eta, sde_type="dance_sde", prev_sample=x_next)
    assert torch.allclose(out.mean.double(), mu_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.log_prob.double(), lp_ref, rtol=1e-5, atol=1e-5)
    # verl-omni returns the transition std as std_dev_t: its KLLoss divides by 2 s^2
    assert torch.allclose(out.std_dev_t.double(), torch.full_like(mu_ref, std_ref), rtol=1e-6)
    ref_mu = mu_ref + 0.01 * torch.randn(x.shape, generator=g, dtype=F64)
    kl = kl_to_reference(out.mean.double(), ref_mu, out.std_dev_t.double())
    want_kl = ((mu_ref - ref_mu) ** 2).mean(dim=(1, 2, 3)) / (2 * std_ref**2)
    assert torch.allclose(kl, want_kl, rtol=1e-4)


def test_step_is_flow_grpo_sde_with_a_constant_std_dev_t_and_euler_at_zero_noise():
    g = torch.Generator().manual_seed(1)
    v, x = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    dance = sde_step_with_logprob(v, x, 0.5, 0.3, noise_level=0.8, sde_type="dance_sde", noise=torch.zeros_like(x))
    # Flow-GRPO's sde at sigma = 0.5 has std_dev_t = noise_level sqrt(sigma / (1 - sigma)) = noise_level: the same
    sde = sde_step_with_logprob(v, x, 0.5, 0.3, noise_level=0.8, sde_type="sde", noise=torch.zeros_like(x))
    assert torch.allclose(dance.mean, sde.mean, atol=1e-6) and torch.allclose(dance.std, sde.std, atol=1e-6)
    euler = sde_step_with_logprob(v, x, 0.5, 0.3, noise_level=0.0, sde_type="dance_sde", noise=torch.randn_like(x))
    assert torch.allclose(euler.prev_sample, x - 0.2 * v, atol=1e-6) and bool((euler.log_prob == 0).all())


@pytest.mark.parametrize("clip_ratio", [0.5, 1e-4])  # the second (verl-omni's default) clips most samples
def test_loss_matches_verl_omni_flow_grpo_loss_through_the_registry(clip_ratio):
    g = torch.Generator().manual_seed(2)
    n = 8
    old_lp = torch.randn(n, generator=g, dtype=F64)
    lp = (old_lp + 0.2 * torch.randn(n, generator=g, dtype=F64)).requires_grad_()
    adv = 4.0 * torch.randn(n, generator=g, dtype=F64)
    clipped = adv.clamp(-2.0, 2.0)  # this project clips when the batch is built (LossMode.clips_advantages)
    loss, metrics = dance_grpo_loss(lp, old_lp, clipped, torch.ones(n), clip_ratio=clip_ratio)
    assert loss.item() == pytest.approx(reference_loss(lp.detach(), old_lp, adv, clip_ratio, 2.0), rel=1e-12)
    mode = LOSS_MODES["dance_grpo"]
    assert mode.built and mode.clips_advantages and mode.algorithm == "dance_grpo" and mode.backward == "window"
    out = sde_step_with_logprob(
        torch.zeros(n, 2), torch.zeros(n, 2), 0.5, 0.3, noise_level=1.0, prev_sample=torch.zeros(n, 2)
    )
    out.log_prob = lp  # the step's log-prob under the current weights
    step = WindowStepInputs(out, old_lp, clipped, torch.ones(n))
    via, _ = mode.window_loss(step, type("DL", (), {"clip_ratio": clip_ratio})())
    assert via.item() == loss.item()
    assert metrics["actor/ratio_mean"].item() == pytest.approx(float((lp.detach() - old_lp).exp().mean()), rel=1e-12)
    via.backward()
    assert lp.grad is not None and bool(torch.isfinite(lp.grad).all())
