import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_async.algos.sde import gaussian_log_prob, kl_to_reference, sde_step_with_logprob, sde_window


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_level_zero_is_diffusers_euler(sde_type):
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=g)
        sched._step_index = i
        want = sched.step(v, t, x, return_dict=False)[0]
        got = sde_step_with_logprob(v, x, sched.sigmas[i], sched.sigmas[i + 1], noise_level=0.0,
                                    sde_type=sde_type, noise=torch.randn(x.shape, generator=g)).prev_sample
        assert torch.equal(got, want) or torch.allclose(got, want, atol=1e-6, rtol=0)
        x = want


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_logprob_of_drawn_sample_recomputes_and_is_gaussian(sde_type):
    g = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    drawn = sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=0.7, sde_type=sde_type, noise=noise)
    again = sde_step_with_logprob(v, x, 0.6, 0.5, noise_level=0.7, sde_type=sde_type, prev_sample=drawn.prev_sample)
    assert torch.allclose(drawn.log_prob, again.log_prob, atol=1e-6)
    # Hand formula: the sample is mean + s * noise, so logp = mean(-noise^2/2) - log s - log sqrt(2 pi).
    s = drawn.std.reshape(2, -1)[:, 0]
    want = (-(noise**2) / 2).mean(dim=(1, 2, 3)) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(drawn.log_prob, want, atol=1e-5)


def test_sde_std_formula_and_sigma_one_guard():
    x, v = torch.zeros(1, 2), torch.zeros(1, 2)
    step = sde_step_with_logprob(v, x, 0.5, 0.4, noise_level=0.7, noise=torch.zeros(1, 2))
    assert torch.allclose(step.std, torch.full((1, 2), 0.7 * math.sqrt(0.5 / 0.5) * math.sqrt(0.1)))
    at_one = sde_step_with_logprob(v, x, 1.0, 0.9, noise_level=0.7, sigma_max=0.9, noise=torch.ones(1, 2))
    assert torch.isfinite(at_one.prev_sample).all() and torch.isfinite(at_one.log_prob).all()
    assert torch.allclose(at_one.std, torch.full((1, 2), 0.7 * math.sqrt(0.9 / 0.1) * math.sqrt(0.1)))


def test_kl_and_gaussian_helpers():
    m, r, s = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor(2.0)
    assert torch.allclose(kl_to_reference(m, r, s), torch.tensor([(1 / 8 + 4 / 8) / 2]))
    assert torch.allclose(gaussian_log_prob(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)),
                          torch.tensor([-0.5 * math.log(2 * math.pi)]))


def test_window_bounds_and_determinism():
    w = [list(sde_window(10, 3, (0, 5), torch.Generator().manual_seed(s))) for s in range(50)]
    assert all(len(x) == 3 and 0 <= x[0] < 5 and x[-1] < 10 for x in w)
    assert len({x[0] for x in w}) > 1
    assert w[7] == list(sde_window(10, 3, (0, 5), torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError):
        sde_window(10, 3, (0, 9), torch.Generator())
