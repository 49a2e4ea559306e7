"""Stream mode against the sync baseline, in-process, on real Ray actors and verl resource pools."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from helpers import SMALL_IMAGE_TRAINER, Trainers

from omni_async.trainer.loop import RewardFailureError

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]
TEST_REWARDS = str(ROOT / "tests/reward/rewards_for_tests.py")
SMALL = SMALL_IMAGE_TRAINER


@pytest.fixture
def data_dir(tmp_path):
    rows = [
        {
            "prompt": f'a sign that says "WORD{i}"',
            "data_source": "ocr",
            "reward_model": {"ground_truth": f"WORD{i}", "style": "rule"},
        }
        for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.fixture
def make_trainer(data_dir, tmp_path):
    trainers = Trainers(data_dir / "train.jsonl", tmp_path, SMALL)
    yield trainers
    trainers.close()


def scores(samples) -> list[float]:
    return [s.outcome.score for s in samples]


def test_stream_on_reward_pool_matches_sync_and_skips_colocated_reward(make_trainer):
    stream = make_trainer(
        "reward.streaming=true",
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=1",
        "reward.num_workers=1",
    )
    # Placement: the reward worker holds a device of the reward pool, not of the actor/rollout pool.
    reward_pgs = {pg.id.hex() for pg in stream.placement.pools.get_resource_pool("reward").get_placement_groups()}
    actor_pgs = {pg.id.hex() for pg in stream.placement.pools.get_resource_pool("actor").get_placement_groups()}
    info = ray.get(stream.reward.workers[0].info.remote())
    assert info["placement_group_id"] in reward_pgs and info["placement_group_id"] not in actor_pgs
    assert len(info["accelerator_ids"]["GPU"]) == 1
    # Ray's per-placement-group resources: the actor pool's device is exactly used up by the actor (0.5) and the
    # rollout replica (0.5), the reward pool's by the reward worker; nothing crossed over.
    free = ray.available_resources()
    total = ray.cluster_resources()
    for pg_id in (next(iter(actor_pgs)), next(iter(reward_pgs))):  # one device each
        assert total[f"GPU_group_{pg_id}"] == 1.0 and free.get(f"GPU_group_{pg_id}", 0.0) == 0.0

    metrics, samples = stream.train_step(0)
    assert not stream.reward.colocated_used and metrics["timing_s/reward"] == 0.0
    # Streaming: with device batches of 2, the first reward is sent while later samples are still generating.
    assert min(s.times.sent for s in samples) < max(s.times.gen_end for s in samples)
    assert metrics["reward_queue/total_produced"] == metrics["reward_queue/total_consumed"] == 8
    assert metrics["timing_s/reward_wait"] >= 0.0 and "timing_s/reward_compute/p95" in metrics
    stream_scores = scores(samples)

    sync = make_trainer("reward.streaming=false")
    metrics, samples = sync.train_step(0)
    assert sync.reward.colocated_used and metrics["timing_s/reward"] > 0.0
    assert scores(samples) == pytest.approx(stream_scores, abs=1e-9)


def test_flaky_reward_is_masked_then_failure_ratio_raises(make_trainer):
    flaky = [
        f"reward.custom_reward_function.path={TEST_REWARDS}",
        "reward.custom_reward_function.name=Flaky",
        "reward.timeout_s=1",
        "reward.num_workers=1",
        "reward.streaming=true",
    ]
    trainer = make_trainer(*flaky, "reward.max_failure_ratio=0.6")
    metrics, samples = trainer.train_step(0)
    status = [s.outcome.status for s in samples]
    # One worker, 8 calls: calls 1 and 5 raise, 3 and 7 hang past reward.timeout_s.
    assert status.count("failed") == 2 and status.count("timeout") == 2 and status.count("ok") == 4
    assert metrics["reward/failed"] == 2 and metrics["reward/timed_out"] == 2
    assert metrics["reward/masked"] >= 4  # failed samples, plus any group left with one member
    assert all("500" in s.outcome.error for s in samples if s.outcome.status == "failed")

    # The failure policy reads reward.max_failure_ratio at each check: the same trainer's next step (calls 9-16,
    # the same pattern) with a lower one stops it.
    trainer.ops.cfg.reward.max_failure_ratio = 0.25
    with pytest.raises(RewardFailureError, match=r"50% of samples.*max_failure_ratio=0.25.*Flaky"):
        trainer.train_step(1)


def test_killed_reward_worker_mid_step_every_sample_scored_once(make_trainer, tmp_path, monkeypatch):
    log = tmp_path / "scored.jsonl"
    monkeypatch.setenv("OMNI_ASYNC_TEST_REWARD_LOG", str(log))
    trainer = make_trainer(
        f"reward.custom_reward_function.path={TEST_REWARDS}",
        "reward.custom_reward_function.name=slow_logged",
        "+reward.custom_reward_function.reward_kwargs.delay_s=1.0",
        "reward.num_workers=2",
        "reward.streaming=true",
    )
    victim = trainer.reward.workers[0]
    victim_pid = ray.get(victim.info.remote())["pid"]
    _, samples = trainer.draws.make(0)
    done = threading.Thread(target=lambda: trainer.agent.generate(samples))
    done.start()
    deadline = time.time() + 60
    while not any(s.times.sent is not None for s in samples) and time.time() < deadline:
        time.sleep(0.01)
    ray.kill(victim, no_restart=False)  # Ray restarts it; the dispatcher re-sends its samples
    done.join(timeout=300)
    assert all(s.outcome.ok for s in samples), [s.outcome.error for s in samples]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted(r["key"] for r in lines) == sorted({r["key"] for r in lines})  # no sample scored twice
    assert len(lines) == len(samples)  # and none lost
    assert victim_pid not in {r["pid"] for r in lines}  # the victim finished nothing before dying
    assert trainer.agent.dispatcher.counters["retried"] >= 1
    deadline = time.time() + 60
    while any(trainer.agent.on_loop(lambda: list(trainer.agent.dispatcher.down))) and time.time() < deadline:
        time.sleep(0.1)
    assert ray.get(victim.info.remote())["pid"] != victim_pid  # restarted, and back in the rotation


def test_post_process_sees_whole_groups_and_async_reward_runs_concurrently(make_trainer, tmp_path, monkeypatch):
    log = tmp_path / "groups.jsonl"
    monkeypatch.setenv("OMNI_ASYNC_TEST_REWARD_LOG", str(log))
    trainer = make_trainer(
        f"reward.custom_reward_function.path={TEST_REWARDS}",
        "reward.custom_reward_function.name=GroupCentred",
        "reward.num_workers=1",
        "reward.streaming=true",
        "+reward.custom_reward_function.reward_kwargs.delay_s=1.0",
        "+reward.custom_reward_function.reward_kwargs.parties=8",
    )
    metrics, samples = trainer.train_step(0)
    assert [json.loads(x)["group_size"] for x in log.read_text().splitlines()] == [4, 4]
    for uid in {s.uid for s in samples}:
        assert sum(s.outcome.score for s in samples if s.uid == uid) == pytest.approx(0.0, abs=1e-9)
    assert all(s.outcome.extra["tag"] == "ok" for s in samples)
    # 8 calls of 1 s each on one worker, concurrent (so the scoring span is about one latency, not eight): each
    # call starts its second only once all 8 are in, and the step succeeded, so they were in flight together.
    assert all(s.outcome.ok for s in samples)
    # reward_compute measures the calls themselves: at least what each call measured inside it.
    own = [s.outcome.extra["own_s"] for s in samples]
    assert metrics["timing_s/reward_compute/mean"] >= sum(own) / len(own) - 1e-6, (metrics, own)


def test_sync_reward_with_post_process_and_wrong_type_error(make_trainer):
    trainer = make_trainer(
        "reward.streaming=false",
        f"reward.custom_reward_function.path={TEST_REWARDS}",
        "reward.custom_reward_function.name=wrong_type",
        "reward.max_failure_ratio=1.0",
    )
    metrics, samples = trainer.train_step(0)
    assert metrics["reward/failed"] == 8
    assert "wrong_type" in samples[0].outcome.error and "'high'" in samples[0].outcome.error
    assert np.isfinite(metrics["critic/rewards/mean"])
