"""Fully async training (``async_reward.fully_async``): verl's ``async_training.*`` keys and verl v1 / verl-omni's
``separate_async`` spelling, and a real run on a rollout pool with a trainer slower than the rollout.

The rollouter's scheduling is stressed over hundreds of steps in tests/agent_loop/test_rollouter.py; here the same
code runs with real rollout workers, reward workers and trainer ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
from helpers import Trainers, record_trained_uids, train_step_killing_rollout, write_prompts

from omni_async.agent_loop.rollout_replica import sample_seed
from omni_async.trainer.config import (
    ConfigError,
    compose,
    fully_async_bounds,
    groups_per_update,
    sync_period_steps,
    total_training_steps,
    validate,
)
from omni_async.trainer.strategies import FullyAsync, OnPolicy

POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
FULLY_ASYNC = [*POOL, "async_reward.fully_async=true"]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1"]


def valid(*overrides: str, config_name: str = "flowgrpo_trainer"):
    return validate(compose(["data.train_files=x.jsonl", *overrides], config_name=config_name))


# ---- keys (no Ray) ---------------------------------------------------------------------------------------------
def test_verl_fully_async_keys_and_verl_omni_separate_async_compose():
    # verl's fully-async recipe keys: 8 prompts, updates of 2 x 2 groups, a sync every 2 updates, threshold 0.5
    cfg = valid(
        *FULLY_ASYNC,
        "async_training.staleness_threshold=0.5",
        "async_training.require_batches=2",
        "async_training.trigger_parameter_sync_step=2",
        "rollout.total_rollout_steps=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    )
    assert groups_per_update(cfg) == 4 and total_training_steps(cfg, 100) == 2 and sync_period_steps(cfg) == 2
    assert fully_async_bounds(cfg) == (12, 2)  # floor(1.5 x 2 x 2 x 2) groups per window; ceil(12 / 4) - 1
    assert cfg.async_training.partial_rollout  # verl's default, an image run: kept
    # null total_rollout_steps: the lock-step run's prompts (4 steps x 4), in updates of 2 groups
    assert total_training_steps(valid(*FULLY_ASYNC), 100) == 8
    # verl-omni's separate-async script: its overrides carry over, the version span tightens the bound
    omni = valid(
        *POOL,
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.sampler.max_off_policy_strategy=drop",
        "async_training.staleness_threshold=3",
    )
    assert omni.async_reward.fully_async and fully_async_bounds(omni) == (4, 1)  # span <= 2: lag <= 1
    # verl-omni's on-policy recipe (threshold 1, sync every update) is synchronous
    assert (
        fully_async_bounds(
            valid(*POOL, "trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1")
        )[1]
        == 0
    )
    text = valid(
        *FULLY_ASYNC,
        "async_training.partial_rollout=false",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        config_name="grpo_text_trainer",
    )
    assert text.async_reward.fully_async


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["async_reward.fully_async=true"], "async_reward.fully_async", "actor_rollout_ref.rollout.nnodes=1"),
        (
            [*FULLY_ASYNC, "async_reward.one_step_off_policy=true"],
            "async_reward.fully_async",
            "one_step_off_policy=false",
        ),
        ([*FULLY_ASYNC, "async_reward.update_pipeline=true"], "async_reward.fully_async", "update_pipeline=false"),
        ([*FULLY_ASYNC, "reward.streaming=false"], "reward.streaming", "streaming=auto"),
        ([*FULLY_ASYNC, "algorithm.rollout_correction.bypass_mode=false"], "bypass_mode", "bypass_mode=true"),
        ([*FULLY_ASYNC, "async_training.staleness_threshold=-1"], "staleness_threshold", "synchronous"),
        ([*FULLY_ASYNC, "async_training.require_batches=0"], "require_batches", "default 1"),
        ([*FULLY_ASYNC, "rollout.total_rollout_steps=1"], "rollout.total_rollout_steps", "raise it"),
        (
            [
                *FULLY_ASYNC,
                "async_training.trigger_parameter_sync_step=3",
                "trainer.v1.sampler.max_off_policy_threshold=2",
            ],
            "max_off_policy_threshold",
            "set it >= 3",
        ),
        ([*FULLY_ASYNC, "trainer.v1.sampler.max_off_policy_strategy=keep"], "max_off_policy_strategy", "drop or wait"),
        ([*POOL, "trainer.v1.sampler.max_off_policy_threshold=2"], "max_off_policy_threshold", "fully_async=true"),
        (
            [*POOL, "trainer.v1.trainer_mode=separate_async", "async_reward.one_step_off_policy=true"],
            "trainer.v1.trainer_mode",
            "drop async_reward.one_step_off_policy",
        ),
        ([*FULLY_ASYNC, "trainer.v1.trainer_mode=sync"], "trainer.v1.trainer_mode", "drop one of them"),
    ],
)
def test_refused_fully_async_combinations_name_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError, match=key) as e:
        valid(*overrides)
    assert fix in str(e.value)


def test_text_partial_rollout_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="async_training.partial_rollout") as e:
        valid(*FULLY_ASYNC, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", config_name="grpo_text_trainer")
    assert "partial_rollout=false" in str(e.value)


# ---- on Ray ----------------------------------------------------------------------------------------------------
@pytest.fixture
def trainers(tmp_path):
    made = Trainers(write_prompts(tmp_path / "train.jsonl", 8), tmp_path)
    yield made
    made.close()


@pytest.mark.slow
def test_image_run_with_a_slow_trainer_and_a_killed_rollout_worker_stays_in_bounds_trains_every_group_once(trainers):
    """Staleness 1, a sync every 2 updates of 1 group (K=2, n=1): at most floor(2 x 2) = 4 groups started per window
    and a lag of at most ceil(4 / 1) - 1 = 3 steps. Each update is slowed by 1 s, far longer than a group takes to
    generate, so the rollouter runs into both bounds. verl's default partial_rollout=true on images. The rollout
    worker is killed during the first step."""
    t = trainers(
        *FULLY_ASYNC, *QUIET, "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2"
    )
    assert (t.source.cap, t.source.bound, t.total_steps) == (4, 3, 8)
    trained = record_trained_uids(t.ops)
    real_step = t.ops.optimizer_step

    def slow_step(minibatch, timer):
        time.sleep(1.0)
        return real_step(minibatch, timer)

    t.ops.optimizer_step = slow_step
    # The rollout worker is killed (as kill -9) once its first batch is done: Ray restarts it, it gets the newest
    # weights and the requests it had are generated again, identical (same seed, window and weights version).
    replica = t.placement.rollout_workers[0]
    first_metrics, first_samples = train_step_killing_rollout(t, 0, replica)
    rows = [first_metrics]
    for s in first_samples:  # before the first sync (at step 2) the rollout still holds version 0
        again = ray.get(replica.generate.remote(s.row.prompt, s.seed, s.window))
        assert again.version == s.version == 0 and np.array_equal(again.result.pixels, s.result.pixels)
    for step in range(1, t.total_steps):
        metrics, samples = t.train_step(step)
        rows.append(metrics)
        assert len({s.uid for s in samples}) == 1 and len(samples) == 4  # one whole group per update
        assert all(s.version % 2 == 0 and s.version <= step for s in samples)  # weights of a sync at most K back
        assert step - min(s.version for s in samples) <= 3
        assert metrics["fully_async/rollouter/window"] <= 4
        assert metrics["fully_async/count/started_groups"] <= step + 1 + 4  # trained + at most one window ahead
    assert sum(r["rollout/regenerated"] for r in rows) >= 1
    lags = [r["training/off_policy/trajectory_staleness/max"] for r in rows]
    assert max(lags) == 3  # the slow trainer let the rollouter run to its bound, not past it
    # every group of the 4 draws of 2 prompts trained exactly once (all its 4 samples), none dropped
    assert sorted(trained) == sorted(f"{d}-{p}" for d in range(4) for p in range(2) for _ in range(4))
    assert len(trained) == 8 * 4
    assert rows[-1]["fully_async/count/dropped_stale_samples"] == 0
    assert max(r["fully_async/rollouter/idle_ratio"] for r in rows[1:]) > 0.3  # paused at the bound
    assert all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_resume_from_a_lock_step_checkpoint_goes_on_with_the_next_draw(trainers):
    """A lock-step checkpoint has no rollouter position. A fully async run resumed from one (here: a real lock-step
    step 0 and its checkpoint at step 1, then the same trainer switched to fully async and resumed) goes on with draw
    1, the sampler as saved: the next prompts, and seeds and uids that step 0 did not use."""
    t = trainers(*FULLY_ASYNC, *QUIET, "trainer.resume_mode=auto", "trainer.total_training_steps=3")
    t.source = OnPolicy(t.ops)
    _, lock_step = t.train_step(0)
    t.save_checkpoint(1)
    t.source = FullyAsync(t.ops, t.total_steps)
    assert t.resume() == 1
    t.ops.sync_weights(1)
    _, samples = t.train_step(1)
    assert {s.uid.split("-")[0] for s in lock_step} == {"0"} and {s.uid.split("-")[0] for s in samples} == {"1"}
    assert all(s.seed == sample_seed(int(t.cfg.trainer.seed), 1, s.index) for s in samples)
    assert not {s.row.prompt for s in samples} & {s.row.prompt for s in lock_step}


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_kill_9_of_the_trainer_then_resume_trains_every_group_once(tmp_path):
    """The trainer process (driver, rollouter, message queue, Ray head) is killed with SIGKILL once its step-2
    checkpoint exists, with scored groups queued and more generating; the resumed run makes the checkpoint's draws
    again and regenerates the unfinished groups from their seeds. Across the two runs every group is trained exactly
    once (the steps the kill lost are the killed run's steps after the checkpoint: they count as not trained)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from helpers import ROOT, SMALL_IMAGE_TRAINER

    data = write_prompts(tmp_path / "train.jsonl", 8)
    run = tmp_path / "run"
    overrides = [
        f"data.train_files={data}",
        f"trainer.run_dir={run}",
        *SMALL_IMAGE_TRAINER,
        *FULLY_ASYNC,
        *QUIET,
        "trainer.resume_mode=auto",
        "async_training.staleness_threshold=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=2",
        "trainer.save_interval_min=-1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    runner = [sys.executable, str(ROOT / "tests/trainer/logging_trainer.py")]
    logs = [tmp_path / "killed.log", tmp_path / "resumed.log"]
    killed = subprocess.Popen(
        [*runner, str(logs[0]), *overrides],
        env={**env, "SLOW_UPDATE_S": "1.5"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = run / "checkpoints/step_000002/trainer.json"
    deadline = time.time() + 300
    while not ckpt.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert ckpt.exists() and killed.poll() is None, "the run should be past its step-2 checkpoint and still running"
    position = json.loads(ckpt.read_text())["fully_async"]
    family = _descendants(killed.pid)
    os.killpg(killed.pid, signal.SIGKILL)
    for p in family:  # Ray's head and workers, wherever they went
        try:
            p.kill()
        except Exception:
            pass
    killed.wait(30)
    subprocess.run(
        [*runner, str(logs[1]), *overrides],
        env=env,
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def rows(path):
        return [
            tuple(int(x) if i != 1 else x for i, x in enumerate(line.split())) for line in path.read_text().splitlines()
        ]

    first, second = rows(logs[0]), rows(logs[1])
    kept = [r for r in first if r[0] < 2]
    lost = [r for r in first if r[0] >= 2]
    assert {r[0] for r in second} == set(range(2, 6))  # resumed at step 2, ran to the end
    trained = [(uid, index) for _, uid, index, _ in kept + second]
    assert len(trained) == len(set(trained)) == 6 * 4  # every sample of every group once
    assert {uid for uid, _ in trained} == {f"{d}-{p}" for d in range(3) for p in range(2)}
    # the unfinished groups were regenerated with the same seeds (deterministic from (seed, draw, index))
    seeds = {(uid, index): seed for _, uid, index, seed in first + second}
    assert all(seeds[(uid, index)] == seed for _, uid, index, seed in lost)
    assert position["draw"] >= 0 and set(position["finished"]) >= {
        r[1] for r in kept if int(r[1][0]) >= position["draw"]
    }
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7)) and metrics[-1][
        "fully_async/count/dropped_stale_samples"
    ] == 0
