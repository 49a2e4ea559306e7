"""FLUX.1 through the trainer (real Ray, ``tiny:flux``: FLUX.1-dev's guidance-distilled layout at 32x32): Flow-GRPO and
DiffusionNFT each train in the lock-step modes (sync, stream, one-step-off) on the hybrid worker and fully async on a
rollout pool; Flow-GRPO's first update scores the rollout's own samples at ratio 1 (rollout and update agree on the
packed latents)."""

from __future__ import annotations

import math

import pytest
from helpers import Trainers, record_trained_uids, switch_mode, write_prompts

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


@pytest.fixture
def trainers(tmp_path):
    t = Trainers(write_prompts(tmp_path / "train.jsonl", 8), tmp_path)
    yield t
    t.close()


def trained(metrics: dict, loss_metric: str) -> None:
    assert math.isfinite(metrics[loss_metric]) and metrics["actor/grad_norm"] > 0, metrics
    assert metrics["reward/failed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSSES))
def test_trains_stream_one_step_off_and_sync(trainers, loss):
    keys, metric = LOSSES[loss]
    trainer = trainers(*FLUX, *keys, "reward.streaming=true", "algorithm.rollout_correction.bypass_mode=true")
    metrics, samples = trainer.train_step(0)
    trained(metrics, metric)
    if loss == "flow_grpo":  # bypass: pi_old is the rollout's log-prob; one optimizer step: the policy has not moved
        assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert all(s.result.window_latents.shape[1:] == (4, 16) for s in samples)  # packed 2x2 tokens
    else:  # ODE rollout with the old policy: final latents, no log-probs
        assert all(s.result.latents_clean is not None and s.result.log_probs.numel() == 0 for s in samples)
    switch_mode(trainer, one_step_off_policy=True)
    trained(trainer.train_step(1)[0], metric)
    switch_mode(trainer, streaming=False, one_step_off_policy=False)  # sync: rollout, scoring, then the update
    trained(trainer.train_step(2)[0], metric)


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSSES))
def test_trains_fully_async(trainers, loss):
    keys, metric = LOSSES[loss]
    trainer = trainers(*FLUX, *keys, *POOL, "async_reward.fully_async=true", "async_training.staleness_threshold=1")
    uids = record_trained_uids(trainer.ops)
    steps = [trainer.train_step(step) for step in range(2)]
    for metrics, _ in steps:
        trained(metrics, metric)
    drawn = [s.uid for _, samples in steps for s in samples]
    assert sorted(set(uids)) == sorted(set(drawn)) and len(uids) == len(drawn)  # each sample trained once
