"""The reward queue: between the agent loop (producer) and the reward-loop workers (consumers).

Every finished sample calls ``await dispatcher.score(record)`` (``Sample.reward_input()``: plain data):

1. it takes a place in a bounded queue (``reward.queue_size``); when the queue is full the call waits, and
   since the agent loop holds a generation slot until its sample is queued, rollout waits too (back-pressure,
   never a drop);
2. it leaves the queue for the least-loaded worker as soon as one has fewer than
   ``reward.max_inflight_per_worker`` samples in flight (the samples leaving in one turn of the event loop: for the
   same worker while it has room, so they share a call);
3. the call has a deadline (``reward.timeout_s`` + a transport grace); past it the outcome is ``timeout``;
4. if the worker dies, Ray restarts it (``max_restarts``) and the sample is re-sent (``reward/retried``), up to
   ``reward.max_resends`` times, after which it is given up as ``failed`` (``reward_queue/dropped_samples``). A sample
   gets exactly one outcome.

The samples that leave the queue for one worker in one turn of the event loop go in one ``score_many`` call
(``batching.TurnCalls``): a Ray call per sample was the driver's largest cost per sample (``bench/driver_cost.py``).
While more samples are being generated (``more_coming``, the agent loop's requests out), a sample leaving the queue
waits for others to share its call (Kafka's ``linger.ms``: at a sparse rate each call costs the driver ~2 ms of CPU,
and the samples arrive one generation answer at a time), up to ``reward.linger_ms`` and at most
:data:`LINGER_SHARE` of its own generation's time, so a reward's start moves little next to the latency the sample
already has (fast generations stream as before); once nothing more is being generated, everything waiting goes at
once, so the last samples of a step never wait. A generation answer that arrives while a call lingers, and whose
samples may linger at least until it goes, waits for it where it arrived (Ray's io thread) instead of waking the loop
(:attr:`RewardDispatcher.hold`, ``batching.AnswerHold``): handed out just before the call goes, its samples join it,
the same call at the same time, one wake-up of the loop fewer.
Each sample still holds its own place, worker slot, deadline, re-sends and outcome.

It runs on the agent loop's event loop; Ray object refs are awaited, so thousands of in-flight samples cost
no threads.

Logging (``omni_async.logs``): a re-sent sample is INFO and a sample given up after its re-sends is WARNING (both at
most once per worker per :data:`LOG_INTERVAL_S`, counting the ones held back); a worker that died is INFO when it is
back, WARNING when it does not come back. A timed-out sample (the scorer past ``reward.timeout_s``, or a worker that
gave no answer) is WARNING, at most once per :data:`LOG_INTERVAL_S`.
The failure rate is watched over the last :data:`FAILURE_WINDOW` outcomes (``failed`` and ``timeout`` count, of any
scorer of the dispatcher): once at least :data:`FAILURE_MIN_OUTCOMES` are in the window and more than
:data:`FAILURE_RATE_WARN` of them failed, one WARNING names the rate and the last error; one INFO follows when it is
back at or below :data:`FAILURE_RATE_CLEAR` (hysteresis, so a rate near the threshold does not flap). Each sample's
outcome is DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from omni_async.batching import AnswerHold, TurnCalls
from omni_async.cluster import wait_for_restart
from omni_async.logs import Throttle
from omni_async.sample import RewardOutcome, SampleTimes

logger = logging.getLogger(__name__)

# A worker enforces reward.timeout_s itself; the dispatcher's own deadline only has to catch a worker that
# stopped answering (a hung process, a lost node), so it allows transport time on top.
TRANSPORT_GRACE_S = 10.0
# The failure-rate watch (module docstring): a window long enough that one bad sample is not an alarm, short enough
# that a scorer going down shows within seconds at streaming rates.
FAILURE_WINDOW, FAILURE_MIN_OUTCOMES = 100, 20
FAILURE_RATE_WARN, FAILURE_RATE_CLEAR = 0.10, 0.05
LOG_INTERVAL_S = 30.0  # events that can come per sample (re-sends, timeouts) log at most this often per worker
# A reward chunk lingers at most this share of its sample's generation time (and reward.linger_ms): a tenth of what the
# sample already took, so lingering never moves a sample's latency by much, however fast generation is.
LINGER_SHARE = 0.1


class FailureRate:
    """The share of failed outcomes among the last ``window`` ones, with a degraded flag that is raised above
    ``warn`` (once ``min_outcomes`` are in the window) and lowered at or below ``clear``."""

    def __init__(
        self,
        window: int = FAILURE_WINDOW,
        min_outcomes: int = FAILURE_MIN_OUTCOMES,
        warn: float = FAILURE_RATE_WARN,
        clear: float = FAILURE_RATE_CLEAR,
    ):
        self.outcomes: deque[bool] = deque(maxlen=int(window))  # True: failed
        self.min_outcomes, self.warn, self.clear = int(min_outcomes), float(warn), float(clear)
        self.degraded = False

    @property
    def rate(self) -> float:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    def observe(self, failed: bool) -> str | None:
        """Add one outcome; ``"degraded"`` or ``"recovered"`` when the flag changes, else ``None``."""
        self.outcomes.append(bool(failed))
        if not self.degraded and len(self.outcomes) >= self.min_outcomes and self.rate > self.warn:
            self.degraded = True
            return "degraded"
        if self.degraded and self.rate <= self.clear:
            self.degraded = False
            return "recovered"
        return None


class RewardDispatcher:
    def __init__(
        self,
        workers: Sequence[Any],
        *,
        queue_size: int,
        max_inflight_per_worker: int,
        timeout_s: float,
        max_resends: int = 2,
        scorers: str = "reward",
        teacher: bool = False,
        linger_s: float = 0.0,
    ):
        """``scorers``: what the workers score with (``manager.scorer_names``), named in the log. ``teacher``: the
        workers hold the distillation teacher, so training samples' chunks carry their trajectory
        (``reward.teacher``). ``linger_s``: the longest a sample may wait for others to share its call while
        ``more_coming()`` (module docstring; ``reward.linger_ms``)."""
        self.workers = list(workers)
        self.scorers = scorers
        self.teacher = teacher
        self.failure_rate = FailureRate()
        self._throttle = Throttle(LOG_INTERVAL_S)
        self.inflight = [0] * len(self.workers)
        self.down = [False] * len(self.workers)
        self.max_inflight = int(max_inflight_per_worker)
        self.deadline_s = float(timeout_s) + TRANSPORT_GRACE_S
        self.max_resends = int(max_resends)
        self._places = asyncio.Semaphore(int(queue_size))
        self.capacity = int(queue_size)
        # Tasks waiting for a worker slot, first come first served. A slot freed is handed to the oldest waiter
        # directly: O(1) per sample, where an asyncio.Condition scans its woken waiters on every notify (O(k^2) for
        # k slots freed in one turn of the loop: a backlog's cost, bench/driver_cost.py).
        self._slot_waiters: deque[asyncio.Future[int]] = deque()
        self._turn_worker: int | None = None  # the worker this turn's samples go to (_least_loaded)
        self.linger_s = float(linger_s)
        # Whether more samples may reach the queue soon (set by the agent loop: its generation requests out); while
        # it says no, nothing lingers.
        self.more_coming: Callable[[], bool] = lambda: True
        # Generation answers that arrive while a call lingers wait here for it, without waking the loop
        # (batching.AnswerHold; the agent loop's generation calls offer their answers to it).
        self.hold = AnswerHold()
        self._calls: TurnCalls[tuple[dict[str, Any], SampleTimes]] = TurnCalls(
            self._send, timeout_s=self.deadline_s, on_timeout=ray.cancel, hold=self.hold
        )
        self.waiting = 0
        self.counters = {"total_produced": 0, "total_consumed": 0, "dropped": 0, "retried": 0, "max_size": 0}

    # ---- metrics ----------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            # verl-recipe's reward-queue names (seed 002's recipe), except max_size: this step's peak (project-only)
            "monitor/queue/reward_queue_size": float(self.waiting),
            "static/max_reward_queue_size": float(self.capacity),
            "reward_queue/max_size": float(c["max_size"]),
            "reward_queue/total_produced": float(c["total_produced"]),
            "reward_queue/total_consumed": float(c["total_consumed"]),
            "reward_queue/dropped_samples": float(c["dropped"]),
            "reward/retried": float(c["retried"]),
        }

    def reset_step_counters(self) -> None:
        self.counters["max_size"] = self.waiting
        self.counters["retried"] = 0

    # ---- scoring ----------------------------------------------------------------------------------------------
    def _least_loaded(self, linger_s: float = 0.0) -> int | None:
        """The worker for the next sample: the one this turn of the loop (or this linger window) already sends to while
        it has room (its samples go in one call, ``TurnCalls``), else the least loaded one. A window opened by a
        sample that may linger ``linger_s`` keeps its worker that long, no longer: the samples of a shorter window go
        to the least loaded worker again, so scoring stays spread across the workers."""
        w = self._turn_worker
        if w is not None and not self.down[w] and self.inflight[w] < self.max_inflight:
            return w
        up = [w for w in range(len(self.workers)) if not self.down[w] and self.inflight[w] < self.max_inflight]
        if not up:
            return None
        if self._turn_worker is None:
            loop = asyncio.get_running_loop()
            if linger_s > 0:
                loop.call_later(linger_s, self._end_turn)
            else:
                loop.call_soon(self._end_turn)
        self._turn_worker = min(up, key=self.inflight.__getitem__)
        return self._turn_worker

    def _end_turn(self) -> None:
        if self.hold.settle():  # generation answers kept for this window: their samples join it first
            asyncio.get_running_loop().call_soon(self._end_turn)
            return
        self._turn_worker = None

    async def _take_worker(self, linger_s: float = 0.0) -> int:
        w = None if self._slot_waiters else self._least_loaded(linger_s)  # no overtaking the tasks already waiting
        if w is not None:
            self.inflight[w] += 1
            return w
        slot = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(slot)
        try:
            return await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():  # handed a slot in the same turn it was cancelled: give it back
                self._release(slot.result())
            raise

    def _hand_out(self) -> None:
        """Give free worker slots to the oldest waiting tasks."""
        while self._slot_waiters:
            w = self._least_loaded()
            if w is None:
                return
            slot = self._slot_waiters.popleft()
            if slot.done():  # its task was cancelled meanwhile
                continue
            self.inflight[w] += 1
            slot.set_result(w)

    def _release(self, w: int) -> None:
        self.inflight[w] -= 1
        self._hand_out()

    async def _revive(self, w: int) -> None:
        """Keep a dead worker out of the rotation until Ray has restarted it and it answers again."""
        t0 = time.perf_counter()
        if not await wait_for_restart(self.workers[w].info.remote, self.deadline_s):
            logger.warning(
                "reward worker %d did not come back within %.0fs (Ray's restarts exhausted or no answer); it stays "
                "out of the rotation, %d of %d workers left",
                w,
                self.deadline_s,
                self.down.count(False),
                len(self.workers),
            )
            return  # restarts exhausted or no answer in time: it stays out of the rotation
        logger.info("reward worker %d restarted and answering again after %.1fs", w, time.perf_counter() - t0)
        self.down[w] = False
        self._hand_out()

    async def _give_back(self, w: int) -> None:
        self._release(w)

    async def score(self, record: dict[str, Any], times: SampleTimes | None = None) -> RewardOutcome:
        """Queue one sample, score it on a worker, return its typed outcome."""
        return await (await self.enqueue(record, times))

    async def enqueue(
        self, record: dict[str, Any], times: SampleTimes | None = None
    ) -> Coroutine[Any, Any, RewardOutcome]:
        """Take a place in the queue (waits while it is full) and return the coroutine that leaves the queue, scores
        the sample and returns its outcome: the caller awaits it at once (the place is held until it leaves the
        queue). A coroutine, not a task: a task per sample cost the agent loop a task, its steps and its wake-ups.

        ``times`` receives the sample's ``queued``, ``sent`` and ``scored`` wall-clock timestamps.
        """
        times = times if times is not None else SampleTimes()
        await self._places.acquire()  # a full queue blocks the producer here
        times.queued = time.time()
        self.counters["total_produced"] += 1
        self.waiting += 1
        self.counters["max_size"] = max(self.counters["max_size"], self.waiting)
        return self._dispatch(record, times)

    def _send(self, w: int, items: list[tuple[dict[str, Any], SampleTimes]]) -> Any:
        """One turn's samples for worker ``w`` in one call (pickles the records into Ray's object store)."""
        t0 = time.perf_counter()
        ref = self.workers[w].score_many.remote([record for record, _ in items])
        sent, share = time.time(), (time.perf_counter() - t0) / len(items)
        for _, times in items:
            if times.sent is None:  # the first send (a re-send keeps it)
                times.sent, times.dispatch_s = sent, share
        return ref

    def _linger_s(self, times: SampleTimes) -> float:
        """How long this sample's chunk may wait for others (module docstring): 0 once nothing more is coming."""
        if self.linger_s <= 0 or not self.more_coming():
            return 0.0
        return self.linger_for(times.gen_start, times.gen_end)

    def linger_for(self, gen_start: float | None, gen_end: float | None) -> float:
        """How long a sample generated from ``gen_start`` to ``gen_end`` (wall clock) may linger while more samples
        are coming: ``reward.linger_ms``, at most :data:`LINGER_SHARE` of its generation's time (all of it without
        one: not from the agent loop)."""
        if gen_start is None or gen_end is None:
            return self.linger_s
        return min(self.linger_s, LINGER_SHARE * max(0.0, gen_end - gen_start))

    async def _dispatch(self, record: dict[str, Any], times: SampleTimes) -> RewardOutcome:
        try:
            w = await self._take_worker(self._linger_s(times))
        finally:
            self.waiting -= 1
            self._places.release()
        attempt = 0
        # The worker slot held (None between a dead worker's and the next): given back however this ends, a caller
        # cancelling the sample's task included (it awaits this coroutine itself: no task of its own).
        try:
            while True:
                try:
                    # The call is cancelled past the deadline; it lingers only while more samples may come.
                    outcome = await self._calls.submit(w, (record, times), self._linger_s(times))
                    break
                except asyncio.TimeoutError:
                    outcome = RewardOutcome(
                        "timeout",
                        error=f"reward worker {w} gave no answer within "
                        f"{self.deadline_s:g}s (reward.timeout_s + transport)",
                    )
                    break
                except (RayActorError, ActorUnavailableError) as e:
                    # The worker died with our sample in flight; Ray restarts it. Re-send to whoever is least loaded.
                    if not self.down[w]:
                        self.down[w] = True
                        asyncio.ensure_future(self._revive(w))
                    if attempt >= self.max_resends:
                        self.counters["dropped"] += 1
                        outcome = RewardOutcome(
                            "failed",
                            error=f"reward worker died {attempt + 1} times while scoring "
                            f"this sample (reward.max_resends={self.max_resends}): {e}",
                        )
                        if (held := self._throttle.ready(("given_up", w))) is not None:
                            logger.warning(
                                "reward re-sends exhausted, sample given up as failed: %s "
                                "(%d more since the last report)",
                                outcome.error,
                                held,
                            )
                        break
                    if (held := self._throttle.ready(("resent", w))) is not None:
                        logger.info(
                            "reward worker %d died with a sample in flight (%s); re-sending it, attempt %d of %d "
                            "(%d more re-sends since the last report)",
                            w,
                            type(e).__name__,
                            attempt + 2,
                            self.max_resends + 1,
                            held,
                        )
                    self._release(w)
                    w = None
                    attempt += 1
                    self.counters["retried"] += 1
                    w = await self._take_worker()
        finally:
            if w is not None:
                self._release(w)
        self.counters["total_consumed"] += 1
        times.scored = time.time()
        self._watch(outcome)
        return outcome

    def _watch(self, outcome: RewardOutcome) -> None:
        """The failure-rate watch (module docstring): a line when the rate crosses a threshold, never per sample."""
        logger.debug("reward outcome %s (error: %s)", outcome.status, outcome.error)
        # A scorer past reward.timeout_s (the worker's verdict) or a worker that gave no answer (the dispatcher's).
        if outcome.status == "timeout" and (held := self._throttle.ready("timeout")) is not None:
            logger.warning("reward timed out: %s (%d more timeouts since the last report)", outcome.error, held)
        change = self.failure_rate.observe(not outcome.ok)
        if change == "degraded":
            logger.warning(
                "reward failure rate %.0f%% over the last %d outcomes (> %.0f%%) of %s; last error: %s",
                100 * self.failure_rate.rate,
                len(self.failure_rate.outcomes),
                100 * self.failure_rate.warn,
                self.scorers,
                outcome.error,
            )
        elif change == "recovered":
            logger.info(
                "reward failure rate back to %.0f%% over the last %d outcomes of %s",
                100 * self.failure_rate.rate,
                len(self.failure_rate.outcomes),
                self.scorers,
            )

    async def post_process_group(self, outcomes: list[RewardOutcome]) -> list[RewardOutcome]:
        """Run the reward classes' ``post_process_scores`` on one complete group, on the least-loaded worker."""
        w = await self._take_worker()
        try:
            return await self.workers[w].post_process_group.remote(outcomes)
        finally:
            await self._give_back(w)
