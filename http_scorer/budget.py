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


def return_freed_memory_to_os() -> None:
    """glibc: allocations of 8 MiB or more are served by ``mmap`` and unmapped when freed.

    By default glibc raises its mmap threshold after the first large free (up to 32 MiB), after which PIL's 16 MiB
    decode blocks (and full-size arrays of large images) come from heaps that fragment and keep the process's RSS
    high long after the images are gone. A fixed threshold switches that adjustment off. Not lower: at 1 MiB every
    1-8 MiB numpy / OpenCV buffer of an OCR read is mapped and unmapped anew (measured: twice the page faults,
    +20 ms of system CPU per 512x512 image). No-op where ``mallopt`` is missing.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 8 << 20)
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
