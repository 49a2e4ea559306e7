"""Start or join the Ray cluster every role runs on.

One call, :func:`init_ray`, for the trainer, the tests and the benchmarks:

- ``trainer.ray.address`` set → join that cluster (multi-node is a Ray cluster, nothing home-made);
- otherwise start a local one. On a box without GPUs it declares *logical* GPUs, one per device of the
  actor/rollout pool plus one per device of the dedicated reward pool, so verl's ``RayResourcePool``
  (which asks for ``GPU`` bundles) places actors exactly as it would on a GPU cluster. Logical CPUs are
  over-declared too, since verl bundles reserve several CPUs each.
- otherwise start a local one. On a box with CUDA devices Ray detects them all (no ``num_gpus`` is passed).
- Every Ray worker process caps torch (and BLAS) threads, via a process setup hook and env vars: with 2
  physical cores, a few actors each spawning one thread per core would wreck every timing. A worker that owns a
  GPU is not capped to 1 (its CPU threads feed the device): :func:`configure_worker` gives it
  ``trainer.ray.gpu_worker_torch_threads`` (null: torch's default, one per physical core) and places its model on
  the GPU Ray assigned it. Workers allocate CUDA memory with ``expandable_segments``.
- Logging (``omni_async.logs``): the driver's level is ``trainer.log_level``; it travels to every worker as
  ``$OMNI_ASYNC_LOG_LEVEL`` in the runtime env, and the process setup hook configures each worker's logger with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from omegaconf import DictConfig

from omni_async.logs import LOG_LEVEL_ENV, check_log_level, setup_logging

logger = logging.getLogger(__name__)

THREADS_ENV = "OMNI_ASYNC_TORCH_THREADS"
RESTART_POLL_S = 0.2  # how often a restarting actor is probed
GPU_THREADS_ENV = "OMNI_ASYNC_GPU_WORKER_TORCH_THREADS"
ALLOC_CONF_ENV, ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"


# A worker's first act is importing torch, verl, diffusers and peft: ~5 CPU-s that build millions of long-lived
# objects and almost no garbage, while Python's cyclic collector re-walks the growing heap over and over. Paused, the
# same imports cost about a fifth less (verl + diffusers + peft, 2-core box: 5.7 -> 4.6 CPU-s), in every one of a
# run's worker processes. Each actor resumes collection once it is built (:func:`resume_gc`); a process that never
# gets there (a task, an idle worker) resumes after ``GC_PAUSE_MAX_S``.
GC_PAUSE_MAX_S = 120.0
_gc_paused = False


def pause_gc_while_importing(max_s: float = GC_PAUSE_MAX_S) -> None:
    """Switch the cyclic collector off until :func:`resume_gc` (called at most ``max_s`` later, by a timer)."""
    import threading

    global _gc_paused
    gc.disable()
    _gc_paused = True
    timer = threading.Timer(max_s, resume_gc)
    timer.daemon = True
    timer.start()


def resume_gc() -> None:
    """End :func:`pause_gc_while_importing`'s pause, if there is one (a process that did not pause keeps its
    collector as it is): what the imports and the model build made is moved out of every later collection
    (``gc.freeze``: it lives as long as the process), then the collector runs again."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def setup_worker_process() -> None:
    """Ray ``worker_process_setup_hook``: runs once in every worker process before any task or actor (and before the
    actor's module is imported)."""
    pause_gc_while_importing()
    import torch

    setup_logging()  # the level from $OMNI_ASYNC_LOG_LEVEL (worker_runtime_env)

    n = int(os.environ.get(THREADS_ENV, "1"))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def torch_default_threads() -> int:
    """The intra-op thread count torch picks in a process without ``OMP_NUM_THREADS``: one per physical core this
    process may run on (the runtime env sets ``OMP_NUM_THREADS=1`` for every worker, so torch's own default in a
    worker is 1 and has to be computed)."""
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else physical
    return max(1, min(physical, usable))


def local_device_index(gpu_id: str, visible: str | None) -> int:
    """The CUDA index in this process of the GPU Ray assigned (``ray.get_gpu_ids()[0]``, a physical id). Ray
    normally sets ``CUDA_VISIBLE_DEVICES`` to the assigned GPU, which is then index 0; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` (as verl supports) it does not, and the index is the physical id,
    or its position in a ``CUDA_VISIBLE_DEVICES`` set by the user."""
    ids = [v.strip() for v in visible.split(",")] if visible else []
    return ids.index(str(gpu_id)) if str(gpu_id) in ids else int(gpu_id)


def configure_worker() -> str:
    """Called in a Ray actor's ``__init__``: its torch threads and the device its model goes on.

    A worker Ray assigned a GPU gets that GPU as its current CUDA device (:func:`local_device_index`) and
    ``trainer.ray.gpu_worker_torch_threads`` threads (null: :func:`torch_default_threads`); a CPU worker keeps the
    cap.
    """
    import ray
    import torch

    setup_logging()  # idempotent; covers an actor whose process skipped the setup hook (a ray.init of its own)
    gpu_ids = ray.get_gpu_ids()
    if gpu_ids and torch.cuda.is_available():
        index = local_device_index(str(gpu_ids[0]), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        torch.set_num_threads(int(os.environ.get(GPU_THREADS_ENV) or torch_default_threads()))
        return f"cuda:{index}"
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    return "cpu"


def worker_runtime_env(
    torch_threads: int = 1, gpu_worker_threads: int | None = None, log_level: str | None = None
) -> dict[str, Any]:
    """The job's runtime env; ``log_level`` (``trainer.log_level``) becomes the workers' ``$OMNI_ASYNC_LOG_LEVEL``
    (None: the driver's own variable, if set, passes through with the other ``OMNI_ASYNC_*`` ones)."""
    from omni_async.models.tiny import cache_root

    threads = str(torch_threads)
    return {
        "env_vars": {
            # The project's own settings reach the workers on a cluster started elsewhere too (a joined cluster's
            # workers inherit its raylet's environment, not the driver's).
            **{k: v for k, v in os.environ.items() if k.startswith("OMNI_ASYNC_") and k != THREADS_ENV},
            THREADS_ENV: threads,
            **({GPU_THREADS_ENV: str(gpu_worker_threads)} if gpu_worker_threads else {}),
            **({LOG_LEVEL_ENV: log_level} if log_level else {}),
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "OPENBLAS_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            "OMNI_ASYNC_CACHE": str(cache_root()),
            "RAY_DEDUP_LOGS": "0",
            # Fewer fragmentation OOMs when generation and updates alternate on one device (a user's value wins).
            ALLOC_CONF_ENV: os.environ.get(ALLOC_CONF_ENV, ALLOC_CONF),
        },
        "worker_process_setup_hook": "omni_async.cluster.setup_worker_process",
    }


def reward_pool_size(cfg: DictConfig) -> int:
    """Devices of the dedicated reward pool: ``reward.reward_model.n_gpus_per_node x nnodes``."""
    rm = cfg.reward.reward_model
    return int(rm.n_gpus_per_node) * int(rm.nnodes)


def actor_ranks(cfg: DictConfig) -> int:
    """Data-parallel actor ranks: one per device of the actor pool, ``trainer.n_gpus_per_node x nnodes``, in every
    layout (the disaggregated layout's rollout pool is its own)."""
    return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)


def sequence_parallel_size(cfg: DictConfig) -> int:
    """The actor's Ulysses group size, ``actor.fsdp_config.ulysses_sequence_parallel_size`` (1: none)."""
    return max(1, int(cfg.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size))


def rollout_pool_size(cfg: DictConfig) -> int:
    """Devices of the standalone rollout pool (disaggregated layout): ``actor_rollout_ref.rollout.nnodes x
    n_gpus_per_node`` (``n_gpus_per_node`` null = ``trainer.n_gpus_per_node``, verl's default); 0 = no pool."""
    r = cfg.actor_rollout_ref.rollout
    per_node = r.n_gpus_per_node if r.n_gpus_per_node is not None else cfg.trainer.n_gpus_per_node
    return int(r.nnodes) * int(per_node)


async def wait_for_restart(probe: Callable[[], Awaitable[Any]], timeout_s: float) -> bool:
    """After a Ray actor with ``max_restarts`` died: poll ``probe()`` (a call on it) until Ray has restarted it and
    the call succeeds (``True``), or give up (``False``) when restarts are exhausted, the call fails otherwise, or
    ``timeout_s`` passes. Ray refuses calls with ``ActorUnavailableError`` while it restarts the actor."""
    from ray.exceptions import ActorUnavailableError

    give_up = time.monotonic() + timeout_s
    while (left := give_up - time.monotonic()) > 0:
        try:
            await asyncio.wait_for(probe(), left)
            return True
        except ActorUnavailableError:
            await asyncio.sleep(RESTART_POLL_S)
        except Exception:  # restarts exhausted, no answer in time, or the probe itself failed
            return False
    return False


def logical_devices(cfg: DictConfig) -> dict[str, int]:
    """Devices each pool needs: the actor/rollout pool (the trainer ranks when there is a rollout pool), the
    standalone rollout pool, and, when enabled, the dedicated reward pool."""
    actor = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    reward = reward_pool_size(cfg) if cfg.reward.reward_model.enable_resource_pool else 0
    return {"actor_rollout": actor, "rollout": rollout_pool_size(cfg), "reward": reward}


# verl reserves several CPUs per device bundle; a CPU box declares enough logical CPUs for every actor.
LOGICAL_CPUS_PER_DEVICE, LOGICAL_CPUS_BASE, MIN_LOGICAL_CPUS = 8, 8, 16


def logical_cpus(devices: int) -> int:
    return max(MIN_LOGICAL_CPUS, LOGICAL_CPUS_PER_DEVICE * max(devices, 1) + LOGICAL_CPUS_BASE)


def init_ray(
    cfg: DictConfig | None = None, *, num_gpus: int | None = None, num_cpus: int | None = None, torch_threads: int = 1
) -> dict[str, Any]:
    """Start (or join) Ray once per process; return the cluster's resources. Idempotent."""
    if ray.is_initialized():
        return ray.cluster_resources()
    # The driver's logging first, so a bad trainer.log_level fails before a cluster starts (no config: the level of
    # $OMNI_ASYNC_LOG_LEVEL, else INFO, which the workers then inherit with the other OMNI_ASYNC_* variables).
    log_level = check_log_level(cfg.trainer.log_level) if cfg is not None else None
    setup_logging(log_level)
    address, gpu_threads = None, None
    if cfg is not None:
        gpu_threads = cfg.trainer.ray.gpu_worker_torch_threads
        address = cfg.trainer.ray.address
        num_cpus = num_cpus if num_cpus is not None else cfg.trainer.ray.num_cpus
        if num_gpus is None:
            num_gpus = sum(logical_devices(cfg).values())
    # Ray's own convention (`ray start` prints it, job submission sets it): with no address configured, a RAY_ADDRESS
    # in the environment means "join that cluster" rather than start a new one next to it.
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = dict(
        runtime_env=worker_runtime_env(torch_threads, gpu_threads, log_level),
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=True,
    )
    t0 = time.perf_counter()
    if address:
        ray.init(address=address, **kwargs)
        how = f"joined the Ray cluster at {address}"
    else:
        import torch

        if torch.cuda.is_available():  # real devices: Ray detects them all
            kwargs["num_cpus"] = num_cpus  # None: Ray counts the machine's cores
        else:  # logical devices, so verl's GPU bundles place actors as they would on a GPU cluster
            kwargs.update(num_gpus=num_gpus or 0, num_cpus=num_cpus or logical_cpus(num_gpus or 0))
        # "local": always a new local cluster. Without it ray.init joins any cluster already running on the machine
        # (another job's `ray start`) and then refuses num_cpus / num_gpus.
        ray.init(address="local", **kwargs)
        how = "started a local Ray cluster"
    resources = ray.cluster_resources()
    logger.info("%s in %.1fs: %s", how, time.perf_counter() - t0, _describe(resources))
    return resources


def _describe(resources: dict[str, Any]) -> str:
    """``N CPUs, M GPUs, K nodes`` of ``ray.cluster_resources()`` (GPUs are logical ones on a CPU box)."""
    nodes = sum(1 for k in resources if k.startswith("node:") and k != "node:__internal_head__")
    return f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs, {nodes} node(s)"


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


# A young-generation collection every this many allocations in the driver (Python's default: 700).
DRIVER_GC_THRESHOLD0 = 20_000


def tune_driver_gc() -> None:
    """The main job's driver, once its trainer is built: ``gc.freeze()`` takes the start-up objects (modules, config,
    models' metadata, Ray handles) out of every later collection, and young collections run every
    ``DRIVER_GC_THRESHOLD0`` allocations. The agent loop allocates a few hundred short-lived objects per sample, so
    with Python's defaults the collector ran every few samples over the whole young set; measured in
    ``bench/driver_cost.py`` (``batched+gc``): about 0.6 ms of driver CPU per sample less. Called once, before any
    trainer's garbage exists to freeze: by the entry point once its trainer is built, and by the test suite once it
    has collected (a process that builds many trainers must not call it per trainer). The entry point
    builds the trainer with the collector off (its imports: see :func:`pause_gc_while_importing`); it is on again
    from here."""
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(max(t0, DRIVER_GC_THRESHOLD0), t1, t2)
    gc.enable()
