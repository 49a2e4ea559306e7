"""The rollout worker of the split and disaggregated layouts.

:class:`RolloutReplica` is the rollout worker of the split layout (``actor_rollout_ref.hybrid_engine=False``: it
shares a device with an actor rank) and of the disaggregated one (``actor_rollout_ref.rollout.nnodes > 0``: it owns
a device of the rollout pool): an inference-only copy of the policy (no gradients, no optimizer) that takes weights
from the trainer, through Ray's object store (:meth:`RolloutReplica.set_weights`) or a bucketed broadcast over a
process group with trainer rank 0 (:meth:`RolloutReplica.receive_weights`, ``agent_loop.weight_sync``). It serves
requests through a :class:`~omni_async.agent_loop.batcher.GenerationBatcher` (``agent_loop/batcher.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from omni_async.agent_loop.batcher import DeviceThread, GenerationBatcher
from omni_async.agent_loop.rollout_worker import RolloutWorker
from omni_async.agent_loop.weight_staging import WeightSlots
from omni_async.agent_loop.weight_sync import WeightGroup, fits_one_bucket, meta_bytes, tensor_meta, write_buckets

logger = logging.getLogger(__name__)


class RolloutReplica(RolloutWorker):
    """An inference-only copy of the policy (split and disaggregated layouts); Ray restarts it if its process dies.

    A weight sync is staged when it can be (``agent_loop.weight_staging``): :meth:`set_weights` keeps the object
    store's state dict, :meth:`receive_weights` receives a one-bucket set on a thread of its own while the device
    generates; the set is written into the model on the device thread between two batches. With ``activate`` (the
    default) the call returns once that happened; without, it returns once the set is here and the first batch that
    asks for it writes it (requests name their version: ``GenerationBatcher``).

    Partial rollout (``partial_rollout``: fully async, text): while a newer set waits (staged, or queued to be written
    in place) the batch on the device stops after its current token; its unfinished responses go back to the agent
    loop, which asks for them again with what they have (:meth:`generate` with ``resume``), and they continue on the
    newer weights. Without it a batch in flight finishes on the weights it started with."""

    def __init__(
        self,
        modality: str,
        model: dict[str, Any],
        sampling: dict[str, Any],
        max_batch_size: int = 8,
        max_wait_ms: float = 5.0,
        rollout_server: dict[str, Any] | None = None,
        dtype_name: str | None = None,
        partial_rollout: bool = False,
        use_torch_compile: bool = False,
    ):
        from omni_async.cluster import configure_worker, resume_gc
        from omni_async.modality import get_modality
        from omni_async.modality.base import model_dtype

        self.device = configure_worker()
        t0 = time.perf_counter()
        dtype = model_dtype(dtype_name, self.device)
        self.policy = get_modality(modality).build_policy(
            model, sampling, self.device, rollout_server, dtype=dtype, compile_blocks=use_torch_compile
        )
        if hasattr(self.policy, "freeze_for_inference"):  # a vLLM client holds no weights in this process
            self.policy.freeze_for_inference(dtype)
        logger.info(
            "rollout worker started: %s model %s on %s (%s) in %.1fs, batches of up to %d",
            modality,
            model.get("path"),
            self.device,
            dtype,
            time.perf_counter() - t0,
            max_batch_size,
        )
        self.slots = WeightSlots()
        self.group: WeightGroup | None = None  # the cross-pool weight group (checkpoint_engine.backend=nccl)
        resume_gc()  # imports and model built (cluster.pause_gc_while_importing)
        self.torn = False  # an in-place weight transfer failed half-way: no generation until a complete set arrived
        self.partial_rollout = bool(partial_rollout)
        # Set (on the event loop) when an in-place weight write is queued on the device thread, cleared by it: with
        # partial rollout the batch on the device stops after its current token, so the write need not wait for it.
        self.write_waiting = threading.Event()
        self.interrupted = 0  # responses returned unfinished (partial rollout)
        self.device_thread = DeviceThread("rollout-device")
        # Staged receives run here, beside the device thread (a broadcast must not wait for the batch on the device).
        self.receive_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-weights")
        self.batcher = GenerationBatcher(
            self._generate,
            lambda: self.slots.active,
            self.device_thread,
            max_batch_size,
            max_wait_ms,
            self.slots,
            stream=self._stream if self.policy.continuous_batching else None,
        )

    @property
    def version(self) -> int:
        """The weights version the model holds now."""
        return self.slots.active

    def _check_weights(self) -> None:
        if self.torn:
            raise RuntimeError(
                "this rollout worker's weights are half written (a weight transfer failed); it "
                "generates again once the next complete sync arrived"
            )

    def _generate(self, *args, **kwargs):
        self._check_weights()
        if self.partial_rollout:
            kwargs["should_stop"] = self._newer_weights_waiting
        results = self.policy.generate(*args, **kwargs)
        self.interrupted += sum(bool(r.unfinished) for r in results)
        return results

    def _stream(self, admit, emit, capacity: int) -> None:
        """A continuous-batching session (text): as :meth:`_generate`, responses answered one by one."""
        self._check_weights()

        def counted(key, result) -> None:
            self.interrupted += bool(result.unfinished)
            emit(key, result)

        stop = self._newer_weights_waiting if self.partial_rollout else None
        self.policy.generate_stream(admit, counted, capacity=capacity, should_stop=stop)

    def _newer_weights_waiting(self) -> bool:
        """Partial rollout, asked by the batch on the device after each token: a newer set is staged (the next batch
        writes it) or an in-place write is queued behind this batch."""
        return self.write_waiting.is_set() or self.slots.has_staged()

    async def _activate(self) -> int:
        """Write the staged set on the device thread, after the batch on the device now (if any)."""
        return await asyncio.get_running_loop().run_in_executor(self.device_thread, self.slots.apply)

    async def set_weights(self, state: dict[str, torch.Tensor], version: int, activate: bool = True) -> int:
        """The trainer's updated weights (from the object store); later samples report ``version``.

        The state dict is staged and loaded on the device thread between two generation batches, so no batch runs on
        half-loaded weights (an adapter torn between two of its forwards): with ``activate`` before this returns
        (after the batch on the device now), else before the first batch that asks for ``version`` or newer."""
        t0 = time.perf_counter()
        self.slots.stage(version, lambda: self.policy.load_weights_state_dict(state))
        active = await self._activate() if activate else int(version)
        logger.info(
            "weights v%d from the object store: %d tensors, %.1f MB, %s in %.3fs",
            version,
            len(state),
            sum(t.numel() * t.element_size() for t in state.values()) / 2**20,
            "written" if activate else "staged",
            time.perf_counter() - t0,
        )
        return active

    def stats(self) -> dict[str, Any]:
        return {
            "batch_sizes": list(self.batcher.batch_sizes),
            "version": self.version,
            "newest_version": self.slots.newest(),
            "interrupted": self.interrupted,
            "pid": os.getpid(),
            "requires_grad": sum(p.requires_grad for p in self._parameters()),
        }

    def _parameters(self) -> list[torch.Tensor]:
        modules = getattr(getattr(self.policy, "pipe", None), "components", {}).values()
        modules = [m for m in modules if isinstance(m, torch.nn.Module)] or [getattr(self.policy, "model", None)]
        return [p for m in modules if m is not None for p in m.parameters()]

    # ---- weights over the cross-pool group (disaggregated layout, checkpoint_engine.backend=nccl) ------------------
    def weights_meta(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Names, shapes and dtypes of the weights a sync writes (this worker's trainable set, in its dtypes)."""
        return tensor_meta(self.policy.weights_views())

    async def join_weight_group(self, address: str, port: int, rank: int, world: int) -> None:
        """Join (or re-join after a restart of any member) the group of trainer rank 0 and the rollout workers."""
        loop = asyncio.get_running_loop()
        self.group = None
        self.group = await loop.run_in_executor(None, WeightGroup, address, port, rank, world, self.device)

    async def receive_weights(self, version: int, meta: list, bucket_bytes: int, activate: bool = True) -> int:
        """Receive a complete weight set from trainer rank 0; later samples report ``version``. Returns the bytes.

        A set of one bucket (``weight_sync.fits_one_bucket``: a LoRA adapter) is received while the device goes on
        generating and staged (``activate`` as in :meth:`set_weights`); a larger one is written in place on the
        device thread, between two batches, and is active when this returns."""
        if self.group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        group, loop = self.group, asyncio.get_running_loop()
        t0 = time.perf_counter()
        if fits_one_bucket(meta, bucket_bytes):
            received = await loop.run_in_executor(self.receive_thread, group.receive_buckets, meta, bucket_bytes)
            got = sum(flat.numel() * flat.element_size() for _, flat in received)
            if got == meta_bytes(meta):
                self.slots.stage(version, lambda: write_buckets(self.policy.weights_views(), received))
                if activate:
                    await self._activate()
        else:

            def receive() -> int:
                self.write_waiting.clear()
                self.torn = True
                n = group.receive(self.policy.weights_views(), meta, bucket_bytes)
                self.torn = False
                self.slots.set_active(version)
                return n

            if self.partial_rollout:  # no await before the write is queued: no batch can start in between
                self.write_waiting.set()
            got = await loop.run_in_executor(self.device_thread, receive)
        if got != meta_bytes(meta):
            raise RuntimeError(f"received {got} of {meta_bytes(meta)} weight bytes")
        logger.info(
            "weights v%d over the %s group: %.1f MB, %s in %.3fs",
            version,
            group.backend,
            got / 2**20,
            "written in place" if not fits_one_bucket(meta, bucket_bytes) else "written" if activate else "staged",
            time.perf_counter() - t0,
        )
        return got
