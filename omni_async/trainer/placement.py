"""Where every role runs: verl resource pools, the actor worker group, the rollout workers.

- ``actor_rollout`` pool: ``trainer.n_gpus_per_node x nnodes`` devices. The actor worker group has one verl
  ``Worker`` per device.
  - hybrid layout (``actor_rollout_ref.hybrid_engine=True``): each actor worker is also its device's rollout worker
    (one pipeline per device); the rollout workers *are* the actor workers.
  - split layout (``hybrid_engine=False``): rollout replicas (``RolloutReplica``) with their own copy of the
    policy share the devices' bundles with the actors (``ACTOR_ROLLOUT_COLOCATE``) and take weights from them
    after each update.
- ``rollout_pool`` (disaggregated layout, ``actor_rollout_ref.rollout.nnodes`` > 0): ``rollout.n_gpus_per_node x
  nnodes`` devices, one inference-only ``RolloutReplica`` on each (a whole device); the ``actor_rollout`` pool then
  holds the trainer ranks only. Nothing shares a device.
- ``reward_pool`` (``reward.reward_model.enable_resource_pool``): the reward-loop workers' own devices; or TP
  bundles for vLLM judge servers (``reward.reward_model.rollout.name=vllm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from omni_async.cluster import rollout_pool_size
from omni_async.modality import get_modality
from omni_async.trainer.actor_worker import ActorWorker
from omni_async.trainer.config import interrupts_at_sync, layout

# Split layout: roles sharing one actor/rollout device bundle, the actor worker and a rollout replica; each takes
# this share. The hybrid layout has one process per device.
ACTOR_ROLLOUT_COLOCATE = 2
DEVICE_SHARE = 1.0 / ACTOR_ROLLOUT_COLOCATE
ROLLOUT_MAX_RESTARTS = 4


@dataclass
class Placement:
    pools: Any  # verl ResourcePoolManager
    actor_wg: Any  # verl RayWorkerGroup of ActorWorker
    rollout_workers: list[Any]  # Ray actor handles serving generate(prompt, seed, window)
    hybrid: bool  # rollout_workers are the actor workers (hybrid_engine)
    reward_pool: Any | None  # verl RayResourcePool for reward-loop workers, or None
    judge_pg: Any | None  # placement group of vLLM judge servers, or None
    layout: str = "hybrid"  # hybrid | split | disaggregated (trainer.config.layout)


@dataclass
class Pools:
    """The run's resource pools, made before any worker starts (:func:`make_pools`)."""

    manager: Any  # verl ResourcePoolManager
    reward_pool: Any | None  # verl RayResourcePool for reward-loop workers, or None
    judge_pg: Any | None  # placement group of vLLM judge servers, or None
    layout: str


def make_pools(cfg: DictConfig) -> Pools:
    """The resource pools (actor/rollout, rollout, reward) and the judges' placement group, without workers: the
    trainer starts the reward side on them while :func:`place` starts the actor workers."""
    from verl.single_controller.ray import ResourcePoolManager

    t, rm = cfg.trainer, cfg.reward.reward_model
    spec, mapping = {"actor_rollout": [t.n_gpus_per_node] * t.nnodes}, {"actor": "actor_rollout"}
    judge_pg = None
    if rm.enable and rm.rollout.name == "vllm":  # TP-device bundles for vLLM judge servers (see vllm_server)
        from omni_async.reward.vllm_server import judge_placement_group

        judge_pg = judge_placement_group(cfg.reward)
    elif rm.enable_resource_pool:
        spec["reward_pool"], mapping["reward"] = [rm.n_gpus_per_node] * rm.nnodes, "reward_pool"
    lay = layout(cfg)
    if lay == "disaggregated":
        r = cfg.actor_rollout_ref.rollout
        spec["rollout_pool"], mapping["rollout"] = (
            [rollout_pool_size(cfg) // int(r.nnodes)] * int(r.nnodes),
            "rollout_pool",
        )
    pools = ResourcePoolManager(
        resource_pool_spec=spec, mapping=mapping, max_colocate_count=ACTOR_ROLLOUT_COLOCATE if lay == "split" else 1
    )
    pools.create_resource_pool()
    reward_pool = pools.get_resource_pool("reward") if "reward" in mapping else None
    return Pools(pools, reward_pool, judge_pg, lay)


def place(cfg: DictConfig, made: Pools) -> Placement:
    """The actor worker group (its model loaded) and the rollout workers, on the pools :func:`make_pools` made."""
    pools, lay = made.manager, made.layout
    actor_wg = _actor_worker_group(cfg, pools.get_resource_pool("actor"))
    if lay == "hybrid":
        rollout = list(actor_wg.workers)
    elif lay == "split":
        rollout = _rollout_replicas(cfg, pools.get_resource_pool("actor"), DEVICE_SHARE)
    else:
        rollout = _rollout_replicas(cfg, pools.get_resource_pool("rollout"), 1.0)
    return Placement(pools, actor_wg, rollout, lay == "hybrid", made.reward_pool, made.judge_pg, lay)


def _actor_worker_group(cfg: DictConfig, pool: Any) -> Any:
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(ActorWorker), config=cfg_dict), name_prefix="actor")
    wg.init_model()
    return wg


def _rollout_replicas(cfg: DictConfig, pool: Any, device_share: float) -> list[Any]:
    """One ``RolloutReplica`` per ``agent.num_workers``, round-robin over the pool's bundles, each taking
    ``device_share`` of its bundle's device."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from omni_async.agent_loop.rollout_replica import RolloutReplica

    m, r = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    modality = get_modality(m.modality)
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
                interrupts_at_sync(cfg),
            )
        )
    return replicas
