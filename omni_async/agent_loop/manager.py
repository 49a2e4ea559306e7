"""Agent loop: one asyncio task per sample, streaming each finished sample to the reward queue.

A task asks a rollout worker for its sample (workers batch concurrent requests on the device), and, in stream
mode, the moment the image exists it sends a minimal one-row chunk (prompt, uint8 pixels, ground truth,
data_source, extra_info; never trajectory latents) to the :class:`RewardDispatcher` and awaits the outcome while
the other samples keep generating. When a whole ``uid`` group is scored, the reward classes'
``post_process_scores`` run on it and the group is handed to the trainer (the mini-batch pipeline trains on
groups as they complete).

With ``coalesce`` (images: a worker's requests sent together share a device batch and finish together) the requests
made for one rollout worker in one turn of the loop go in ``generate_many`` calls of up to ``coalesce`` requests, a
device batch each (``batching.TurnCalls``; a call is answered when its last request is): the same requests to the
same worker in the same order, each handed to its batcher as its own call would be, so the same device batches and
pixels, at a fraction of the driver's CPU per sample (``bench/driver_cost.py``). A text
response ends at its own token and is answered alone (one call each), as are continued ones and those of a lent
trainer device.

Where a group's requests go: a sample is a function of (weights version, seed, window) up to the float rounding of
the device batch it shares (a pixel may round to its neighbour, ``tests/agent_loop/test_rollout_replica.py``), so
the worker decides when it is made, not what. While few requests are out (a lock-step draw starting, a small batch)
a group's samples spread over the workers by their index, so every worker has work and a lock-step draw's device
batches are what they always were. Once the workers hold more than a group's requests each on average (fully async
with many groups in flight, where which samples share a batch is a matter of timing anyway), a new group goes whole
to the least-loaded worker: its samples share one call and one device batch there and finish together, where spread
they would wait in as many queues, and the group is trainable when its slowest member is scored
(``bench/driver_cost.py``: fewer generation calls per sample, more samples per second).

A rollout worker that dies with requests in flight is restarted by Ray; its requests are generated again on a
live worker (same seed, same weights version: the same sample) and counted as ``rollout/regenerated``. A
restarted worker gets the current weights (``restore_worker``) before it serves again.

Partial rollout (text, fully async): a response that a weight sync interrupted comes back unfinished; it is asked for
again with what it has (``resume``, verl's partial rollout resubmitting the cancelled output) and continued under the
new weights, as often as syncs interrupt it, counted as ``rollout/resumed``. Its sample's ``version`` is set from its
first part (the oldest weights in it) as soon as that exists, so the rollouter's lag bound sees it while the rest
generates. A worker that dies during a continuation loses only that part: it is asked for again from the same
point. A generation thrown away in flight and started again, what verl-omni does to every diffusion sample in flight
when it switches to training, is counted as ``rollout/discarded_at_sync``: here only a text response interrupted on
a trainer rank lent to generation, going back to training, without partial rollout (images finish first).

The tasks run on an event loop in a background thread, beside the rollouter (``agent_loop.rollouter``) that starts
the groups, so the trainer's step loop stays plain synchronous code and generation goes on while it trains.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from omni_async.agent_loop.batcher import Generation
from omni_async.batching import TurnCalls
from omni_async.cluster import wait_for_restart
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.teacher import TEACHER_INPUT, trajectory_fields
from omni_async.sample import Sample

logger = logging.getLogger(__name__)

# How long a dead rollout worker may take to come back (Ray restart + model load) before it is given up.
WORKER_RESTART_TIMEOUT_S = 300.0


class RolloutWorkersLostError(RuntimeError):
    """Every rollout worker is dead and none came back."""


class _Gate:
    """The samples between "asked for" and "queued for reward": a semaphore whose capacity can change (trainer
    devices lent to generation add their share while they serve), counting the samples waiting for a place."""

    def __init__(self, capacity: int):
        self.capacity, self.used = int(capacity), 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    async def acquire(self) -> None:
        if self.used < self.capacity and not self._waiters:
            self.used += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted, then cancelled: give the place back
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        self.used -= 1
        self._wake()

    def resize(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used < self.capacity:
            fut = self._waiters.popleft()
            if not fut.done():
                self.used += 1
                fut.set_result(None)


class _Booking:
    """A group's requests placed on worker ``w`` and not yet out, counted in ``booked[w]`` (the manager's per-worker
    bookings) so that groups placed in the same turn see each other."""

    def __init__(self, booked: list[int], w: int, n: int):
        self._booked, self.w, self.left = booked, w, n
        booked[w] += n

    def take(self) -> int:
        """One request goes out: the worker. (A sibling's error ends the group's gather while others still run:
        after :meth:`release` a late request takes nothing more off the bookings.)"""
        if self.left > 0:
            self.left -= 1
            self._booked[self.w] -= 1
        return self.w

    def release(self) -> None:
        """The group is over: whatever never went out is no longer booked."""
        self._booked[self.w] -= self.left
        self.left = 0


class Stopwatch:
    """Seconds while running, added up until taken (on the agent loop)."""

    def __init__(self, running: bool):
        self._since: float | None = time.perf_counter() if running else None
        self._s = 0.0

    def start(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def stop(self, now: float) -> None:
        if self._since is not None:
            self._s += now - self._since
            self._since = None

    def take(self) -> float:
        """The seconds run since the last take (a running watch keeps running)."""
        now = time.perf_counter()
        s = self._s + (now - self._since if self._since is not None else 0.0)
        self._s = 0.0
        if self._since is not None:
            self._since = now
        return s


@dataclass
class AgentLoopMetrics:
    """The agent loop's counters, one object, touched on the loop only: per-step counts (reset by
    :meth:`take_step`), the requests out (the rollout idle while none is, fully async's rollouter idle ratio) and the
    requests out at lent trainer devices (their busy time counts as rollout work)."""

    regenerated: int = 0  # generations asked again of another worker after a worker died
    resumed: int = 0  # continuations of interrupted responses (partial rollout)
    discarded: int = 0  # generations thrown away in flight and started again
    lent_samples: int = 0  # samples a lent trainer device made
    requeued: int = 0  # requests a trainer device gave back when it went back to training (unstarted, or discarded)
    lent_continued: int = 0  # text responses a lent device stopped (continued on a rollout worker)
    requests_out: int = 0
    lent_requests: int = 0
    idle: Stopwatch = field(default_factory=lambda: Stopwatch(running=True))
    lent_busy: Stopwatch = field(default_factory=lambda: Stopwatch(running=False))

    def request_out(self, change: int) -> None:
        now = time.perf_counter()
        if self.requests_out == 0:
            self.idle.stop(now)
        self.requests_out += change
        if self.requests_out == 0:
            self.idle.start(now)

    def lent_request(self, change: int) -> None:
        now = time.perf_counter()
        if self.lent_requests == 0 and change > 0:
            self.lent_busy.start(now)
        self.lent_requests += change
        if self.lent_requests == 0:
            self.lent_busy.stop(now)

    def take_step(self) -> dict[str, float]:
        """This step's counts (the metrics' names), reset."""
        m = {
            "rollout/regenerated": float(self.regenerated),
            "rollout/resumed": float(self.resumed),
            "rollout/discarded_at_sync": float(self.discarded),
            "separate_async/switch/lent_samples": float(self.lent_samples),
            "separate_async/switch/requeued": float(self.requeued),
            "separate_async/switch/continued": float(self.lent_continued),
        }
        self.regenerated = self.resumed = self.discarded = 0
        self.lent_samples = self.requeued = self.lent_continued = 0
        return m


class AgentLoopManager:
    def __init__(
        self,
        workers: list[Any],
        dispatcher_factory: Callable[[], RewardDispatcher] | None = None,
        max_generating: int | None = None,
        post_process: bool = False,
        restore_worker: Callable[[Any], Awaitable[None]] | None = None,
        restartable: bool = True,
        coalesce: int = 0,
    ):
        """``dispatcher_factory()`` builds the :class:`RewardDispatcher` on the loop (``None``: generate only).

        ``max_generating`` bounds the samples between "asked for" and "queued for reward"; with a full reward
        queue, generation stops there. ``post_process``: run the reward classes' group hook on complete groups.
        ``restore_worker(handle)`` brings a restarted rollout worker back to the current weights.
        ``restartable=False`` (hybrid layout: the rollout workers are actor ranks, never restarted with their
        optimizer state) gives a dead worker up at once instead of waiting for Ray to restart it. ``coalesce``: the
        requests for one worker in one turn of the loop go in generation calls of up to this many (module docstring:
        for requests that finish together, a worker's device batch); 0: a call per request.
        """
        self.workers = list(workers)
        self.down = [False] * len(self.workers)
        self.restore_worker, self.restartable = restore_worker, restartable
        self.post_process = post_process
        self.counts = AgentLoopMetrics()  # every counter of the loop (on the loop)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self._thread.start()
        self.dispatcher: RewardDispatcher | None = None
        if dispatcher_factory is not None:
            self.dispatcher = self.on_loop(dispatcher_factory)
            # A reward chunk lingers for others only while generation requests are out (more chunks will come); the
            # requests of answers kept for a lingering call (AnswerHold) are answered.
            self.dispatcher.more_coming = lambda: self._requests_out() > self.dispatcher.hold.items
        # Generation answers that may wait for the lingering reward call wait in its hold (batching.AnswerHold).
        hold = self.dispatcher.hold if self.dispatcher is not None else None
        self._calls: TurnCalls[tuple] | None = (
            TurnCalls(
                lambda w, requests: self.workers[w].generate_many.remote(requests),
                max_items=coalesce,
                hold=hold,
                linger_of=self._answers_linger if hold is not None else None,
            )
            if coalesce
            else None
        )
        self._generating = _Gate(max_generating) if max_generating else None
        self._base_capacity = int(max_generating or 0)
        self._per_worker = int(max_generating or 0) // max(1, len(self.workers))
        self._revived: asyncio.Condition = self.on_loop(asyncio.Condition)
        self._out = [0] * len(self.workers)  # requests out at each rollout worker
        self._booked = [0] * len(self.workers)  # requests of groups placed on a worker, not yet out (_group_home)
        # Trainer devices lent to generation (the disaggregated layout's switch, trainer.layout.Disaggregated): new
        # requests go to them too while they are here; their busy time (a request out at one) counts as rollout work.
        self.lent: list[Any] = []
        self._lent_out: dict[int, int] = {}  # id(handle) -> requests out

    def _requests_out(self) -> int:
        return self.counts.requests_out + self.counts.lent_requests

    def _answers_linger(self, answers: list[Any]) -> float:
        """On Ray's io thread: how long a ``generate_many`` answer's samples may wait for the reward call lingering
        now (``AnswerHold.offer``): the least of their lingers (``RewardDispatcher.linger_for``); 0, handed out at
        once, when a request failed or nothing else is generating (its samples then go at once)."""
        d = self.dispatcher
        if d is None or self._requests_out() - d.hold.items - len(answers) <= 0:
            return 0.0
        if not all(isinstance(a, Generation) for a in answers):
            return 0.0
        return min(d.linger_for(a.gen_start, a.gen_end) for a in answers)

    def call(self, coro):
        """Run a coroutine on the agent loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def on_loop(self, fn):
        """Call ``fn()`` on the agent loop's thread: asyncio primitives must be created (and the dispatcher's state
        read) on the loop that uses them."""

        async def run():
            return fn()

        return self.call(run())

    def step_metrics(self) -> dict[str, float]:
        """This step's rollout and reward-queue counters; resets the per-step ones."""

        def read():
            m = {**self.counts.take_step(), "rollout/workers_down": float(sum(bool(d) for d in self.down))}
            if self.dispatcher is not None:
                m.update(self.dispatcher.metrics())
                self.dispatcher.reset_step_counters()
            return m

        return self.on_loop(read)

    def take_idle_s(self) -> float:
        """Seconds since the last call during which no generation request was out at any rollout worker."""

        return self.on_loop(self.counts.idle.take)

    def take_lent_busy_s(self) -> float:
        """Seconds since the last call during which a request was out at a lent trainer device."""

        return self.on_loop(self.counts.lent_busy.take)

    @property
    def regenerated(self) -> int:
        """Generations asked again of another worker this step (``counts.regenerated``; tests read it)."""
        return self.counts.regenerated

    # ---- trainer devices lent to generation -------------------------------------------------------------------
    def lend(self, handles: list[Any]) -> None:
        """On the loop: ``handles`` (rollout-contract workers: trainer ranks) take new requests beside the rollout
        workers, each with a rollout worker's share of the samples in flight, until :meth:`stop_lending`."""
        self.lent = list(handles)
        for h in self.lent:
            self._lent_out.setdefault(id(h), 0)
        if self._generating is not None:
            self._generating.resize(self._base_capacity + self._per_worker * len(self.lent))

    def stop_lending(self) -> None:
        """On the loop: no new request goes to a lent device. The ones out there come back answered, unfinished (a
        text response interrupted: continued on a rollout worker) or withdrawn (asked again of a rollout worker)."""
        self.lent = []
        if self._generating is not None:
            self._generating.resize(self._base_capacity)

    def waiting_for_device(self) -> int:
        """On the loop: samples asked for that no device has started: waiting for a place among the samples in
        flight, or queued at a rollout worker behind the batch it can run (the work a lent device could take)."""
        waiting = self._generating.waiting if self._generating is not None else 0
        return waiting + sum(max(0, n - self._per_worker // 2) for n in self._out)

    def _pick_lent(self, w: int) -> Any | None:
        """A lent device with fewer requests out than rollout worker ``w`` (the least loaded), else None."""
        if not self.lent:
            return None
        h = min(self.lent, key=lambda h: self._lent_out.get(id(h), 0))
        return h if self._lent_out.get(id(h), 0) < self._out[w] else None

    def _lent_request(self, h: Any, change: int) -> None:
        self._lent_out[id(h)] = self._lent_out.get(id(h), 0) + change
        self.counts.lent_request(change)

    async def run_group(
        self,
        samples: list[Sample],
        *,
        sampling: dict | None = None,
        version: int | None = None,
        on_generated: Callable[[], None] | None = None,
    ) -> list[Sample]:
        """On the agent loop: generate and (when streaming) score ``samples``, one GRPO group, and return them once
        all are done; the reward classes' ``post_process_scores`` run on the complete group. Each sample has its own
        seed and SDE window (``Sample.window``). ``sampling``: settings that differ from the policy's own
        (validation's ``rollout.val_kwargs``), passed to every request. ``version``: the weights version the samples
        are for (a lock-step draw's: the rollout worker generates them with it although a newer set may arrive
        meanwhile; ``RolloutReplica.generate``); None: the newest weights a worker has. ``on_generated()`` is called
        as each sample's image / response exists."""
        home = self._group_home(len(samples))
        try:
            await asyncio.gather(*(self._sample(s, on_generated, sampling, version, home) for s in samples))
        finally:
            if home is not None:  # requests that never went out (the group cancelled first) free their booking
                home.release()
        if self.dispatcher is not None and self.post_process:
            outcomes = await self.dispatcher.post_process_group([m.outcome for m in samples])
            for m, o in zip(samples, outcomes, strict=True):
                m.outcome = o
        return samples

    def generate(self, samples: list[Sample], *, sampling: dict | None = None) -> list[Sample]:
        """From the trainer's thread: generate (and, when streaming, score) ``samples`` group by group and wait for all
        of them (validation)."""
        groups: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            groups[s.uid].append(s)

        async def run() -> None:
            await asyncio.gather(*(self.run_group(g, sampling=sampling) for g in groups.values()))

        self.call(run())
        return samples

    def _group_home(self, n: int) -> _Booking | None:
        """The worker a new group of ``n`` requests goes to whole, booked there until each request is out; None: its
        samples spread by index (module docstring: once the live workers hold more than ``n`` requests each on average,
        and only for coalesced calls, which a whole group can share)."""
        live = [w for w in range(len(self.workers)) if not self.down[w]]
        if self._calls is None or len(live) < 2 or self.counts.requests_out + sum(self._booked) < len(live) * n:
            return None
        w = min(live, key=lambda w: self._out[w] + self._booked[w])
        return _Booking(self._booked, w, n)

    async def _sample(
        self,
        s: Sample,
        on_generated: Callable[[], None] | None,
        sampling: dict | None,
        version: int | None,
        home: _Booking | None = None,
    ) -> None:
        if self._generating is not None:
            await self._generating.acquire()
        try:
            gen = await self._generate(s, sampling, version, home)
            s.result, s.version = gen.result, gen.version
            s.times.gen_start, s.times.gen_end = gen.gen_start, gen.gen_end
            if on_generated is not None:
                on_generated()
            if self.dispatcher is None:
                return
            # The generation slot is held until the sample is in the reward queue: back-pressure on rollout.
            t0 = time.perf_counter()
            record = s.reward_input()  # plain data (reward.worker.RewardLoopWorker.score_many)
            if self.dispatcher.teacher and sampling is None:  # a training sample's trajectory, for the teacher
                record[TEACHER_INPUT] = trajectory_fields(s.result)
            s.times.serialize_s = time.perf_counter() - t0
            scoring = await self.dispatcher.enqueue(record, s.times)
        finally:
            if self._generating is not None:
                self._generating.release()
        s.outcome = await scoring  # at once: the dispatcher's coroutine, scored in this sample's task

    # ---- rollout workers, and what happens when one dies ------------------------------------------------------
    async def _live_worker(self, preferred: int) -> int:
        """``preferred`` if it is up, else another live worker; waits while all are restarting."""
        if not self.down[preferred]:  # every request asks: no lock taken while its worker is up
            return preferred
        async with self._revived:
            while True:
                n = len(self.workers)
                for k in range(n):
                    if not self.down[(preferred + k) % n]:
                        return (preferred + k) % n
                if all(d == "lost" for d in self.down):
                    raise RolloutWorkersLostError(
                        f"all {n} rollout workers died and did not come back within {WORKER_RESTART_TIMEOUT_S:g}s "
                        "(Ray max_restarts exhausted or the node is gone); rerun with trainer.resume_mode=auto"
                    )
                await self._revived.wait()

    async def _generate(
        self, s: Sample, sampling: dict | None = None, version: int | None = None, home: _Booking | None = None
    ) -> Generation:
        kwargs = {"sampling": sampling} if sampling else {}  # training requests use the policy's own settings
        if version is not None:
            kwargs["version"] = version
        return await self._generate_on_a_worker(s, kwargs, home)

    async def _generate_on_a_worker(self, s: Sample, kwargs: dict, home: _Booking | None = None) -> Generation:
        """The sample's generation, on its group's ``home`` worker if it has one (``_group_home``), else spread by
        index; an interrupted text response (partial rollout) is asked for again until it is finished. The answer
        carries the first part's version (the oldest) and start time."""
        w = s.index % len(self.workers) if home is None else home.take()  # out below, this turn while it is up
        first: Generation | None = None
        while True:
            w = await self._live_worker(w)
            lent = self._pick_lent(w)
            resume = {"resume": first.result} if first is not None else {}
            if first is None:
                s.times.requested = time.time()
            if lent is not None:
                self._lent_request(lent, +1)
            else:
                self._out[w] += 1
                self.counts.request_out(+1)
            try:
                if self._calls is not None and lent is None and not resume:
                    gen = await self._calls.submit(w, (s.row.request, s.seed, s.window, kwargs))
                else:
                    worker = lent if lent is not None else self.workers[w]
                    gen = await worker.generate.remote(s.row.request, s.seed, s.window, **kwargs, **resume)
            except (RayActorError, ActorUnavailableError):
                if not ray.is_initialized():
                    # The driver's Ray session ended (ray.shutdown with this trainer still open): its actors went
                    # with it. Nothing to regenerate on, and a retry would reconnect through Ray's auto-init,
                    # racing the next session's ray.init.
                    raise
                # The worker died with this request in flight: generate it again elsewhere (same seed, same
                # weights version -> the same sample) while Ray restarts the dead one.
                self.counts.regenerated += 1
                if lent is not None:
                    self._lent_died(lent)
                elif not self.down[w]:
                    logger.info(
                        "rollout worker %d died with requests in flight; they are generated again on a live worker%s",
                        w,
                        " while Ray restarts it" if self.restartable else " (it is not restarted: an actor rank)",
                    )
                    self.down[w] = True if self.restartable else "lost"
                    if self.restartable:
                        asyncio.ensure_future(self._revive(w))
                continue
            finally:
                if lent is not None:
                    self._lent_request(lent, -1)
                else:
                    self._out[w] -= 1
                    self.counts.request_out(-1)
            if gen.result is None:  # withdrawn by a trainer device going back to training: ask again
                self.counts.requeued += 1
                self.counts.discarded += gen.discarded  # it had started: its work so far is thrown away
                continue
            s.lent = lent is not None
            if s.lent:
                self.counts.lent_samples += not gen.result.unfinished
                self.counts.lent_continued += bool(gen.result.unfinished)
            if first is None:
                first = gen
                s.version = gen.version  # the oldest weights in it, known before the rest generates
            else:
                # A part made on a lent trainer rank may be newer than the rollout worker's continuation (syncs every
                # K > 1 updates): the sample's version is its oldest part's either way.
                s.version = min(first.version, gen.version)
                first = Generation(gen.result, s.version, first.gen_start, gen.gen_end)
            if not gen.result.unfinished:
                return first
            self.counts.resumed += 1

    def _lent_died(self, handle: Any) -> None:
        """A lent trainer rank died with requests in flight: they are generated again on the rollout workers; the
        trainer finds the rank dead at its next call (``ActorRankDiedError``, resume from the last checkpoint)."""
        if any(h is handle for h in self.lent):
            logger.warning("a trainer rank lent to generation died; its requests are generated again elsewhere")
            self.lent = [h for h in self.lent if h is not handle]
            if self._generating is not None:
                self._generating.resize(self._base_capacity + self._per_worker * len(self.lent))

    def worker_died(self, handle: Any) -> None:
        """Any thread: ``handle``'s process died outside a generation request (e.g. during a weight sync). It is taken
        out of the rotation and revived like a worker that died with requests in flight (restart, newest weights);
        its requests then fail and are generated again elsewhere, or wait for it. Does not block."""

        def mark() -> None:
            w = next((i for i, h in enumerate(self.workers) if h == handle), None)
            if w is not None and not self.down[w] and self.restartable:
                logger.info("rollout worker %d died outside a generation request; waiting for its restart", w)
                self.down[w] = True
                asyncio.ensure_future(self._revive(w))

        self.loop.call_soon_threadsafe(mark)

    async def _revive(self, w: int) -> None:
        """Wait for Ray to restart worker ``w``, give it the current weights, put it back in the rotation."""

        async def back_with_current_weights():
            await self.workers[w].stats.remote()
            if self.restore_worker is not None:
                await self.restore_worker(self.workers[w])

        revived = await wait_for_restart(back_with_current_weights, WORKER_RESTART_TIMEOUT_S)
        if revived:
            logger.info("rollout worker %d restarted with the newest weights and serves again", w)
        else:
            logger.warning("rollout worker %d did not come back within %g s: given up", w, WORKER_RESTART_TIMEOUT_S)
        async with self._revived:
            self.down[w] = False if revived else "lost"
            self._revived.notify_all()

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
