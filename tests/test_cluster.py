"""Ray bootstrap: logical devices make verl resource pools work on CPU, torch threads capped, clean shutdown."""

from __future__ import annotations

import time

import psutil
import pytest
import ray

from omni_async.cluster import init_ray, logical_devices, shutdown_ray
from omni_async.trainer.config import compose


@ray.remote
class _Probe:
    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def pid(self) -> int:
        import os

        return os.getpid()


@ray.remote
class _CollectorAtStart:
    """The worker's cyclic collector as this actor's ``__init__`` finds it, then after the product's resume."""

    def __init__(self):
        import gc

        from omni_async import cluster

        self.at_start = (gc.isenabled(), cluster._gc_paused)
        cluster.resume_gc()

    def state(self) -> tuple[tuple[bool, bool], bool, int]:
        import gc

        return self.at_start, gc.isenabled(), gc.get_freeze_count()


def test_workers_import_with_the_collector_paused_and_an_actor_resumes_it_once_built():
    """The job's process setup hook pauses collection before the actor's module is imported; resuming turns it back
    on with the start-up objects frozen out of later collections."""
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        at_start, enabled, frozen = ray.get(_CollectorAtStart.remote().state.remote())
        assert at_start == (False, True)
        assert enabled and frozen > 10_000  # torch alone is over 100k objects
    finally:
        shutdown_ray()


@pytest.fixture
def paused_collector():
    """This process's collector paused as a worker's is; on again (and unfrozen) afterwards. In a Ray session, as
    the actors built in process ask Ray for their devices."""
    import gc

    from omni_async import cluster

    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    yield cluster
    cluster.resume_gc()
    gc.unfreeze()
    shutdown_ray()


def test_the_product_actors_resume_the_collector_once_built(paused_collector):
    import gc

    from omni_async.agent_loop.rollout_replica import RolloutReplica
    from omni_async.reward.worker import RewardLoopWorker

    reward_cfg = {
        "timeout_s": 30,
        "max_inflight_per_worker": 2,
        "reward_functions": {},
        "custom_reward_function": {
            "path": "pkg://omni_async.reward.scorers.jpeg",
            "name": "compute_score",
            "reward_kwargs": {},
        },
    }
    text_model = {"path": "tiny:qwen2", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    for build in (
        lambda: RewardLoopWorker(reward_cfg, 0),
        lambda: RolloutReplica("text", text_model, {"response_length": 8, "temperature": 1.0}, 2, 1.0),
    ):
        paused_collector.pause_gc_while_importing()
        assert not gc.isenabled()
        build()
        assert gc.isenabled() and not paused_collector._gc_paused
    # A process that never builds an actor (a task, an idle worker) gets its collector back after the limit.
    paused_collector.pause_gc_while_importing(max_s=0.2)
    deadline = time.monotonic() + 30
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gc.isenabled() and not paused_collector._gc_paused


@pytest.mark.slow  # a local Ray cluster of its own: not in the fast tier (pytest -m 'not slow')
def test_pools_threads_and_clean_shutdown(own_ray_cluster):
    from verl.single_controller.ray import RayResourcePool

    cfg = compose(
        [
            "data.train_files=x.jsonl",
            "reward.reward_model.enable_resource_pool=True",
            "reward.reward_model.n_gpus_per_node=1",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.agent.num_workers=2",
        ]
    )
    assert logical_devices(cfg) == {"actor_rollout": 2, "rollout": 0, "reward": 1}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        res = init_ray(cfg)
        assert res["GPU"] == 3  # logical devices on a CPU box
        actor_pool = RayResourcePool([2], use_gpu=True, name_prefix="actor", max_colocate_count=1)
        reward_pool = RayResourcePool([1], use_gpu=True, name_prefix="reward", max_colocate_count=1)
        pg_a, pg_r = actor_pool.get_placement_groups()[0], reward_pool.get_placement_groups()[0]
        assert pg_a.bundle_count == 2 and pg_r.bundle_count == 1
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = _Probe.options(
            num_cpus=0.1,
            num_gpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg_r, placement_group_bundle_index=0),
        ).remote()
        assert ray.get(probe.threads.remote()) == 1
        worker_pid = ray.get(probe.pid.remote())
        assert psutil.pid_exists(worker_pid)
    finally:
        shutdown_ray()
    psutil.wait_procs([psutil.Process(worker_pid)] if psutil.pid_exists(worker_pid) else [], timeout=15)
    assert not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before, f"stray processes after shutdown: {after - before}"


def test_gpu_box_lets_ray_detect_its_devices(monkeypatch):
    """On a machine that reports CUDA, a local Ray is started without num_gpus (Ray counts the real devices)
    instead of the logical-device count a CPU box declares; the GPU workers' thread setting travels along."""
    import torch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # ray.init is a spy: no cluster starts, none is joined
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    cfg = compose(["data.train_files=x.jsonl", "trainer.n_gpus_per_node=4", "trainer.ray.gpu_worker_torch_threads=4"])
    init_ray(cfg)
    assert "num_gpus" not in seen and seen["num_cpus"] is None
    assert seen["runtime_env"]["env_vars"]["OMNI_ASYNC_GPU_WORKER_TORCH_THREADS"] == "4"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same config on a CPU box
    seen.clear()
    init_ray(cfg)
    assert seen["num_gpus"] == 4 and seen["num_cpus"] >= 16


def test_ray_address_in_the_environment_joins_that_cluster(monkeypatch):
    """trainer.ray.address=null with RAY_ADDRESS set joins that cluster (Ray's convention) instead of starting a new
    local one; an address in the config wins over the environment."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # ray.init is a spy: no cluster starts, none is joined
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    cfg = compose(["data.train_files=x.jsonl"])
    init_ray(cfg)
    assert seen["address"] == "local" and "num_gpus" in seen
    seen.clear()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    init_ray(cfg)
    assert seen["address"] == "10.0.0.5:6379" and "num_gpus" not in seen and "num_cpus" not in seen
    seen.clear()
    init_ray(compose(["data.train_files=x.jsonl", "trainer.ray.address=auto"]))
    assert seen["address"] == "auto"


def test_gpu_worker_takes_its_assigned_device_and_torch_default_threads(monkeypatch):
    """``configure_worker`` in a GPU worker: the device Ray assigned (index 0 when Ray set CUDA_VISIBLE_DEVICES to
    it; the physical id under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, as verl supports), made current, and
    ``gpu_worker_torch_threads: null`` = torch's default (one per physical core), not the CPU workers' cap of 1."""
    import psutil
    import torch

    from omni_async import cluster

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current, threads = [], []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv(cluster.GPU_THREADS_ENV, raising=False)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Ray's default: only the assigned GPU is visible
    assert cluster.configure_worker() == "cuda:0" and current == [0]
    assert threads == [8]  # torch's default: the physical cores (the runtime env's OMP_NUM_THREADS=1 would give 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # NOSET: every GPU visible, the assigned one by its id
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    assert cluster.configure_worker() == "cuda:3" and current[-1] == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # NOSET under a user's own visible list
    assert cluster.configure_worker() == "cuda:1" and current[-1] == 1
    monkeypatch.setenv(cluster.GPU_THREADS_ENV, "4")  # trainer.ray.gpu_worker_torch_threads=4
    cluster.configure_worker()
    assert threads[-1] == 4


def test_workers_allocate_cuda_memory_with_expandable_segments(monkeypatch):
    from omni_async.cluster import worker_runtime_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert worker_runtime_env()["env_vars"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # a user's own setting wins
    assert worker_runtime_env()["env_vars"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_rendezvous_is_found_on_the_driver_only_when_rank_0_shares_its_node(monkeypatch):
    """verl's worker group finds its torch.distributed address with a Ray task (a worker process that imports verl);
    when rank 0's bundle is on the driver's node the driver finds it itself, and on another node verl's task does."""
    import socket

    from ray.util.placement_group import placement_group, remove_placement_group

    from omni_async.trainer import placement

    shutdown_ray()
    init_ray(num_gpus=1, num_cpus=4)
    pg = placement_group([{"CPU": 1}])
    try:
        assert pg.wait(60)
        addr, port = placement.rendezvous_here(pg, 0)
        assert addr == ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", int(port)))  # free: rank 0 can bind it
        table = ray.util.placement_group_table(pg)
        elsewhere = {**table, "bundles_to_node_id": {0: "another-node"}}
        monkeypatch.setattr(ray.util, "placement_group_table", lambda _pg: elsewhere)
        assert placement.rendezvous_here(pg, 0) is None
    finally:
        remove_placement_group(pg)
        shutdown_ray()
