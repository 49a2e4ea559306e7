"""Prometheus metrics of the server: the HTTP process's own, and the scorer processes' through prometheus_client's
multiprocess mode, served together on ``GET /metrics``.

The HTTP process counts requests, errors, latency, batches and the queue (one process: plain in-memory metrics).
Each scorer process (``--workers``) records what only it sees -- items scored, seconds decoding and scoring, its
CPU time and resident memory -- into files of its own under a directory the server creates for this run
(``PROMETHEUS_MULTIPROC_DIR`` is set to it in the scorer processes only, and the directory is removed when the
server stops; one left behind by a killed server is removed at the next start). ``/metrics`` merges those files
on every scrape: counters and histograms are summed over the processes (a restarted process's counts stay in
the sums), the per-process gauges carry a ``pid`` label and only list living processes.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DIR_PREFIX = "http_scorer-metrics-"


class ServerMetrics:
    """The HTTP process's metrics, plus (``metrics_dir``) the scorer processes' merged in at each scrape."""

    def __init__(self, scorer_metrics_dir: Callable[[], str | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("scorer_requests", "requests by route", ["route"], registry=self.registry)
        self.errors = Counter("scorer_errors", "error responses by status code", ["code"], registry=self.registry)
        self.batch_size = Histogram(
            "scorer_batch_size", "items per scorer call", registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128)
        )
        self.batch_seconds = Histogram(
            "scorer_batch_seconds",
            "seconds per batch, from sending it to a scorer process to its answer (decoding included)",
            registry=self.registry,
        )
        self.latency = Histogram(
            "scorer_request_seconds",
            "request latency",
            ["route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.queue_depth = Gauge("scorer_queue_depth", "items waiting for a scorer call", registry=self.registry)
        self.inflight_pixels = Gauge(
            "scorer_inflight_pixels", "decoded pixels reserved by requests in flight", registry=self.registry
        )
        self.busy = Counter(
            "scorer_busy_rejections", "requests answered 503: the pixel budget stayed full", registry=self.registry
        )
        self.restarts = Gauge(
            "scorer_process_restarts", "scorer processes started again after they died", registry=self.registry
        )
        self.registry.register(_ScorerProcesses(scorer_metrics_dir))


class _ScorerProcesses:
    """The scorer processes' metric files, merged at each scrape (the directory exists once the pool started)."""

    def __init__(self, metrics_dir: Callable[[], str | None]):
        self.metrics_dir = metrics_dir

    def collect(self):
        path = self.metrics_dir()
        if path is None or not os.path.isdir(path):
            return []
        from prometheus_client.multiprocess import MultiProcessCollector

        return MultiProcessCollector(None, path=path).collect()


class ScorerProcessMetrics:
    """One scorer process's metrics, written to the run's directory. Build it only in a scorer process, after
    :func:`use_dir` (prometheus_client picks file-backed values from the environment)."""

    def __init__(self) -> None:
        self.items = Counter(
            "scorer_process_items", "items scored in the scorer processes (all processes)", ["outcome"]
        )
        self.seconds = Histogram(
            "scorer_process_seconds",
            "seconds per batch inside the scorer processes, by stage",
            ["stage"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.cpu = Gauge(
            "scorer_process_cpu_seconds", "CPU seconds used by each living scorer process", multiprocess_mode="liveall"
        )
        self.rss = Gauge(
            "scorer_process_resident_memory_bytes",
            "resident memory of each living scorer process",
            multiprocess_mode="liveall",
        )
        self.sample()

    def sample(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.set(usage.ru_utime + usage.ru_stime)
        try:
            with open("/proc/self/statm") as f:
                self.rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError):  # not Linux: the peak instead (ru_maxrss is in KiB there too)
            self.rss.set(usage.ru_maxrss * 1024)


def use_dir(metrics_dir: str) -> None:
    """In a scorer process: its metrics go to ``metrics_dir`` (set before any metric is built)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # in case prometheus_client was imported before the variable


def new_dir() -> str:
    """A fresh, empty directory for this run's scorer-process metrics; removes those of servers no longer
    running (killed before they could remove their own)."""
    base = Path(tempfile.gettempdir())
    for old in base.glob(f"{DIR_PREFIX}*"):
        pid = old.name[len(DIR_PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")


def remove_dir(metrics_dir: str) -> None:
    shutil.rmtree(metrics_dir, ignore_errors=True)


def process_gone(metrics_dir: str, pid: int) -> None:
    """A scorer process exited: its per-process gauges leave ``/metrics`` (its counts stay in the sums)."""
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, metrics_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
