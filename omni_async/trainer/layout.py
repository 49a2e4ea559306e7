"""Layouts: where the rollout runs and how new weights reach it, one object each.

- :class:`Hybrid` (``actor_rollout_ref.hybrid_engine=True``, verl's hybrid engine, the default): each actor worker is
  also its device's rollout worker. A sync is a version bump (and, when updates overlap generation, a fresh
  device-local snapshot of the LoRA adapter the rollout reads), so it waits until no sample is generating.
- :class:`Split` (``hybrid_engine=False``): rollout replicas with their own copy of the policy share the actor
  devices' bundles (``ACTOR_ROLLOUT_COLOCATE`` processes per device). Rank 0's trainable weights go into Ray's object
  store once and every replica reads them; the replicas stage them beside generation.
- :class:`Disaggregated` (``actor_rollout_ref.rollout.nnodes`` > 0): inference-only replicas on a rollout pool of
  their own, weights by ``checkpoint_engine.backend`` (``trainer.pool_sync``: the object store for LoRA, or a
  bucketed broadcast over a process group). Staged when the set fits the workers' staging, else written in place
  between two generation batches.

A layout owns the placement of its rollout workers (:meth:`Layout.start_rollout`, with the pools ``placement``
makes from :meth:`Layout.pool_spec`, started before the actor group so the two load side by side; then
:meth:`Layout.connect` ties them to it), the weight sync after an update (:meth:`Layout.sync`), whether a sync can be
staged while generation runs (:attr:`Layout.stages`) or needs the rollout idle (:attr:`Layout.sync_needs_idle_rollout`),
and bringing a restarted rollout worker back to the newest weights (:meth:`Layout.restore`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

import ray
from omegaconf import DictConfig, OmegaConf

from omni_async.agent_loop.producer import Producer
from omni_async.cluster import actor_ranks, rollout_pool_size, sequence_parallel_size
from omni_async.config_error import check as _check
from omni_async.modality import modality_of
from omni_async.trainer.hybrid_switch import SwitchConfig, SwitchPolicy, check_switch
from omni_async.trainer.mode import Mode
from omni_async.trainer.pool_sync import PoolSync
from omni_async.trainer.timer import Timer

logger = logging.getLogger(__name__)

# Split layout: roles sharing one actor/rollout device bundle, the actor worker and a rollout replica; each takes
# this share. The other layouts have one process per device.
ACTOR_ROLLOUT_COLOCATE = 2
ROLLOUT_MAX_RESTARTS = 4


class Layout:
    name: ClassVar[str]
    colocate: ClassVar[int] = 1  # processes per actor-pool bundle (verl's max_colocate_count)
    rollout_is_actor: ClassVar[bool] = False  # the rollout workers are the actor ranks (never restarted alone)
    sync_needs_idle_rollout: ClassVar[bool] = False  # a sync must wait until no sample is generating
    rollout_pool: ClassVar[bool] = False  # the rollout runs on devices of its own (the trainer's may be lent to it)

    def __init__(self, cfg: DictConfig, mode: Mode):
        self.cfg = cfg
        self.mode = mode  # decided once (trainer.config.plan), never re-derived from cfg here
        self.actor_wg: Any = None
        self.workers: list[Any] = []
        # Any thread: a rollout worker died outside a generation request (set to the agent loop's worker_died).
        self.on_death: Callable[[Any], None] = lambda worker: None
        self.sync_bytes = 0  # bytes moved by syncs since the last take_sync_bytes
        # Actor ranks that generate each batch together (Ulysses in generation, trainer.group_order); 1: alone
        self.generation_group = 1

    def pool_spec(self) -> dict[str, list[int]]:
        """Resource pools of its own besides ``actor_rollout`` (name -> devices per node), mapped to the role
        ``rollout``."""
        return {}

    def start_rollout(self, pools: Any) -> list[Any]:
        """Create the rollout workers on ``pools`` (verl's ``ResourcePoolManager``). Called before the actor group
        exists, so each replica's start (imports, model load) overlaps the trainer ranks'; they get weights at the
        first sync."""
        return []

    def connect(self, actor_wg: Any) -> list[Any]:
        """Tie the rollout workers to the loaded actor group (the weight path); returns the rollout workers."""
        self.actor_wg = actor_wg
        return self.workers

    @property
    def stages(self) -> bool:
        """Whether the rollout workers receive a sync while they generate and write it in between two device batches
        (``agent_loop.weight_staging``)."""
        return False

    def sync(self, version: int, activate: bool = True) -> None:
        """Make ``version`` the rollout's weights. ``activate=False`` (only where :attr:`stages`): the workers stage
        the set while they generate and write it in before the first request for ``version`` or newer."""
        t0 = time.perf_counter()
        moved = self._sync(int(version), activate)
        self.sync_bytes += moved
        logger.info(
            "weight sync to version %d done (%s layout): %.1f MB per worker in %.3f s%s",
            version,
            self.name,
            moved / 1e6,
            time.perf_counter() - t0,
            "" if activate else ", staged",
        )

    def _sync(self, version: int, activate: bool) -> int:
        raise NotImplementedError

    def take_sync_bytes(self) -> int:
        n, self.sync_bytes = self.sync_bytes, 0
        return n

    async def restore(self, worker: Any) -> None:
        """Give a restarted rollout worker the newest weights (it came back with the initial ones)."""

    def collect(self, producer: Producer, step: int, n: int, among: int, timer: Timer) -> list[Any]:
        """Step ``step``'s next ``n`` groups from the producer (``Producer.take``). The disaggregated layout may lend
        its trainer devices to generation meanwhile (``hybrid_rollout``)."""
        return producer.take(step, n, among)

    def step_metrics(self, agent: Any) -> dict[str, float]:
        """The layout's own metrics of the step (the switch's), read once per step."""
        return {}

    def set_mode(self, mode: Mode) -> None:
        """Go on in ``mode`` (``RLTrainer.set_mode``): its decisions for the actor workers handed down again, so a
        trainer built for one mode generates as one built for the other would (a snapshot of the adapter where
        updates now overlap generation on the actor's device)."""
        self.mode = mode
        if self.actor_wg is not None:
            args = self.actor_worker_args()
            ray.get(
                [
                    w.follow_mode.remote(args["snapshot_rollout"], args["interrupts_at_sync"])
                    for w in self.actor_wg.workers
                ]
            )

    def actor_worker_args(self) -> dict[str, bool]:
        """What each actor worker must know of the layout and the mode (``ActorWorker``'s keyword arguments), so it
        does not derive them again from the config: whether it generates from a snapshot of the adapter taken at the
        sync (it is the rollout and updates overlap generation), whether it may be lent to a rollout pool (a text
        batch then stops when the rank is reclaimed), and whether a sync interrupts text responses (the mode's: an
        unfinished one is then continued elsewhere, else thrown away)."""
        return {
            "snapshot_rollout": self.rollout_is_actor and self.mode.overlaps_update,
            "lendable": self.rollout_pool,
            "interrupts_at_sync": self.mode.interrupts_at_sync,
        }


class Hybrid(Layout):
    name = "hybrid"
    rollout_is_actor = True
    sync_needs_idle_rollout = True

    def __init__(self, cfg: DictConfig, mode: Mode):
        super().__init__(cfg, mode)
        # With Ulysses, rollout.agent.num_workers says how the ranks generate: one worker per actor device (each
        # generates whole samples alone, as verl-omni's rollout at tensor parallel 1), or one per sequence-parallel
        # group (the group generates each batch together: long sequences one device's generation cannot hold).
        devices, sp = actor_ranks(cfg), sequence_parallel_size(cfg)
        if sp > 1 and int(cfg.actor_rollout_ref.rollout.agent.num_workers) * sp == devices:
            self.generation_group = sp

    def connect(self, actor_wg: Any) -> list[Any]:
        """Every actor rank is a rollout worker, or each group of :attr:`generation_group` ranks is one (its leader
        takes the requests, the others generate each batch with it: ``trainer.group_order``)."""
        self.actor_wg, self.workers = actor_wg, list(actor_wg.workers)[:: self.generation_group]
        return self.workers

    def _sync(self, version: int, activate: bool) -> int:
        ray.get([w.set_rollout_version.remote(version) for w in self.actor_wg.workers])
        return 0


class Split(Layout):
    name = "split"
    colocate = ACTOR_ROLLOUT_COLOCATE

    def __init__(self, cfg: DictConfig, mode: Mode):
        super().__init__(cfg, mode)
        self._weights: tuple[Any, int] | None = None  # (object ref of the newest weights, version)

    def start_rollout(self, pools: Any) -> list[Any]:
        actor = pools.get_resource_pool("actor")  # its processes per device: the actor's, the replica's (a reward's)
        self.workers = rollout_replicas(self.cfg, actor, 1.0 / actor.max_colocate_count, self.mode.interrupts_at_sync)
        return self.workers

    @property
    def stages(self) -> bool:
        return True

    def _sync(self, version: int, activate: bool) -> int:
        ref = self.actor_wg.workers[0].get_weights.remote()
        self._weights = (ref, version)
        ray.get([w.set_weights.remote(ref, version, activate) for w in self.workers])
        return 0

    async def restore(self, worker: Any) -> None:
        if self._weights is not None:
            await worker.set_weights.remote(*self._weights)


class Disaggregated(Layout):
    """With ``trainer.v1.separate_async.hybrid_rollout.enable_switch`` (fully async) the trainer ranks lend a hand
    to generation when a step starts with too few groups to train (``trainer.hybrid_switch`` decides): they take
    generation requests beside the rollout workers, with the weights trained so far (reported as that version), until
    the step can take ``threshold`` groups; then requests not started on them go back to the rollout workers, a text
    batch stops after its token (continued or regenerated elsewhere), an image batch on a device finishes (the
    update waits at most one device batch), and the step trains. A rank that dies while lent: its requests are
    generated again on the rollout pool and the step stops with ``ActorRankDiedError`` (as any dead rank)."""

    name = "disaggregated"
    rollout_pool = True

    def __init__(self, cfg: DictConfig, mode: Mode):
        super().__init__(cfg, mode)
        self.pool_sync: PoolSync | None = None
        self.switch: SwitchPolicy | None = None
        self._decided = -1  # the last step whose switch was decided
        self._metrics: dict[str, float] = {}

    def pool_spec(self) -> dict[str, list[int]]:
        nodes = int(self.cfg.actor_rollout_ref.rollout.nnodes)
        return {"rollout_pool": [rollout_pool_size(self.cfg) // nodes] * nodes}

    def start_rollout(self, pools: Any) -> list[Any]:
        self.workers = rollout_replicas(self.cfg, pools.get_resource_pool("rollout"), 1.0, self.mode.interrupts_at_sync)
        return self.workers

    def connect(self, actor_wg: Any) -> list[Any]:
        self.actor_wg = actor_wg
        self.pool_sync = PoolSync(self.cfg, actor_wg, self.workers, on_death=lambda w: self.on_death(w))
        config = SwitchConfig.from_config(self.cfg)
        if config.enable_switch:
            mode = self.mode
            chunk = mode.mini_batch if mode.pipelined else mode.groups_per_step
            trainer_devices = len(actor_wg.workers)
            self.switch = SwitchPolicy(config, mode.groups_per_step, chunk, trainer_devices, len(self.workers))
        return self.workers

    @property
    def stages(self) -> bool:
        return self.pool_sync is not None and self.pool_sync.stages

    def _sync(self, version: int, activate: bool) -> int:
        return self.pool_sync.sync(version, activate)

    async def restore(self, worker: Any) -> None:
        await self.pool_sync.restore(worker)

    # ---- the switch: trainer devices lend a hand to generation ---------------------------------------------------
    def collect(self, producer: Producer, step: int, n: int, among: int, timer: Timer) -> list[Any]:
        if self.switch is None:
            return super().collect(producer, step, n, among, timer)
        if step != self._decided:  # verl switches at step boundaries: once per step, before its first take
            self._decided = step
            self._lend_if_worth_it(producer, step, n, timer)
        short = max(0, n - producer.sampleable(step))
        t0 = time.perf_counter()
        groups = super().collect(producer, step, n, among, timer)
        self.switch.record_take(time.perf_counter() - t0, short)
        return groups

    def _lend_if_worth_it(self, producer: Producer, step: int, take: int, timer: Timer) -> None:
        # Decided and switched back on what the step's first take of `take` groups can use (Rollouter.ready), not
        # verl's sampleable count alone: a take that would still wait for a due group in flight keeps the trainer idle.
        sampleable, waiting = producer.switch_inputs(step, take)
        decision = self.switch.decide(sampleable, waiting)
        self._metrics.update(decision.metrics)
        for key in ("switch_to_rollout", "switch_wait", "switch_to_trainer"):  # verl reports 0 on steps without
            timer.timing.setdefault(f"timing_s/{key}", 0.0)
        if not decision.lend:
            return
        ranks = list(self.actor_wg.workers)
        t0 = time.perf_counter()
        with timer("switch_to_rollout"):
            ray.get([w.lend.remote(step) for w in ranks])  # the weights trained so far: version `step`
            producer.lend(ranks)
        t1 = time.perf_counter()
        logger.info("step %d: trainer ranks lent to generation until %d groups can train", step, decision.threshold)
        try:
            with timer("switch_wait"):
                got = producer.wait_sampleable(step, decision.threshold, take)
        finally:
            t2 = time.perf_counter()
            with timer("switch_to_trainer"):
                producer.stop_lending()
                back = ray.get([w.reclaim.remote() for w in ranks])  # a dead rank raises: ActorRankDiedError
            t3 = time.perf_counter()
        self.switch.record_costs(t1 - t0, t3 - t2)
        self._metrics.update(
            {
                "separate_async/switch/count": self._metrics.get("separate_async/switch/count", 0.0) + 1.0,
                "separate_async/switch/lent_seconds": t3 - t0,
                "separate_async/switch/sampleable_at_switch_back": float(got),
                "separate_async/switch/withdrawn": sum(b["withdrawn"] for b in back),
                "separate_async/switch/drain_seconds": max(b["drain_s"] for b in back),
            }
        )

    def step_metrics(self, agent: Any) -> dict[str, float]:
        if self.switch is None:
            return {}
        m, self._metrics = self._metrics, {}
        m.setdefault("separate_async/switch/count", 0.0)
        m["separate_async/switch/lent_busy_seconds"] = agent.take_lent_busy_s()
        return m


def layout_class(cfg: DictConfig) -> type[Layout]:
    """The config's layout: :class:`Disaggregated` with a rollout pool (``actor_rollout_ref.rollout.nnodes`` > 0),
    else :class:`Hybrid` (``hybrid_engine=True``, the default) or :class:`Split`. The only place the layout is read
    from the config (``trainer.config.plan`` hands it down)."""
    if int(cfg.actor_rollout_ref.rollout.nnodes) > 0:
        return Disaggregated
    return Hybrid if cfg.actor_rollout_ref.hybrid_engine else Split


def make_layout(cfg: DictConfig, mode: Mode, cls: type[Layout]) -> Layout:
    """The run's layout object: ``cls`` and ``mode`` as ``trainer.config.plan`` decided them."""
    return cls(cfg, mode)


def rollout_replicas(cfg: DictConfig, pool: Any, device_share: float, interrupts: bool) -> list[Any]:
    """One ``RolloutReplica`` per ``agent.num_workers``, round-robin over the pool's bundles, each taking
    ``device_share`` of its bundle's device; ``interrupts``: the mode's ``interrupts_at_sync``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from omni_async.agent_loop.rollout_replica import RolloutReplica

    m, r = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    modality = modality_of(cfg)
    bundles = [(pg, b) for pg in pool.get_placement_groups() for b in range(pg.bundle_count)]
    rollout_server = None
    if r.name == "vllm":  # text rollout through a vLLM server per replica (see models/vllm_text_policy)
        rollout_server = {k: r[k] for k in ("server_python", "server_url", "gpu_memory_utilization", "server_args")}
    replica_cls = ray.remote(RolloutReplica)
    replicas = []
    for i in range(r.agent.num_workers):
        pg, index = bundles[i % len(bundles)]
        replicas.append(
            replica_cls.options(
                num_cpus=1,
                num_gpus=device_share,
                max_restarts=ROLLOUT_MAX_RESTARTS,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            ).remote(
                m.modality,
                OmegaConf.to_container(m, resolve=True),
                vars(modality.sampling_config(cfg)),
                r.agent.max_batch_size,
                r.agent.max_wait_ms,
                rollout_server,
                cfg.actor_rollout_ref.actor.fsdp_config.model_dtype,
                interrupts,
                cfg.actor_rollout_ref.actor.use_torch_compile,  # the rollout compiles the blocks the update does
            )
        )
    return replicas


# ---- the layouts' config checks (trainer.config.validate runs them) ----------------------------------------------
def check_layout(cfg: DictConfig, mode: Mode, cls: type[Layout]) -> None:
    """What the layout ``cls`` can place, move and overlap, in ``mode`` (both as ``trainer.config.plan`` decided)."""
    _check_layout(cfg, cls, mode)
    _check_weight_sync(cfg, cls)
    check_switch(cfg, cls.rollout_pool, cls.name)
    rollout = cfg.actor_rollout_ref.rollout
    if not cls.rollout_pool:
        _check(
            rollout.agent.num_workers <= cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes,
            "actor_rollout_ref.rollout.agent.num_workers",
            f"{rollout.agent.num_workers} rollout replicas do not fit "
            f"{cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes} actor/rollout devices",
            "lower it or raise trainer.n_gpus_per_node",
        )


def _check_layout(cfg: DictConfig, cls: type[Layout], mode: Mode) -> None:
    """The hybrid layout (one process per device trains and generates) and the disaggregated one (a rollout pool)
    have their own rules."""
    arr = cfg.actor_rollout_ref
    r = arr.rollout
    _check(
        r.nnodes >= 0,
        "actor_rollout_ref.rollout.nnodes",
        f"must be >= 0, got {r.nnodes}",
        "0 (no rollout pool) or the rollout pool's node count",
    )
    if cls.rollout_pool:
        _check(
            r.n_gpus_per_node is None or r.n_gpus_per_node >= 1,
            "actor_rollout_ref.rollout.n_gpus_per_node",
            f"a rollout pool needs devices, got {r.n_gpus_per_node}",
            "e.g. 1",
        )
        devices = rollout_pool_size(cfg)
        _check(
            r.agent.num_workers == devices,
            "actor_rollout_ref.rollout.agent.num_workers",
            f"the disaggregated layout has one rollout worker per rollout device ({devices}), got "
            f"{r.agent.num_workers}",
            f"set it to {devices} (actor_rollout_ref.rollout.n_gpus_per_node x nnodes)",
        )
        return
    if not cls.rollout_is_actor:  # split: replicas beside the actor ranks, nothing more to check
        return
    devices, sp = actor_ranks(cfg), sequence_parallel_size(cfg)
    workers, groups = arr.rollout.agent.num_workers, devices // sp
    split = (
        f", or {groups} (one per sequence-parallel group of {sp}: it generates each batch together)"
        if sp > 1 and not devices % sp  # an sp that does not divide the devices is refused by its own check
        else ""
    )
    _check(
        workers == devices or (split and workers == groups),
        "actor_rollout_ref.rollout.agent.num_workers",
        f"the hybrid layout has one rollout worker per actor device ({devices}){split}, got {workers}",
        f"set it to {devices} (trainer.n_gpus_per_node x nnodes){split}, or actor_rollout_ref.hybrid_engine=False "
        "for rollout replicas separate from the actor",
    )
    _check(
        arr.rollout.name == "transformers",
        "actor_rollout_ref.hybrid_engine",
        f"rollout.name={arr.rollout.name} generates in its own server process, not in the actor",
        "set actor_rollout_ref.hybrid_engine=False",
    )
    if mode.overlaps_update and arr.model.lora_rank == 0:
        _check(
            False,
            "actor_rollout_ref.hybrid_engine",
            f"the {mode.name} mode runs updates while the rollout generates; with a full fine-tune "
            "(lora_rank=0) in the hybrid layout the rollout would read weights the update is changing in place (wrong "
            "pi_old), and only a LoRA adapter is cheap to snapshot on the device",
            "set actor_rollout_ref.hybrid_engine=False (rollout replicas on their own copy), a rollout pool "
            "(actor_rollout_ref.rollout.nnodes=1), or lora_rank > 0",
        )


def _check_weight_sync(cfg: DictConfig, cls: type[Layout]) -> None:
    """``checkpoint_engine`` and the sync period: what each layout can move, and how often."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    r, ce = arr.rollout, arr.rollout.checkpoint_engine
    lay = cls.name  # for the messages only
    _check(
        ce.backend in ("naive", "nccl"),
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        f"{ce.backend!r} is not implemented here (verl's nixl / hccl / mooncake engines)",
        "use nccl (a torch.distributed group: NCCL on CUDA, gloo on CPU) or naive",
    )
    _check(
        ce.update_weights_bucket_megabytes >= 1,
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "must be >= 1",
        "verl's default is 2048",
    )
    if not cls.rollout_pool:
        _check(
            ce.backend == "naive",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            f"nccl sends weights to a rollout pool; the {lay} layout has none (rollout.nnodes=0)",
            "set actor_rollout_ref.rollout.nnodes=1 (and n_gpus_per_node), or backend=naive",
        )
    else:
        _check(
            ce.backend == "nccl" or arr.model.lora_rank > 0,
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            "naive ships weights through Ray's object store: fine for a LoRA adapter, not for a full fine-tune's "
            "weights (lora_rank=0)",
            "set actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        )
        _check(
            ce.backend == "naive" or r.name == "transformers",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            f"nccl loads weights into in-process rollout workers; rollout.name={r.name} serves from its own "
            "server (it takes LoRA adapters)",
            "set actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        )
    k = cfg.async_training.trigger_parameter_sync_step
    if k is None or cfg.async_reward.fully_async:  # fully async: any count of updates (trainer.mode.check_mode)
        return
    key = "async_training.trigger_parameter_sync_step"
    mb, tbs = int(arr.actor.ppo_mini_batch_size), int(data.train_batch_size)
    _check(
        k >= 1 and (k * mb) % tbs == 0,
        key,
        f"{k} local updates of ppo_mini_batch_size={mb} prompts is not a whole number of steps of "
        f"data.train_batch_size={tbs} prompts (weights move between steps)",
        f"use a multiple of {tbs // mb} (= train_batch_size / ppo_mini_batch_size: every step), or null",
    )
    if k * mb // tbs > 1:
        _check(
            cls.rollout_pool,
            key,
            f"a sync period of {k * mb // tbs} steps needs a rollout pool that keeps "
            f"older weights; in the {lay} layout the rollout reads the trained weights",
            "set actor_rollout_ref.rollout.nnodes=1, or leave the key null (every step)",
        )
        _check(
            bool(cfg.algorithm.rollout_correction.bypass_mode),
            "algorithm.rollout_correction.bypass_mode",
            f"{key}={k} trains on samples of older weights, so pi_old must be the rollout's log-probs",
            "set algorithm.rollout_correction.bypass_mode=true",
        )
