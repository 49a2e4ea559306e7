"""Rollout replica: a Ray actor that owns a copy of the policy (diffusion or text) and serves per-sample requests.

Callers ask for one sample at a time (``generate(prompt, seed, window)``) so each sample can be streamed to its
reward as soon as it exists; the replica still runs the device in batches: requests that arrive within
``max_wait_ms`` of each other (up to ``max_batch_size``, same SDE window) are generated together. The model runs
in a worker thread, so the actor's event loop keeps accepting requests while a batch is on the device.

Sampling is a pure function of (weights version, seed, window): sample ``i`` of step ``k`` uses the seed
:func:`sample_seed` (trainer seed, k, i), so results do not depend on batching or on which replica served them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_async.models.factory import build_policy

SEED_SAMPLE, SEED_WINDOW, SEED_VALIDATION = 0, 1, 2  # independent random streams


def sample_seed(base_seed: int, step: int, index: int, stream: int = SEED_SAMPLE) -> int:
    """A 31-bit seed that depends only on (base seed, stream, step, sample index)."""
    return int(np.random.SeedSequence([base_seed, stream, step, index]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass
class _Request:
    prompt: str
    seed: int
    window: tuple[int, int]
    future: asyncio.Future


class RolloutReplica:
    def __init__(self, model: dict[str, Any], sampling: dict[str, Any], max_batch_size: int = 8,
                 max_wait_ms: float = 5.0, rollout_server: dict[str, Any] | None = None):
        self.policy = build_policy(model, sampling, rollout_server)
        self.max_batch_size, self.max_wait_s = int(max_batch_size), float(max_wait_ms) / 1000.0
        self.version = 0
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-device")
        self.batch_sizes: list[int] = []

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Load the trainer's updated weights; later samples report ``version``."""
        self.policy.load_weights_state_dict(state)
        self.version = int(version)
        return self.version

    def get_version(self) -> int:
        return self.version

    def stats(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "version": self.version}

    async def generate(self, prompt: str, seed: int, window: tuple[int, int]) -> dict[str, Any]:
        """One sample (image + SDE-window latents and log-probs, or response tokens + log-probs), timestamps,
        weights version."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompt, int(seed), (int(window[0]), int(window[1])), fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            if len(self._pending) < self.max_batch_size:
                await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
            window = self._pending[0].window
            batch = [r for r in self._pending if r.window == window][: self.max_batch_size]
            self._pending = [r for r in self._pending if r not in batch]
            version, t0 = self.version, time.time()
            try:
                records = await loop.run_in_executor(
                    self._device, self.policy.sample_records, [r.prompt for r in batch], [r.seed for r in batch],
                    range(*window))
            except Exception as e:  # a failed batch fails its requests, not the replica
                for r in batch:
                    r.future.set_exception(e)
                continue
            t1 = time.time()
            self.batch_sizes.append(len(batch))
            for r, record in zip(batch, records, strict=True):
                r.future.set_result({**record, "version": version, "t_gen_start": t0, "t_gen_end": t1})
