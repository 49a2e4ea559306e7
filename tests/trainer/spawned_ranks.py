"""Training ranks in spawned processes on gloo, for tests that hold several ranks to one process: each rank fills a
dict of what it found (a crash as its traceback, beside what it found before) and writes it to ``rank<r>.pt``; the
test reads them all back. Light on purpose: every spawned rank imports this module and the test module."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    """A loopback port free now, for a rendezvous the ranks bind later (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(body: Callable[..., None], rank: int, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)  # as the one-process reference: a CPU reduction's order depends on the thread count
    results: dict[str, Any] = {}
    try:
        body(rank, results, *args)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(body: Callable[..., None], n: int, *args: Any, out_dir: Path, timeout_s: float) -> dict[int, dict]:
    """``body(rank, results, *args)`` in ``n`` spawned processes (a module-level function of the test module, which
    each process imports); each rank's ``results``, after asserting that none crashed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(body, r, args, str(out_dir))) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    results = {r: torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(n)}
    for r, res in results.items():
        assert "crash" not in res, f"rank {r}: {res['crash']}"
    return results
