"""DiffusionOPD's ``distill_kl`` pinned to verl-omni's ``DistillKLLoss`` (a1139ba,
``verl_omni/trainer/diffusion/diffusion_algos.py``), written out below in its own form independently of the
implementation, on random fp64 tensors; the registry's dispatch of it; and the step mean the update computes from the
teacher's velocity (``DiffusionPolicy.step_with`` -> ``sde_step_with_logprob``), checked against the velocity-form of
Flow-GRPO's ``sde`` mean (linear in the velocity)."""

import math

import pytest
import torch

from omni_async.algos.distill import distill_kl_loss
from omni_async.algos.loss_modes import LOSS_MODES
from omni_async.algos.sde import sde_step_with_logprob
from omni_async.algos.window_losses import WindowStepInputs

torch.set_num_threads(1)
F64 = torch.float64


def verl_omni_distill_kl(prev_sample_mean, teacher_prev_sample_mean, std_dev_t):
    """verl-omni's compute_loss: ((mu - mu_T) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std_dev_t ** 2), then its
    mean over the batch; shapes (bs, s, c) and std_dev_t (bs, 1, 1). Sample by sample, in Python floats."""
    total = 0.0
    for i in range(prev_sample_mean.shape[0]):
        sq = [float(d) ** 2 for d in (prev_sample_mean[i] - teacher_prev_sample_mean[i]).flatten()]
        total += (sum(sq) / len(sq)) / (2 * float(std_dev_t[i].flatten()[0]) ** 2)
    return total / prev_sample_mean.shape[0]


def test_distill_kl_is_verl_omnis_formula():
    g = torch.Generator().manual_seed(0)
    mu, mu_t = torch.randn(5, 16, 4, generator=g, dtype=F64), torch.randn(5, 16, 4, generator=g, dtype=F64)
    std = torch.rand(5, 1, 1, generator=g, dtype=F64) + 0.1
    keep = torch.ones(5, dtype=torch.bool)
    loss, metrics = distill_kl_loss(mu, mu_t, std.expand_as(mu), keep)
    want = verl_omni_distill_kl(mu, mu_t, std)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert float(metrics["actor/distill_kl_loss"]) == pytest.approx(want, rel=1e-12)


def test_kept_samples_only_and_the_reference_term():
    g = torch.Generator().manual_seed(1)
    mu, mu_t = torch.randn(4, 8, generator=g, dtype=F64), torch.randn(4, 8, generator=g, dtype=F64)
    mu[3] = float("inf")  # a dropped sample's garbage stays out
    std = torch.full((4, 8), 0.5, dtype=F64)
    keep = torch.tensor([True, True, True, False])
    kl = torch.tensor([0.1, 0.2, 0.3, 99.0], dtype=F64)
    loss, metrics = distill_kl_loss(mu, mu_t, std, keep, kl=kl, kl_coef=0.5)
    distill = verl_omni_distill_kl(mu[:3], mu_t[:3], std[:3])
    assert float(metrics["actor/distill_kl_loss"]) == pytest.approx(distill, rel=1e-12)
    assert float(loss) == pytest.approx(distill + 0.5 * 0.2, rel=1e-12)
    assert float(metrics["actor/kl_loss"]) == pytest.approx(0.2, rel=1e-12)


def test_the_gradient_moves_the_student_toward_the_teacher():
    g = torch.Generator().manual_seed(2)
    mu = torch.randn(3, 6, generator=g, dtype=F64, requires_grad=True)
    mu_t = torch.randn(3, 6, generator=g, dtype=F64, requires_grad=True)
    loss, _ = distill_kl_loss(mu, mu_t, 0.3, torch.ones(3, dtype=torch.bool))
    loss.backward()
    assert mu_t.grad is None  # the teacher is frozen
    # d/dmu of mean (mu - mu_T)^2 / (2 s^2), averaged over 3 samples of 6 elements
    assert torch.allclose(mu.grad, (mu - mu_t).detach() / (0.3**2) / 18)


def test_registry_dispatches_distill_kl_on_the_window_step():
    mode = LOSS_MODES["distill_kl"]
    assert mode.built and mode.teacher and mode.data_path == "sde_window" and mode.algorithm == "flow_grpo"
    g = torch.Generator().manual_seed(3)
    v, v_t, x = (torch.randn(2, 4, 3, 3, generator=g, dtype=F64) for _ in range(3))
    out = sde_step_with_logprob(v, x, 0.6, 0.45, noise_level=0.7, sde_type="cps", noise=torch.zeros_like(x))
    teacher = sde_step_with_logprob(v_t, x, 0.6, 0.45, noise_level=0.7, sde_type="cps", noise=torch.zeros_like(x))
    keep = torch.ones(2, dtype=torch.bool)
    step = WindowStepInputs(out, out.log_prob, torch.zeros(2, dtype=F64), keep, teacher_mean=teacher.mean)
    loss, metrics = mode.window_loss(step, None)
    std = torch.full((2, 1, 1), 0.45 * math.sin(0.7 * math.pi / 2), dtype=F64)  # cps: std_dev_t = s
    want = verl_omni_distill_kl(out.mean.reshape(2, 9, 4), teacher.mean.reshape(2, 9, 4), std)
    assert float(loss) == pytest.approx(want, rel=1e-5)  # the SDE step computes in fp32


@pytest.mark.parametrize("sigma", [0.9, 0.5])
def test_the_teachers_step_mean_from_its_velocity(sigma):
    """Flow-GRPO's sde mean is linear in the velocity: mu_theta - mu_T = (v - v_T) (1 + s^2 (1 - sigma) / (2 sigma)) dt
    with s = eta sqrt(sigma / (1 - sigma)); so KL = mean (v - v_T)^2 c^2 dt^2 / (2 s^2)."""
    g = torch.Generator().manual_seed(4)
    v, v_t, x = (torch.randn(3, 4, 2, 2, generator=g, dtype=F64) for _ in range(3))
    sigma_next, eta = sigma - 0.2, 0.7
    zeros = torch.zeros_like(x)
    out = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=eta, sde_type="sde", noise=zeros)
    teacher = sde_step_with_logprob(v_t, x, sigma, sigma_next, noise_level=eta, sde_type="sde", noise=zeros)
    loss, _ = distill_kl_loss(out.mean, teacher.mean, out.std_dev_t, torch.ones(3, dtype=torch.bool))
    s2 = eta**2 * sigma / (1 - sigma)
    c, dt = 1 + s2 * (1 - sigma) / (2 * sigma), sigma_next - sigma
    want = float(((v - v_t) ** 2).mean()) * c**2 * dt**2 / (2 * s2)
    assert float(loss) == pytest.approx(want, rel=1e-5)  # the SDE step computes in fp32
