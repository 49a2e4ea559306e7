"""bf16 frozen weights on CPU (CPU supports bf16, so CI covers the casts the GPU path needs): sampling, log-prob
recompute in fp32 equal to the rollout's, and optimizer steps on fp32 LoRA weights, for image and video."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.modality.base import model_dtype
from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

FAMILIES = {"sd3": dict(height=32, width=32), "wan": dict(height=32, width=32, num_frames=5)}
PROMPTS, SEEDS = ["a red sign", "a blue sign", "a green sign", "a sign"], [3, 4, 5, 6]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_policy_samples_recomputes_log_probs_and_trains(name, no_network):
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, noise_level=0.7, **FAMILIES[name])
    policy = DiffusionPolicy(f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"],
                             dtype=torch.bfloat16)
    frozen = [p for p in policy.transformer.parameters() if not p.requires_grad]
    lora = policy.trainable_parameters()
    # diffusers keeps a few small modules in fp32 (Wan's _keep_in_fp32_modules); the bulk is bf16.
    bf16 = sum(p.numel() for p in frozen if p.dtype == torch.bfloat16)
    assert bf16 >= 0.8 * sum(p.numel() for p in frozen)
    assert lora and all(p.dtype == torch.float32 for p in lora)  # trainable weights and Adam state in fp32

    out = policy.rollout(PROMPTS, SEEDS, window=range(1, 3))
    assert out.window_latents.dtype == torch.float32 and out.log_probs.dtype == torch.float32
    assert torch.isfinite(out.log_probs).all() and out.images.dtype == np.uint8
    batch = DataProto.from_dict(
        tensors={"window_latents": out.window_latents, "old_log_probs": out.log_probs,
                 "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]), **out.conditioning},
        non_tensors={"prompt": np.array(PROMPTS, dtype=object)}, meta_info={"window_start": 1})
    modality = ImageModality()
    with torch.no_grad():
        again = modality.log_probs(policy, batch)
    # Same weights, same fp32 SDE math: the importance ratio of the first inner step is 1 up to bf16 noise.
    assert (again - out.log_probs).abs().max() < 1e-3, (again - out.log_probs).abs().max()

    before = [p.detach().clone() for p in lora]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    actor_cfg = OmegaConf.create({"clip_ratio": 0.2, "kl_loss_coef": 0.01})
    for _ in range(2):
        optimizer.zero_grad()
        metrics = modality.backward(policy, batch, torch.ones(4, dtype=torch.bool), actor_cfg)
        assert all(np.isfinite(v).all() for v in metrics.values())
        optimizer.step()
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in lora)
    assert any(not torch.equal(a, b) for a, b in zip(before, lora, strict=True))


def test_model_dtype_defaults_follow_the_device():
    assert model_dtype(None, "cuda:0") == torch.bfloat16 and model_dtype(None, "cpu") == torch.float32
    assert model_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="model_dtype"):
        model_dtype("int8", "cpu")
