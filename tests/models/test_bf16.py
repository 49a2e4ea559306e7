"""bf16 frozen weights on CPU (CPU supports bf16, so CI covers the casts the GPU path needs): sampling, log-prob
recompute in fp32 equal to the rollout's, and optimizer steps on fp32 LoRA weights, for image and video; the
rollout's log-prob (pi_old in bypass mode) equal to the update's first forward whatever the batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.modality.base import model_dtype
from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import accumulate_gradients

FAMILIES = {"sd3": dict(height=32, width=32), "wan": dict(height=32, width=32, num_frames=5)}
PROMPTS, SEEDS = ["a red sign", "a blue sign", "a green sign", "a sign"], [3, 4, 5, 6]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_policy_samples_recomputes_log_probs_and_trains(name, no_network):
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, noise_level=0.7, **FAMILIES[name])
    policy = DiffusionPolicy(
        f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"], dtype=torch.bfloat16
    )
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
        tensors={
            "window_latents": out.window_latents,
            "old_log_probs": out.log_probs,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            **out.conditioning,
        },
        non_tensors={"prompt": np.array(PROMPTS, dtype=object)},
        meta_info={"window_start": 1},
    )
    modality = ImageModality()
    with torch.no_grad():
        again = modality.log_probs(policy, batch)
    # Same weights, same fp32 SDE math: the importance ratio of the first inner step is 1 up to bf16 noise.
    assert (again - out.log_probs).abs().max() < 1e-3, (again - out.log_probs).abs().max()

    before = [p.detach().clone() for p in lora]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    actor_cfg = OmegaConf.create({"diffusion_loss": {"clip_ratio": 0.2}, "kl_loss_coef": 0.01})
    for _ in range(2):
        optimizer.zero_grad()
        metrics = modality.backward(policy, batch, torch.ones(4, dtype=torch.bool), actor_cfg)
        assert all(np.isfinite(v).all() for v in metrics.values())
        optimizer.step()
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in lora)
    assert any(not torch.equal(a, b) for a, b in zip(before, lora, strict=True))


CFG = {"qwen_image": dict(true_cfg_scale=4.0), "sd3": dict(guidance_scale=4.0)}


@pytest.mark.parametrize("name", list(CFG))
def test_bf16_rollout_log_prob_is_the_updates_first_forward_in_any_batching(name, monkeypatch):
    """Bypass mode compares the rollout's log-prob (pi_old) with the update's at verl-omni's clip_ratio 1e-5, so
    before the first optimizer step the two must agree to well below the clip: the same sample generated alone and in
    a batch with prompts of other lengths (two text buckets for tiny Qwen-Image's byte tokens) and seeds, updated in
    a mini-batch padded to another prompt, with SDE-window calls of 2 and 4 samples (rollout and update alike) and
    update micro-batches of 2 and 4 (micro-batches of 4 and 1: whole calls and calls filled with copies). Batched at the size a batch
    happens to have, tiny SD3 differed by 1.2e-3 here (kernels block by batch size)."""
    torch.manual_seed(0)
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=4, noise_level=0.7, **CFG[name])
    base = DiffusionPolicy(
        f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], dtype=torch.bfloat16
    )
    with torch.no_grad():  # a trained adapter (B != 0): the LoRA branch is part of every forward
        for p in base.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    window = range(1, 3)
    prompts = [
        "a sign",
        "a much longer prompt about a red shop sign that says OPEN, in white letters on blue",
        "a sign",
        "x",
        "a blue sign with white letters",
    ]
    seeds = [7, 11, 7, 12, 13]
    modality = ImageModality()
    for window_batch, micros in ((2, (2, 4)), (4, (4,))):
        policy = base.with_sampling(window_batch=window_batch)
        results = policy.generate(prompts[:1], seeds[:1], window) + policy.generate(prompts[1:], seeds[1:], window)
        samples = [
            Sample(i, f"g{i}", PromptRow(p, "t", ""), s, result=r, outcome=RewardOutcome("ok", 0.0))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        batch = DataProto.from_dict(
            tensors={
                **modality.batch_tensors(samples),
                "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0]),
                "loss_mask": torch.ones(5, dtype=torch.bool),
            },
            meta_info={"window_start": window.start},
        )
        rollout_lp = torch.stack([r.log_probs for r in results])

        seen: list[torch.Tensor] = []
        step = policy.step

        def recording_step(*args, step=step, seen=seen, **kwargs):
            out = step(*args, **kwargs)
            if torch.is_grad_enabled():  # the update's forwards, not the reference's
                seen.append(out.log_prob.detach())
            return out

        monkeypatch.setattr(policy, "step", recording_step)
        for micro in micros:
            seen.clear()
            actor_cfg = OmegaConf.create(
                {"diffusion_loss": {"clip_ratio": 1e-5}, "kl_loss_coef": 0.0, "ppo_micro_batch_size_per_gpu": micro}
            )
            metrics = accumulate_gradients(modality, policy, batch, actor_cfg)
            policy.transformer.zero_grad(set_to_none=True)
            w = len(window)
            update_lp = torch.cat([torch.stack(seen[k : k + w], 1) for k in range(0, len(seen), w)])
            ratio = (update_lp - rollout_lp).exp()
            assert (ratio - 1).abs().max() <= 1e-5, (window_batch, micro, (ratio - 1).abs().max())
            assert metrics["actor/pg_clipfrac"] == [0.0] * len(metrics["actor/pg_clipfrac"])
            assert metrics["actor/pg_clipfrac_lower"] == [0.0] * len(metrics["actor/pg_clipfrac_lower"])


def test_model_dtype_defaults_follow_the_device():
    assert model_dtype(None, "cuda:0") == torch.bfloat16 and model_dtype(None, "cpu") == torch.float32
    assert model_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="model_dtype"):
        model_dtype("int8", "cpu")


def test_bf16_lora_computes_in_bf16_with_fp32_masters_and_updates_as_the_fp32_lora(no_network):
    """LoRA in the base dtype (issue 21, item 5): the adapter's working copy is bf16, so peft's LoRA branch runs bf16
    GEMMs on the bf16 input instead of casting every site's input to fp32; the optimizer steps fp32 masters and the
    working copy is their rounding after every step. One update equals the fp32-adapter path's within bf16 noise."""
    from omni_async.trainer.actor_core import TensorBatch, update_minibatch

    cfg = SamplingConfig(num_inference_steps=4, noise_level=0.7, height=32, width=32)
    kw = dict(lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"], dtype=torch.bfloat16)
    new = DiffusionPolicy("tiny:sd3", cfg, **kw)
    old = DiffusionPolicy("tiny:sd3", cfg, **kw, trainable_dtype=torch.float32)  # peft's fp32 adapter in bf16 Linear
    masters = new.trainable_parameters()
    assert masters and all(p.dtype == torch.float32 for p in masters)
    working = [p for n, p in new.transformer.named_parameters() if ".lora_" in n]
    assert working and all(p.dtype == torch.bfloat16 for p in working)
    # One starting adapter for both, B non-zero so every LoRA weight gets a gradient; bf16-exact values.
    gen = torch.Generator().manual_seed(1)
    start = {
        k: (torch.randn(v.shape, generator=gen) * 0.05).bfloat16().float() for k, v in new.weights_state_dict().items()
    }
    new.load_weights_state_dict(start)
    old.load_weights_state_dict(start)

    site = new.transformer.transformer_blocks[0].attn.to_q
    seen = []
    hook = site.lora_A["default"].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    out = new.rollout(PROMPTS, SEEDS, window=range(1, 3))
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the LoRA GEMMs take the bf16 activations as they are

    batch = TensorBatch(
        {
            "window_latents": out.window_latents,
            "old_log_probs": out.log_probs,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "loss_mask": torch.ones(4, dtype=torch.bool),
            **out.conditioning,
        },
        {"window_start": 1},
    )
    actor_cfg = OmegaConf.create(
        {
            "diffusion_loss": {"clip_ratio": 0.2},
            "kl_loss_coef": 0.0,
            "grad_clip": 1.0e9,
            "ppo_micro_batch_size_per_gpu": 2,
        }
    )
    lr, deltas, grads, norms = 1e-3, [], [], []
    for policy in (new, old):
        params = policy.trainable_parameters()
        before = [p.detach().clone() for p in params]
        metrics = update_minibatch(ImageModality(), policy, torch.optim.AdamW(params, lr=lr), batch, actor_cfg)
        norms.append(metrics["actor/grad_norm"])
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)]))
    for w, m in zip(working, masters, strict=True):  # the working copy is the masters' rounding
        assert torch.equal(w, m.detach().to(torch.bfloat16))
    # Measured here: grad norms 0.1% apart, cosine 0.999996, weight updates at most 0.10 lr apart (mean 0.0004 lr)
    # after one AdamW step (whose per-element step is ~lr whatever the gradient's size).
    assert norms[0] == pytest.approx(norms[1], rel=1e-2)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.9999
    diff = (deltas[0] - deltas[1]).abs()
    assert diff.max() <= 0.5 * lr and diff.mean() <= 0.01 * lr
