"""The fix ``bench/driver_cost.py --variants batched`` measures: per-sample Ray calls coalesced into one per group.

Every Ray actor call costs the driver about as much CPU as the rest of a sample's handling (submission, the gRPC
round trip on Ray's io thread, the awaited reply), and the agent loop makes two per sample: ``generate`` and the
reward's ``score``. Here, without changing the agent loop or the dispatcher, the handles they are given coalesce:

- :class:`CoalescingRollout`: the ``generate.remote`` calls made in one turn of the event loop are sent as one
  ``generate_many`` call per worker, routed by prompt, so a GRPO group (its members share the prompt, and the
  rollouter starts a group's members together) is one call to one worker, which answers the group at once (one
  device batch). The manager's own choice of worker (``sample.index % workers``) is overridden.
- :class:`CoalescingReward`: the ``score.remote`` calls made in one turn go as one ``score_many`` call
  (:class:`BatchedRewardLoopWorker`: the real worker's ``score`` on each chunk, concurrently), to the workers in
  turn. The dispatcher's per-worker load accounting then counts calls it did not place; with in-flight limits far
  above the load, as in the benchmark, that changes nothing.

A coalesced reply is handed out :data:`ANSWERS_PER_TURN` answers per turn of the event loop, not all at once.
Each returns an asyncio future where Ray returns an ``ObjectRef``; awaiting it raises what the Ray call raised. The
dispatcher's ``ray.cancel`` on a timed-out call does not take a future: the benchmark's reward never times out.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from typing import Any

from omni_async.reward.worker import RewardLoopWorker

# Answers handed to their callers per turn of the event loop. The dispatcher wakes a task waiting for a reward slot
# with asyncio.Condition.notify, which scans past the waiters already woken in the same turn: k slots freed in one
# turn cost O(k^2) (a 372-sample reply: ~70,000 Future.done calls). A group's worth per turn keeps that flat.
ANSWERS_PER_TURN = 8


class _Method:
    """``handle.method.remote(...)`` for a proxy."""

    def __init__(self, remote: Callable[..., Any]):
        self.remote = remote


async def _answer(ref: Any, futures: list[asyncio.Future]) -> None:
    """Hand each caller its share of one coalesced call's answer (or its error)."""
    try:
        answers = await ref
    except BaseException as e:  # the worker died, or the call failed: every caller sees it, as with its own call
        for f in futures:
            if not f.done():
                f.set_exception(e)
        return
    for i, (f, a) in enumerate(zip(futures, answers, strict=True)):
        if not f.done():  # its caller may have given up
            f.set_result(a)
        if i % ANSWERS_PER_TURN == ANSWERS_PER_TURN - 1:
            await asyncio.sleep(0)  # the rest next turn (module docstring)


class _Coalescer:
    """Calls made in one turn of the event loop, sent together at the end of it."""

    def __init__(self, workers: list[Any]):
        self.workers = list(workers)
        self._pending: dict[int, list[tuple[Any, asyncio.Future]]] = {}
        self._flush_scheduled = False
        self.calls = self.items = 0

    def _submit(self, w: int, item: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.setdefault(w, []).append((item, fut))
        if not self._flush_scheduled:
            # call_soon runs after every callback already due in this turn: the samples that reached this point
            # together (a group's members, a batch's answers) go in one call.
            loop.call_soon(self._flush)
            self._flush_scheduled = True
        return fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for w, entries in pending.items():
            ref = self._send(w, [item for item, _ in entries])
            self.calls += 1
            self.items += len(entries)
            asyncio.ensure_future(_answer(ref, [f for _, f in entries]))

    def _send(self, w: int, items: list[Any]) -> Any:
        raise NotImplementedError


class CoalescingRollout(_Coalescer):
    """Rollout worker handles for the agent loop: one ``generate_many`` call per group (module docstring)."""

    def handles(self) -> list[Any]:
        return [_RolloutHandle(self, w) for w in self.workers]

    def _generate(self, prompt: str, seed: int, window: Any, **kwargs: Any) -> asyncio.Future:
        w = zlib.crc32(prompt.encode()) % len(self.workers)  # a group's members share its prompt: one worker
        return self._submit(w, (prompt, seed, window, kwargs))

    def _send(self, w: int, items: list[Any]) -> Any:
        return self.workers[w].generate_many.remote(items)


class CoalescingReward(_Coalescer):
    """Reward worker handles for the dispatcher: the chunks of one turn in one ``score_many`` call."""

    def __init__(self, workers: list[Any]):
        super().__init__(workers)
        self._next = 0

    def handles(self) -> list[Any]:
        return [_RewardHandle(self, w) for w in self.workers]

    def _score(self, chunk: Any) -> asyncio.Future:
        return self._submit(0, chunk)  # one queue: the turn's chunks all go to the next worker in turn

    def _send(self, w: int, items: list[Any]) -> Any:
        self._next = (self._next + 1) % len(self.workers)
        return self.workers[self._next].score_many.remote(items)


class _RolloutHandle:
    def __init__(self, owner: CoalescingRollout, worker: Any):
        self.generate = _Method(owner._generate)
        self.stats = worker.stats  # the manager's probe of a restarted worker: straight to it


class _RewardHandle:
    def __init__(self, owner: CoalescingReward, worker: Any):
        self.score = _Method(owner._score)
        self.info, self.post_process_group = worker.info, worker.post_process_group  # control calls: straight


class BatchedRewardLoopWorker(RewardLoopWorker):
    """The real reward-loop worker, taking several one-row chunks in one call."""

    async def score_many(self, chunks: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*(self.score(c) for c in chunks)))
