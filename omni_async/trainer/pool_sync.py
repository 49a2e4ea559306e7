"""The driver's side of the weight sync to a rollout pool (disaggregated layout), per
``actor_rollout_ref.rollout.checkpoint_engine.backend``:

- ``naive``: rank 0's trainable weights go into Ray's object store once and every rollout worker reads them (the
  split layout's path). Only a LoRA adapter is allowed through it (``config.validate``).
- ``nccl``: a ``torch.distributed`` group of trainer rank 0 and every rollout worker (``agent_loop.weight_sync``;
  NCCL on CUDA, gloo on CPU). The driver only starts the calls: rank 0 broadcasts the weights bucket by bucket and
  each worker writes them in place, so no weight passes through the driver or the object store. The group is formed
  at the first sync and formed again after a rollout worker restarted (a group with a dead member cannot be used).

A restarted rollout worker comes back with the initial weights; :meth:`PoolSync.restore` gives it the newest set
before it serves again (the agent loop calls it). A sync and a restore never run at the same time.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import ray
from omegaconf import DictConfig
from ray.exceptions import ActorUnavailableError, RayActorError

from omni_async.agent_loop.weight_sync import meta_bytes


class PoolSync:
    def __init__(self, cfg: DictConfig, actor_wg: Any, workers: list[Any]):
        ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
        self.backend = str(ce.backend)
        self.bucket_bytes = int(ce.update_weights_bucket_megabytes) << 20
        self.rank0, self.workers = actor_wg.workers[0], list(workers)
        self.lock = threading.Lock()
        self.version: int | None = None  # the newest version synced (what a restarted worker gets)
        self._ref: Any = None  # naive: the object ref of that version's weights
        self._group_ok = False
        # What one sync moves: the rollout workers' trainable set in their dtypes (nccl casts to them on rank 0), or
        # rank 0's own state (naive ships it as it is).
        holder = self.workers[0] if self.backend == "nccl" else self.rank0
        self.meta = ray.get(holder.weights_meta.remote())
        self.bytes_per_sync = meta_bytes(self.meta)

    def sync(self, version: int) -> int:
        """Make ``version`` the rollout pool's weights; returns the bytes moved (per receiver)."""
        with self.lock:
            self.version = int(version)
            if self.backend == "naive":
                self._ref = self.rank0.get_weights.remote()
                ray.get([w.set_weights.remote(self._ref, self.version) for w in self.workers])
                return self.bytes_per_sync
            return self._broadcast()

    async def restore(self, worker: Any) -> None:
        """A restarted rollout worker gets the newest weights (on a new group with nccl, sent to every member)."""
        if self.version is None:
            return
        if self.backend == "naive":
            await worker.set_weights.remote(self._ref, self.version)
            return

        def again() -> None:
            with self.lock:
                self._group_ok = False
                self._broadcast()

        await asyncio.get_running_loop().run_in_executor(None, again)

    def _form_group(self) -> None:
        address, port = ray.get(self.rank0.weight_group_address.remote())
        world = 1 + len(self.workers)
        ray.get(
            [self.rank0.join_weight_group.remote(address, port, world)]
            + [w.join_weight_group.remote(address, port, i + 1, world) for i, w in enumerate(self.workers)]
        )
        self._group_ok = True

    def _broadcast(self) -> int:
        if not self._group_ok:
            self._form_group()
        send = self.rank0.send_weights.remote(self.meta, self.bucket_bytes)
        receives = [w.receive_weights.remote(self.version, self.meta, self.bucket_bytes) for w in self.workers]
        worker_died = False
        for ref in receives:
            try:
                ray.get(ref)
            except (RayActorError, ActorUnavailableError):
                worker_died = True  # Ray restarts it; the agent loop's restore brings it (and a new group) back
        try:
            sent = ray.get(send)
        except Exception:
            if not worker_died:
                raise
            sent = 0  # rank 0's broadcast failed because a member died: the restore sends again
        if worker_died:
            self._group_ok = False
        return sent
