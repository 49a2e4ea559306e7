"""The SDE window's batched transformer calls (models.diffusion_policy's module docstring): the same samples and
log-probs as one call per sample, each distinct prompt encoded once, the call size from the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.trainer.actor_core import TensorBatch
from omni_async.trainer.config import ConfigError, compose, validate

# Five samples: a group's repeated prompt, texts in two of tiny Qwen-Image's 64-token buckets (192 and 256 tokens: its
# template is kept and its tokenizer reads bytes) and two SDE windows (steps 1 and 3 run some rows as SDE, the others
# as ODE). Calls of 4: full ones, and ones filled with copies of their last sample.
PROMPTS = [
    "a red sign",
    "a red sign",
    "x",
    "a much longer prompt about a red shop sign that says OPEN, in white letters on blue",
    "a sign",
]
SEEDS = [3, 4, 5, 6, 7]
WINDOWS = [range(1, 3), range(1, 3), range(2, 4), range(2, 4), range(1, 3)]


@pytest.fixture(scope="module")
def policy() -> DiffusionPolicy:
    torch.manual_seed(0)
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=4, true_cfg_scale=4.0, window_batch=4)
    policy = DiffusionPolicy("tiny:qwen_image", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"])
    with torch.no_grad():  # a trained adapter: the LoRA branch is part of every forward
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy


def test_batched_window_gives_the_per_sample_paths_samples_and_log_probs_encoding_each_prompt_once(policy, monkeypatch):
    """fp32: the window's calls of 4 samples, text padded to its bucket with a mask, give what one call per sample on
    its own text length gave before batching (window_batch=1, window_text_bucket=1), to float rounding; the rollout
    encodes each distinct prompt once (and the negative prompt once) and every sample carries its prompt's encoding."""
    encoded: list[list[str]] = []
    encode = policy.pipe.encode_prompt

    def counting(*args, prompt, **kwargs):
        encoded.append(list(prompt))
        return encode(*args, prompt=prompt, **kwargs)

    monkeypatch.setattr(policy.pipe, "encode_prompt", counting)
    batched = policy.rollout(PROMPTS, SEEDS, WINDOWS)
    monkeypatch.undo()
    assert encoded == [list(dict.fromkeys(PROMPTS)), [" "]]
    cond = batched.conditioning
    emb, mask, neg = cond["prompt_embeds"], cond["prompt_embeds_mask"], cond["negative_prompt_embeds"]
    assert torch.equal(emb[0], emb[1]) and torch.equal(mask[0], mask[1]) and not torch.equal(emb[0], emb[2])
    assert torch.equal(neg[0], neg[4])

    alone = policy.with_sampling(window_batch=1, window_text_bucket=1).rollout(PROMPTS, SEEDS, WINDOWS)
    assert torch.allclose(batched.log_probs, alone.log_probs, rtol=0, atol=1e-5), (
        (batched.log_probs - alone.log_probs).abs().max()
    )
    assert torch.allclose(batched.window_latents, alone.window_latents, rtol=0, atol=1e-5)
    diff = np.abs(batched.images.astype(np.int16) - alone.images.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    # The recompute in calls of 4 (per-sample window starts) scores the rollout's own transitions the same.
    starts = torch.tensor(batched.window_starts)
    batch = TensorBatch({"window_latents": batched.window_latents, "window_start": starts, **cond})
    with torch.no_grad():
        again = ImageModality().log_probs(policy, batch)
    assert torch.equal(again, batched.log_probs.cpu())


def test_window_batch_follows_the_update_micro_batch_and_is_checked():
    base = ["data.train_files=x.jsonl", "actor_rollout_ref.rollout.agent.max_batch_size=8"]
    modality = ImageModality()
    cfg = validate(compose([*base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]))
    assert modality.sampling_config(cfg).window_batch == 2 and modality.sampling_config(cfg).reference_batch is None
    # verl's ref micro-batch below the actor's: Flow-GRPO's window runs its reference in calls of that size
    ref = validate(compose([*base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]))  # fmt: skip
    assert modality.sampling_config(ref).reference_batch == 1
    # Unset micro-batch: the mini-batch's samples, at most a generation batch.
    assert modality.sampling_config(validate(compose(base))).window_batch == 8
    with pytest.raises(ConfigError, match="window_batch_size"):
        validate(compose([*base, "actor_rollout_ref.rollout.pipeline.window_batch_size=0"]))


def test_the_reference_forward_runs_in_window_calls_of_the_ref_micro_batch(policy):
    """verl's ref.log_prob_micro_batch_size_per_gpu (SamplingConfig.reference_batch): the adapter-off KL forward of an
    SDE-window loss runs in calls of at most that many samples (here 2 of the window's 4; CFG puts both branches of a
    sample in its call), the live forward keeps the window's calls, and the reference velocities are those of the
    uncapped calls to float rounding (only the KL reads them)."""
    capped = policy.with_sampling(reference_batch=2)
    short = [0, 1, 2, 4]  # one text bucket: one window call of 4
    pick = lambda xs: [xs[k] for k in short]  # noqa: E731
    out = capped.rollout(pick(PROMPTS), pick(SEEDS), pick(WINDOWS))
    cond = capped.conditioning_from(out.conditioning)
    x = out.window_latents[:, 0].to(capped.device)
    rows: list[int] = []

    def record(module, args, kwargs):
        rows.append((args[0] if args else kwargs["hidden_states"]).shape[0])

    hook = capped.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            capped.velocity(cond, x, 1)
            live_rows, rows[:] = list(rows), []
            with capped.reference():
                ref = capped.velocity(cond, x, 1)
            ref_rows = list(rows)
            with policy.reference():
                ref_full = policy.velocity(policy.conditioning_from(out.conditioning), x, 1)
    finally:
        hook.remove()
    assert live_rows == [8] and ref_rows == [4, 4]  # 4 samples x 2 CFG branches, then 2 calls of 2 x 2
    assert torch.allclose(ref, ref_full, rtol=0, atol=1e-5), (ref - ref_full).abs().max()
    assert not capped._in_reference  # the cap ends with the reference
