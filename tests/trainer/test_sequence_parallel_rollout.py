"""Ulysses in generation, on real Ray actor ranks (CPU, gloo): one sequence-parallel group of 2 actor ranks in the
hybrid layout, one-step off-policy (updates run while the rollout generates, so the trainer's calls and generation
batches reach the two ranks in their own orders: ``trainer.group_order`` puts them in the leader's), trains as one
rank alone: the same samples, seeds, versions and rewards step for step, and the same weights. The leader took every
request; the other rank generated each of its batches with it."""

from __future__ import annotations

import ray
from helpers import SMALL_IMAGE_TRAINER, Trainers, write_prompts
from parity_cases import assert_close, weights_fingerprint

STEPS = 2  # step 1 generates while step 0 updates: the two orders meet
BASE = [
    *(o for o in SMALL_IMAGE_TRAINER if not o.startswith("actor_rollout_ref.model.path=")),
    "actor_rollout_ref.model.path=tiny:qwen_image",
    "async_reward.one_step_off_policy=true",
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]
GROUP = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.rollout.agent.num_workers=1",
]


def run(trainers: Trainers, *overrides: str) -> tuple[dict, list[dict]]:
    t = trainers(*overrides)
    steps = []
    for step in range(STEPS):
        _, samples = t.train_step(step)

        steps.append(sorted([s.uid, s.index, s.seed, s.version, float(s.outcome.score), s.advantage] for s in samples))
    ranks = t.placement.actor_wg.workers
    weights = ray.get(ranks[0].get_weights.remote())
    return {"steps": steps, "weights": weights_fingerprint(weights)}, ray.get([w.stats.remote() for w in ranks])


def test_a_sequence_parallel_group_generates_and_trains_as_one_rank(tmp_path):
    trainers = Trainers(write_prompts(tmp_path / "train.jsonl", 16), tmp_path / "runs", base=BASE)
    try:
        alone, _ = run(trainers)
        group, (leader, follower) = run(trainers, *GROUP)
    finally:
        trainers.close()
    # generation on half of every sequence per rank gives the samples to float rounding; the rewards (JPEG sizes of
    # 8-bit images) and the weights follow
    assert_close(group, alone, tol=1e-4, weight_tol=1e-4)
    # every trained sample came from the leader's batches (the step after the last may have begun too)
    assert sum(leader["batch_sizes"]) >= sum(len(s) for s in group["steps"])
    # the other rank took no request and ran each of the leader's batches with it (one may be on the devices still)
    assert follower["batch_sizes"] == [] and follower["followed_batches"] - len(leader["batch_sizes"]) in (0, 1)
