"""Server-side batching: items of concurrent requests are packed into one scorer call, on whichever scorer process
is free.

Each request puts its items in the one queue (:meth:`Batcher.submit`) and awaits their outcomes. The loop waits for a free scorer process,
then takes up to ``max_batch`` waiting items with the same metadata (one model call has one set of options). If
fewer than ``max_batch`` are waiting, it waits for more until the oldest has waited ``max_wait_ms``, then sends
what it has (``omni_async.batching.MicroBatcher``, the project's one micro-batcher). Items never queue behind a busy
process while another is free (see pool.py for why).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from http_scorer.pool import Outcome, ScorerPool
from omni_async.batching import MicroBatcher


@dataclass
class Item:
    payload: Any  # (raw, fmt, field) or a list of them: decoded in the scorer process
    prompt: str
    ground_truth: Any
    metadata: dict[str, Any]
    future: asyncio.Future
    settled: asyncio.Event  # set when no scorer process holds the item (done, or withdrawn before it was sent)
    sent: bool = False


class Batcher:
    def __init__(self, pool: ScorerPool, max_batch: int, max_wait_ms: float, on_batch=None):
        self.pool = pool
        self.queue: MicroBatcher[Item] = MicroBatcher(max_batch, max_wait_ms)
        self.on_batch = on_batch or (lambda size, seconds: None)
        self._free: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    def start(self) -> None:
        if self.pool.info and self.pool.info.max_batch:  # the scorer's own limit (scorers.py)
            self.queue.max_batch = min(self.queue.max_batch, self.pool.info.max_batch)
        for w in self.pool.workers:
            self._free.put_nowait(w)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for t in list(self._running):
            t.cancel()

    def submit(self, payloads, prompts, ground_truths, metadata) -> list[Item]:
        """Queue a request's items; await :meth:`results` for their outcomes."""
        loop = asyncio.get_running_loop()
        items = [
            Item(x, p, g, metadata, loop.create_future(), asyncio.Event())
            for x, p, g in zip(payloads, prompts, ground_truths, strict=True)
        ]
        self.queue.put(*items)
        return items

    async def results(self, items: list[Item]) -> list[Outcome]:
        return list(await asyncio.gather(*(it.future for it in items)))

    def withdraw(self, items: list[Item]) -> None:
        """A request that gave up (timeout, client gone): its items not yet sent leave the queue, and their bytes
        with them; items already in a scorer process finish there (see :meth:`settled`)."""
        self.queue.discard(items)
        for it in items:
            if not it.sent:
                it.payload = None
                it.settled.set()
            it.future.cancel()

    async def settled(self, items: list[Item]) -> None:
        """Returns once no scorer process holds any of these items (their pixels can be counted as free)."""
        for it in items:
            await it.settled.wait()

    def queue_depth(self) -> int:
        return len(self.queue)

    async def _run(self) -> None:
        while True:
            worker = await self._free.get()
            batch = await self._take()
            task = asyncio.get_running_loop().create_task(self._dispatch(worker, batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _take(self) -> list[Item]:
        """The next batch: waits for items, and for more of them until the oldest has waited max_wait_ms."""
        batch = await self.queue.next_batch(_same_metadata, wait_for_items=True)
        for it in batch:
            it.sent = True
        return batch

    async def _dispatch(self, worker, batch: list[Item]) -> None:
        t0 = time.monotonic()
        try:
            outcomes = await self.pool.run(
                worker,
                [it.payload for it in batch],
                [it.prompt for it in batch],
                [it.ground_truth for it in batch],
                batch[0].metadata,
            )
        except Exception as e:  # noqa: BLE001 - e.g. the pool was stopped: the requests are told, the loop lives
            outcomes = [("error", f"scorer {self.pool.spec}: {type(e).__name__}: {e}")] * len(batch)
        self.on_batch(len(batch), time.monotonic() - t0)
        for it, outcome in zip(batch, outcomes, strict=True):
            it.payload = None  # the encoded bytes are not needed any more
            it.settled.set()
            if not it.future.done():
                it.future.set_result(outcome)
        try:
            if worker.dead:  # answered first, then a fresh process; meanwhile the other processes take the queue
                await self.pool.restart(worker)
        finally:
            self._free.put_nowait(worker)


def _same_metadata(waiting: list[Item]) -> list[Item]:
    """The items that may share a model call with the oldest live one: the same metadata (one set of options)."""
    live = [it for it in waiting if not it.future.done()]
    return [it for it in live if it.metadata == live[0].metadata] if live else []
