"""A reward with a simulated remote latency, for overlap experiments and benchmarks.

Each call waits a seeded random time, uniform in ``[min_latency_s, max_latency_s] * latency_scale`` (by default
1-40 s, as in the async reward agent study, scaled by 1/40 for CPU runs: 25 ms - 1 s), then returns a real rule
score (JPEG compressibility for images, the digits share of a text response). The wait is ``asyncio.sleep``: no thread and no CPU is held, like an HTTP call to a
scorer on another machine. The latency is a pure function of (``seed``, the sample's pixels or text), so every mode
of a benchmark sees the same latency for the same sample.

``capacity`` > 0 makes it a rate-limited service: at most ``capacity`` requests are served at once per scorer
instance (process), the rest wait their turn, as with a remote judge's concurrency limit. The sync baseline's
colocated reward and one reward-loop worker then have the same scoring capacity.
"""

from __future__ import annotations

import asyncio
import time
import weakref
import zlib
from typing import Any

import numpy as np

from omni_async.reward.pixels import to_pixels
from omni_async.reward.scorers.gsm8k import compute_score_digits
from omni_async.reward.scorers.jpeg import jpeg_kb


def simulated_latency(
    solution: Any, min_latency_s: float, max_latency_s: float, latency_scale: float, seed: int
) -> float:
    """Seconds to wait for this sample: ``U(min, max) * scale`` drawn from a generator seeded by (seed, sample)."""
    # The pixels in one canonical layout (HWC), so the tensor and the numpy form of a sample wait the same time.
    data = solution.encode() if isinstance(solution, str) else to_pixels(solution).tobytes()
    key = zlib.crc32(data)
    u = np.random.default_rng([int(seed), key]).uniform(min_latency_s, max_latency_s)
    return float(u * latency_scale)


_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its capacity semaphore


def _service_slot(capacity: int) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(capacity)
    return _slots[loop]


async def compute_score(
    data_source: str,
    solution_image: Any = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    min_latency_s: float = 1.0,
    max_latency_s: float = 40.0,
    latency_scale: float = 1.0 / 40.0,
    seed: int = 0,
    capacity: int = 0,
    solution_str: str | None = None,
    **kwargs,
) -> dict[str, float]:
    """A rule score after a simulated scorer latency; latency and queueing kept in the extra info."""
    sample = solution_str if solution_image is None else solution_image
    latency = simulated_latency(sample, min_latency_s, max_latency_s, latency_scale, seed)
    t0 = time.perf_counter()
    if capacity > 0:
        async with _service_slot(capacity):
            waited = time.perf_counter() - t0
            await asyncio.sleep(latency)
    else:
        waited = 0.0
        await asyncio.sleep(latency)
    score = -jpeg_kb(solution_image) if solution_image is not None else compute_score_digits(data_source, sample)
    return {"score": score, "simulated_latency_s": latency, "simulated_queue_s": waited}
