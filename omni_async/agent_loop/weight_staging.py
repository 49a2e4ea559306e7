"""A rollout worker's weights: the version it generates with, and at most one complete newer set staged beside it.

A weight sync that reaches a rollout worker while it generates is received into a staging slot (off the device
thread: the object store's state dict, or the one bucket of a broadcast, ``agent_loop.weight_sync``), so the sync does
not wait for the batch on the device and generation does not stop for the transfer. The device thread writes the
staged set into the model between two device batches, before the first batch that asks for it
(``batcher.GenerationBatcher``): a request names the weights version it is for (lock-step modes: the version
the trainer published when it started the step's collection), so the requests of an older version queued at the worker
finish on the weights they were made for, and a batch never runs on half-written weights.

Logging: staging and writing a set are DEBUG (the rollout worker logs each set it received at INFO).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class WeightSlots:
    """``active``: the version the model holds (written only on the device thread); ``staged``: a complete newer set
    and the function that writes it into the model."""

    def __init__(self, version: int = 0):
        self.active = int(version)
        self._staged: tuple[int, Callable[[], object]] | None = None
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def newest(self) -> int:
        """The newest version this worker can generate with: the staged one, else the active one."""
        with self._lock:
            return self._staged[0] if self._staged is not None else self.active

    def has_staged(self) -> bool:
        with self._lock:
            return self._staged is not None

    def stage(self, version: int, write: Callable[[], object]) -> None:
        """Any thread: a complete set of ``version`` is here; ``write()`` puts it into the model (device thread).
        A newer staged set replaces an older one that was never applied."""
        with self._lock:
            replaced, self._staged = self._staged, (int(version), write)
        logger.debug("weights v%d staged%s", version, f" (replacing v{replaced[0]}, never applied)" if replaced else "")
        self._changed()

    def apply(self) -> int:
        """Device thread, between two batches: write the staged set (if any) and make it the active version."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            t0 = time.perf_counter()
            staged[1]()
            self.active = staged[0]
            logger.debug("staged weights v%d written into the model in %.3fs", self.active, time.perf_counter() - t0)
            self._changed()
        return self.active

    def set_active(self, version: int) -> None:
        """Device thread: a set of ``version`` was written in place; a staged set no newer than it is dropped."""
        with self._lock:
            if self._staged is not None and self._staged[0] <= int(version):
                self._staged = None
        self.active = int(version)
        self._changed()

    def on_change(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs (on the thread that made the change) whenever a set is staged or applied."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()
