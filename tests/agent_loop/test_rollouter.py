"""The rollouter's bounds as a schedule (no Ray): groups are "generated" by a stand-in for the rollout workers that
stamps each sample with the weights version the pool holds when its generation ends after a random delay (a long
tail included), and a trainer that takes its groups, spends a random time updating and syncs every K steps. The
real rollout workers run the same scheduler in tests/trainer/test_fully_async.py; here it runs hundreds of steps
in seconds, under many (staleness, K, R, m) settings."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async.agent_loop.rollouter import ProducerSettings, Rollouter
from omni_async.algos.staleness import effective_bound, groups_per_window, lag_bound
from omni_async.sample import PromptRow, Sample


class Pool:
    """Generates a group: each sample after a random time (seeded), stamped with the version held then.

    ``partial`` (partial rollout of text): a sample's first tokens are drawn at once with the version held then, which
    becomes its version (the agent loop sets it from the first part), and it finishes after the random time, under
    whatever syncs happened meanwhile (``spans`` records (first, last) version)."""

    def __init__(self, rng: random.Random, tail: float, partial: bool = False):
        self.rng, self.tail, self.version, self.partial = rng, tail, 0, partial
        self.spans: dict[tuple[str, int], tuple[int, int]] = {}

    async def run_group(self, samples: list[Sample], *, version=None, on_generated=None) -> list[Sample]:
        """``version``: the weights the requests name (lock-step), generated with them; else the pool's newest."""

        async def one(s: Sample) -> None:
            delay = 0.001 * (self.rng.random() + (20 if self.rng.random() < self.tail else 0))
            if self.partial:
                await asyncio.sleep(0)
                s.version = self.version
                await asyncio.sleep(delay)
                self.spans[(s.uid, s.index)] = (s.version, self.version)
                s.result = object()
                on_generated()
                return
            await asyncio.sleep(delay)
            s.result, s.version = object(), self.version if version is None else version
            on_generated()

        await asyncio.gather(*(one(s) for s in samples))
        return samples


class Draws:
    """``batch`` prompts per draw, ``group_size`` samples each (``agent_loop.draws.Draws``'s contract)."""

    def __init__(self, group_size: int, batch: int):
        self.group_size, self.batch = group_size, batch

    def make(self, d: int):
        row = PromptRow(prompt="p", data_source="x", ground_truth="", extra_info={})
        return {"d": d}, [
            Sample(index=i, uid=f"{d}-{i // self.group_size}", row=row, seed=i)
            for i in range(self.batch * self.group_size)
        ]

    def state(self) -> dict:
        return {}


async def train(
    staleness: float,
    k: int,
    r: int,
    m: int,
    steps: int,
    strategy: str,
    seed: int,
    tail: float,
    threshold: int | None = None,
    partial: bool = False,
):
    rng = random.Random(seed)
    pool, n = Pool(rng, tail, partial), r * m
    cap, bound = effective_bound(groups_per_window(staleness, k, r, m), n, threshold)
    rollouter = Rollouter(
        pool,
        Draws(2, 3),
        ProducerSettings(cap=cap, bound=bound, wait_for_stale=strategy == "wait", lock_step=False),
        groups_to_train=steps * n,
        rollout_version=0,
    )
    await rollouter.start()
    lags, trained, peak_window = [], [], 0
    for step in range(steps):
        groups = await rollouter.take(step, n)
        assert len(groups) == n and all(len(g.samples) == 2 for g in groups)  # whole groups, n per update
        lags += [step - g.version() for g in groups]
        trained += [g.uid for g in groups]
        await asyncio.sleep(0.001 * rng.random() * 3)  # the update: often slower than generating a group
        peak_window = max(peak_window, rollouter.window)
        if (step + 1) % k == 0:
            pool.version = step + 1
            await rollouter.on_sync(step + 1)
    await rollouter.stop()
    rollouter.pool = pool
    return lags, trained, rollouter, cap, bound, peak_window


@pytest.mark.parametrize(
    ("staleness", "k", "r", "m"),
    [(0, 1, 1, 2), (0.5, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 2), (2, 1, 1, 1), (3, 2, 1, 1), (0.1, 4, 1, 2)],
)
def test_lag_never_passes_the_bound_and_every_group_is_trained_once(staleness, k, r, m):
    lags, trained, rollouter, cap, bound, peak = asyncio.run(train(staleness, k, r, m, 120, "wait", 0, 0.1))
    assert max(lags) <= bound == lag_bound(cap, r * m)
    assert len(trained) == len(set(trained)) == 120 * r * m and rollouter.dropped_groups == 0
    assert peak <= cap  # production paused at the cap
    if staleness == 0 and k == 1:
        assert max(lags) == 0  # synchronous
    assert max(lags) >= min(bound, 1)  # the bound is reached: a slow trainer lets the rollouter run ahead


def test_drop_strategy_never_trains_past_the_bound_and_counts_what_it_drops():
    # verl v1's span threshold 2 (lag <= 1) under staleness 3 with a heavy tail: stale groups arrive late.
    lags, trained, rollouter, cap, bound, _ = asyncio.run(train(3, 1, 1, 2, 150, "drop", 1, 0.3, threshold=2))
    assert bound == 1 and max(lags) <= 1 and cap == 4
    finished = set(rollouter.finished)
    assert len(trained) == len(set(trained)) == 300  # dropped groups were replaced by fresh prompts
    assert len(finished) == 300 + rollouter.dropped_groups and rollouter.dropped_samples == 2 * rollouter.dropped_groups


@pytest.mark.parametrize(("strategy", "partial"), [("drop", False), ("wait", True)])
def test_the_kept_deadline_order_picks_what_sorting_every_live_group_picks(monkeypatch, strategy, partial):
    """The take reads the done groups' (version, seq) order kept as groups finish; on every wake it picks, counts and
    drops what a sort of all live groups by (deadline, seq) gives."""
    pick, checked = Rollouter._pick, []

    def sorted_pick(self, step, n):
        got = pick(self, step, n)
        done = sorted((g for g in self.live.values() if g.done), key=lambda g: (self._deadline(g), g.seq))
        assert [uid for _, _, uid in self._done] == [g.uid for g in done]
        assert self.sampleable(step) == sum(step - g.version() <= self.bound for g in done)
        if got is not None or not self.settings.wait_for_stale:  # wait: the feasibility check may hold it back
            assert got == (done[:n] if len(done) >= n else None)
        checked.append(got is not None)
        return got

    monkeypatch.setattr(Rollouter, "_pick", sorted_pick)
    _, trained, rollouter, *_ = asyncio.run(train(3, 1, 1, 2, 60, strategy, 4, 0.3, threshold=2, partial=partial))
    assert sum(checked) == 60 and len(checked) > 60 and len(trained) == 120
    assert strategy == "wait" or rollouter.dropped_groups > 0  # the drop path ran too


def test_staleness_formulas_match_verl():
    assert groups_per_window(0.1, 4, 1, 32) == 140  # verl: int(32 * 1.1 * 4)
    assert groups_per_window(0, 1, 1, 8) == 8 and lag_bound(8, 8) == 0
    assert lag_bound(groups_per_window(1, 1, 1, 8), 8) == 1  # one-step-off
    assert lag_bound(groups_per_window(0.5, 2, 1, 4), 4) == 2
    assert effective_bound(16, 4, 2) == (8, 1) and effective_bound(16, 4, None) == (16, 3)


@pytest.mark.parametrize(("staleness", "k", "strategy"), [(1, 1, "wait"), (2, 2, "wait"), (3, 1, "drop")])
def test_partial_rollout_bounds_the_oldest_token_and_trains_every_group_once(staleness, k, strategy):
    """Partial rollout: a response's version is its first part's (its oldest) as soon as that exists, and it may
    finish under later weights. The bound holds for that oldest version, and (wait) nothing is dropped."""
    lags, trained, rollouter, cap, bound, _ = asyncio.run(
        train(staleness, k, 1, 2, 120, strategy, 2, 0.2, partial=True)
    )
    assert max(lags) <= bound and len(trained) == len(set(trained)) == 240
    assert any(last > first for first, last in rollouter.pool.spans.values())  # responses continued across syncs
    if strategy == "wait":
        assert rollouter.dropped_groups == 0


@pytest.mark.parametrize(("staleness", "pipelined"), [(0, False), (1, False), (0, True), (1, True)])
def test_lock_step_trains_each_draw_in_order_with_one_version_per_draw(staleness, pipelined):
    """The lock-step presets: a step takes the oldest draw's groups (the pipeline: a mini-batch at a time, as they are
    scored), every sample of draw d is made by the weights its draw started under (d - staleness, at least 0), and
    with staleness 1 the next draw generates while a step trains; quiesce waits until nothing is generating."""

    async def run():
        rng = random.Random(5)
        pool, n, per = Pool(rng, 0.2), 3, (1 if pipelined else 3)
        cap = (1 + staleness) * n
        rollouter = Rollouter(
            pool,
            Draws(2, n),
            ProducerSettings(cap=cap, bound=lag_bound(cap, n), wait_for_stale=True, lock_step=True),
            groups_to_train=8 * n,
            rollout_version=0,
        )
        await rollouter.start()
        steps, ahead = [], []
        for step in range(8):
            taken = []
            while len(taken) < n:
                taken += await rollouter.take(step, per, n - len(taken))
            steps.append(taken)
            await asyncio.sleep(0.002)  # the update
            ahead.append(len(rollouter.live))
            await rollouter.quiesce()
            assert all(g.generated == len(g.samples) for g in rollouter.live.values())
            pool.version = step + 1
            await rollouter.on_sync(step + 1)
        await rollouter.stop()
        return steps, ahead

    steps, ahead = asyncio.run(run())
    for step, groups in enumerate(steps):
        assert {g.draw for g in groups} == {step}  # the step's own draw, each group once
        assert sorted(g.uid for g in groups) == [f"{step}-{p}" for p in range(3)]
        assert {s.version for g in groups for s in g.samples} == {max(0, step - staleness)}
    assert ahead[:-1] == [3 * staleness] * 7 and ahead[-1] == 0  # one draw ahead (one-step-off), none past the end


def test_ready_says_whether_the_next_take_returns_at_once_and_names_a_held_back_take():
    """The switch decides and switches back on ``Rollouter.ready``: the groups the next take can use now. Under
    ``wait`` a take with enough done groups can still wait for a due group in flight (a long-tail straggler); ready
    is then ``take - 1``, and a take returns at once exactly when ready reaches it."""

    async def run() -> tuple[int, int]:
        rng = random.Random(3)
        pool, n = Pool(rng, 0.3), 2
        cap, bound = effective_bound(groups_per_window(2, 1, 1, n), n, None)
        rollouter = Rollouter(
            pool,
            Draws(2, 3),
            ProducerSettings(cap=cap, bound=bound, wait_for_stale=True, lock_step=False),
            groups_to_train=150 * n,
            rollout_version=0,
        )
        await rollouter.start()
        held = at_once = 0
        for step in range(150):
            await asyncio.sleep(0.001 * rng.random() * 3)  # the update
            ready, sampleable = rollouter.ready(step, n), rollouter.sampleable(step)
            take = rollouter.take(step, n)
            try:  # the take's first pass, run here: it returns, or it waits for a change
                take.send(None)
                take.close()
                groups = await rollouter.take(step, n)
                assert ready < n
                held += sampleable >= n  # enough done, held back for a due one in flight
            except StopIteration as done:
                groups = done.value
                assert ready >= n
                at_once += 1
            assert len(groups) == n
            pool.version = step + 1
            await rollouter.on_sync(step + 1)
        await rollouter.stop()
        return held, at_once

    held, at_once = asyncio.run(run())
    assert held >= 1 and at_once >= 1
