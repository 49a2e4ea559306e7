"""The one micro-batcher: items that arrive close together go out as one batch; and :class:`TurnCalls`, the calls
made in one turn of an event loop sent as one.

Three places batch this way: a rollout worker's generation requests (``agent_loop.rollout_replica``), the HTTP
scorer client's samples (``reward.scorers.http``) and the scorer server's items (``http_scorer.batcher``). A batch
is due when ``max_batch`` items that may go together are waiting, or when the oldest of them has waited
``max_wait_ms``; which items may go together (same sampling settings, same metadata, weights that are here) is the
caller's ``select``. The deadline is the oldest waiting item's own, so a batch sent because it was full leaves no
timer behind that would send the next one early.

Standard library only: the scorer server's own install (``packages/scorer``) ships this module without torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Select = Callable[[list[T]], Sequence[T]]


class MicroBatcher(Generic[T]):
    """Items waiting to be batched, oldest first.

    :meth:`put` and :meth:`next_batch` run on the event loop the items arrive on; :meth:`take_now`, :meth:`wake`,
    :meth:`discard` and ``len()`` may be called from any thread (a device thread that admits requests into a running
    batch, a thread that staged new weights)."""

    def __init__(self, max_batch: int, max_wait_ms: float):
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_ms) / 1000.0
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._arrived: dict[int, float] = {}  # id(item) -> time.monotonic() of its put
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None  # set on put / wake: a waiting next_batch looks again

    def __len__(self) -> int:
        return len(self._items)

    def _event(self) -> asyncio.Event:
        """The change event of the running loop (a new one when the loop is new: an event belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._changed is None:
            self._loop, self._changed = loop, asyncio.Event()
        return self._changed

    def put(self, *items: T) -> None:
        changed = self._event()
        now = time.monotonic()
        with self._lock:
            self._items.extend(items)
            self._arrived.update((id(it), now) for it in items)
        changed.set()

    def wake(self) -> None:
        """Any thread: what ``select`` depends on changed (e.g. weights arrived); a waiting :meth:`next_batch` looks
        again."""
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None and not loop.is_closed():
            loop.call_soon_threadsafe(changed.set)

    def discard(self, items: Sequence[T]) -> None:
        """Take these items out of the queue (those still in it): nobody waits for them any more."""
        with self._lock:
            self._remove(items)

    def take_now(self, select: Select[T] | None = None) -> list[T]:
        """Any thread: remove and return ``select``'s pick of the waiting items at once, due or not."""
        with self._lock:
            return self._remove((select or self._oldest)(list(self._items)))

    async def next_batch(self, select: Select[T] | None = None, *, wait_for_items: bool = False) -> list[T]:
        """The next due batch, removed from the queue: ``select(waiting)`` (default: the oldest ``max_batch``) once
        it holds ``max_batch`` items or its oldest has waited ``max_wait_ms``. While ``select`` picks nothing the
        items wait for a :meth:`wake`. Returns ``[]`` when nothing waits, unless ``wait_for_items``."""
        changed = self._event()
        while True:
            changed.clear()
            timeout: float | None = None
            with self._lock:
                if not self._items and not wait_for_items:
                    # Idle: forget the loop, so a queue kept per loop (weakly keyed) does not keep its loop alive.
                    self._loop = self._changed = None
                    return []
                batch = list((select or self._oldest)(list(self._items)))[: self.max_batch]
                if batch:
                    oldest = min(self._arrived[id(it)] for it in batch)
                    timeout = oldest + self.max_wait_s - time.monotonic()
                    if len(batch) >= self.max_batch or timeout <= 0:
                        return self._remove(batch)
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _oldest(self, items: list[T]) -> list[T]:
        return items[: self.max_batch]

    def _remove(self, items: Sequence[T]) -> list[T]:
        """Under the lock: drop ``items`` from the queue; returns them."""
        gone = {id(it) for it in items}
        self._items = [it for it in self._items if id(it) not in gone]
        for key in gone:
            self._arrived.pop(key, None)
        return list(items)


class AnswerHold:
    """Answers that need not wake the event loop: while lingering items are due to go out at a known time
    (:meth:`due`, set by the :class:`TurnCalls` that lingers), an answer whose own items would linger at least that long
    waits here, on the thread it arrived on (Ray's io thread), and is handed out on the loop just before those items go
    (:meth:`settle`), so its items join the same call at the same time as if it had been handed out at once.

    Why: a generation answer that arrives while a reward call lingers only adds its samples to that call; handed out
    at the flush, it gives the same call one cross-thread wake-up of the loop fewer (``bench/driver_cost.py``: the
    loop's wake-ups per sample 0.46 -> 0.26; the driver's CPU moved within the runs' spread, docs/benchmarks.md).
    ``held`` / ``items``: answers that waited so far, and the items they carry now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: float | None = None  # loop time at which the lingering items go out; None: nothing lingers
        self._held: list[tuple[Callable[[], None], int]] = []
        self._handed = False  # answers were handed out this turn: their items reach the calls in the next
        self.held = 0
        self.items = 0

    def due(self, when: float) -> None:
        """On the loop: lingering items go out at loop time ``when``."""
        with self._lock:
            self._due = when

    def offer(self, now: float, linger_s: float, n: int, hand_out: Callable[[], None]) -> bool:
        """Any thread: keep ``hand_out`` (an answer of ``n`` items, which may linger ``linger_s`` from ``now``, loop
        time) until the lingering items go, if they go no later than its own items would; False: hand it out now."""
        with self._lock:
            if self._due is None or now + linger_s < self._due:
                return False
            self._held.append((hand_out, n))
            self.held += 1
            self.items += n
            return True

    def settle(self) -> bool:
        """On the loop, before lingering items go (or a linger window ends): hand out the answers kept. True while
        answers handed out in this turn have not reached their calls: the caller acts again in the next turn
        (``loop.call_soon``), after their items' tasks have run."""
        with self._lock:
            held, self._held, self._due = self._held, [], None
            self.items -= sum(n for _, n in held)
        if held:
            for hand_out, _ in held:
                hand_out()
            self._handed = True
            asyncio.get_running_loop().call_soon(self._settled)  # after the tasks the answers woke
        return self._handed

    def _settled(self) -> None:
        self._handed = False


class TurnCalls(Generic[T]):
    """Calls coalesced per turn of the event loop: the items submitted for one key (a worker) during one turn go out
    at the end of that turn as one call, ``send(key, items)``, an awaitable (a Ray ``ObjectRef``) of one answer per
    item, handed to each item's future; an answer that is an exception is raised at its item's caller. A call that
    raises (its worker died) raises at every caller of its items; one with no answer within ``timeout_s`` raises
    ``asyncio.TimeoutError`` there, after ``on_timeout(call)`` (``ray.cancel``). ``max_items``: at most this many items
    per call (a call is answered when its last item is: a rollout worker's device batch), the rest in further calls.

    Why: one Ray call costs the driver about as much CPU as the rest of a sample's handling (pickling, submitting,
    the reply on Ray's io thread), so at thousands of samples a second the per-sample call is the largest cost
    (``bench/driver_cost.py``). Samples that reach the same point in one turn (a group's members, a reply's
    answers) share a call and nothing waits for a timer. ``calls`` / ``items``: what went out.

    An item submitted with ``linger_s`` > 0 (Kafka's ``linger.ms``) may wait up to that long for others: everything
    waiting goes out at the end of the turn in which the earliest of the waiting items' deadlines passes, or at the end
    of the turn of an item submitted with ``linger_s=0`` (nothing more is coming). At a sparse rate, where each call
    costs the driver ~2 ms of CPU across Ray's threads and the loop's wake-ups (``bench/driver_cost.py``), this halves
    the calls for a bounded delay.

    ``hold`` (an :class:`AnswerHold`) ties two of them together: the one that lingers (the reward calls) marks in it
    when its lingering items go and hands its answers out first; the other (the generation calls, with ``linger_of``:
    how long an answer's items may linger, 0 if they must not) keeps the answers that may wait there instead of waking
    the loop for each."""

    def __init__(
        self,
        send: Callable[[Hashable, list[T]], Awaitable[list[Any]]],
        timeout_s: float | None = None,
        on_timeout: Callable[[Any], object] | None = None,
        max_items: int | None = None,
        hold: AnswerHold | None = None,
        linger_of: Callable[[list[Any]], float] | None = None,
    ):
        self._send, self.timeout_s, self._on_timeout = send, timeout_s, on_timeout
        self.max_items = max_items
        self.hold, self._linger_of = hold, linger_of
        # Of the two sides of a hold, this is the lingering one (the reward calls): it marks when its lingering items go
        # and hands the kept answers out first. The other side (linger_of given) offers its answers to the hold.
        self._lingers_for_hold = hold is not None and linger_of is None
        self._pending: dict[Hashable, list[tuple[T, asyncio.Future]]] = {}
        self._flush_soon = False  # a flush at the end of this turn is scheduled
        self._linger: asyncio.TimerHandle | None = None  # the lingering items' flush
        self._answering: set[asyncio.Future] = set()  # strong references: the loop keeps only weak ones to tasks
        self.calls = self.items = 0

    def submit(self, key: Hashable, item: T, linger_s: float = 0.0) -> asyncio.Future:
        """On the loop: ``item`` goes to ``key`` with the others of this turn (and of the next ``linger_s`` seconds at
        most); the future of its answer."""
        loop = asyncio.get_running_loop()
        if linger_s > 0:
            due = loop.time() + linger_s
            if not self._flush_soon and (self._linger is None or due < self._linger.when()):
                if self._linger is not None:
                    self._linger.cancel()
                self._linger = loop.call_at(due, self._flush)
                if self._lingers_for_hold:
                    self.hold.due(due)
        elif not self._flush_soon:
            # call_soon runs after every callback already due in this turn: what reached this point together goes
            # together.
            self._flush_soon = True
            loop.call_soon(self._flush)
        fut = loop.create_future()
        self._pending.setdefault(key, []).append((item, fut))
        return fut

    def _flush(self) -> None:
        if self._lingers_for_hold and self.hold.settle():
            # Answers kept for this flush were handed out: their items come in the next turn, and go with the rest.
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self._flush_soon = False
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        pending, self._pending = self._pending, {}
        for key, entries in pending.items():
            step = self.max_items or len(entries)
            for i in range(0, len(entries), step):
                self._call(key, entries[i : i + step])

    def _call(self, key: Hashable, entries: list[tuple[T, asyncio.Future]]) -> None:
        futures = [f for _, f in entries]
        try:
            call = self._send(key, [item for item, _ in entries])
        except Exception as e:  # the call could not be made (e.g. an argument that does not pickle)
            _fail(futures, e)
            return
        self.calls += 1
        self.items += len(entries)
        # Callbacks, not a task per call: a task awaiting the call (and ``wait_for``'s own task with a timeout) cost
        # the loop a task, its steps and its wake-ups per call, at every call of every sample.
        loop = asyncio.get_running_loop()
        timer = None
        if self.timeout_s is not None:
            timer = loop.call_later(self.timeout_s, self._expire, call, futures)
        future = getattr(call, "future", None)
        if callable(future):
            # A Ray ObjectRef (duck-typed: this module imports no Ray): its concurrent future (what ``await ref``
            # wraps: a task's error raised as its cause) hands the answer straight to the loop, one wake-up per call.
            def answered(done: concurrent.futures.Future) -> None:  # on Ray's io thread
                if loop.is_closed():
                    return
                try:
                    kept = self._keep(loop, futures, timer, done)
                except Exception:  # an answer must never be lost: one the hold cannot judge goes at once
                    kept = False
                if not kept:
                    loop.call_soon_threadsafe(self._answer, futures, timer, done)

            future().add_done_callback(answered)
            return
        answer = asyncio.ensure_future(call)
        self._answering.add(answer)
        answer.add_done_callback(self._answering.discard)
        answer.add_done_callback(functools.partial(self._answer, futures, timer))

    def _keep(
        self,
        loop: asyncio.AbstractEventLoop,
        futures: list[asyncio.Future],
        timer: asyncio.TimerHandle | None,
        done: concurrent.futures.Future,
    ) -> bool:
        """Any thread: whether ``hold`` keeps this answer for the lingering items' flush (``AnswerHold.offer``)."""
        if self._linger_of is None or self.hold is None or done.cancelled() or done.exception() is not None:
            return False
        linger_s = self._linger_of(done.result())
        hand_out = functools.partial(self._answer, futures, timer, done)
        return linger_s > 0 and self.hold.offer(loop.time(), linger_s, len(futures), hand_out)

    def _expire(self, call: Any, futures: list[asyncio.Future]) -> None:
        """No answer within ``timeout_s``: the call is cancelled (``on_timeout``) and its items fail; an answer that
        comes later finds them done."""
        if self._on_timeout is not None:
            self._on_timeout(call)
        if isinstance(call, asyncio.Future):
            call.cancel()
        _fail(futures, asyncio.TimeoutError())

    def _answer(
        self,
        futures: list[asyncio.Future],
        timer: asyncio.TimerHandle | None,
        answer: asyncio.Future | concurrent.futures.Future,
    ) -> None:
        """On the loop: the call's answer (done) handed to each item's future."""
        if timer is not None:
            timer.cancel()
        if answer.cancelled():  # past its deadline (_expire failed the items) or cancelled with its loop
            for f in futures:
                f.cancel()
            return
        error = answer.exception()
        if error is not None:
            _fail(futures, error)
            return
        answers = answer.result()
        if len(answers) != len(futures):
            _fail(futures, RuntimeError(f"a coalesced call answered {len(answers)} items of {len(futures)}"))
            return
        for f, a in zip(futures, answers, strict=True):
            if f.done():  # its caller gave up (cancelled), or the call is past its deadline
                continue
            if isinstance(a, BaseException):
                f.set_exception(a)
            else:
                f.set_result(a)


def _fail(futures: list[asyncio.Future], error: BaseException) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(error)
