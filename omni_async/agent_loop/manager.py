"""Agent loop: one asyncio task per sample, streaming each finished sample to the reward queue.

A task asks a rollout replica for its sample (replicas batch concurrent requests on the device), and, in stream
mode, the moment the image exists it sends a minimal one-row chunk (prompt, uint8 pixels, ground truth,
data_source, extra_info; never trajectory latents) to the :class:`RewardDispatcher` and awaits the outcome while
the other samples keep generating. When a whole ``uid`` group is scored, the reward classes'
``post_process_scores`` run on it and the group is handed to the trainer (the mini-batch pipeline trains on
groups as they complete).

The tasks run on an event loop in a background thread, so the trainer's step loop stays plain synchronous code
and a step's collection can run while the trainer does something else (one-step off-policy).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.manager import RewardOutcome
from omni_async.reward.worker import sample_to_proto
from omni_async.trainer.dataset import PromptRow


@dataclass
class Sample:
    index: int
    uid: str
    row: PromptRow
    seed: int
    generated: dict[str, Any] | None = None
    outcome: RewardOutcome | None = None
    times: dict[str, float] = field(default_factory=dict)

    def reward_input(self) -> dict[str, Any]:
        """The minimal record a reward function sees: never trajectory latents."""
        out = {"prompt": self.row.prompt, "data_source": self.row.data_source, "uid": self.uid,
               "ground_truth": self.row.ground_truth, "extra_info": self.row.extra_info}
        if "image" in self.generated:
            out["image"] = self.generated["image"]
        else:
            out["response"] = self.generated["response"]
        return out


class Collection:
    """One step's samples in flight. ``groups`` yields each ``uid`` group once all its members are done."""

    def __init__(self, samples: list[Sample], window: tuple[int, int]):
        self.samples, self.window = samples, window
        self.done: Future = Future()
        self.generated: Future = Future()  # set once every sample's image exists
        self.groups: queue.Queue[list[Sample] | None] = queue.Queue()
        self.t_start = time.time()
        self.t_done = float("nan")

    def wait(self) -> list[Sample]:
        return self.done.result()

    def iter_groups(self):
        """Complete groups in the order they finish; ends when the collection does (re-raises its error)."""
        while (group := self.groups.get()) is not None:
            yield group
        self.wait()


class AgentLoopManager:
    def __init__(self, replicas: list[Any], dispatcher_factory=None, max_generating: int | None = None):
        """``dispatcher_factory()`` builds the :class:`RewardDispatcher` on the loop (``None``: generate only).

        ``max_generating`` bounds the samples between "asked for" and "queued for reward"; with a full reward
        queue, generation stops there.
        """
        self.replicas = replicas
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._thread.start()
        self.dispatcher: RewardDispatcher | None = None
        if dispatcher_factory is not None:
            self.dispatcher = self.on_loop(dispatcher_factory)
        self._generating = self.on_loop(lambda: asyncio.Semaphore(max_generating or 1 << 30))
        self.post_process = False

    def call(self, coro):
        """Run a coroutine on the agent loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def on_loop(self, fn):
        """Call ``fn()`` on the agent loop's thread: asyncio primitives must be created (and the dispatcher's state
        read) on the loop that uses them."""

        async def run():
            return fn()

        return self.call(run())

    def start(self, samples: list[Sample], window: tuple[int, int]) -> Collection:
        """Begin generating (and, when streaming, scoring) ``samples``; returns at once."""
        collection = Collection(samples, window)
        fut = asyncio.run_coroutine_threadsafe(self._run(collection), self.loop)

        def finish(f):
            collection.t_done = time.time()
            if not collection.generated.done():
                collection.generated.set_result(None)
            collection.groups.put(None)
            if f.exception() is not None:
                collection.done.set_exception(f.exception())
            else:
                collection.done.set_result(samples)

        fut.add_done_callback(finish)
        return collection

    async def _run(self, collection: Collection) -> None:
        members: dict[str, list[Sample]] = defaultdict(list)
        for s in collection.samples:
            members[s.uid].append(s)
        remaining = {uid: len(group) for uid, group in members.items()}
        to_generate = [len(collection.samples)]

        def generated() -> None:
            to_generate[0] -= 1
            if to_generate[0] == 0:
                collection.generated.set_result(None)

        async def one(s: Sample) -> None:
            await self._sample(s, collection.window, generated)
            remaining[s.uid] -= 1
            if remaining[s.uid] == 0:
                group = members[s.uid]
                if self.dispatcher is not None and self.post_process:
                    outcomes = await self.dispatcher.post_process_group([m.outcome for m in group])
                    for m, o in zip(group, outcomes, strict=True):
                        m.outcome = o
                collection.groups.put(group)

        await asyncio.gather(*(one(s) for s in collection.samples))

    async def _sample(self, s: Sample, window: tuple[int, int], on_generated) -> None:
        replica = self.replicas[s.index % len(self.replicas)]
        await self._generating.acquire()
        try:
            s.generated = await replica.generate.remote(s.row.prompt, s.seed, window)
            s.times.update(gen_start=s.generated["t_gen_start"], generated=s.generated["t_gen_end"])
            on_generated()
            if self.dispatcher is None:
                return
            # The generation slot is held until the sample is in the reward queue: back-pressure on rollout.
            t0 = time.perf_counter()
            chunk = sample_to_proto(s.reward_input())
            s.times["serialize_s"] = time.perf_counter() - t0
            scoring = await self.dispatcher.enqueue(chunk, s.times)
        finally:
            self._generating.release()
        s.outcome = await scoring

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
