"""Where reward-loop workers live.

- ``reward.reward_model.enable_resource_pool=True``: on verl's dedicated ``reward_pool`` resource pool
  (``n_gpus_per_node x nnodes`` devices, its own placement groups, so the actor/rollout pool is untouched);
  worker ``i`` takes bundle ``i`` (one device each: a judge model or OCR engine per device).
- ``reward.reward_model.colocate_with_actor=True``: on the actor pool's bundles, worker ``i`` beside actor rank
  ``i``, taking ``1 / max_colocate_count`` of its device as every process there does (verl's colocation rule).
- otherwise: plain CPU actors (verl's rule: with no reward model, streaming needs no device).

Workers restart when their process dies (``max_restarts``); the dispatcher re-sends what they had in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from omni_async.reward.worker import RewardLoopWorker

logger = logging.getLogger(__name__)

WORKER_MAX_RESTARTS = 4
# Ray admits this many calls beyond the dispatcher's scoring slots (info probes, group post-processing), so a
# control call never waits behind reward.max_inflight_per_worker scoring calls.
CONTROL_CALL_SLOTS = 8


def create_reward_workers(
    reward_cfg: DictConfig,
    resource_pool: Any | None = None,
    judge_urls: list[str] | None = None,
    teacher: dict[str, Any] | None = None,
) -> list[Any]:
    """Start ``reward.num_workers`` reward-loop workers, on ``resource_pool`` (a verl ``RayResourcePool``) if given,
    each with the distillation ``teacher`` (``reward.teacher.teacher_spec``) when given. Returns at once, while they
    load; :func:`wait_ready` waits for them."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(RewardLoopWorker)
    cfg_dict = OmegaConf.to_container(reward_cfg, resolve=True)
    workers = []
    bundles = (
        [(pg, b) for pg in resource_pool.get_placement_groups() for b in range(pg.bundle_count)]
        if resource_pool is not None
        else []
    )
    for i in range(int(reward_cfg.num_workers)):
        opts: dict[str, Any] = dict(
            num_cpus=1,
            max_restarts=WORKER_MAX_RESTARTS,
            max_task_retries=0,
            max_concurrency=int(reward_cfg.max_inflight_per_worker) + CONTROL_CALL_SLOTS,
        )
        if bundles:
            pg, index = bundles[i % len(bundles)]
            opts.update(
                num_gpus=1 / resource_pool.max_colocate_count if reward_cfg.reward_model.colocate_with_actor else 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            )
        workers.append(cls.options(**opts).remote(cfg_dict, i, list(judge_urls or []), teacher))
    where = "as CPU actors"
    if bundles:
        shared = reward_cfg.reward_model.colocate_with_actor
        where = f"{'beside the actor on' if shared else 'on the reward pool'}: {len(bundles)} device(s)"
    logger.info("starting %d reward worker(s) %s", len(workers), where)
    return workers


def wait_ready(workers: list[Any]) -> None:
    """Block until every worker has built its reward manager. Fail at start, not mid-step, if a reward function
    cannot be loaded (bad path, missing dependency): the worker's error is raised here."""
    t0 = time.perf_counter()
    ray.get([w.info.remote() for w in workers])
    logger.info("%d reward worker(s) ready after %.1fs", len(workers), time.perf_counter() - t0)
