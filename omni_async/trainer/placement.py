"""Where every role runs: verl resource pools, the actor worker group, and the layout's rollout workers.

- ``actor_rollout`` pool: ``trainer.n_gpus_per_node x nnodes`` devices, one actor ``Worker`` per device (shared
  with a rollout replica each in the split layout: ``Layout.colocate``).
- the layout's own pools (``Layout.pool_spec``): the disaggregated layout's ``rollout_pool``,
  ``rollout.n_gpus_per_node x nnodes`` devices, one inference-only replica on each.
- ``reward_pool`` (``reward.reward_model.enable_resource_pool``): the reward-loop workers' own devices; or TP
  bundles for vLLM judge servers (``reward.reward_model.rollout.name=vllm``). With
  ``reward.reward_model.colocate_with_actor`` the reward-loop workers sit on the actor pool's devices instead: one
  more process per device (verl's ``max_colocate_count``), each process taking ``1 / count`` of its device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf
from verl.single_controller.ray import RayWorkerGroup

from omni_async.trainer.actor_worker import ActorWorker
from omni_async.trainer.layout import Layout
from omni_async.trainer.profiling import NsysPlan


@dataclass
class Pools:
    """The run's resource pools, made before any worker starts (:func:`make_pools`)."""

    manager: Any  # verl ResourcePoolManager
    reward_pool: Any | None  # verl RayResourcePool for reward-loop workers, or None
    judge_pg: Any | None  # placement group of vLLM judge servers, or None


@dataclass
class Placement:
    pools: Any  # verl ResourcePoolManager
    actor_wg: Any  # verl RayWorkerGroup of ActorWorker
    rollout_workers: list[Any]  # Ray actor handles implementing agent_loop.rollout_worker.RolloutWorker
    reward_pool: Any | None
    judge_pg: Any | None


def make_pools(cfg: DictConfig, layout: Layout) -> Pools:
    """The resource pools (actor/rollout, the layout's, reward) and the judges' placement group, without workers:
    the trainer starts the reward side on them while :func:`place` starts the actor workers."""
    from verl.single_controller.ray import ResourcePoolManager

    t, rm = cfg.trainer, cfg.reward.reward_model
    spec, mapping = {"actor_rollout": [t.n_gpus_per_node] * t.nnodes}, {"actor": "actor_rollout"}
    judge_pg = None
    if rm.enable and rm.rollout.name == "vllm":  # TP-device bundles for vLLM judge servers (see vllm_server)
        from omni_async.reward.vllm_server import judge_placement_group

        judge_pg = judge_placement_group(cfg.reward)
    elif rm.enable_resource_pool:
        spec["reward_pool"], mapping["reward"] = [rm.n_gpus_per_node] * rm.nnodes, "reward_pool"
    elif rm.colocate_with_actor:  # one more process per actor device: each takes 1 / count of it (verl's rule)
        mapping["reward"] = "actor_rollout"
    for name, devices in layout.pool_spec().items():
        spec[name], mapping["rollout"] = devices, name
    colocate = layout.colocate + int(bool(rm.colocate_with_actor))
    pools = ResourcePoolManager(resource_pool_spec=spec, mapping=mapping, max_colocate_count=colocate)
    pools.create_resource_pool()
    reward_pool = pools.get_resource_pool("reward") if "reward" in mapping else None
    return Pools(pools, reward_pool, judge_pg)


def rendezvous_here(pg: Any, bundle_index: int) -> tuple[str, str] | None:
    """The torch.distributed rendezvous address (node IP, free port) for a worker group whose rank 0 lands on
    ``pg``'s bundle ``bundle_index``, when that bundle is on this process's node; ``None`` when it is elsewhere.

    verl's ``RayWorkerGroup`` finds it with a Ray task on the bundle, and that task's worker process imports verl
    (~2.5 CPU-s) for two lines of socket code; once per worker group that is seconds of start-up on every run. On
    the driver's own node the same two lines run here. Like verl's task, the port is free when probed and bound by
    rank 0 a moment later."""
    node = ray.util.placement_group_table(pg)["bundles_to_node_id"][bundle_index]
    if node != ray.get_runtime_context().get_node_id():
        return None
    from omni_async.agent_loop.weight_sync import free_address

    addr, port = free_address()
    return addr, str(port)


class ActorWorkerGroup(RayWorkerGroup):
    """verl's ``RayWorkerGroup``, with the rendezvous found on the driver when rank 0 shares its node
    (:func:`rendezvous_here`), by verl's task otherwise. ``sequence_parallel_size``: the Ulysses degree its
    data-parallel dispatch reads (``trainer.data_parallel.dispatch_by_groups``). ``nsys``: the ranks it profiles
    start under Ray's nsight runtime env (``trainer.profiling``), the others without."""

    sequence_parallel_size = 1

    def __init__(self, *args: Any, nsys: NsysPlan | None = None, **kwargs: Any) -> None:
        self._nsys = nsys  # read while the workers are created, inside verl's __init__
        super().__init__(*args, **kwargs)

    def _create_worker(self, rank, pg_idx, pg, local_rank, resource_pool, ray_cls_with_init, worker_env, detached):
        env = self._nsys.runtime_env(rank) if self._nsys is not None else None
        if env is None:
            return super()._create_worker(
                rank, pg_idx, pg, local_rank, resource_pool, ray_cls_with_init, worker_env, detached
            )
        # verl's own switch to a worker under nsight (its _create_worker: profile_steps and worker_nsight_options),
        # set for this rank only
        saved = self.profile_steps, self.worker_nsight_options
        self.profile_steps, self.worker_nsight_options = list(self._nsys.steps), env["nsight"]
        try:
            worker_env = {**(worker_env or {}), **env["env_vars"]}
            return super()._create_worker(
                rank, pg_idx, pg, local_rank, resource_pool, ray_cls_with_init, worker_env, detached
            )
        finally:
            self.profile_steps, self.worker_nsight_options = saved

    def _get_master_addr_port(self, pg, bundle_index=0, master_port_range=None):
        # An address already set or a port range to honour stays verl's business (no probe here first).
        found = None
        if self._master_addr is None and master_port_range is None:
            found = rendezvous_here(pg, bundle_index)
        if found is None:
            return super()._get_master_addr_port(pg, bundle_index, master_port_range)
        self._master_addr, self._master_port = found


def place(cfg: DictConfig, made: Pools, layout: Layout, nsys: NsysPlan | None = None) -> Placement:
    """The actor worker group (its model loaded) and the layout's rollout workers, on the pools :func:`make_pools`
    made; ``nsys``: the run's profiling plan (``trainer.config.plan``), its ranks started under Nsight Systems."""
    from verl.single_controller.ray import RayClassWithInitArgs

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    layout.start_rollout(made.manager)  # not awaited: the replicas load while the actor group below does
    actor_wg = ActorWorkerGroup(
        made.manager.get_resource_pool("actor"),
        RayClassWithInitArgs(ray.remote(ActorWorker), config=cfg_dict, nsys=nsys, **layout.actor_worker_args()),
        name_prefix="actor",
        nsys=nsys,
    )
    actor_wg.sequence_parallel_size = int(cfg.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size)
    actor_wg.init_model()
    n = layout.generation_group
    if n > 1:  # each group generates together: its leader orders its calls for the others (trainer.group_order)
        ranks = actor_wg.workers
        ray.get([w.join_sequence_group.remote(None if i % n else ranks[i + 1 : i + n]) for i, w in enumerate(ranks)])
    rollout = layout.connect(actor_wg)
    return Placement(made.manager, actor_wg, rollout, made.reward_pool, made.judge_pg)
