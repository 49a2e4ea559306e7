"""SDE step, log-prob and KL pinned to hand-computed numbers of the flow_grpo / verl-omni formulas.

Every expected value below is written out with explicit arithmetic (``math``) from the reference formulas, not
from the implementation: ``std_dev_t = noise_level * sqrt(sigma / (1 - sigma'))``, the Flow-GRPO mean, CPS
``s = sigma_next * sin(noise_level * pi / 2)``, ``log_prob_cps = mean(-(x - mu)^2)``, ``KL = mean(d^2) / (2 std_dev_t^2)``.
"""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_async.algos.sde import gaussian_log_prob, kl_to_reference, sde_step_with_logprob, sde_window

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def t(*rows):
    return torch.tensor([list(r) for r in rows], dtype=torch.float32)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_level_zero_is_diffusers_euler(sde_type):
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    for i, ts in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=g)
        sched._step_index = i
        want = sched.step(v, ts, x, return_dict=False)[0]
        got = sde_step_with_logprob(
            v,
            x,
            sched.sigmas[i],
            sched.sigmas[i + 1],
            noise_level=0.0,
            sde_type=sde_type,
            sigma_max=float(sched.sigmas[1]),
            noise=torch.randn(x.shape, generator=g),
        )
        assert torch.allclose(got.prev_sample, want, atol=1e-6, rtol=0)
        assert torch.equal(got.log_prob, torch.zeros(3))
        x = want


def test_sde_mean_std_logprob_hand_computed():
    # sigma = 0.5 -> 0.4, noise_level 0.7: std_dev_t = 0.7 * sqrt(0.5 / 0.5) = 0.7, dt = -0.1
    x, v, prev = t([1.0, 2.0]), t([0.5, -1.0]), t([1.0, 2.0])
    step = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, prev_sample=prev)
    # mu = x (1 + 0.49 / 1.0 * -0.1) + v (1 + 0.49 * 0.5 / 1.0) * -0.1 = 0.951 x - 0.1245 v
    mu = [0.951 * 1.0 - 0.1245 * 0.5, 0.951 * 2.0 - 0.1245 * -1.0]
    assert mu == pytest.approx([0.88875, 2.0265])
    assert step.mean[0].tolist() == pytest.approx(mu, abs=1e-6)
    s = 0.7 * math.sqrt(0.1)
    assert step.std[0].tolist() == pytest.approx([s, s], abs=1e-7)
    assert step.std_dev_t[0].tolist() == pytest.approx([0.7, 0.7], abs=1e-7)
    # flow_grpo's sde log-prob: full Gaussian density, mean over dims
    lp = [-((p - m) ** 2) / (2 * s * s) - math.log(s) - LOG_SQRT_2PI for p, m in zip([1.0, 2.0], mu, strict=True)]
    assert step.log_prob.item() == pytest.approx(sum(lp) / 2, abs=1e-5)
    assert step.log_prob.item() == pytest.approx(0.52230, abs=1e-4)  # the same number, by hand


def test_sigma_one_guard_as_flow_grpo():
    # sigma = 1 -> 0.9 with sigma_max = sigmas[1] = 0.9: std_dev_t = 0.7 * sqrt(1 / (1 - 0.9)); the numerator keeps
    # sigma = 1 (flow_grpo / verl-omni: sigma / (1 - where(sigma == 1, sigma_max, sigma)))
    x, v = t([1.0, -2.0]), t([3.0, 0.5])
    step = sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7, sigma_max=0.9, noise=torch.zeros(1, 2))
    sdt = 0.7 * math.sqrt(10.0)
    assert step.std_dev_t[0, 0].item() == pytest.approx(sdt, rel=1e-5)
    assert step.std[0, 0].item() == pytest.approx(sdt * math.sqrt(0.1), rel=1e-5)  # = 0.7
    # mu = x (1 + 4.9 / 2 * -0.1) + v (1 + 4.9 * 0 / 2) * -0.1 = 0.755 x - 0.1 v
    assert step.mean[0].tolist() == pytest.approx([0.755 - 0.3, -1.51 - 0.05], abs=1e-5)
    assert torch.isfinite(step.log_prob).all()
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7, noise=torch.zeros(1, 2))


def test_cps_mean_and_flow_grpo_logprob_hand_computed():
    # sigma = 0.6 -> 0.5, noise_level 0.5: s = 0.5 sin(pi/4); sqrt(0.25 - s^2) = sqrt(0.125)
    x, v, prev = t([1.0, 0.0]), t([0.5, 1.0]), t([1.0, 0.0])
    s = 0.5 * math.sin(math.pi / 4)
    c = math.sqrt(0.25 - s * s)
    # x0^ = x - 0.6 v = [0.7, -0.6]; eps^ = x + 0.4 v = [1.2, 0.4]; mu = 0.5 x0^ + c eps^
    mu = [0.5 * 0.7 + c * 1.2, 0.5 * -0.6 + c * 0.4]
    step = sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=0.5, sde_type="cps", prev_sample=prev)
    assert step.mean[0].tolist() == pytest.approx(mu, abs=1e-6)
    assert step.std[0, 0].item() == pytest.approx(s) and step.std_dev_t[0, 0].item() == pytest.approx(s)
    # reference form: -(x - mu)^2, averaged over dims; no 1/(2 s^2), no log s, no log sqrt(2 pi)
    want = (-((1.0 - mu[0]) ** 2) - (0.0 - mu[1]) ** 2) / 2
    assert step.log_prob.item() == pytest.approx(want, abs=1e-6)
    assert step.log_prob.item() == pytest.approx(-0.038052, abs=1e-5)
    gauss = sde_step_with_logprob(
        v, x, 0.6, 0.5, noise_level=0.5, sde_type="cps", prev_sample=prev, cps_log_prob="gaussian"
    )
    lp = [-((p - m) ** 2) / (2 * s * s) - math.log(s) - LOG_SQRT_2PI for p, m in zip([1.0, 0.0], mu, strict=True)]
    assert gauss.log_prob.item() == pytest.approx(sum(lp) / 2, abs=1e-5)
    with pytest.raises(ValueError, match="cps_log_prob"):
        sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=0.5, sde_type="cps", prev_sample=prev, cps_log_prob="x")


@pytest.mark.parametrize("sde_type,cps_log_prob", [("sde", "flow_grpo"), ("cps", "flow_grpo"), ("cps", "gaussian")])
def test_logprob_of_drawn_sample_recomputes(sde_type, cps_log_prob):
    g = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    kw = dict(noise_level=0.7, sde_type=sde_type, cps_log_prob=cps_log_prob)
    drawn = sde_step_with_logprob(v, x, 0.6, 0.5, noise=noise, **kw)
    again = sde_step_with_logprob(v, x, 0.6, 0.5, prev_sample=drawn.prev_sample, **kw)
    assert torch.allclose(drawn.log_prob, again.log_prob, atol=1e-6)
    # The sample is mean + s * noise, so x - mu = s * noise.
    s = drawn.std.reshape(2, -1)[:, 0]
    if sde_type == "cps" and cps_log_prob == "flow_grpo":
        want = (-((s[:, None, None, None] * noise) ** 2)).mean(dim=(1, 2, 3))
    else:
        want = (-(noise**2) / 2).mean(dim=(1, 2, 3)) - torch.log(s) - LOG_SQRT_2PI
    assert torch.allclose(drawn.log_prob, want, atol=1e-5)


@pytest.mark.parametrize("cps_log_prob", ["flow_grpo", "gaussian"])
def test_cps_at_sigma_next_zero_is_finite(cps_log_prob):
    # The last denoising step (sigma_next = 0) inside an SDE window: s = 0, mu = x0^ = x - sigma v.
    x = t([1.0, 2.0], [0.5, -1.0])
    v = t([0.5, -1.0], [1.0, 1.0]).requires_grad_(True)
    kw = dict(noise_level=0.7, sde_type="cps", cps_log_prob=cps_log_prob)
    drawn = sde_step_with_logprob(v, x, 0.25, 0.0, noise=torch.ones(2, 2), **kw)
    assert drawn.mean.flatten().tolist() == pytest.approx([0.875, 2.25, 0.25, -1.25])
    assert torch.equal(drawn.prev_sample, drawn.mean) and torch.equal(drawn.log_prob, torch.zeros(2))
    prev = t([1.0, 2.0], [0.25, -1.25])
    step = sde_step_with_logprob(v, x, 0.25, 0.0, prev_sample=prev, **kw)
    # flow_grpo form: mean(-(prev - mu)^2) = -(0.125^2 + 0.25^2) / 2 for row 0, 0 for row 1; gaussian: 0 (s = 0)
    want = [-(0.125**2 + 0.25**2) / 2, 0.0] if cps_log_prob == "flow_grpo" else [0.0, 0.0]
    assert step.log_prob.tolist() == pytest.approx(want)
    ref = sde_step_with_logprob(v.detach() + 1.0, x, 0.25, 0.0, prev_sample=prev, **kw)
    kl = kl_to_reference(step.mean, ref.mean, step.std_dev_t)
    assert kl.tolist() == [0.0, 0.0]
    (step.log_prob.sum() + kl.sum()).backward()
    assert torch.isfinite(v.grad).all()


def test_kl_uses_std_dev_t_not_the_transition_std():
    m, r = t([1.0, 3.0]), t([0.0, 1.0])
    # mean((1, 4)) / (2 * 2^2) = 2.5 / 8
    assert kl_to_reference(m, r, torch.tensor(2.0)).tolist() == pytest.approx([0.3125])
    # Two sde steps at sigma 0.5 -> 0.4 (noise 0.7) differing by dv = [1, 2]: mu differs by -0.1245 dv, and the
    # KL divides by 2 * std_dev_t^2 = 2 * 0.49 (flow_grpo / verl-omni), not by 2 * s^2 = 2 * 0.49 * 0.1.
    x, v = t([1.0, 2.0]), t([0.5, -1.0])
    pol = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, prev_sample=x)
    ref = sde_step_with_logprob(v - t([1.0, 2.0]), x, 0.5, 0.4, noise_level=0.7, prev_sample=x)
    want = (0.1245**2 * (1 + 4) / 2) / (2 * 0.49)
    assert kl_to_reference(pol.mean, ref.mean, pol.std_dev_t).item() == pytest.approx(want, rel=1e-5)
    assert kl_to_reference(pol.mean, ref.mean, pol.std).item() == pytest.approx(want / 0.1, rel=1e-5)


def test_gaussian_helper():
    assert gaussian_log_prob(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)).tolist() == pytest.approx(
        [-LOG_SQRT_2PI]
    )
    # x - mu = 1, s = 2: -1/8 - log 2 - log sqrt(2 pi)
    assert gaussian_log_prob(torch.ones(1, 1), torch.zeros(1, 1), 2.0).item() == pytest.approx(
        -0.125 - math.log(2) - LOG_SQRT_2PI
    )


def _reference_window_starts(lo, hi, size):
    """The starts the references can draw: verl-omni ``torch.randint(lo, hi - size + 1)``, flow_grpo's pipelines
    Python ``random.randint(lo, hi - size)`` (both ends inclusive): the window never leaves ``[lo, hi)``."""
    return set(range(lo, hi - size + 1))


@pytest.mark.parametrize("size,window_range", [(2, (0, 5)), (3, (0, 5)), (1, (2, 3)), (4, (1, 10))])
def test_window_lies_inside_the_range_as_the_references(size, window_range):
    lo, hi = window_range
    w = [sde_window(10, size, window_range, torch.Generator().manual_seed(s)) for s in range(200)]
    assert all(len(x) == size and lo <= x.start and x.stop <= hi for x in w)
    assert {x.start for x in w} == _reference_window_starts(lo, hi, size)  # every reference start, no other
    assert w[7] == sde_window(10, size, window_range, torch.Generator().manual_seed(7))


def test_window_range_shorter_than_the_window_is_refused():
    with pytest.raises(ValueError, match=r"sde_window_range \[3, 5\).*sde_window_size=3"):
        sde_window(10, 3, (3, 5), torch.Generator())
    with pytest.raises(ValueError, match="10 denoising steps"):
        sde_window(10, 3, (8, 11), torch.Generator())
