"""The package's Python logging: one logger per module (``logger = logging.getLogger(__name__)``), all under the
``omni_async`` logger, which :func:`setup_logging` configures once per process.

The level is ``trainer.log_level`` (DEBUG | INFO | WARNING | ERROR, default INFO). The driver sets it from the config
(``cluster.init_ray``); Ray workers read it from ``$OMNI_ASYNC_LOG_LEVEL``, which ``cluster.worker_runtime_env`` puts
into the job's runtime env (so it also reaches the workers of a joined cluster). Every worker process configures
logging in Ray's process setup hook (``cluster.setup_worker_process``), and the project's actors call
:func:`setup_logging` again in their ``__init__`` (idempotent), so an actor started outside ``init_ray`` logs too.

One handler, on the ``omni_async`` logger: time, level, logger name and process id (Ray forwards a worker's stderr to
the driver prefixed with the actor's name). Records still propagate to the root logger, so a user's own handlers,
Hydra's job log file and pytest's ``caplog`` see them; the root logger's console handlers (``import verl`` runs
``logging.basicConfig``, Hydra configures one) skip them, so a record prints once (:func:`_quiet_root_console`).

Per-sample events are DEBUG at most; events that can repeat at the sample rate (timeouts, retries) go through a
:class:`Throttle`, so the log stays readable at thousands of samples per second.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

LOG_LEVEL_KEY = "trainer.log_level"
LOG_LEVEL_ENV = "OMNI_ASYNC_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
PACKAGE = "omni_async"
FORMAT = "%(asctime)s %(levelname)s %(name)s pid=%(process)d: %(message)s"


def check_log_level(value: Any, key: str = LOG_LEVEL_KEY) -> str:
    """``value`` as one of :data:`LOG_LEVELS` (case does not matter); a ``ValueError`` naming ``key`` and the fix
    otherwise. ``trainer.config.validate`` calls it so a bad level fails at start, with the other config errors."""
    level = str(value).strip().upper() if isinstance(value, str) else None
    if level not in LOG_LEVELS:
        raise ValueError(
            f"{key}={value!r}: not a log level. Fix: set {key} to one of {', '.join(LOG_LEVELS)} "
            f"(e.g. {key}={DEFAULT_LEVEL})"
        )
    return level


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (as ``logging.lastResort`` does): a stream captured at setup
    would be left dangling when a test harness swaps and closes ``sys.stderr``."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


class _NotOurs(logging.Filter):
    """Drops the package's records on a console handler of the root logger: our own handler printed them already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == PACKAGE or record.name.startswith(PACKAGE + "."))


_NOT_OURS = _NotOurs()
_lock = threading.Lock()


def _is_ours(handler: logging.Handler) -> bool:
    return bool(getattr(handler, "_omni_async", False))


def _handler(level: int = logging.NOTSET) -> logging.Handler:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(level)
    handler._omni_async = True  # type: ignore[attr-defined]  # marks ours, so a second call adds none
    return handler


def _quiet_root_console(root: logging.Logger) -> None:
    """Keep the package's records off the root logger's console handlers, so each prints once (ours) while they still
    propagate (pytest's ``caplog``, a user's file handler, Hydra's job log file see them).

    A plain ``StreamHandler`` on the root (``logging.basicConfig``'s, which ``import verl`` installs, or Hydra's
    console) gets a filter. An empty root gets a WARNING console handler in our format that prints everything else,
    as Python's last-resort handler would: it also keeps a later ``logging.basicConfig`` (a module importing verl after
    this) from adding a console handler that would print the package's records a second time."""
    if not root.handlers:
        quiet = _handler(logging.WARNING)
        quiet.addFilter(_NOT_OURS)
        root.addHandler(quiet)
    for h in root.handlers:
        if (type(h) is logging.StreamHandler or _is_ours(h)) and _NOT_OURS not in h.filters:
            h.addFilter(_NOT_OURS)


def setup_logging(level: str | None = None) -> logging.Logger:
    """Configure the ``omni_async`` logger hierarchy: ``level`` and one stderr handler; returns the package logger.

    A second call adds no handler: with a ``level`` it sets that level, without one it keeps the level (an actor's
    ``__init__`` calling it after the process setup hook, or in the driver's process after ``init_ray`` set the
    config's level) and only filters console handlers added to the root logger since (:func:`_quiet_root_console`;
    the actors call it after their modules imported verl). A first call without a level takes
    ``$OMNI_ASYNC_LOG_LEVEL``, else INFO."""
    logger = logging.getLogger(PACKAGE)
    with _lock:
        configured = any(_is_ours(h) for h in logger.handlers)
        if level is not None or not configured:
            if level is None:
                level, key = (
                    os.environ.get(LOG_LEVEL_ENV) or DEFAULT_LEVEL,
                    LOG_LEVEL_ENV,
                )  # the error names the variable
            else:
                key = LOG_LEVEL_KEY
            level = check_log_level(level, key)
            if not configured:
                logger.addHandler(_handler())
            logger.setLevel(level)
        _quiet_root_console(logging.getLogger())
    return logger


class Throttle:
    """At most one report per key per ``interval_s``: :meth:`ready` returns how many reports of that key were held
    back since the last one it let through (0 on the first), or ``None`` to hold this one back. Events that can come
    at the sample rate (a scorer timing out, HTTP retries) log through it, counting what they skipped."""

    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = float(interval_s), clock
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()  # reward functions may log from their worker's thread pool

    def ready(self, key: Hashable) -> int | None:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)
