"""Peak device memory per phase of a worker (generation, the pi_old recompute, the update).

A hybrid worker's phases take turns on its one device thread, so resetting CUDA's peak counter when a phase starts
and reading it when the phase ends gives each phase's own peak; the largest per phase since the last report goes
into the update's metrics (verl's ``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb``, in GiB as
verl reports them, over all phases, and ``perf/max_memory_allocated_gb/<phase>`` per phase). Without CUDA nothing
is recorded: CPU tensors have no such counter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

GIB = 2**30
# Every metric PhasePeaks reports starts so: merged across micro-batches and ranks as a peak (the largest), not a mean.
PEAK_PREFIX = "perf/max_memory_"


class PhasePeaks:
    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.device = device if device.type == "cuda" else None
        self.allocated: dict[str, float] = {}
        self.reserved: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device is None:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            alloc = torch.cuda.max_memory_allocated(self.device) / GIB
            reserved = torch.cuda.max_memory_reserved(self.device) / GIB
            self.allocated[name] = max(self.allocated.get(name, 0.0), alloc)
            self.reserved[name] = max(self.reserved.get(name, 0.0), reserved)

    def take(self) -> dict[str, float]:
        """The peaks since the last call, as metrics; the record starts again."""
        if not self.allocated:
            return {}
        out = {f"{PEAK_PREFIX}allocated_gb/{name}": gb for name, gb in self.allocated.items()}
        out[f"{PEAK_PREFIX}allocated_gb"] = max(self.allocated.values())
        out[f"{PEAK_PREFIX}reserved_gb"] = max(self.reserved.values())
        self.allocated, self.reserved = {}, {}
        return out
