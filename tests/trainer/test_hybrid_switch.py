"""Trainer devices lend a hand to generation (verl v1 / verl-omni's ``trainer.v1.separate_async.hybrid_rollout``):
the decision rule (no Ray), the keys, a request withdrawn from a device going back to training, and on Ray the
disaggregated layout in fully async mode with the switch on: samples made on the trainer device, nothing lost or
trained twice across a switch, and a trainer rank killed while it generates.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import numpy as np
import pytest
import ray
import torch
from helpers import SMALL_LORA, Trainers, record_trained_uids, write_prompts

from omni_async.agent_loop.batcher import GenerationBatcher
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.hybrid_switch import SwitchConfig, SwitchPolicy
from omni_async.trainer.step_ops import ActorRankDiedError
from omni_async.trainer.timeline import draw_timeline

POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
# A sync every update and the dropless strategy (verl-omni's defaults would be 4 and drop): the runs below were sized
# for them.
SEPARATE_ASYNC = [
    *POOL,
    "trainer.use_v1=true",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=1",
    "trainer.v1.sampler.max_off_policy_strategy=wait",
]
SWITCH = "trainer.v1.separate_async.hybrid_rollout.enable_switch=true"
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1"]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default). verl's default
# rank 0, a full fine-tune, is refused in the hybrid layout's overlap modes and ships to a rollout pool only with
# checkpoint_engine nccl; a test of that passes lora_rank=0 itself.
def valid(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


# ---- the decision (no Ray) -------------------------------------------------------------------------------------
def test_threshold_is_verls_clamped_ratio_and_the_rule_weighs_benefit_against_cost():
    policy = SwitchPolicy(SwitchConfig(enable_switch=True, adaptive_switch_threshold=False), 8, 2, 1, 1)
    assert policy.threshold() == 3  # round(0.4 x 8), above the one-chunk floor
    assert SwitchPolicy(SwitchConfig(switch_threshold_ratio=0.1), 8, 2, 1, 1).threshold() == 2  # floor: a chunk
    assert SwitchPolicy(SwitchConfig(), 4, 4, 1, 1).threshold() == 4  # no pipeline: the whole step
    # Nothing measured yet: lend whenever groups are missing and work waits for a device.
    assert policy.decide(sampleable=0, waiting=4).lend
    assert not policy.decide(sampleable=3, waiting=4).lend  # enough to start training
    assert not policy.decide(sampleable=0, waiting=0).lend  # nothing a lent device could take
    # Measured: the trainer waited 2 s for 4 missing groups (0.5 s each); a switch costs 0.2 + 0.3 s. With 1 trainer
    # + 1 rollout device the trainer adds half the generation: benefit = remaining x 0.5 x 0.5.
    policy.record_take(2.0, 4)
    policy.record_costs(0.2, 0.3)
    d = policy.decide(sampleable=0, waiting=4)  # benefit 3 x 0.25 = 0.75 > 0.5
    assert d.lend and d.metrics["separate_async/decision/benefit_seconds"] == pytest.approx(0.75)
    assert d.metrics["separate_async/decision/effective_switch_cost_seconds"] == pytest.approx(0.5)
    assert d.metrics["separate_async/decision/per_sample_time_seconds"] == pytest.approx(0.5)
    assert d.metrics["separate_async/switch/idle"] == 1.0
    assert not policy.decide(sampleable=1, waiting=4).lend  # benefit 2 x 0.25 = 0.5, not above the cost


def test_adaptive_ratio_moves_once_per_release_interval():
    config = SwitchConfig(enable_switch=True, switch_threshold_ratio=0.5)
    policy = SwitchPolicy(config, 8, 1, 1, 1)
    ratios = []
    for _ in range(4):  # every step waited for groups outside a lend
        policy.record_take(1.0, 2)
        policy.decide(0, 1)
        ratios.append(round(policy.ratio, 4))
    # the first decision has no previous step; then idle, idle (release: +0.05 once, verl#7665), idle (+0.05)
    assert ratios == [0.5, 0.5, 0.55, 0.6]
    for _ in range(3):  # calm steps
        policy.decide(8, 1)
    # -0.03 once two calm steps have passed, and on each calm step after (verl keeps the count at the interval)
    assert policy.ratio == pytest.approx(0.54)


def test_keys_compose_and_the_switch_is_refused_where_it_cannot_run():
    cfg = valid(*SEPARATE_ASYNC, SWITCH, "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio=0.6")
    c = SwitchConfig.from_config(cfg)
    assert c.enable_switch and c.switch_threshold_ratio == 0.6 and c.switch_cost_window_size == 3
    assert not SwitchConfig.from_config(valid()).enable_switch
    for overrides, fix in [
        ([SWITCH, "async_reward.fully_async=true"], "nnodes=1"),  # the hybrid layout
        ([*POOL, SWITCH], "separate_async"),  # lock-step on a rollout pool
        ([*SEPARATE_ASYNC, SWITCH, "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio=0"], "0.4"),
    ]:
        with pytest.raises(ConfigError, match="hybrid_rollout") as e:
            valid(*overrides)
        assert fix in str(e.value)


def test_a_device_going_back_to_training_withdraws_the_requests_it_has_not_started():
    """The batch on the device finishes; the ones queued behind it are answered withdrawn (no result) at once."""

    async def run():
        device = __import__("concurrent.futures").futures.ThreadPoolExecutor(1)
        started = threading.Event()

        def generate(prompts, seeds):
            started.set()
            time.sleep(0.3)
            return [f"{p}/{s}" for p, s in zip(prompts, seeds, strict=True)]

        batcher = GenerationBatcher(generate, lambda: 5, device, max_batch_size=2, max_wait_ms=0)
        calls = [asyncio.ensure_future(batcher.submit(f"p{i}", i, None)) for i in range(5)]
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        assert batcher.withdraw() == 3
        answers = await asyncio.gather(*calls)
        device.shutdown()
        return answers

    answers = asyncio.run(run())
    assert [a.result for a in answers] == ["p0/0", "p1/1", None, None, None]
    assert answers[0].version == 5


# ---- on Ray ----------------------------------------------------------------------------------------------------
def slow_generation(handle, seconds: float) -> None:
    """Each device batch of ``handle`` (a rollout worker or a trainer rank) takes ``seconds`` longer (set again: the
    new delay replaces the old). A trainer rank's batches are recorded in ``device_batches``: the lend they ran in
    and whether the rank was being reclaimed (``withdrawing``) when each ended."""

    def slow(self):
        self.test_delay_s = seconds
        if not hasattr(self, "test_batches"):
            self.test_batches, generate = [], self.batcher.generate

            def delayed(*a, **k):
                time.sleep(self.test_delay_s)
                out = generate(*a, **k)
                lend = getattr(self, "_lent_at", None)
                self.test_batches.append({"lend": lend, "drained": bool(getattr(self, "withdrawing", False))})
                return out

            self.batcher.generate = delayed

    ray.get(handle.__ray_call__.remote(slow))


def device_batches(handle) -> list[dict]:
    return ray.get(handle.__ray_call__.remote(lambda self: list(self.test_batches)))


def switch_trainer(trainers, *extra: str):
    # One group of 4 samples per step, staleness 1 (2 groups per window); the rollout worker runs batches of 2.
    return trainers(*SEPARATE_ASYNC, *QUIET, SWITCH, "async_training.staleness_threshold=1", *extra)


@pytest.mark.slow
def test_trainer_rank_generates_the_same_samples_and_every_group_trains_once_across_switches(trainers):
    t = switch_trainer(trainers, "rollout.total_rollout_steps=6")
    rollout, rank0 = t.placement.rollout_workers[0], t.placement.actor_wg.workers[0]
    # Sample i of draw k is the same sample whichever device makes it: the trainer rank lent at version 0 and the
    # rollout worker holding version 0 give the same image and log-probs for one (prompt, seed, window).
    ray.get(rank0.lend.remote(0))
    on_trainer = ray.get(rank0.generate.remote("p3", 1234, (1, 3)))
    ray.get(rank0.reclaim.remote())
    on_rollout = ray.get(rollout.generate.remote("p3", 1234, (1, 3)))
    assert on_trainer.version == on_rollout.version == 0
    torch.testing.assert_close(on_trainer.result.pixels, on_rollout.result.pixels, atol=1e-5, rtol=0)
    torch.testing.assert_close(on_trainer.result.log_probs, on_rollout.result.log_probs, atol=1e-5, rtol=1e-5)
    assert ray.get(rank0.generate.remote("p3", 1234, (1, 3))).result is None  # reclaimed: withdrawn at once

    # The rollout pool is slow (1 s per batch of 2, a group = 2 batches), the trainer fast: each step waits, so the
    # trainer rank lends a hand (its batches 0.4 s). From step 3 on its batches take 3 s: the rollout worker
    # completes the step's group first and the switch back finds requests on the trainer rank's device or queued.
    slow_generation(rollout, 1.0)
    slow_generation(rank0, 0.4)
    trained = record_trained_uids(t.ops)
    rows, all_samples = [], []
    for step in range(t.total_steps):
        if step == 3:
            slow_generation(rank0, 3.0)
            late_lends_from = len(device_batches(rank0))
        metrics, samples = t.train_step(step)
        rows.append(metrics)
        if step == 0:  # the timeline of a switch: the trainer's switch phases and the samples its device made
            record = t.last_timeline
            assert {"switch_to_rollout", "switch_wait", "switch_to_trainer"} <= {p["phase"] for p in record["trainer"]}
            assert any(s["lent"] for s in record["samples"])
            assert draw_timeline(record, trainers.run_root / "switch.png").exists()
        all_samples += samples
        assert step - min(s.version for s in samples) <= t.mode.bound  # the staleness bound holds
        for key in ("switch_wait", "switch_to_rollout", "switch_to_trainer"):
            assert f"timing_s/{key}" in metrics
        assert "separate_async/decision/should_switch_to_rollout" in metrics
        assert 0.0 <= metrics["perf/busy_fraction/trainer_pool"] <= 1.0
    assert sum(r["separate_async/switch/count"] for r in rows) >= 1
    lent = [s for s in all_samples if s.lent]
    assert lent and sum(r["separate_async/switch/lent_samples"] for r in rows) >= len(lent)
    # A sample made on the trainer rank reports the version of the weights it trained so far.
    assert all(s.version <= step for s in lent)
    # Every group of the 6 steps trained exactly once, whole, none dropped; nothing lost at a switch back.
    assert sorted(trained) == sorted(s.uid for s in all_samples) and len(all_samples) == 6 * 4
    assert len({s.uid for s in all_samples}) == 6
    batches = device_batches(rank0)
    # A switch back from step 3 on met requests on the trainer rank: requeued elsewhere, or its batch drained.
    assert any(r["separate_async/switch/requeued"] for r in rows[3:]) or any(
        b["drained"] for b in batches[late_lends_from:]
    ), (rows[3:], batches)
    assert all(s.outcome.ok for s in all_samples)
    assert rows[-1]["fully_async/count/dropped_stale_samples"] == 0
    # images in flight at a switch back finish (verl-omni aborts and regenerates them): nothing thrown away
    assert all(r["rollout/discarded_at_sync"] == 0 and r["training/discarded_samples"] == 0 for r in rows)
    lent_busy = sum(r["separate_async/switch/lent_busy_seconds"] for r in rows)
    assert lent_busy > 0
    # The update waited at most one device batch of the lent rank at each switch back: of each lend's batches, at
    # most one ended while the rank was being reclaimed (the queued ones were withdrawn, not run).
    drained_per_lend = Counter(b["lend"] for b in batches if b["drained"])
    assert max(drained_per_lend.values(), default=0) <= 1, batches
    print(
        "switch metrics:",
        [
            {k: round(v, 3) for k, v in r.items() if k.startswith(("separate_async/switch", "timing_s/switch"))}
            for r in rows
        ],
    )


@pytest.mark.slow
def test_a_trainer_rank_killed_while_generating_is_regenerated_elsewhere_and_stops_the_step(trainers):
    t = switch_trainer(trainers, "rollout.total_rollout_steps=4")
    rollout, rank0 = t.placement.rollout_workers[0], t.placement.actor_wg.workers[0]
    slow_generation(rollout, 1.0)
    slow_generation(rank0, 3.0)  # its requests are on its device when it dies
    out: list = []

    def step():
        try:
            out.append(t.train_step(0))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    thread = threading.Thread(target=step)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline and not t.agent.on_loop(lambda: any(t.agent._lent_out.values())):
        time.sleep(0.05)
    assert time.time() < deadline, "the trainer rank was never lent a request"
    ray.kill(rank0, no_restart=True)
    thread.join(timeout=300)
    # Its requests were generated again on the rollout pool (a rollout worker's death) and the step stopped as for
    # a dead trainer rank, naming the last checkpoint.
    assert isinstance(out[0], ActorRankDiedError), out[0]
    assert "resume_mode=auto" in str(out[0])
    assert t.agent.regenerated >= 1
    assert t.agent.on_loop(lambda: t.agent.lent) == []
    assert np.isfinite(t.agent.take_lent_busy_s())


def slow_tokens(handle, seconds: float) -> None:
    """Each token of ``handle``'s text generation takes ``seconds`` longer (asked with the stop check)."""

    def slow(self):
        real = self.policy.generate_stream

        def generate_stream(admit, emit, *, capacity, should_stop=None):
            def stop() -> bool:
                time.sleep(seconds)
                return bool(should_stop and should_stop())

            return real(admit, emit, capacity=capacity, should_stop=stop)

        self.policy.generate_stream = generate_stream

    ray.get(handle.__ray_call__.remote(slow))


@pytest.mark.slow
def test_text_responses_on_a_trainer_rank_at_the_switch_back_are_continued_on_the_rollout_pool(tmp_path):
    """Text, fully async with partial rollout (verl's default), a full fine-tune synced over the group: the lent
    trainer rank is slower per token than the rollout worker, so when a step's group is ready its responses are in
    flight there; they stop after their current token and are continued on the rollout worker with their tokens.
    Every response is trained once, finished, within the lag bound."""
    made = Trainers(
        write_prompts(tmp_path / "train.jsonl", 8),
        tmp_path,
        base=[
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.response_length=24",
            "actor_rollout_ref.rollout.agent.max_batch_size=2",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            "reward.custom_reward_function.name=compute_score_digits",
            "trainer.logger=[jsonl]",
            "trainer.resume_mode=disable",
            "data.shuffle=false",
        ],
        config_name="grpo_text_trainer",
    )
    try:
        t = made(
            *SEPARATE_ASYNC, *QUIET, SWITCH, "async_training.staleness_threshold=1", "trainer.total_training_steps=2"
        )
        slow_tokens(t.placement.rollout_workers[0], 0.03)
        slow_tokens(t.placement.actor_wg.workers[0], 0.12)
        trained = record_trained_uids(t.ops)
        rows, all_samples = [], []
        for step in range(t.total_steps):
            metrics, samples = t.train_step(step)
            rows.append(metrics)
            all_samples += samples
            assert all(step - s.version <= t.mode.bound for s in samples)
            assert all(not s.result.unfinished for s in samples)
    finally:
        made.close()
    assert sorted(trained) == sorted(s.uid for s in all_samples) and len(all_samples) == t.total_steps * 4
    assert len({(s.uid, s.index) for s in all_samples}) == len(all_samples)
    assert sum(r["separate_async/switch/count"] for r in rows) >= 1
    moved = sum(r["separate_async/switch/continued"] + r["separate_async/switch/requeued"] for r in rows)
    assert moved >= 1  # responses on the trainer rank at a switch back went on elsewhere
