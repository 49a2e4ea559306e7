"""The actor: a verl ``Worker`` per actor/rollout device, run through ``RayWorkerGroup``.

It owns the trainable copy of the policy and the optimizer. The trainer splits a step's batch into mini-batches
(``trainer.step_ops.minibatches``: whole ``uid`` groups, every epoch) and calls :meth:`ActorWorker.update_minibatch`
once per optimizer step; what a trajectory is and how its loss is computed is the modality's
(``omni_async.modality``).

In the hybrid layout (``actor_rollout_ref.hybrid_engine=True``, verl's default) the same process is also its
device's rollout worker: :meth:`ActorWorker.generate` serves the agent loop's per-sample requests with the model it
trains, batched by a :class:`GenerationBatcher`, so one device holds one pipeline and a weight sync is a version
bump. Every model call (generation batches, updates, checkpoints) runs on one device thread in call order, so they
never interleave inside a forward. When an update may run while the rollout generates (one-step off-policy, the
mini-batch pipeline) the rollout reads a frozen snapshot of the LoRA adapter (``TrainableModule.rollout_adapter``)
taken at each sync, so the samples of version k never see the update that version k's batch is driving.

Data parallelism (``trainer.data_parallel``): the ranks form one process group; ``compute_log_prob`` and
``update_minibatch`` take a share of the batch each (whole ``uid`` groups, balanced by samples) and an update is one
optimizer step of the whole group (LoRA gradients all-reduced, a full fine-tune sharded with FSDP2 and its full
weights gathered again for generation after each step). Rank 0 writes the LoRA checkpoint; FSDP2 writes one
sharded checkpoint. Each of these calls runs under ``DataParallel.failfast``: a rank that raises tears the group down
and the others stop at once with ``RankFailedError`` naming it, instead of waiting ``actor_rollout_ref.nccl_timeout``.

Logging: each rank logs the model it loaded (INFO); rank 0 logs each checkpoint saved or loaded and each weight set
it broadcast to a rollout pool (INFO; the other ranks at DEBUG, so a line per event, not per rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from typing import Any

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from omni_async.agent_loop.batcher import DeviceThread, Generation, GenerationBatcher
from omni_async.agent_loop.rollout_worker import RolloutWorker
from omni_async.agent_loop.weight_sync import WeightGroup, fits_one_bucket, free_address, tensor_meta
from omni_async.cluster import configure_worker, resume_gc
from omni_async.modality import modality_of
from omni_async.modality.base import model_dtype
from omni_async.models.lora import LIVE_ADAPTER, OLD_ADAPTER
from omni_async.models.sequence_parallel import SequenceParallel, denoisers
from omni_async.trainer import data_parallel as dpm
from omni_async.trainer.actor_core import begin_step, old_log_prob, train_minibatch
from omni_async.trainer.device_memory import PhasePeaks
from omni_async.trainer.group_order import Alone, Follower, Leader
from omni_async.trainer.profiling import NsysPlan, RankProfiler

logger = logging.getLogger(__name__)

TRAINED_ROWS_KEPT = 1 << 16  # the (uid, index) rows this rank trained on, newest kept (ActorWorker.trained_rows)


class ActorWorker(Worker, RolloutWorker):
    def __init__(
        self,
        config: dict[str, Any],
        snapshot_rollout: bool = False,
        lendable: bool = False,
        interrupts_at_sync: bool = False,
        nsys: NsysPlan | None = None,
    ):
        """``snapshot_rollout``, ``lendable`` and ``interrupts_at_sync``: the layout's and the mode's decisions for
        this worker (``Layout.actor_worker_args``), handed down rather than derived again from ``config``; the
        defaults are the lock-step hybrid layout's. ``nsys``: the run's profiling plan (``trainer.config.plan``)."""
        super().__init__()
        self.cfg = OmegaConf.create(config)
        self._snapshot_rollout, self._lendable = bool(snapshot_rollout), bool(lendable)
        self._interrupts_at_sync = bool(interrupts_at_sync)
        self.device = configure_worker()
        self.peaks = PhasePeaks(self.device)
        # global_profiler: this rank's capture ranges and NVTX ranges (trainer.profiling)
        self.profiler = RankProfiler.of_rank(nsys, self.rank)
        self.modality = modality_of(self.cfg)
        self._device_thread = DeviceThread("actor-device")
        # The order of this rank's group calls: arrival order, or its Ulysses leader's (join_sequence_group)
        self.order: Alone | Leader | Follower = Alone(self._device_thread)
        self.rollout_version = 0
        self.weights_shipped = 0  # get_weights calls: the split layout's transfers (stays 0 in the hybrid one)
        self.weights_broadcast = 0  # send_weights calls: transfers over the cross-pool group (disaggregated, nccl)
        self.trained: deque[tuple[str, int]] = deque(maxlen=TRAINED_ROWS_KEPT)
        # Disaggregated layout with trainer.v1.separate_async.hybrid_rollout.enable_switch: this rank serves
        # generation requests only between lend() and reclaim() (the hybrid layout's ranks always do).
        self.withdrawing = False
        self.lent_s = 0.0  # seconds lent, in all
        self._lent_at = 0.0

    async def _on_device(self, fn, *args):
        """A device call that runs no collective and leaves what generation reads untouched: in arrival order."""
        return await asyncio.get_running_loop().run_in_executor(self._device_thread, fn, *args)

    async def _in_group(self, name: str, fn, *args):
        """A device call every rank gets (a collective, or a change of what generation reads): in the order the
        sequence-parallel group's leader runs them (``trainer.group_order``; arrival order without Ulysses)."""
        return await self.order.submit(name, fn, *args)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def init_model(self) -> None:
        t0 = time.perf_counter()
        await self._on_device(self._init_model)
        resume_gc()  # imports and model built (cluster.pause_gc_while_importing)
        m = self.cfg.actor_rollout_ref.model
        logger.info(
            "actor rank %d of %d started: %s model %s (%s, %.2fM trainable parameters on this rank) on %s in %.1fs",
            self.dp.rank,
            self.dp.world,
            m.modality,
            m.path,
            f"LoRA rank {m.lora_rank}" if self.policy.lora else "full fine-tune",
            sum(p.numel() for p in self.policy.trainable_parameters()) / 1e6,
            self.device,
            time.perf_counter() - t0,
        )

    @contextlib.contextmanager
    def _phase(self, name: str):
        """A phase of the rank's work (gen / old_log_prob / update): its peak memory, and its NVTX range when
        profiled."""
        with self.peaks.phase(name), self.profiler.phase(name):
            yield

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def start_profile(self) -> None:
        """Open this rank's capture range before a profiled step (a no-op on a rank not profiled)."""
        await self._in_group("start_profile", self.profiler.start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def stop_profile(self) -> None:
        await self._in_group("stop_profile", self.profiler.stop)

    def _log_rank0(self, msg: str, *args: Any) -> None:
        """INFO on rank 0, DEBUG on the others: one line per event of the whole group."""
        logger.log(logging.INFO if self.dp.rank == 0 else logging.DEBUG, msg, *args)

    def _init_model(self) -> None:
        cfg = self.cfg
        m, a, r = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        # The actor ranks' process group (none with one rank); collectives time out after verl's nccl_timeout.
        sp = int(a.fsdp_config.ulysses_sequence_parallel_size)
        self.dp = dpm.DataParallel(self.device, timeout_s=cfg.actor_rollout_ref.nccl_timeout, sp=sp)
        torch.manual_seed(int(cfg.trainer.seed))
        sampling = vars(self.modality.sampling_config(cfg))
        dtype = model_dtype(a.fsdp_config.model_dtype, self.device)
        self.policy = self.modality.build_policy(
            OmegaConf.to_container(m, resolve=True),
            sampling,
            self.device,
            dtype=dtype,
            compile_blocks=a.use_torch_compile,  # verl's key: the transformer's blocks (models.acceleration)
        )
        # Ulysses over each group of sp ranks: the update, the log-prob recompute and (join_sequence_group) generation
        self.sequence_parallel = (
            SequenceParallel(denoisers(self.policy), sp, self.dp.rank, self.dp.world, self.dp.device)
            if sp > 1
            else None
        )
        with self.dp.failfast("init_model"):
            if self.dp.active and self.policy.lora:
                self.dp.broadcast_(self.policy.trainable_parameters())  # one starting adapter on every rank
                self.policy.refresh_working_weights()
            elif self.dp.active:
                # Full fine-tune: FSDP2 over the ranks, sharded from the loaded (bf16) weights, fp32 shards.
                dpm.shard_module(self.policy.trainable, self.dp, dtype)
                self.policy.rebind_trainable_parameters()  # the sharded parameters, for the optimizer and the clip
            self.optimizer = torch.optim.AdamW(
                self.policy.trainable_parameters(),
                lr=a.optim.lr,
                weight_decay=a.optim.weight_decay,
                betas=tuple(a.optim.betas),
                **(a.optim.override_optimizer_config or {}),
            )
            if self.dp.sharded:
                dpm.full_params(self.policy.trainable)  # generation runs on the gathered (bf16) weights
        # DiffusionNFT: the old policy (rollout.rollout_adapter=old) samples and gives the loss its v_old; AWM: its
        # EMA anchor (model.policy_state_adapters=["default","old"]), while the live weights sample.
        self.rollout_old = r.rollout_adapter == OLD_ADAPTER
        if OLD_ADAPTER in m.policy_state_adapters:
            self.policy.init_old_policy()
        self.snapshot = self._snapshot_rollout  # the hybrid layout with updates overlapping generation
        self.weight_group: WeightGroup | None = None  # rank 0 with a rollout pool (checkpoint_engine.backend=nccl)
        self._last_sent: list[torch.Tensor] | None = None  # the last set broadcast, when it is one bucket
        self.batcher = GenerationBatcher(
            self._generate,
            lambda: self.rollout_version,
            self._device_thread,
            r.agent.max_batch_size,
            r.agent.max_wait_ms,
            stream=self._stream if self.policy.continuous_batching else None,
        )

    # ---- rollout (hybrid layout; lent to generation in the disaggregated one) ----------------------------------
    def _rollout_weights(self):
        """The weights generation reads: the snapshot taken at the last sync when updates overlap generation, else
        the old policy (DiffusionNFT) or the live weights."""
        if self.snapshot:
            return self.policy.rollout_adapter()
        if self.rollout_old:
            return self.policy.old_policy()
        return contextlib.nullcontext()

    def _generate(self, *args, **kwargs):
        if self._stops_text():
            kwargs["should_stop"] = lambda: self.withdrawing
        self.order.announce_generation((args, kwargs))  # the group's followers generate the batch beside this rank
        return self._generate_in_group((args, kwargs))

    def _generate_in_group(self, call: tuple[tuple, dict[str, Any]]) -> list[Any]:
        """A generation batch; with Ulysses, together with the group's other ranks (each on a share of every
        sequence, all getting the whole samples)."""
        args, kwargs = call
        with self._rollout_weights(), self._phase("gen"), self._generating_in_group():
            return self.policy.generate(*args, **kwargs)

    @contextlib.contextmanager
    def _generating_in_group(self):
        if not self.order.grouped:  # this rank generates whole samples alone (Ulysses in the update only, or none)
            yield
            return
        with self.dp.failfast("generate"), self.sequence_parallel.active():
            yield

    def _stream(self, admit, emit, capacity: int) -> None:
        stop = {"should_stop": lambda: self.withdrawing} if self._stops_text() else {}
        with self._rollout_weights(), self._phase("gen"):
            return self.policy.generate_stream(admit, emit, capacity=capacity, **stop)

    def _stops_text(self) -> bool:
        """Lent to generation (disaggregated layout), a text batch stops after its current token when the rank is
        reclaimed; an image batch (one device batch of denoising steps) finishes."""
        return self.cfg.actor_rollout_ref.model.modality == "text" and self._lendable

    async def generate(self, prompt, seed, window, *, sampling=None, version=None, resume=None):
        """The rollout contract (``RolloutWorker.generate``); a rank going back to training (``reclaim``) answers
        withdrawn at once, and a text response it interrupted comes back unfinished (continued elsewhere with its
        tokens, partial rollout) or, without partial rollout, withdrawn (generated again from its seed elsewhere).
        With Ulysses only a group's leader takes requests (``Layout.connect``)."""
        if not self.order.leader:
            raise RuntimeError(
                f"actor rank {self.dp.rank} is sequence rank {self.dp.sp_rank} of a Ulysses group: it generates the "
                f"batches of its group's leader (rank {self.dp.rank - self.dp.sp_rank}), which takes the requests"
            )
        if self.withdrawing:
            return Generation(None, -1, 0.0, 0.0)
        gen = await self.batcher.submit(prompt, seed, window, sampling=sampling, version=version, resume=resume)
        if gen.result is not None and gen.result.unfinished and not self._interrupts_at_sync:
            return Generation(None, -1, 0.0, 0.0, discarded=True)  # its tokens so far are thrown away
        return gen

    async def lend(self, version: int) -> int:
        """Disaggregated layout, the trainer idle: serve generation requests with the weights trained so far,
        reported as ``version`` (the trained adapter / weights, read-only until :meth:`reclaim`: no update runs
        while the trainer waits for groups)."""

        def publish() -> int:
            begin_step(self.policy, self.cfg.actor_rollout_ref.actor.fsdp_config.param_offload)
            self.rollout_version = int(version)
            return self.rollout_version

        self.withdrawing = False
        self._lent_at = time.perf_counter()
        return await self._in_group("lend", publish)

    async def reclaim(self) -> dict[str, float]:
        """Back to training: requests not yet on the device are answered withdrawn (the agent loop asks a rollout
        worker), a text batch stops after its current token, an image batch on the device finishes (at most one
        device batch: ``rollout.agent.max_batch_size`` samples). Returns once the device is free."""
        self.withdrawing = True
        withdrawn = self.batcher.withdraw()
        t0 = time.perf_counter()
        await self._on_device(lambda: None)  # after the batch on the device now
        self.lent_s += time.perf_counter() - self._lent_at
        return {"withdrawn": float(withdrawn), "drain_s": time.perf_counter() - t0}

    async def follow_mode(self, snapshot_rollout: bool, interrupts_at_sync: bool) -> None:
        """Another mode on the same trainer (``Layout.set_mode``): the mode's decisions for this worker again; where
        generation now reads a snapshot, it is taken of the weights the rollout reads now (the last sync's)."""

        def apply() -> None:
            self._interrupts_at_sync = bool(interrupts_at_sync)
            if snapshot_rollout and not self.snapshot:
                self.policy.snapshot_for_rollout(OLD_ADAPTER if self.rollout_old else LIVE_ADAPTER)
            self._snapshot_rollout = self.snapshot = bool(snapshot_rollout)

        await self._in_group("follow_mode", apply)

    async def join_sequence_group(self, followers: list[Any] | None) -> None:
        """Ulysses (``trainer.placement``, once after ``init_model``): this rank leads its sequence-parallel group,
        announcing its group calls to ``followers`` (the group's other ranks' handles), or (None) follows its leader's
        order and generates the batches it announces (``trainer.group_order``)."""
        if followers is None:
            self.order = Follower(self._device_thread, self._generate_in_group)
        else:
            self.order = Leader(self._device_thread, followers)

    async def follow(self, seq: int, key: tuple[str, int], payload: Any) -> None:
        """The group's leader started its call ``key`` (a generation batch: ``payload``) on its device."""
        self.order.follow(seq, key, payload)

    async def set_rollout_version(self, version: int) -> int:
        """The hybrid layout's weight sync: later samples report ``version`` (and read a fresh adapter snapshot
        when updates overlap generation). Nothing leaves the device."""

        def publish() -> int:
            if self.snapshot:
                self.policy.snapshot_for_rollout(OLD_ADAPTER if self.rollout_old else LIVE_ADAPTER)
            begin_step(self.policy, self.cfg.actor_rollout_ref.actor.fsdp_config.param_offload)
            self.rollout_version = int(version)
            return self.rollout_version

        return await self._in_group("set_rollout_version", publish)

    async def stats(self) -> dict[str, Any]:
        return {
            "batch_sizes": list(self.batcher.batch_sizes),
            "version": self.rollout_version,
            "pid": os.getpid(),
            "weights_shipped": self.weights_shipped,
            "weights_broadcast": self.weights_broadcast,
            "rank": self.dp.rank,
            "world_size": self.dp.world,
            "lent_s": self.lent_s,
            "snapshot_rollout": self.snapshot,  # generation reads the adapter snapshot of the last sync
            # Ulysses: the generation batches this follower ran with its group's leader
            "followed_batches": self.order.followed,
        }

    async def trained_rows(self) -> list[tuple[str, int]]:
        """The ``(uid, index)`` of every sample this rank trained on since the last call (an audit of the split)."""
        rows = list(self.trained)
        self.trained.clear()
        return rows

    # ---- training -----------------------------------------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def get_weights(self) -> dict[str, torch.Tensor]:
        self.weights_shipped += 1
        return await self._on_device(self._weights)

    def _weights(self) -> dict[str, torch.Tensor]:
        """What a rollout replica loads: the trainable weights, or (DiffusionNFT) the old policy's."""
        if self.dp.sharded:  # the gathered full weights, read without a collective (rank 0 alone is asked)
            return dpm.local_state_dict(self.policy.trainable)
        if self.rollout_old:
            return {k: v.clone() for k, v in self.policy.old_weights_views().items()}
        return self.policy.weights_state_dict()

    def _weight_views(self) -> dict[str, torch.Tensor]:
        """The rollout's weights (:meth:`_weights`) read in place (no copy); FSDP2: the gathered full parameters."""
        if self.dp.sharded:
            return dpm.local_state_dict(self.policy.trainable, clone=False)
        if self.rollout_old:
            return self.policy.old_weights_views()
        return self.policy.weights_views()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def refresh_old_policy(self, decay: float) -> float:
        """DiffusionNFT's old-policy refresh, ``old <- decay * old + (1 - decay) * theta`` (every rank the same, from
        the same live weights); returns the distance the old weights moved. Runs on the device thread, so between
        two generation batches and never inside an update."""
        return await self._in_group("refresh_old_policy", self.policy.refresh_old, float(decay))

    # ---- weight sync to a rollout pool (disaggregated layout; called on rank 0 only) ----------------------------
    async def weights_meta(self) -> list[tuple[str, tuple[int, ...], str]]:
        return await self._on_device(lambda: tensor_meta(self._weight_views()))

    async def weight_group_address(self) -> tuple[str, int]:
        return free_address()

    async def join_weight_group(self, address: str, port: int, world: int) -> None:
        """Rank 0 of the group of this trainer rank and the rollout workers (``agent_loop.weight_sync``)."""
        self.weight_group = None
        self.weight_group = await asyncio.get_running_loop().run_in_executor(
            None, WeightGroup, address, port, 0, world, self.device
        )

    async def send_weights(self, meta: list, bucket_bytes: int, again: bool = False) -> int:
        """Broadcast the trainable weights (cast to the rollout's dtypes in ``meta``) in buckets; on the device
        thread, so it reads the weights between updates. Returns the bytes sent.

        A set of one bucket (a LoRA adapter) is kept as sent, and ``again`` (a restarted rollout worker's restore)
        broadcasts that copy: the last synced version, even when an update has begun since. A larger set is not kept
        (a second copy of the model); ``again`` then sends the weights as they are now."""

        def send() -> int:
            if again and self._last_sent:
                return self.weight_group.send_buckets(self._last_sent)
            self._last_sent = [] if fits_one_bucket(meta, bucket_bytes) else None
            return self.weight_group.send(self._weight_views(), meta, bucket_bytes, keep=self._last_sent)

        self.weights_broadcast += 1
        t0 = time.perf_counter()
        sent = await self._on_device(send)
        self._log_rank0(
            "weights %s to the rollout pool: %.1f MB in %.3fs",
            "re-sent" if again else "broadcast",
            sent / 2**20,
            time.perf_counter() - t0,
        )
        return sent

    @register(dispatch_mode=dpm.BY_GROUPS_ROWS)
    async def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        """This rank's share of the batch; the worker group returns the whole batch's log-probs in its order."""
        return await self._in_group("compute_log_prob", self._compute_log_prob, data)

    def _compute_log_prob(self, data: DataProto) -> tuple:
        """Log-probs of the stored trajectories (pi_old when not bypassed) under the weights of the last sync (the
        live ones until the window's first update; ``trainer.actor_core.old_log_prob``), in micro-batches of
        ``rollout.log_prob_micro_batch_size_per_gpu`` samples."""
        arr = self.cfg.actor_rollout_ref
        with self.dp.failfast("compute_log_prob"), self._sequence_parallel(), self._phase("old_log_prob"):
            return dpm.rows_result(
                data,
                old_log_prob(
                    self.modality,
                    self.policy,
                    data,
                    arr.rollout.log_prob_micro_batch_size_per_gpu,
                    param_offload=arr.actor.fsdp_config.param_offload,
                    # FSDP2: the forwards read the gathered shards (a collective: every rank runs the recompute)
                    gather=(lambda: dpm.full_params(self.policy.trainable)) if self.dp.sharded else None,
                ),
            )

    @register(dispatch_mode=dpm.BY_GROUPS_METRICS)
    async def update_minibatch(self, data: DataProto) -> dict[str, float]:
        """This rank's share of the mini-batch; the worker group returns the step's merged metrics."""
        return await self._in_group("update_minibatch", self._update_minibatch, data)

    def _update_minibatch(self, data: DataProto) -> dict[str, list[float]]:
        """One optimizer step on one mini-batch (``loss_mask`` marks the samples in the loss).

        The mini-batch runs in micro-batches of ``actor.ppo_micro_batch_size_per_gpu`` samples with gradients
        accumulated; each micro-batch's loss (a mean over its own loss units) is weighted by its share of the
        mini-batch's units, so the step equals the un-micro-batched one. ``fsdp_config.param_offload`` keeps the
        frozen text encoder and VAE on the CPU meanwhile, ``optimizer_offload`` the AdamW state between steps
        (``trainer.actor_core``, ``models.offload``).
        """
        a = self.cfg.actor_rollout_ref.actor
        # a rank that raises stops the others at once, naming itself
        with self.dp.failfast("update_minibatch"), self._sequence_parallel(), self._phase("update"):
            metrics = train_minibatch(
                self.modality,
                self.policy,
                self.optimizer,
                data,
                a,
                param_offload=a.fsdp_config.param_offload,
                optimizer_offload=a.fsdp_config.optimizer_offload,
                dp=self.dp,
            )
        metrics[dpm.SAMPLES_KEY] = [dpm.trained_samples(data)]
        metrics.update({k: [v] for k, v in self.peaks.take().items()})
        index = data.meta_info.get(dpm.DP_INDEX_KEY)
        real = range(len(data)) if index is None else [i for i, k in enumerate(index) if k >= 0]
        if self.dp.sp_rank:  # the group's other ranks trained on the same rows: the audit counts them once
            real = []
        nt = data.non_tensor_batch
        self.trained.extend((str(nt["uid"][i]), int(nt["index"][i]) if "index" in nt else -1) for i in real)
        return dict(metrics)

    def _sequence_parallel(self):
        """Ulysses across this rank's sequence-parallel group while inside (``models.sequence_parallel``)."""
        return self.sequence_parallel.active() if self.sequence_parallel else contextlib.nullcontext()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def save_checkpoint(self, path: str) -> None:
        t0 = time.perf_counter()
        await self._in_group("save_checkpoint", self._save_checkpoint, path)
        self._log_rank0("checkpoint saved to %s in %.1fs", path, time.perf_counter() - t0)

    def _save_checkpoint(self, path: str) -> None:
        """One checkpoint set: rank 0's ``actor.pt`` (LoRA, or one rank), or one sharded ``actor_dcp/`` (FSDP2)."""
        os.makedirs(path, exist_ok=True)
        with self.dp.failfast("save_checkpoint"):
            dpm.save_actor(path, self.policy, self.optimizer, self.dp)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def load_checkpoint(self, path: str) -> None:
        t0 = time.perf_counter()
        await self._in_group("load_checkpoint", self._load_checkpoint, path)
        self._log_rank0("checkpoint loaded from %s in %.1fs", path, time.perf_counter() - t0)

    def _load_checkpoint(self, path: str) -> None:
        """Every rank reads it; a LoRA checkpoint resumes on any number of ranks."""
        with self.dp.failfast("load_checkpoint"):
            dpm.load_actor(path, self.policy, self.optimizer, self.dp)
