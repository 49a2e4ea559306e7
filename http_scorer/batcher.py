"""Server-side batching: items of concurrent requests are packed into one scorer call.

Each request puts its items in a queue and awaits their futures. One loop takes up to ``max_batch`` items with
the same metadata (one model call has one set of options), waiting at most ``max_wait_ms`` after the first for
more, and runs the scorer on them in a worker thread, so the event loop keeps accepting requests meanwhile.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from http_scorer.scorers import Scorer, normalize


@dataclass
class Item:
    image: np.ndarray
    prompt: str
    ground_truth: Any
    metadata: dict[str, Any]
    future: asyncio.Future


class Batcher:
    def __init__(self, scorer: Scorer, spec: str, max_batch: int, max_wait_ms: float, on_batch=None):
        self.scorer, self.spec = scorer, spec
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_ms) / 1000.0
        self.pending: list[Item] = []
        self._arrived = asyncio.Event()
        self.on_batch = on_batch or (lambda size, seconds: None)
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._device.shutdown(wait=False, cancel_futures=True)

    async def score(self, images, prompts, ground_truths, metadata) -> list[tuple[float, dict]]:
        loop = asyncio.get_running_loop()
        items = [Item(i, p, g, metadata, loop.create_future()) for i, p, g in zip(images, prompts, ground_truths,
                                                                                   strict=True)]
        self.pending.extend(items)
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(it.future for it in items)))
        finally:
            for it in items:  # a request that timed out gives its items up (they are skipped if not started)
                it.future.cancel()
            if any(it.future.cancelled() for it in items):  # and lets go of their images now, not at the next batch
                mine = {id(it) for it in items}
                self.pending = [it for it in self.pending if id(it) not in mine]

    def queue_depth(self) -> int:
        return len(self.pending)

    async def _run(self) -> None:
        while True:
            while not self.pending:
                self._arrived.clear()
                await self._arrived.wait()
            if len(self.pending) < self.max_batch:
                await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
            await self._one_batch()  # its locals (the batch's images) are gone when it returns

    async def _one_batch(self) -> None:
        loop = asyncio.get_running_loop()
        self.pending = [it for it in self.pending if not it.future.done()]
        if not self.pending:
            return
        meta = self.pending[0].metadata
        batch = [it for it in self.pending if it.metadata == meta][: self.max_batch]
        taken = {id(it) for it in batch}
        self.pending = [it for it in self.pending if id(it) not in taken]
        t0 = loop.time()
        try:
            raw = await loop.run_in_executor(
                self._device, self.scorer, [it.image for it in batch], [it.prompt for it in batch],
                [it.ground_truth for it in batch], meta)
            results = normalize(raw, len(batch), self.spec)
        except Exception as e:  # a scorer failure fails this batch's requests, not the server
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        self.on_batch(len(batch), loop.time() - t0)
        for it, res in zip(batch, results, strict=True):
            if not it.future.done():
                it.future.set_result(res)
