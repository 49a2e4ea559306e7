"""Scorer processes: the scorer runs in ``--workers`` processes of its own, fed batches from the server's one queue.

Why processes fed from one queue (measured: bench/results/http_scorer_reference_before.json): with N uvicorn
worker processes each holding its own batcher, a client's keep-alive connection stays with the process that
accepted it, and asyncio accepts a burst of connections in whichever process wakes first (32 clients were spread
26/6 and 20/12 over 2 processes); items then queue behind their own process's batch while the other may be idle,
and a step's last samples wait for the busiest process. Here the HTTP process keeps one queue, and a batch is
formed when a scorer process is free, from everything waiting: no process idles while work waits, and a
GPU-like scorer still gets full batches. Decoding happens in the scorer processes too (in parallel, and off the
HTTP process's GIL); the HTTP process only reads image headers for the limits and the pixel budget.

Messages between the server and its scorer processes are pickled by ``multiprocessing`` over a pipe between
processes of this server: they carry bytes the server has already checked, strings and numbers, never bytes
from the network as a pickle.

A scorer process that dies (a crash in native code, the OOM killer) fails only the batch it held (500 naming the
exit code) and is started again; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from http_scorer.budget import tune_allocator
from http_scorer.metrics import ScorerProcessMetrics, new_dir, process_gone, remove_dir, use_dir
from http_scorer.protocol import BadRequest, Limits, decode_item
from http_scorer.scorers import load_scorer, max_batch, max_side, needs_target, normalize

START_TIMEOUT_S = 600.0  # loading a model onto a GPU can take minutes


class ScorerLoadError(RuntimeError):
    """The scorer could not be loaded in a scorer process; the message says why."""


@dataclass(frozen=True)
class ScorerInfo:
    max_side: int | None
    needs_target: bool
    max_batch: int | None


# Per-item outcome of a batch, as the scorer process sends it back:
#   ("ok", score, details) | ("bad", field, message, status) | ("error", message)
Outcome = tuple


def _worker_main(conn, spec: str, limits: Limits, metrics_dir: str) -> None:
    tune_allocator()
    use_dir(metrics_dir)
    try:
        scorer = load_scorer(spec)
    except (ValueError, ImportError) as e:  # a bad --scorer: its message says what to use instead
        conn.send(("error", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - e.g. the scorer's module failed on import: the server refuses to start
        conn.send(("error", f"loading {spec!r}: {type(e).__name__}: {e}"))
        return
    side = max_side(scorer)
    metrics = ScorerProcessMetrics()
    conn.send(("ready", side, needs_target(scorer), max_batch(scorer)))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        outcomes = score_batch(scorer, spec, side, limits, *message, metrics=metrics)
        conn.send(outcomes)
        metrics.sample()


def score_batch(
    scorer,
    spec: str,
    side: int | None,
    limits: Limits,
    items: list[Any],
    prompts: list[str],
    targets: list[Any],
    metadata: dict[str, Any],
    metrics: ScorerProcessMetrics | None = None,
) -> list[Outcome]:
    """Decode each item (a corrupt one fails alone, with its field) and score the rest in one call."""
    out: list[Outcome | None] = [None] * len(items)
    images, kept = [], []
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        try:
            images.append(decode_item(item, limits, side))
            kept.append(i)
        except BadRequest as e:
            out[i] = ("bad", e.field, str(e), e.status)
    t1 = time.perf_counter()
    if kept:
        try:
            raw = scorer(images, [prompts[i] for i in kept], [targets[i] for i in kept], metadata)
            del images
            results = normalize(raw, len(kept), spec)
        except Exception as e:  # the scorer's failure fails this batch's items, not the process
            message = f"scorer {spec}: {type(e).__name__}: {e}"
            for i in kept:
                out[i] = ("error", message)
        else:
            for i, (score, details) in zip(kept, results, strict=True):
                out[i] = ("ok", score, details)
    if metrics is not None:
        metrics.seconds.labels("decode").observe(t1 - t0)
        if kept:
            metrics.seconds.labels("score").observe(time.perf_counter() - t1)
        for outcome in out:
            metrics.items.labels(outcome[0]).inc()
    return out  # type: ignore[return-value]


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.process: mp.process.BaseProcess | None = None
        self.conn = None
        self.dead = False  # its process exited: restart before the next batch
        # One thread per scorer process does the blocking send / receive, so the event loop never waits on a pipe.
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"scorer{index}")


class ScorerPool:
    def __init__(self, spec: str, workers: int, limits: Limits):
        if workers < 1:
            raise ValueError(f"--workers {workers}: need at least 1 scorer process")
        self.spec, self.limits = spec, limits
        self.workers = [_Worker(i) for i in range(workers)]
        self.info: ScorerInfo | None = None
        self.restarts = 0
        self.metrics_dir: str | None = None  # the scorer processes' metric files (metrics.py), from start() on
        self._stopping = False
        self._ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, locks or GPU state
        self._lock = threading.Lock()

    def start(self) -> ScorerInfo:
        """Start every scorer process and wait until each has loaded the scorer (raises ScorerLoadError)."""
        try:
            self.metrics_dir = self.metrics_dir or new_dir()
            for w in self.workers:
                self._spawn(w)
            for w in self.workers:
                self._handshake(w)
        except BaseException:
            self.stop()
            raise
        return self.info

    def _spawn(self, w: _Worker) -> None:
        parent, child = self._ctx.Pipe()
        w.conn = parent
        w.process = self._ctx.Process(
            target=_worker_main,
            args=(child, self.spec, self.limits, self.metrics_dir),
            daemon=True,
            name=f"http_scorer-scorer{w.index}",
        )
        w.process.start()
        child.close()

    def _handshake(self, w: _Worker) -> None:
        if not w.conn.poll(START_TIMEOUT_S):
            raise ScorerLoadError(f"the scorer process did not load {self.spec!r} in {START_TIMEOUT_S:g}s")
        try:
            message = w.conn.recv()
        except EOFError:
            w.process.join(5)
            raise ScorerLoadError(
                f"the scorer process exited with code {w.process.exitcode} while loading {self.spec!r}"
            ) from None
        if message[0] != "ready":
            raise ScorerLoadError(message[1])
        info = ScorerInfo(*message[1:])
        with self._lock:
            self.info = self.info or info

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None and w.process.pid is not None]

    async def run(self, w: _Worker, items, prompts, targets, metadata) -> list[Outcome]:
        return await asyncio.get_running_loop().run_in_executor(
            w.io, self._round_trip, w, (items, prompts, targets, metadata)
        )

    def _round_trip(self, w: _Worker, message) -> list[Outcome]:
        try:
            w.conn.send(message)
            return w.conn.recv()
        except (EOFError, OSError):
            if self._stopping or w.process is None:
                return [("error", f"scorer {self.spec}: the server is shutting down")] * len(message[0])
            w.process.join(5)
            w.dead = True
            return [
                (
                    "error",
                    f"scorer {self.spec}: the scorer process exited (code {w.process.exitcode}) while "
                    "scoring this batch; it is being restarted, retry the request",
                )
            ] * len(message[0])

    async def restart(self, w: _Worker) -> None:
        """A fresh process in place of a dead one (its batch has been answered already)."""
        await asyncio.get_running_loop().run_in_executor(w.io, self._restart, w)

    def _restart(self, w: _Worker) -> None:
        if self._stopping:
            return
        w.conn.close()
        process_gone(self.metrics_dir, w.process.pid)
        self.restarts += 1
        try:
            self._spawn(w)
            self._handshake(w)
            w.dead = False
        except (ScorerLoadError, OSError):  # tried again after its next batch fails
            pass

    def stop(self) -> None:
        """Ask every scorer process to exit after its batch, kill what is still there after 5 s (idempotent)."""
        self._stopping = True
        for w in self.workers:
            if w.process is None:
                continue
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            if w.process is None:
                continue
            w.process.join(5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5)
            w.conn.close()
            w.io.shutdown(wait=False, cancel_futures=True)
            w.process = None
        if self.metrics_dir is not None:
            remove_dir(self.metrics_dir)
            self.metrics_dir = None
