"""Two actor ranks on the two nodes of a ``ray.cluster_utils.Cluster`` (two raylets on this machine) form one
data-parallel group (gloo) in the hybrid layout. In one cluster: each sample is trained on by exactly one rank,
every mode runs (stream, pipeline, one-step off-policy, sync), each save writes one checkpoint set (rank 0's), a
dead rank stops the step naming the last checkpoint, a resume with two ranks reproduces the next step, and a resume
with one rank continues it too (LoRA). Then, on the same cluster, a trainer with a dedicated reward pool: the actor
takes one node's device, so the reward pool lands on the other node, and a step streams across the two.

(The reward pool's placement was a test of its own with a cluster of its own, ``tests/test_multinode.py``, until
2026-11-26: starting a second two-node cluster cost ~20 s of the suite for the same check.)"""

from __future__ import annotations

import os
import shutil

import pytest
import ray
import torch
from helpers import SMALL_IMAGE_TRAINER, switch_mode, two_node_cluster, write_prompts

from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import compose
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.step_ops import ActorRankDiedError

# Training runs (not in the fast tier), on a two-raylet cluster of their own (each in a pytest process of its own).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_ray_cluster")]

# 4 prompts x 2 samples; a mini-batch of 2 groups = one group per rank.
DP = [
    *SMALL_IMAGE_TRAINER,
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
    "reward.streaming=true",
    "trainer.total_training_steps=8",  # 7 trained, the 8th stopped by a dead rank
    # pi_old = the rollout's log-probs in every mode the run switches through (one-step-off needs it; lock-step's
    # default would recompute it)
    "algorithm.rollout_correction.bypass_mode=true",
    # One sample per device batch: which samples share a batch depends on arrival times (load), and a batch of two
    # rounds differently from two of one; the resumes below compare rewards to 1e-5.
    "actor_rollout_ref.rollout.agent.max_batch_size=1",
]
# One actor device on a one-device node: the reward pool's device is the other node's.
REWARD_POOL = [
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "data.train_batch_size=2",
    "reward.reward_model.enable_resource_pool=True",
    "trainer.total_training_steps=1",
]
KEYS = ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "perf/samples_per_rank")


def ranks(nodes: int) -> list[str]:
    return [
        f"trainer.nnodes={nodes}",
        "trainer.n_gpus_per_node=1",
        f"actor_rollout_ref.rollout.agent.num_workers={nodes}",
    ]


def weights(trainer: RLTrainer) -> list[dict[str, torch.Tensor]]:
    return ray.get([w.get_weights.remote() for w in trainer.placement.actor_wg.workers])


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def resume_step_1(cfg) -> tuple[dict, dict]:
    trainer = RLTrainer(cfg)
    try:
        start = trainer.resume()
        assert start == 1
        trainer.sync_weights(start)
        metrics, _ = trainer.train_step(start)
        return metrics, weights(trainer)[0]
    finally:
        trainer.close()
        shutdown_ray()


def test_two_node_data_parallel_trains_every_mode_checkpoints_once_and_resumes(tmp_path):
    write_prompts(tmp_path / "train.jsonl", 24)
    cluster = two_node_cluster(num_cpus=16)

    def cfg(run: str, nodes: int, *extra: str):
        return compose(
            [
                f"data.train_files={tmp_path}/train.jsonl",
                f"trainer.run_dir={tmp_path}/{run}",
                f"trainer.ray.address={cluster.address}",
                *DP,
                *ranks(nodes),
                *extra,
            ]
        )

    trainer = None
    try:
        trainer = RLTrainer(cfg("run", 2))
        workers = trainer.placement.actor_wg.workers
        nodes = ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in workers])
        assert len(set(nodes)) == 2  # one rank per node
        assert [s["rank"] for s in ray.get([w.stats.remote() for w in workers])] == [0, 1]

        trainer.sync_weights(0)
        rows = []
        for step in (0, 1):
            metrics, samples = trainer.train_step(step)
            rows.append(metrics)
            trained = ray.get([w.trained_rows.remote() for w in workers])
            assert all(trained)  # both ranks trained
            seen = [r for per_rank in trained for r in per_rank]
            assert sorted(seen) == sorted((s.uid, s.index) for s in samples)  # each sample once, on one rank
            assert metrics["perf/samples_per_rank"] == len(samples) / 2
            trainer.save_checkpoint(step + 1)
            files = sorted(os.listdir(tmp_path / f"run/checkpoints/step_{step + 1:06d}"))
            assert files == ["actor.pt", "trainer.json"]  # one set per save: rank 0's
        after_two = weights(trainer)
        assert max_diff(after_two[0], after_two[1]) == 0.0  # the ranks hold one model
        after_one = torch.load(tmp_path / "run/checkpoints/step_000001/actor.pt", weights_only=True)["weights"]
        assert max_diff(after_two[0], after_one) > 1e-5  # step 2 (what the resumes must reproduce) moved them

        # The other modes on the same two ranks.
        switch_mode(trainer, update_pipeline=True)  # stream + pipeline: a mini-batch per 2 scored groups
        metrics, _ = trainer.train_step(2)
        switch_mode(trainer, update_pipeline=False, one_step_off_policy=True)  # stream + one-step off
        for step in (3, 4):
            metrics, _ = trainer.train_step(step)
        assert metrics["async_reward/policy_version_lag"] == 1.0
        switch_mode(trainer, one_step_off_policy=False, streaming=False)  # sync: score after rollout, colocated
        metrics, samples = trainer.train_step(5)
        # (step 5's draw was started by the one-step-off look-ahead before the switch: it streamed its rewards)
        assert all(s.outcome.ok for s in samples) and not trainer.reward.colocated_used
        metrics, samples = trainer.train_step(6)  # drawn after the switch: scored after rollout, colocated
        assert trainer.reward.colocated_used and all(s.outcome.ok for s in samples)
        assert metrics["actor/grad_norm"] > 0
        ray.kill(workers[1], no_restart=True)  # a rank dies: the next update stops, naming the last checkpoint
        with pytest.raises(ActorRankDiedError, match="step_000002"):
            trainer.train_step(7)
        trainer.close()
        shutdown_ray()  # the run ends here; the resumes below start from the checkpoint of step 1
        trainer = None

        for run in ("resume2", "resume1"):
            shutil.copytree(tmp_path / "run/checkpoints/step_000001", tmp_path / f"{run}/checkpoints/step_000001")
        metrics, w = resume_step_1(cfg("resume2", 2, "trainer.resume_mode=auto"))
        for k in KEYS:
            assert metrics[k] == pytest.approx(rows[1][k], rel=1e-5, abs=1e-7), k
        assert max_diff(w, after_two[0]) < 1e-6
        metrics, w = resume_step_1(cfg("resume1", 1, "trainer.resume_mode=auto"))  # LoRA: 2 ranks -> 1
        for k in KEYS[:3]:
            assert metrics[k] == pytest.approx(rows[1][k], rel=1e-4, abs=1e-6), k
        assert metrics["perf/samples_per_rank"] == 2 * rows[1]["perf/samples_per_rank"]
        assert max_diff(w, after_two[0]) < 1e-6

        trainer = RLTrainer(cfg("reward_pool", 1, *REWARD_POOL))
        assert len(ray.nodes()) == 2
        reward_node = ray.get(trainer.reward.workers[0].info.remote())["node_id"]
        actor_node = ray.get(
            trainer.placement.rollout_workers[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_node_id()
            )
        )
        assert reward_node != actor_node
        trainer.sync_weights(0)
        metrics, samples = trainer.train_step(0)  # and a step runs across the two nodes
        assert not trainer.reward.colocated_used and all(s.outcome.ok for s in samples)
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_ray()
        cluster.shutdown()
