"""A reward-loop worker beside the actor on a share of the same device (issue 49 item 3's CPU twin):
``reward.reward_model.colocate_with_actor`` puts the reward-loop workers on the actor pool's bundles, one more process
per device (verl's ``max_colocate_count``), each process asking ``1 / count`` of it. On CPU the shared test cluster's
logical GPUs stand for the device; the GPU tier (tests/gpu) runs the same test on a CUDA device."""

from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from omni_async.cluster import init_ray, shutdown_ray
from omni_async.reward.pool import create_reward_workers, wait_ready
from omni_async.trainer.config import ConfigError, compose, plan, validate
from omni_async.trainer.layout import make_layout
from omni_async.trainer.placement import ActorWorkerGroup, make_pools

# Ray workers cannot import this test module: the probe's class and the functions sent from here travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BESIDE = [
    "data.train_files=x.jsonl",
    "reward.reward_model.colocate_with_actor=true",
    "trainer.n_gpus_per_node=1",
    "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.jpeg",  # loads at once (OCR's engine does not)
]


class DeviceProbe(Worker):
    """An actor rank placed as the trainer places its ``ActorWorker`` (verl's ``RayWorkerGroup`` on the actor pool),
    without a model: what Ray gave it."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def placement(self) -> dict:
        return placement_of(self)


def placement_of(_actor=None) -> dict:
    """Inside an actor: the device share Ray accounts to it, its device ids and its placement group bundle."""
    ctx = ray.get_runtime_context()
    gpu = sum(v for k, v in ctx.get_assigned_resources().items() if k == "GPU" or k.startswith("GPU_group_"))
    return {
        "gpu": gpu,
        "gpu_ids": ray.get_gpu_ids(),
        "pg": ctx.get_placement_group_id(),
        "node": ctx.get_node_id(),
    }


def test_reward_worker_sits_beside_the_actor_on_a_share_of_its_device():
    """The actor rank and the reward-loop worker placed on the actor pool's one bundle (one device), each asking half
    of it (hybrid layout: 2 processes per device); Ray's accounting gives each that half of the same device. The
    split layout counts 3 processes per device (its rollout replica too: ``trainer.layout.rollout_replicas`` asks
    ``1 / max_colocate_count``)."""
    init_ray(validate(compose(BESIDE)))
    try:
        split = make_pools(*planned(hybrid=False)).manager.get_resource_pool("actor")
        assert split.max_colocate_count == 3
        for pg in split.get_placement_groups():  # its device back: a one-GPU machine has one (the GPU tier)
            ray.util.remove_placement_group(pg)
        cfg, layout = planned(hybrid=True)
        pools = make_pools(cfg, layout)
        actor_pool = pools.manager.get_resource_pool("actor")
        assert actor_pool.max_colocate_count == 2 and pools.reward_pool is actor_pool
        rewards = create_reward_workers(cfg.reward, actor_pool)
        wait_ready(rewards)
        actors = ActorWorkerGroup(actor_pool, ray_cls_with_init(DeviceProbe), name_prefix="probe")
        got = [*actors.placement(), *ray.get([w.__ray_call__.remote(placement_of) for w in rewards])]
        assert [g["gpu"] for g in got] == pytest.approx([0.5, 0.5], abs=1e-3)  # Ray keeps 4 decimals
        assert len({g["pg"] for g in got}) == 1 and len({g["node"] for g in got}) == 1
        assert all(g["gpu_ids"] == got[0]["gpu_ids"] and len(g["gpu_ids"]) == 1 for g in got)  # the same device
        assert ray.get(rewards[0].info.remote())["accelerator_ids"].get("GPU") == [str(got[0]["gpu_ids"][0])]
    finally:
        shutdown_ray()


def planned(hybrid: bool):
    """(config, layout) of a run with the reward beside the actor, on the hybrid or the split layout."""
    cfg = validate(compose([*BESIDE, f"actor_rollout_ref.hybrid_engine={str(hybrid).lower()}"]))
    decided = plan(cfg)
    return cfg, make_layout(cfg, decided.mode, decided.layout)


def ray_cls_with_init(cls):
    from verl.single_controller.ray import RayClassWithInitArgs

    return RayClassWithInitArgs(ray.remote(cls))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["reward.reward_model.enable_resource_pool=true"], "reward.reward_model.colocate_with_actor"),
        (["reward.num_workers=2"], "reward.num_workers"),
        (["reward.streaming=false"], "reward.reward_model.colocate_with_actor"),
    ],
)
def test_what_cannot_sit_beside_the_actor_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose([*BESIDE, *overrides]))
