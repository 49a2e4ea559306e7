"""Per-step phase timings: ``timing_s/<phase>`` durations and each phase's wall-clock span for the timeline."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Timer:
    def __init__(self) -> None:
        self.timing: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str):
        t0, w0 = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.timing[f"timing_s/{name}"] += time.perf_counter() - t0
            self.spans.append((name, w0, time.time()))
