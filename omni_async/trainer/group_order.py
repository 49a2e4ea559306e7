"""A sequence-parallel group's device calls in one order, so its ranks can generate together.

Under Ulysses (``models.sequence_parallel``) every transformer call of a group's ranks is a collective: the ``sp``
ranks must run the same device calls in the same order, or two of them wait in different collectives for ever. Calls
the trainer sends every rank (an update, a log-prob recompute, a weight sync, a checkpoint, ...) reach each rank in
its own order relative to the generation batches, and only one rank can form those batches: its batcher decides them
from the requests' timing (``agent_loop.batcher``). So the group's leader (sequence rank 0, the group's rollout
worker) fixes the order. As each group call starts on its device thread, it announces the call to the followers —
a trainer's call by its name and per-name count, a generation batch with its arguments — and a follower hands its
calls to its device thread in the announced order only: a trainer's call waits until announced, an announcement until
the trainer's copy of the call has arrived; a generation batch runs from its announcement (no request reaches a
follower). vLLM's tensor-parallel driver worker hands each step's inputs to its workers the same way.

The n-th call of a name is the same call on every rank: the trainer sends each such call to all ranks of the group
and waits for it before the next of that name (a data-parallel collective already needs that). A call that runs no
collective and leaves what generation reads untouched (``ActorWorker._on_device``: weights read for a rollout pool,
a drain) is not ordered.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

GENERATE = "generate"  # an announced generation batch (its arguments travel with the announcement)
Key = tuple[str, int]  # (the call's name, its count among this rank's calls of that name)


class Alone:
    """One rank generating alone (no Ulysses, or one rank per group): calls run in the order they arrive."""

    leader = True
    grouped = False  # generation batches run on this rank alone
    followed = 0  # generation batches run with a leader: none

    def __init__(self, device: ThreadPoolExecutor):
        self.device = device

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        return asyncio.wrap_future(self.device.submit(fn, *args))

    def announce_generation(self, payload: Any) -> None:
        """On the device thread, as a generation batch starts (nobody to tell)."""


class Leader(Alone):
    """Sequence rank 0: runs its calls as they arrive and announces each group call to ``followers`` (their Ray
    handles, ``ActorWorker.follow``) as it starts on the device thread."""

    grouped = True

    def __init__(self, device: ThreadPoolExecutor, followers: Sequence[Any]):
        super().__init__(device)
        self.followers = list(followers)
        self.counts: Counter[str] = Counter()
        self.seq = 0  # the next announcement's number (the device thread's)

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        key = (name, self.counts[name])
        self.counts[name] += 1

        def run() -> Any:
            self._announce(key, None)
            return fn(*args)

        return asyncio.wrap_future(self.device.submit(run))

    def announce_generation(self, payload: Any) -> None:
        self._announce((GENERATE, -1), payload)

    def _announce(self, key: Key, payload: Any) -> None:
        for f in self.followers:
            f.follow.remote(self.seq, key, payload)  # numbered: the follower orders them whatever their arrival
        self.seq += 1


class Follower:
    """Sequence rank > 0: its group calls go to the device thread in its leader's order; announced generation
    batches run ``generate(payload)`` there. Lives on the worker's event loop (one thread: no locks)."""

    leader = False
    grouped = True

    def __init__(self, device: ThreadPoolExecutor, generate: Callable[[Any], Any]):
        self.device, self.generate = device, generate
        self.counts: Counter[str] = Counter()
        self.parked: dict[Key, tuple[Callable[..., Any], tuple, asyncio.Future]] = {}  # arrived, not yet announced
        self.announced: dict[int, tuple[Key, Any]] = {}  # announced, not yet handed to the device thread
        self.next = 0
        self.followed = 0  # generation batches run with the leader

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        key = (name, self.counts[name])
        self.counts[name] += 1
        future = asyncio.get_running_loop().create_future()
        self.parked[key] = (fn, args, future)
        self._pump()
        return future

    def announce_generation(self, payload: Any) -> None:
        raise RuntimeError("a follower of a sequence-parallel group generates only the batches its leader announces")

    def follow(self, seq: int, key: Key, payload: Any) -> None:
        """The leader started the group call ``key`` (numbered ``seq``) on its device."""
        self.announced[int(seq)] = (tuple(key), payload)
        self._pump()

    def _pump(self) -> None:
        """Hand the device thread every call whose turn has come and whose copy is here."""
        while self.next in self.announced:
            key, payload = self.announced[self.next]
            if key[0] == GENERATE:
                self.followed += 1
                self.device.submit(self.generate, payload).add_done_callback(_log_failure)
            elif key in self.parked:
                fn, args, future = self.parked.pop(key)
                _chain(self.device.submit(fn, *args), future)
            else:
                return  # the trainer's copy of this call has not arrived yet
            del self.announced[self.next]
            self.next += 1


def _chain(done: Future, future: asyncio.Future) -> None:
    """``future`` (on the event loop) takes ``done``'s outcome (on the device thread). Not ``asyncio.wrap_future``:
    cancelling the caller (a cancelled Ray task) would cancel a call already handed out in the leader's order, and the
    follower would skip a collective its leader runs."""
    loop = future.get_loop()

    def copy(f: Future) -> None:
        if future.cancelled():
            return
        if f.exception() is not None:
            future.set_exception(f.exception())
        else:
            future.set_result(f.result())

    done.add_done_callback(lambda f: loop.call_soon_threadsafe(copy, f))


def _log_failure(done: Future) -> None:
    if done.exception() is not None:  # the leader's batch fails too and answers its requests with the error
        logger.error("a generation batch followed from the sequence-parallel leader failed: %s", done.exception())
