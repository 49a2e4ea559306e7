"""FLUX.1 through the trainer (real Ray, ``tiny:flux``: FLUX.1-dev's guidance-distilled layout at 32x32): Flow-GRPO and
DiffusionNFT each train sync, one-step-off and fully async, one trainer per loss switching modes (Flow-GRPO on the
hybrid worker, DiffusionNFT with a rollout pool); Flow-GRPO's first update scores the rollout's own samples at
ratio 1 (rollout and update agree on the packed latents)."""

from __future__ import annotations

import math

import pytest
from helpers import record_trained_uids, switch_mode

FLUX = [
    "actor_rollout_ref.model.path=tiny:flux",
    "actor_rollout_ref.rollout.pipeline.guidance_scale=3.5",  # FLUX.1-dev's guidance embedding (diffusers' default)
    "actor_rollout_ref.rollout.pipeline.max_sequence_length=32",  # T5 tokens (FluxPipeline's 512) cut for CPU
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # the step's 2 groups: one optimizer step
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
    "trainer.total_training_steps=10",
]
# verl-omni's DiffusionNFT keys (examples/diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh), as
# tests/trainer/test_diffusion_nft.py composes them
NFT = [
    "actor_rollout_ref.model.algorithm=diffusion_nft",
    "actor_rollout_ref.model.model_type=diffusion_nft_model",
    'actor_rollout_ref.model.policy_state_adapters=["default","old"]',
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5",
    "actor_rollout_ref.actor.diffusion_loss.mix_beta=0.1",
    "actor_rollout_ref.actor.diffusion_loss.adv_clip_max=5.0",
    "actor_rollout_ref.rollout.calculate_log_probs=False",
    "actor_rollout_ref.rollout.rollout_adapter=old",
    "algorithm.trainer_type=direct_preference",
    "algorithm.sample_source=online",
    "algorithm.timestep_fraction=1.0",
    "algorithm.adv_mode=continuous",
]
LOSSES = {"flow_grpo": ([], "actor/pg_loss"), "diffusion_nft": (NFT, "actor/policy_loss")}
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]


def trained(metrics: dict, loss_metric: str, mode: str = "") -> None:
    assert math.isfinite(metrics[loss_metric]) and metrics["actor/grad_norm"] > 0, (mode, metrics)
    assert metrics["reward/failed"] == 0, mode


def walk(trainer, step: int, modes: list[tuple[str, dict, int]], metric: str) -> list:
    """Train ``trainer`` on from ``step`` through ``modes`` (name, ``switch_mode`` arguments, steps), asserting every
    step trained; returns each step's samples. Every group is trained whole and once across the switches."""
    uids, drawn = record_trained_uids(trainer.ops), []
    for name, switch, steps in modes:
        if switch:
            switch_mode(trainer, **switch)
        for _ in range(steps):
            metrics, samples = trainer.train_step(step)
            trained(metrics, metric, name)
            drawn.append(samples)
            step += 1
    everything = [s.uid for samples in drawn for s in samples]
    assert sorted(set(uids)) == sorted(set(everything)) and len(uids) == len(everything)
    return drawn


@pytest.mark.slow
def test_flow_grpo_trains_stream_one_step_off_fully_async_and_sync(trainers):
    """One hybrid trainer (fully async here is verl v1's colocate_async) walks the modes; its first update scores the
    rollout's own log-probs (bypass) before any optimizer step: ratio 1."""
    keys, metric = LOSSES["flow_grpo"]
    trainer = trainers(
        *FLUX, *keys, "reward.streaming=true", "algorithm.rollout_correction.bypass_mode=true",
        "async_training.staleness_threshold=1",
    )  # fmt: skip
    metrics, samples = trainer.train_step(0)
    trained(metrics, metric)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(s.result.window_latents.shape[1:] == (4, 16) for s in samples)  # packed: 4 tokens of 2x2x4 channels
    modes = [
        ("one_step_off", {"one_step_off_policy": True}, 1),
        ("fully_async", {"one_step_off_policy": False, "fully_async": True}, 2),
        ("sync", {"streaming": False, "fully_async": False}, 1),
    ]
    walk(trainer, 1, modes, metric)


@pytest.mark.slow
def test_diffusion_nft_trains_fully_async_one_step_off_and_sync_on_a_rollout_pool(trainers):
    """DiffusionNFT with its rollout workers on their own pool (the old policy shipped to them): fully async, then
    one-step-off, then sync. The rollout is ODE with the old policy: final latents, no log-probs."""
    keys, metric = LOSSES["diffusion_nft"]
    trainer = trainers(*FLUX, *keys, *POOL, "async_reward.fully_async=true", "async_training.staleness_threshold=1")
    modes = [
        ("fully_async", {}, 2),
        ("one_step_off", {"fully_async": False, "one_step_off_policy": True}, 1),
        ("sync", {"streaming": False, "one_step_off_policy": False}, 1),
    ]
    drawn = walk(trainer, 0, modes, metric)
    assert all(s.result.latents_clean is not None and s.result.log_probs.numel() == 0 for d in drawn for s in d)
