"""A rollout worker's generation requests, one per sample, run on the device in batches.

Callers ask for one sample at a time (``generate(prompt, seed, window)``) so each sample can be streamed to its
reward as soon as it exists; a :class:`GenerationBatcher` still runs the device in batches: requests that arrive
within ``max_wait_ms`` of each other (up to ``max_batch_size``, same sampling settings and SDE window length) are
generated together, each with its own SDE window (the policy runs per-row windows in one batch, as verl-omni's
request batches do). The model runs in one device thread, so the worker's event loop keeps accepting requests while
a batch is on the device. A text policy batches continuously (``TextPolicy.generate_stream``): a request that arrives
while a batch runs takes the row of a response that ended, between two tokens, and each response is answered when it
ends, not when the batch's longest one does.

Sampling is a pure function of (weights version, seed, window): sample ``i`` of step ``k`` uses the seed
:func:`~omni_async.agent_loop.draws.sample_seed` (trainer seed, k, i) and the window the trainer drew for it, so results do not depend on
batching or on which worker served them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from omni_async.agent_loop.weight_staging import WeightSlots
from omni_async.batching import MicroBatcher
from omni_async.sample import Result

logger = logging.getLogger(__name__)


class DeviceThread(ThreadPoolExecutor):
    """The one thread that runs a worker's device work (generation batches, weight writes, updates), counting the
    calls queued behind the one running: a continuous-batching session takes no new requests while another call
    waits, so a weight write or an update is not starved by a stream of requests."""

    def __init__(self, name: str):
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued = 0

    def submit(self, fn, /, *args, **kwargs):
        def run():
            with self._lock:
                self._queued -= 1
            return fn(*args, **kwargs)

        with self._lock:
            self._queued += 1
        try:
            return super().submit(run)
        except BaseException:
            with self._lock:
                self._queued -= 1
            raise

    def others_waiting(self) -> bool:
        return self._queued > 0


@dataclass
class Generation:
    """A rollout worker's answer to one request (``result`` None: withdrawn, ask another worker; before it started,
    :meth:`GenerationBatcher.withdraw`, or, ``discarded``, after: its generation so far is thrown away)."""

    result: Result | None
    version: int  # weights version that generated it
    gen_start: float  # wall clock: its batch started on the device
    gen_end: float
    discarded: bool = False  # withdrawn mid-generation, the work done thrown away (rollout/discarded_at_sync)


@dataclass
class _Request:
    prompt: str
    seed: int
    window: tuple[int, int] | None
    future: asyncio.Future
    sampling: tuple | None = None  # sorted (field, value) pairs overriding the policy's sampling settings
    version: int | None = None  # the weights version it is for (None: the newest the worker has)
    resume: Result | None = None  # an interrupted text response to continue (partial rollout)

    @property
    def settings(self) -> tuple:
        """Requests with equal settings can share a device batch: windows may differ, their lengths may not (the
        batch stacks the window latents)."""
        return (None if self.window is None else self.window[1] - self.window[0]), self.sampling


class GenerationBatcher:
    """Collects concurrent requests into device batches and runs ``generate(prompts, seeds, windows)`` on ``device``
    (``windows``: one ``range`` per request; left out for a modality without SDE windows). A batch goes when
    ``max_batch_size`` requests of one kind wait or the oldest has waited ``max_wait_ms`` (``batching.MicroBatcher``).

    ``version()`` is read on the device thread when a batch starts there, so every sample of a batch reports the
    weights it was made with: a weight load queued on the device thread before the batch has happened, one queued
    after it has not (read on the event loop, a load queued between the two could run first unseen).
    A request with ``sampling`` (e.g. validation's settings) is batched only with requests of equal settings and
    runs as ``generate(prompts, seeds, windows, sampling=sampling)``. A batch with continued responses (partial
    rollout, text) runs as ``generate(prompts, seeds, resume=[...])``. Each text result's new tokens are stamped with
    the batch's version (``TextResult.stamp_version``).

    With ``slots`` (a rollout worker that stages weight syncs, ``agent_loop.weight_staging``) a request may name the
    weights ``version`` it is for. Requests the active weights serve (``version`` at most the active one: a request
    regenerated after its worker moved on runs on the newer weights and reports them) go first; a request for a newer
    version waits until that version is staged, and its batch writes the staged set into the model on the device
    thread first. ``version=None`` means the newest weights the worker has. So the requests of an older version queued
    at the worker finish on their weights although the next version arrived meanwhile.
    """

    def __init__(
        self,
        generate: Callable[..., list[Result]],
        version: Callable[[], int],
        device: ThreadPoolExecutor,
        max_batch_size: int,
        max_wait_ms: float,
        slots: WeightSlots | None = None,
        stream: Callable[..., None] | None = None,
    ):
        self.generate, self.version, self.device, self.slots = generate, version, device, slots
        self.stream = stream
        self.max_batch_size = int(max_batch_size)
        # The event loop adds and picks requests; a streaming session on the device thread takes them too.
        self._pending: MicroBatcher[_Request] = MicroBatcher(max_batch_size, max_wait_ms)
        self._worker: asyncio.Task | None = None
        self.batch_sizes: list[int] = []
        if slots is not None:
            slots.on_change(self._pending.wake)  # a set was staged or applied: a drain waiting for weights looks again

    async def submit(self, prompt: str, seed: int, window: tuple[int, int] | None, **options: Any) -> Generation:
        """One request of the rollout contract (``agent_loop.rollout_worker.RolloutWorker.generate``: ``options`` are
        its ``sampling``, ``version`` and ``resume``), answered when its batch is done."""
        fut = asyncio.get_running_loop().create_future()
        window = (int(window[0]), int(window[1])) if window is not None else None
        sampling = options.get("sampling")
        settings = tuple(sorted(sampling.items())) if sampling else None
        self._pending.put(
            _Request(prompt, int(seed), window, fut, settings, options.get("version"), options.get("resume"))
        )
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    def withdraw(self) -> int:
        """Answer every request not yet on the device as withdrawn (a :class:`Generation` without a result: its
        caller asks another worker); the batch on the device goes on. Returns how many."""
        taken = self._pending.take_now(lambda pending: list(pending))
        for r in taken:
            _answer(r.future, Generation(None, -1, 0.0, 0.0))
        return len(taken)

    def _needs_staged(self, r: _Request) -> bool:
        """Whether ``r`` runs on the staged set rather than the active weights."""
        if self.slots is None:
            return False
        if r.version is None:
            return self.slots.has_staged()
        return r.version > self.slots.active

    def _next_batch(self, pending: list[_Request]) -> list[_Request]:
        """The next device batch: requests the active weights serve first; then those whose version is staged (the
        batch runs on the staged set); none while every request waits for weights not here yet."""
        candidates = [r for r in pending if not self._needs_staged(r)]
        if not candidates:
            newest = self.slots.newest()
            candidates = [r for r in pending if r.version is None or r.version <= newest]
        if not candidates:
            return []
        settings = candidates[0].settings
        return [r for r in candidates if r.settings == settings][: self.max_batch_size]

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        # Waits for each batch to come due; a batch of requests for weights not here yet waits for them.
        while batch := await self._pending.next_batch(self._next_batch):
            swap = self._needs_staged(batch[0])  # only when no waiting request runs on the active weights
            if self.stream is not None and batch[0].window is None and batch[0].sampling is None:
                await self._session(batch, swap)
                continue
            sampling = batch[0].sampling
            args = ([r.prompt for r in batch], [r.seed for r in batch])
            if batch[0].window is not None:
                args += ([range(*r.window) for r in batch],)
            kwargs: dict[str, Any] = {"sampling": dict(sampling)} if sampling else {}
            if any(r.resume is not None for r in batch):
                kwargs["resume"] = [r.resume for r in batch]
            call = partial(self.generate, **kwargs) if kwargs else self.generate
            try:
                version, t0, results = await loop.run_in_executor(self.device, self._run, call, args, swap)
            except Exception as e:  # a failed batch fails its requests, not the worker
                for r in batch:
                    r.future.set_exception(e)
                continue
            t1 = time.time()
            self.batch_sizes.append(len(batch))
            for r, result in zip(batch, results, strict=True):
                if hasattr(result, "stamp_version"):  # text: each token's version
                    result.stamp_version(version)
                r.future.set_result(Generation(result, version, t0, t1))

    async def _session(self, first: list[_Request], swap: bool) -> None:
        """Continuous batching (``stream``, text): ``first`` starts a session on the device that takes further
        requests of the same settings between two tokens while rows are free, on the weights it started with (a
        request that needs newer weights waits for the next session) and while no other device call waits; each
        response is answered the moment it ends. ``batch_sizes`` records the session's peak rows."""
        loop = asyncio.get_running_loop()
        settings = first[0].settings
        admitted: dict[int, tuple[_Request, float]] = {}
        version, index = 0, len(self.batch_sizes)
        self.batch_sizes.append(0)

        def admit(free: int) -> list[tuple[int, str, int, Result | None]]:
            if first:
                take = first[:free]
                del first[:free]
            elif getattr(self.device, "others_waiting", lambda: False)():
                return []
            else:
                take = self._pending.take_now(
                    lambda pending: [r for r in pending if r.settings == settings and not self._needs_staged(r)][:free]
                )
            t = time.time()
            admitted.update({id(r): (r, t) for r in take})
            self.batch_sizes[index] = max(self.batch_sizes[index], len(admitted))
            return [(id(r), r.prompt, r.seed, r.resume) for r in take]

        def emit(key: int, result: Result) -> None:
            r, t0 = admitted.pop(key)
            result.stamp_version(version)
            loop.call_soon_threadsafe(_answer, r.future, Generation(result, version, t0, time.time()))

        def run() -> None:
            nonlocal version
            if swap:
                self.slots.apply()
            version = self.version()
            self.stream(admit, emit, capacity=self.max_batch_size)

        try:
            await loop.run_in_executor(self.device, run)
        except Exception as e:  # a failed session fails the requests it holds, not the worker
            for r in [*first, *(r for r, _ in admitted.values())]:
                if not r.future.done():
                    r.future.set_exception(e)

    def _run(self, call: Callable[..., list[Result]], args: tuple, swap: bool) -> tuple[int, float, list[Result]]:
        """On the device thread: the staged weights written first when the batch is for them, then the weights
        version and start time of this batch, and its results."""
        if swap:
            self.slots.apply()
        version, t0 = self.version(), time.time()
        return version, t0, call(*args)


def _answer(future: asyncio.Future, generation: Generation) -> None:
    if not future.done():  # its caller may have given up (cancelled)
        future.set_result(generation)
