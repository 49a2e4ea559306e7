"""The hybrid layout (``actor_rollout_ref.hybrid_engine=True``): one process per device trains and generates.

Checked on real Ray workers against the split layout (rollout replicas with their own copy of the policy).
"""

from __future__ import annotations

import pytest
import ray
import torch
from helpers import Trainers, write_prompts

from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.mode import PIPELINE

TWO_DEVICES = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.rollout.agent.num_workers=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # a group per rank (refused otherwise)
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]


@pytest.fixture
def make_trainer(tmp_path):
    trainers = Trainers(write_prompts(tmp_path / "train.jsonl", 8), tmp_path)
    yield trainers
    trainers.close()


def run(trainer: RLTrainer, steps: int):
    return [trainer.train_step(step) for step in range(steps)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds two trainers (hybrid and split); 373 s at load 20 on 2 cores
def test_hybrid_one_pipeline_per_device_no_transfer_same_samples_as_split(make_trainer):
    hybrid = make_trainer(*TWO_DEVICES, "reward.streaming=true")
    workers = hybrid.placement.rollout_workers
    actor_pids = set(
        ray.get(
            [w.__ray_call__.remote(lambda self: __import__("os").getpid()) for w in hybrid.placement.actor_wg.workers]
        )
    )
    stats = ray.get([w.stats.remote() for w in workers])
    # One process per device, and it is the actor rank: the rollout has no copy of its own.
    assert len(actor_pids) == 2 and {s["pid"] for s in stats} == actor_pids
    h_steps = run(hybrid, 2)
    stats = ray.get([w.stats.remote() for w in workers])
    assert all(s["weights_shipped"] == 0 for s in stats)  # a sync is a version bump, no weights leave the device
    assert all(s["batch_sizes"] for s in stats)  # both devices generated
    assert h_steps[1][0]["rollout/policy_version"] == 1.0

    split = make_trainer(*TWO_DEVICES, "reward.streaming=true", "actor_rollout_ref.hybrid_engine=false")
    s_steps = run(split, 2)
    # rank 0 alone ships weights: the first sync and one per step
    assert ray.get(split.placement.actor_wg.workers[0].stats.remote())["weights_shipped"] == 3
    assert ray.get(split.placement.actor_wg.workers[1].stats.remote())["weights_shipped"] == 0
    for (_, h), (_, s) in zip(h_steps, s_steps, strict=True):  # the sample for (step, index) is the same image
        for a, b in zip(sorted(h, key=lambda x: x.index), sorted(s, key=lambda x: x.index), strict=True):
            assert a.index == b.index and a.version == b.version
            torch.testing.assert_close(a.result.pixels, b.result.pixels, atol=1, rtol=0)
            torch.testing.assert_close(a.result.log_probs, b.result.log_probs, atol=1e-4, rtol=1e-4)
            assert a.outcome.score == pytest.approx(b.outcome.score, abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["async_reward.one_step_off_policy=true", "actor_rollout_ref.model.lora_rank=0"],
            "actor_rollout_ref.hybrid_engine",
            "hybrid_engine=False",
        ),
        (
            [*PIPELINE, "actor_rollout_ref.model.lora_rank=0"],
            "actor_rollout_ref.hybrid_engine",
            "hybrid_engine=False",
        ),
        (["trainer.n_gpus_per_node=2"], "actor_rollout_ref.rollout.agent.num_workers", "set it to 2"),
    ],
)
def test_hybrid_refuses_what_it_cannot_run(overrides, key, fix):
    cfg = compose(["data.train_files=x.jsonl", *overrides])
    with pytest.raises(ConfigError, match=key) as e:
        validate(cfg)
    assert fix in str(e.value)
    validate(compose(["data.train_files=x.jsonl", *overrides, "actor_rollout_ref.hybrid_engine=false"]))
