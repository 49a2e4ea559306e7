"""Placement on a Ray cluster of two nodes (``ray.cluster_utils.Cluster``: two raylets on this machine)."""

from __future__ import annotations

import json

import pytest
import ray
from helpers import SMALL_LORA, two_node_cluster

from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import compose
from omni_async.trainer.loop import FlowGRPOTrainer

# Training runs (not in the fast tier), on a two-raylet cluster of their own (each in a pytest process of its own).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_ray_cluster")]


def test_reward_pool_lands_on_the_other_node(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "data_source": "ocr", "reward_model": {"ground_truth": "x"}}) + "\n"
            for i in range(4)
        )
    )
    cluster = two_node_cluster()
    trainer = None
    try:
        cfg = compose(
            [
                f"data.train_files={tmp_path}/train.jsonl",
                f"trainer.run_dir={tmp_path}/run",
                f"trainer.ray.address={cluster.address}",
                "actor_rollout_ref.model.path=tiny:sd3",
                *SMALL_LORA,
                "data.train_batch_size=2",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                "actor_rollout_ref.rollout.height=32",
                "actor_rollout_ref.rollout.width=32",
                "actor_rollout_ref.rollout.num_inference_steps=3",
                "actor_rollout_ref.rollout.algo.sde_window_range=[0,2]",
                "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.jpeg",
                "reward.reward_model.enable_resource_pool=True",
                "trainer.logger=[jsonl]",
            ]
        )
        trainer = FlowGRPOTrainer(cfg)
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
