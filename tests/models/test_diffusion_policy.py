"""The diffusion policy on tiny Qwen-Image, SD3 and Wan: rollout, log-prob recompute, CFG, LoRA, reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_async.algos.loss import flow_grpo_loss
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

FAMILIES = {
    "qwen_image": dict(height=32, width=32),
    "sd3": dict(height=32, width=32),
    "wan": dict(height=32, width=32, num_frames=5),
}


def make(name: str, **sampling) -> DiffusionPolicy:
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, noise_level=0.7, **{**FAMILIES[name], **sampling})
    return DiffusionPolicy(f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8,
                           target_modules=["to_q", "to_k", "to_v", "to_out.0"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollout_shapes_and_logprob_recompute(name, no_network):
    policy = make(name)
    out = policy.rollout(["a red sign", "a blue sign"], seeds=[3, 4], window=range(1, 3))
    frames = FAMILIES[name].get("num_frames")
    want = (2, frames, 32, 32, 3) if frames else (2, 32, 32, 3)
    assert out.images.shape == want and out.images.dtype == np.uint8
    assert out.window_latents.shape[1] == 3 and out.log_probs.shape == (2, 2)
    cond = policy.encode(["a red sign", "a blue sign"])
    for j in range(2):
        again = policy.step(cond, out.window_latents[:, j], 1 + j, prev_sample=out.window_latents[:, j + 1])
        assert (again.log_prob - out.log_probs[:, j]).abs().max() < 1e-5
        # First inner step: the same weights, so the importance ratio is exactly 1.
        _, metrics = flow_grpo_loss(again.log_prob, out.log_probs[:, j], torch.tensor([1.0, -1.0]),
                                    torch.ones(2, dtype=torch.bool), clip_ratio=0.2)
        assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_sample_does_not_depend_on_batch_or_companions():
    policy = make("sd3")
    alone = policy.rollout(["x"], [7], range(0, 2))
    together = policy.rollout(["y", "x"], [8, 7], range(0, 2))
    np.testing.assert_array_equal(alone.images[0], together.images[1])
    assert torch.allclose(alone.log_probs[0], together.log_probs[1], atol=1e-6)


@pytest.mark.parametrize("name,key", [("qwen_image", "true_cfg_scale"), ("sd3", "guidance_scale"),
                                      ("wan", "guidance_scale")])
def test_cfg_changes_the_sample(name, key):
    plain = make(name).rollout(["a cat"], [1], range(0, 1))
    guided_policy = make(name, **{key: 4.0})
    guided = guided_policy.rollout(["a cat"], [1], range(0, 1))
    assert not np.array_equal(plain.images, guided.images)
    cond = guided_policy.encode(["a cat"])  # recompute with CFG matches the rollout too
    again = guided_policy.step(cond, guided.window_latents[:, 0], 0, prev_sample=guided.window_latents[:, 1])
    assert (again.log_prob - guided.log_probs[:, 0]).abs().max() < 1e-5


def test_lora_weights_roundtrip_and_reference_is_adapter_off():
    policy, other = make("sd3"), make("sd3")
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = policy.weights_state_dict()
    assert state and all("lora" in k for k in state)
    other.load_weights_state_dict(state)
    a = policy.rollout(["z"], [5], range(0, 1))
    b = other.rollout(["z"], [5], range(0, 1))
    np.testing.assert_array_equal(a.images, b.images)
    cond = policy.encode(["z"])
    x = a.window_latents[:, 0]
    with policy.reference():
        ref = policy.step(cond, x, 0, prev_sample=a.window_latents[:, 1])
    base = make("sd3")  # freshly initialised LoRA (B = 0) == the base model
    want = base.step(base.encode(["z"]), x, 0, prev_sample=a.window_latents[:, 1])
    assert torch.allclose(ref.mean, want.mean, atol=1e-6)
    assert not torch.allclose(policy.step(cond, x, 0, prev_sample=a.window_latents[:, 1]).mean, want.mean, atol=1e-4)
    with pytest.raises(KeyError, match="do not match"):
        other.load_weights_state_dict({"transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(1)})


def test_wan_frames_must_fit_temporal_compression():
    with pytest.raises(ValueError, match=r"num_frames=4.*4\*n\+1"):
        make("wan", num_frames=4)
