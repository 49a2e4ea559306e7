"""The server-wide budget of decoded pixels in flight, and the default derived from the machine's memory.

Every request reserves its pixels *before* any image is decoded (the sizes come from the PNG / JPEG headers):

    cost(request) = sum(kept pixels of each image) + full pixels of its largest image

``kept`` is an image's size after the scorer's downscale (``max_side``; the full size when the scorer has none) --
the arrays that wait for and enter the scorer. The second term is the one image being decoded at full size (a
request decodes its images one after another). After decoding, the reservation shrinks to the kept pixels; it is
returned when the response is ready. A request that does not fit waits (first come, first served) at most
``--inflight-wait-s``, then gets 503 with ``Retry-After``; one that could never fit gets 413.

Memory model: a reserved pixel costs at most ``BYTES_PER_PIXEL`` = 12 bytes -- 3 for the kept uint8 RGB array,
and while decoding 4 for PIL's RGB(X) buffer, 4 for a mode-conversion copy (RGBA / palette / grey inputs) and
transient copies on the way to numpy. So the memory held by decoded images never exceeds
``BYTES_PER_PIXEL * max_inflight_pixels``. The default budget spends an eighth of the memory available at start,
at most 2 GiB, on decoded pixels::

    default max_inflight_pixels = min(MemAvailable / 8, 2 GiB) / 12 B      # 179 M pixels on a machine with >= 16 GB free
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from collections import deque

BYTES_PER_PIXEL = 12
DEFAULT_MEMORY_FRACTION = 1 / 8
DEFAULT_MEMORY_CAP = 2 << 30


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (Linux); elsewhere the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_inflight_pixels(available: int | None = None) -> int:
    available = available_memory_bytes() if available is None else available
    return int(min(available * DEFAULT_MEMORY_FRACTION, DEFAULT_MEMORY_CAP) // BYTES_PER_PIXEL)


MMAP_THRESHOLD_BYTES = 64 << 20  # allocations this large are mapped on their own and unmapped when freed
TRIM_THRESHOLD_BYTES = 128 << 20  # free memory at the top of the heap kept for reuse, at most


def tune_allocator() -> None:
    """glibc's allocator set for a scorer process, which allocates the same buffers again for every image.

    glibc's defaults map anything over 32 MiB afresh on every call (and unmap it when freed) and give the top of
    the heap back to the OS past a threshold that moves with the traffic. PP-OCR (rapidocr runs onnxruntime
    without its memory arena) allocates a 34 MiB buffer per 512x512 image: every image then faults 8,700 fresh
    pages in. Measured here, per image: 9,300 page faults and 26 ms of system CPU with the 8 MiB threshold used
    before, 4,400 and 10-14 ms with these settings (of ~190 ms of CPU in all). Below 64 MiB the heap's blocks are
    reused; larger allocations (a huge image's full-size array) are still mapped and returned when freed; and a
    process keeps at most 128 MiB free at the top of its heap. Fixed values also switch glibc's moving threshold
    off. No-op where ``mallopt`` is missing.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)
        libc.mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError, TypeError):
        pass


class TooLarge(ValueError):
    """The request needs more pixels than the whole budget: no wait can make it fit."""


class PixelBudget:
    """An asyncio budget of pixels with a FIFO wait queue (a large request is not starved by small ones)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    async def acquire(self, n: int, timeout_s: float) -> bool:
        """Reserve ``n`` pixels, waiting at most ``timeout_s``; False if they did not become free in time."""
        if n > self.capacity:
            raise TooLarge(n)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return True
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        except asyncio.CancelledError:  # the client went away while waiting
            self._give_up(entry)
            raise
        if fut.done():
            return True
        self._give_up(entry)
        return False

    def _give_up(self, entry: tuple[int, asyncio.Future]) -> None:
        n, fut = entry
        if fut.done():  # granted at the same moment: hand it back
            self.release(n)
            return
        fut.cancel()
        if entry in self._waiters:
            self._waiters.remove(entry)
        self._wake()  # the head may have been blocking smaller requests behind it

    def release(self, n: int) -> None:
        self.used -= int(n)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(True)

    def waiting(self) -> int:
        return sum(1 for _, f in self._waiters if not f.done())
