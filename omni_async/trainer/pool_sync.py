"""The driver's side of the weight sync to a rollout pool (disaggregated layout), per
``actor_rollout_ref.rollout.checkpoint_engine.backend``:

- ``naive``: rank 0's trainable weights go into Ray's object store once and every rollout worker reads them (the
  split layout's path). Only a LoRA adapter is allowed through it (``config.validate``).
- ``nccl``: a ``torch.distributed`` group of trainer rank 0 and every rollout worker (``agent_loop.weight_sync``;
  NCCL on CUDA, gloo on CPU). The driver only starts the calls: rank 0 broadcasts the weights bucket by bucket and
  each worker writes them, so no weight passes through the driver or the object store. The group is formed at the
  first sync and formed again after a rollout worker restarted (a group with a dead member cannot be used).

A sync that fits the workers' staging (:attr:`PoolSync.stages`: the object store's copy, or one bucket) returns once
every worker has the set; with ``activate=False`` the workers keep generating the requests of older versions and
write the set in before the first request for it (``agent_loop.weight_staging``).

A restarted rollout worker comes back with the initial weights; :meth:`PoolSync.restore` gives it the newest set
before it serves again (the agent loop calls it). A worker that dies during a sync (mid-broadcast included) does not
fail the sync: the members still alive keep the weights they had and get the set again with the restarted worker's
restore. A sync and a restore never run at the same time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import ray
from omegaconf import DictConfig
from ray.exceptions import ActorUnavailableError, RayActorError

from omni_async.agent_loop.weight_sync import fits_one_bucket, meta_bytes

DEAD = (RayActorError, ActorUnavailableError)


class PoolSync:
    def __init__(
        self,
        cfg: DictConfig,
        actor_wg: Any,
        workers: list[Any],
        on_death: Callable[[Any], None] = lambda worker: None,
    ):
        """``on_death(worker)``: a rollout worker died during a sync (the agent loop revives it: restart, then
        :meth:`restore`, even when no generation request of it was in flight to notice)."""
        ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
        self.backend = str(ce.backend)
        self.bucket_bytes = int(ce.update_weights_bucket_megabytes) << 20
        self.rank0, self.workers, self.on_death = actor_wg.workers[0], list(workers), on_death
        self.lock = threading.Lock()
        self.version: int | None = None  # the newest version synced (what a restarted worker gets)
        self._ref: Any = None  # naive: the object ref of that version's weights
        self._group_ok = False
        # What one sync moves: the rollout workers' trainable set in their dtypes (nccl casts to them on rank 0), or
        # rank 0's own state (naive ships it as it is).
        holder = self.workers[0] if self.backend == "nccl" else self.rank0
        self.meta = ray.get(holder.weights_meta.remote())
        self.bytes_per_sync = meta_bytes(self.meta)
        # Whether the workers stage a sync (receive it while generating, write it in between two batches): the object
        # store's copy always; a broadcast when it is one bucket (a larger one is written in place, generation paused).
        self.stages = self.backend == "naive" or fits_one_bucket(self.meta, self.bucket_bytes)

    def sync(self, version: int, activate: bool = True) -> int:
        """Make ``version`` the rollout pool's weights; returns the bytes moved (per receiver). ``activate=False``
        (with :attr:`stages`): the workers write it in before the first request for it, not at once."""
        with self.lock:
            self.version = int(version)
            if self.backend == "naive":
                self._ref = self.rank0.get_weights.remote()
                self._gather([w.set_weights.remote(self._ref, self.version, activate) for w in self.workers])
                return self.bytes_per_sync
            return self._broadcast(activate)

    async def restore(self, worker: Any) -> None:
        """A restarted rollout worker gets the newest weights (on a new group with nccl, sent to every member; the
        others stage it and write it in when a request asks for it)."""
        if self.version is None:
            return
        if self.backend == "naive":
            await worker.set_weights.remote(self._ref, self.version)
            return

        def again() -> None:
            with self.lock:
                self._group_ok = False
                self._broadcast(activate=False, restarted=worker)

        await asyncio.get_running_loop().run_in_executor(None, again)

    def _form_group(self) -> None:
        address, port = ray.get(self.rank0.weight_group_address.remote())
        world = 1 + len(self.workers)
        ray.get(
            [self.rank0.join_weight_group.remote(address, port, world)]
            + [w.join_weight_group.remote(address, port, i + 1, world) for i, w in enumerate(self.workers)]
        )
        self._group_ok = True

    def _gather(self, receives: list) -> bool:
        """Wait for every worker's receive; True if a worker died meanwhile. Another worker's failure is raised, unless
        a worker died (a broadcast with a dead member fails the living ones too: the restore sends it again)."""
        died, error = False, None
        for worker, ref in zip(self.workers, receives, strict=True):
            try:
                ray.get(ref)
            except DEAD:
                died = True  # Ray restarts it; the agent loop revives it and its restore re-forms the group
                self.on_death(worker)
            except Exception as e:
                error = error or e
        if error is not None and not died:
            raise error
        return died

    def _broadcast(self, activate: bool, restarted: Any = None) -> int:
        if not self._group_ok:
            self._form_group()
        send = self.rank0.send_weights.remote(self.meta, self.bucket_bytes, restarted is not None)
        receives = [
            w.receive_weights.remote(self.version, self.meta, self.bucket_bytes, activate or w == restarted)
            for w in self.workers
        ]
        died = self._gather(receives)
        try:
            sent = ray.get(send)
        except Exception:
            if not died:
                raise
            sent = 0  # rank 0's broadcast failed because a member died: the restore sends again
        if died:
            self._group_ok = False
        return sent
