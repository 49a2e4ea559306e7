"""Timing device work: a host clock that waits for the device (one helper for every timer of device work)."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has run everything queued on it. CUDA (like any accelerator) runs kernels
    asynchronously: without this, a host clock read after a forward measures the launches, not the work.
    Nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device).synchronize(device)


def device_clock(device: torch.device | str) -> float:
    """``time.perf_counter()`` once ``device`` is idle: the difference of two readings is the device time of the
    work between them (and only of that work: what was queued before the first reading is finished by then)."""
    synchronize(device)
    return time.perf_counter()
