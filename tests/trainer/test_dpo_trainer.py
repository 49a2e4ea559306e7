"""Online Diffusion-DPO (``loss_mode=dpo``, ``algos.dpo``) through the trainer with verl-omni's recipe keys
(``examples/dpo_trainer/qwen_image``): the actor's batch holds each group's best and worst sample as an adjacent
pair; one trainer (real Ray, tiny SD3, a rollout pool, streamed reward) goes stream -> pipeline -> fully async, and
each step trains every pair of its groups whole (in one optimizer step), in that step only.
What does not fit DPO is refused naming the fix."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import SMALL_LORA, switch_mode

from omni_async.modality import modality_of
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.step_ops import StepOps

# verl-omni's run_qwen_image_online_dpo_lora.sh, its DPO keys as written there
DPO = [
    "algorithm.trainer_type=direct_preference",
    "algorithm.sample_source=online",
    "algorithm.paired_preference=true",
    "actor_rollout_ref.model.algorithm=dpo",
    "actor_rollout_ref.model.model_type=diffusion_dpo_model",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo",
    "actor_rollout_ref.actor.diffusion_loss.dpo_beta=100.0",
    "actor_rollout_ref.rollout.calculate_log_probs=false",
]


def valid(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["actor_rollout_ref.model.algorithm=dpo"], "model.model_type", "diffusion_dpo_model"),
        ([*DPO, "algorithm.paired_preference=false"], "paired_preference", "paired_preference=True"),
        (["algorithm.paired_preference=true"], "paired_preference", "paired_preference=false"),
        ([*DPO, "actor_rollout_ref.model.lora_rank=0"], "lora_rank", "lora_rank=32"),
        ([*DPO, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu", "even"),
        (["algorithm.sample_source=offline"], "sample_source", "sample_source=online"),
        ([*DPO, "actor_rollout_ref.rollout.calculate_log_probs=true"], "calculate_log_probs", "false"),
    ],
)
def test_what_does_not_fit_dpo_is_refused_naming_the_fix(overrides, key, fix):
    assert valid(*DPO).actor_rollout_ref.actor.diffusion_loss.dpo_beta == 100.0
    with pytest.raises(ConfigError) as err:
        valid(*overrides)
    assert key in str(err.value) and fix in str(err.value), str(err.value)


def test_actor_batch_is_each_groups_best_and_worst_sample_adjacent_with_one_draw_per_pair():
    cfg = valid(*DPO)
    modality = modality_of(cfg)
    assert modality.final_latents and modality.sampling_config(cfg).clean_latents
    uids = ["a", "b", "a", "b", "a", "b"]
    scores = [0.1, 0.5, 0.9, 0.4, 0.3, 0.2]
    samples = []
    for i, (u, r) in enumerate(zip(uids, scores, strict=True)):
        s = Sample(i, u, PromptRow(f"p{u}", "x", ""), 1000 + 7 * i)
        s.outcome = RewardOutcome("ok", r)
        samples.append(s)

    def build():
        batch_tensors = {"latents_clean": torch.randn(6, 2), "rm_scores": torch.tensor(scores)[:, None]}
        modality.batch_tensors = lambda _: batch_tensors  # no rollout result needed to lay out the pairs
        return StepOps(cfg, modality, None, None).build_batch(samples)

    batch = build()
    assert batch.non_tensor_batch["index"].tolist() == [2, 0, 1, 5]  # a: 0.9 over 0.1; b: 0.5 over 0.2
    assert batch.batch["loss_mask"].all()
    for key in ("noise_seed", "train_u"):
        v = batch.batch[key]
        assert torch.equal(v[0::2], v[1::2]) and v[0] != v[2]  # shared by a pair, one draw per pair
    assert torch.equal(build().batch["train_u"], batch.batch["train_u"])  # from the seeds: the same on a resume
    assert [s.advantage is not None for s in samples] == [True, True, True, False, False, True]


# ---- a run (real Ray, tiny SD3) -----------------------------------------------------------------------------------
RUN = [
    *DPO,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "reward.streaming=true",
    "async_training.staleness_threshold=1",
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]
# One trainer walks the modes where a pair is whole (name, ``switch_mode`` arguments, steps): streamed reward, then the
# update pipeline (an optimizer step per scored group: SMALL_IMAGE_TRAINER's ppo_mini_batch_size=1, one pair), then
# fully async (2 steps span a lagged draw).
MODES = [
    ("stream", {}, 1),
    ("stream+pipeline", {"update_pipeline": True}, 1),
    ("fully_async", {"update_pipeline": False, "fully_async": True}, 2),
]


@pytest.mark.slow
def test_stream_pipeline_and_fully_async_train_every_pair_whole_in_one_step_and_once(trainers):
    trainer = trainers(*RUN)
    calls: list[list[str]] = []  # the uids of each optimizer step, in order
    real_step = trainer.ops.optimizer_step

    def recording_step(minibatch, timer):
        calls.append(minibatch.non_tensor_batch["uid"].tolist())
        return real_step(minibatch, timer)

    trainer.ops.optimizer_step = recording_step
    step, seen = 0, set()
    for name, switch, count in MODES:
        if switch:
            switch_mode(trainer, **switch)
        for _ in range(count):
            before = len(calls)
            metrics, samples = trainer.train_step(step)
            step += 1
            assert all(s.result.latents_clean is not None and s.result.window_latents.numel() == 0 for s in samples)
            assert math.isfinite(metrics["actor/dpo_loss"]) and metrics["actor/grad_norm"] > 0, name
            assert {"actor/implicit_acc", "rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(metrics)
            groups = {s.uid for s in samples}
            assert metrics["reward/masked"] == len(samples) - 2 * len(groups)  # 2 of each group train
            for uids in calls[before:]:  # a pair is whole in each optimizer step: chosen and rejected adjacent
                assert len(uids) % 2 == 0 and uids[0::2] == uids[1::2], (name, uids)
            trained = [u for uids in calls[before:] for u in uids]
            assert Counter(trained) == dict.fromkeys(groups, 2), name  # each group of the step: its pair, in this step
            assert not groups & seen, name  # and in no other step
            seen |= groups
