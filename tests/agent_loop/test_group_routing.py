"""Where the agent loop sends a group's generation requests (``AgentLoopManager._group_home``): spread over the
workers while few requests are out, whole to the least-loaded worker, in one call, once the workers hold more than a
group each. The workers are recording handles answering ``generate_many`` when the test releases them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from omni_async.agent_loop.batcher import Generation
from omni_async.agent_loop.manager import AgentLoopManager
from omni_async.sample import PromptRow, Sample

WORKERS, GROUP = 4, 4


class _Worker:
    """A rollout worker's ``generate_many`` / ``generate``: records each call's seeds, answers when ``release`` is
    set."""

    def __init__(self, index: int, release: asyncio.Event):
        self.index, self.release, self.calls = index, release, []
        self.generate_many = SimpleNamespace(remote=self._generate_many)
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, prompt: str, seed: int, window, **options) -> Generation:
        return (await self._generate_many([(prompt, seed, window, options)]))[0]

    async def _generate_many(self, requests: list[tuple]) -> list[Generation]:
        self.calls.append([seed for _prompt, seed, _window, _options in requests])
        await self.release.wait()
        return [Generation(SimpleNamespace(unfinished=False), 0, 0.0, 1.0) for _ in requests]


def _groups(draw: int, n_groups: int) -> list[list[Sample]]:
    return [
        [
            Sample(index=i, uid=f"{draw}-{p}", row=PromptRow(f"p{p}", "x", None), seed=1000 * draw + i)
            for i in range(p * GROUP, (p + 1) * GROUP)
        ]
        for p in range(n_groups)
    ]


def _seeds_by_worker(workers: list[_Worker], seeds: set[int]) -> dict[int, list[list[int]]]:
    """Per worker, its calls' seeds among ``seeds``."""
    out = {}
    for w in workers:
        calls = [[s for s in call if s in seeds] for call in w.calls]
        out[w.index] = [c for c in calls if c]
    return out


@pytest.mark.parametrize("coalesce", [GROUP, 0])
def test_groups_spread_while_few_requests_are_out_and_go_whole_to_the_least_loaded_worker_when_many_are(coalesce):
    agent = AgentLoopManager([], coalesce=coalesce)
    release = agent.on_loop(asyncio.Event)
    workers = [_Worker(w, release) for w in range(WORKERS)]
    agent.workers, agent.down = workers, [False] * WORKERS
    agent._out, agent._booked = [0] * WORKERS, [0] * WORKERS
    try:

        async def start(groups: list[list[Sample]]) -> list[asyncio.Task]:
            tasks = [asyncio.ensure_future(agent.run_group(g)) for g in groups]
            for _ in range(5):  # the tasks route their requests, the coalesced calls go out
                await asyncio.sleep(0)
            return tasks

        # A draw's 4 groups started at once with nothing out (a lock-step draw): each spreads over all 4 workers,
        # one call per worker carrying one sample of every group.
        first = _groups(0, WORKERS)
        tasks = agent.call(start(first))
        assert agent._out == [GROUP] * WORKERS
        seeds = {s.seed for g in first for s in g}
        for w, calls in _seeds_by_worker(workers, seeds).items():
            got = sorted(s for c in calls for s in c)
            assert got == [s.seed for g in first for s in g if s.index % WORKERS == w]
            assert len(calls) == (1 if coalesce else GROUP)

        # 16 requests out = a group's 4 per worker: the next groups go whole, each to one worker (the least loaded,
        # counting those already placed in this turn), in one call when calls are coalesced.
        second = _groups(1, WORKERS)
        tasks += agent.call(start(second))
        placed = []
        for g in second:
            seeds = {s.seed for s in g}
            on = {w: calls for w, calls in _seeds_by_worker(workers, seeds).items() if calls}
            if coalesce:
                assert len(on) == 1, f"group {g[0].uid} went to workers {sorted(on)}"
                ((w, calls),) = on.items()
                assert calls == [[s.seed for s in g]]
                placed.append(w)
            else:  # text: each request answered alone, nothing to share: spread as before
                assert len(on) == WORKERS
        if coalesce:
            assert sorted(placed) == list(range(WORKERS))  # least loaded: one new group per worker
        assert agent._booked == [0] * WORKERS and agent._out == [2 * GROUP] * WORKERS

        async def finish() -> None:
            release.set()
            await asyncio.gather(*tasks)

        agent.call(finish())
        assert agent._out == [0] * WORKERS
    finally:
        agent.shutdown()


def test_a_group_cancelled_before_its_requests_went_out_frees_its_booking():
    agent = AgentLoopManager([], coalesce=GROUP)
    release = agent.on_loop(asyncio.Event)
    workers = [_Worker(w, release) for w in range(WORKERS)]
    agent.workers, agent.down = workers, [False] * WORKERS
    agent._out, agent._booked = [GROUP] * WORKERS, [0] * WORKERS  # deep: the next group is placed whole
    agent.counts.requests_out = GROUP * WORKERS
    try:

        async def cancelled_at_once() -> list[int]:
            task = asyncio.ensure_future(agent.run_group(_groups(0, 1)[0]))
            await asyncio.sleep(0)  # run_group placed the group; its samples' tasks have not run
            booked = list(agent._booked)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return booked

        assert sorted(agent.call(cancelled_at_once())) == [0, 0, 0, GROUP]
        assert agent._booked == [0] * WORKERS and sum(len(w.calls) for w in workers) == 0
    finally:
        agent.shutdown()


def test_a_failed_request_ending_the_group_leaves_no_booking_behind_its_later_siblings():
    """One generation slot (``max_generating=1``): a group's requests go out one at a time; the first one's error ends
    the group's gather (its booking released) while its siblings still run and go out afterwards."""

    async def fails(requests: list[tuple]) -> list[Generation]:
        raise RuntimeError("the worker could not generate")

    agent = AgentLoopManager([], coalesce=GROUP, max_generating=1)
    workers = [SimpleNamespace(generate_many=SimpleNamespace(remote=fails)) for _ in range(WORKERS)]
    agent.workers, agent.down = workers, [False] * WORKERS
    agent._out, agent._booked = [GROUP] * WORKERS, [0] * WORKERS
    agent.counts.requests_out = GROUP * WORKERS
    try:

        async def run() -> None:
            with pytest.raises(RuntimeError, match="could not generate"):
                await agent.run_group(_groups(0, 1)[0])
            for _ in range(20):  # the siblings still running take their turns at the slot and fail too
                await asyncio.sleep(0)

        agent.call(run())
        assert agent._booked == [0] * WORKERS
    finally:
        agent.shutdown()
