"""DiffusionPolicy's sigma schedule is each pipeline's own, and CPS stays finite at the last step (sigma_next = 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

N = 4


def make(name: str, **sampling) -> DiffusionPolicy:
    torch.manual_seed(0)
    extra = {"num_frames": 5} if name == "wan" else {}
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=N, noise_level=0.7, **{**extra, **sampling})
    return DiffusionPolicy(f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8)


def shifted(s: float, shift: float) -> float:
    return shift * s / (1 + (shift - 1) * s)


def test_sd3_uses_its_schedulers_own_set_timesteps(no_network):
    policy = make("sd3")
    own = FlowMatchEulerDiscreteScheduler.from_config(policy.pipe.scheduler.config)
    own.set_timesteps(N)
    assert torch.equal(policy.sigmas, own.sigmas.float()) and torch.equal(policy.timesteps, own.timesteps.float())
    # By hand (tiny SD3: shift 3, 1000 training steps): t runs linearly from 1 to the shifted training sigma_min
    # 3 * 0.001 / (1 + 2 * 0.001), then the shift is applied once more; a final 0 is appended.
    lo = shifted(0.001, 3.0)
    want = [shifted(1 - k * (1 - lo) / (N - 1), 3.0) for k in range(N)] + [0.0]
    assert policy.sigmas.tolist() == pytest.approx(want, abs=1e-6)
    assert policy.timesteps.tolist() == pytest.approx([1000 * s for s in want[:-1]], abs=1e-3)
    # ... which is not Qwen-Image's linspace(1, 1/N, N) grid
    assert policy.sigmas[N - 1].item() != pytest.approx(shifted(1 / N, 3.0), abs=1e-3)


@pytest.mark.parametrize("name", ["qwen_image", "wan"])
def test_qwen_image_and_wan_use_linspace_flow_sigmas(name, no_network):
    policy = make(name)
    # tiny Qwen-Image / Wan: FlowMatchEuler, static shift 3: sigmas = shift(linspace(1, 1/N, N)) + [0]
    want = [shifted(1 - k / N, 3.0) for k in range(N)] + [0.0]
    assert policy.sigmas.tolist() == pytest.approx(want, abs=1e-6)
    assert policy.timesteps.tolist() == pytest.approx([1000 * s for s in want[:-1]], abs=1e-3)


def test_qwen_image_dynamic_shift(no_network):
    policy = make("qwen_image")
    policy.pipe.scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    sigmas, _ = policy._schedule()
    seq = (32 // policy.pipe.vae_scale_factor // 2) ** 2  # packed 2x2 latent tokens
    mu = 0.5 + (seq - 256) * (1.15 - 0.5) / (4096 - 256)
    want = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in np.linspace(1, 1 / N, N)] + [0.0]
    assert sigmas.tolist() == pytest.approx(want, abs=1e-6)


def test_wan_unipc_maps_to_flow_sigmas_with_its_flow_shift(no_network):
    policy = make("wan")
    policy.pipe.scheduler = UniPCMultistepScheduler(
        use_flow_sigmas=True, flow_shift=5.0, prediction_type="flow_prediction"
    )
    sigmas, timesteps = policy._schedule()
    want = [shifted(1 - k / N, 5.0) for k in range(N)] + [0.0]
    assert sigmas.tolist() == pytest.approx(want, abs=1e-6) and sigmas[0].item() == 1.0
    assert timesteps.tolist() == pytest.approx([1000 * s for s in want[:-1]], abs=1e-3)


def test_cps_window_on_the_last_step_is_finite(no_network):
    policy = make("sd3", sde_type="cps")
    out = policy.rollout(["a red sign", "a blue sign"], seeds=[3, 4], window=range(N - 2, N))
    assert policy.sigmas[N].item() == 0.0
    assert torch.isfinite(out.log_probs).all()
    cond = policy.encode(["a red sign", "a blue sign"])
    last = policy.step(cond, out.window_latents[:, 1], N - 1, prev_sample=out.window_latents[:, 2])
    assert torch.isfinite(last.log_prob).all() and (last.log_prob - out.log_probs[:, 1]).abs().max() < 1e-5
    last.log_prob.sum().backward()
    grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
