"""Micro-batches inside a mini-batch: the accumulated gradient step equals the un-micro-batched one (fp32,
parameters to 1e-6), for images and text, with a masked (failed) sample in the mini-batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.modality import get_modality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
from omni_async.trainer.actor_core import accumulate_gradients

PROMPTS = ["a red sign", "a blue sign", "say 12", "ok"]


def image_case():
    torch.manual_seed(0)
    policy = DiffusionPolicy(
        "tiny:sd3",
        SamplingConfig(height=32, width=32, num_inference_steps=4),
        lora_rank=4,
        lora_alpha=8,
        target_modules=["to_q", "to_v"],
    )
    out = policy.rollout(PROMPTS, [1, 2, 3, 4], window=range(1, 3))
    tensors = {
        "window_latents": out.window_latents,
        "old_log_probs": out.log_probs + 0.01 * torch.arange(4.0)[:, None],
        **out.conditioning,
    }
    return policy, get_modality("image"), tensors, {"window_start": 1}


def text_case():
    torch.manual_seed(0)
    policy = TextPolicy("tiny:qwen2", TextSamplingConfig(response_length=6), lora_rank=0)
    results = policy.generate(PROMPTS, [1, 2, 3, 4])
    modality = get_modality("text")
    from omni_async.sample import PromptRow, RewardOutcome, Sample

    samples = [
        Sample(i, f"u{i // 2}", PromptRow(p, "x", ""), i, result=r, outcome=RewardOutcome("ok", 1.0))
        for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))
    ]
    tensors = modality.batch_tensors(samples)
    tensors["old_log_probs"] = tensors["old_log_probs"] - 0.05
    return policy, modality, tensors, {}


@pytest.mark.parametrize("case", [image_case, text_case], ids=["image", "text"])
def test_micro_batched_update_equals_the_full_update(case):
    policy, modality, tensors, meta = case()
    tensors = {
        **tensors,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "loss_mask": torch.tensor([True, True, False, True]),
    }  # sample 2 failed: out of the loss
    batch = DataProto.from_dict(
        tensors=tensors, non_tensors={"prompt": np.array(PROMPTS, dtype=object)}, meta_info=meta
    )
    start = copy.deepcopy(policy.weights_state_dict())
    finals = []
    for micro in (None, 1, 3):
        policy.load_weights_state_dict(start)
        params = policy.trainable_parameters()
        # SGD: the parameter change is the accumulated gradient itself. (Adam divides by sqrt(v), which turns the
        # ~1e-9 rounding of near-zero gradient entries into ~1e-6 parameter noise whatever the micro-batching.)
        optimizer = torch.optim.SGD(params, lr=0.05)
        cfg = OmegaConf.create(  # text reads clip_ratio (verl's key), images diffusion_loss.clip_ratio
            {
                "clip_ratio": 0.2,
                "diffusion_loss": {"clip_ratio": 0.2},
                "kl_loss_coef": 0.0,
                "ppo_micro_batch_size_per_gpu": micro,
            }
        )
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            accumulate_gradients(modality, policy, batch, cfg)
            optimizer.step()
        finals.append({k: v.clone() for k, v in policy.weights_state_dict().items()})
    moved = max((finals[0][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-5  # the update did something
    for other in finals[1:]:
        diff = max((finals[0][k] - other[k]).abs().max().item() for k in start)
        assert diff < 1e-6, diff


def test_gradient_checkpointing_gives_the_same_gradient():
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = DiffusionPolicy(
            "tiny:sd3",
            SamplingConfig(height=32, width=32, num_inference_steps=4),
            lora_rank=4,
            lora_alpha=8,
            target_modules=["to_q", "to_v"],
            gradient_checkpointing=checkpointing,
        )
        assert policy.transformer.is_gradient_checkpointing == checkpointing
        out = policy.rollout(PROMPTS[:2], [1, 2], window=range(1, 3))
        cond = policy.encode(PROMPTS[:2])
        step = policy.step(cond, out.window_latents[:, 0], 1, prev_sample=out.window_latents[:, 1])
        step.log_prob.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable_parameters()]))
    assert grads[0].abs().max() > 0 and (grads[0] - grads[1]).abs().max() < 1e-6


def test_non_finite_gradient_norm_skips_the_optimizer_step():
    from omni_async.trainer.actor_core import clipped_step

    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    (w * torch.tensor([1.0, float("nan"), 1.0])).sum().backward()
    assert clipped_step(optimizer, [w], 1.0) is None and torch.equal(w.detach(), torch.ones(3))
    optimizer.zero_grad()
    (w * 2).sum().backward()
    assert clipped_step(optimizer, [w], 1.0) == pytest.approx(2 * 3**0.5) and not torch.equal(w.detach(), torch.ones(3))
