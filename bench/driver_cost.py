"""The driver's CPU cost per sample at scale (issue 40, item 4), measured by simulation.

    .venv/bin/python bench/driver_cost.py [--workers 64] [--in-flight 4096] [--samples 2048] [--group 8]
        [--gen-mean 60] [--gen-sigma 0.5] [--reward-latency 0.1] [--variants product]
        [--out bench/results/driver_cost_product.json]

Two regimes. The default offers 4096 / 60 s = 68 samples/s (the product with a Ray call per sample reached about half
of it on a 2-core box). Costs per second weigh more per sample at such a rate (the rollouter's take polls
every ``TAKE_POLL_S``; Ray tracks every pending call: ``in_flight_idle``). ``--gen-mean 4 --samples 4096 --warmup 4096
--profile-samples 1024 --out bench/results/driver_cost_saturated.json`` offers 1024/s: the box saturates (the 64
stand-ins alone keep ~0.7 of its 2 cores busy while idle, Ray's worker overhead) and samples queue for the reward
workers, so the figures add what a backlog costs the driver (the dispatcher's asyncio.Condition / Semaphore scan their
waiters: hundreds of ``Future.done`` calls per sample in the profile). The saturated JSON predates
``in_flight_idle`` / ``marginal`` and the product's coalesced calls (it measured the variants below).

The producer is the fully async one (``make_producer``): the real agent loop (``AgentLoopManager``), rollouter
(``Rollouter``, ``--in-flight / --group`` groups in flight), reward queue (``RewardDispatcher``) and reward-loop
workers (``RewardLoopWorker``, ``--reward-workers`` Ray actors); only the rollout workers are stand-ins
(``bench.stand_ins.StandInRollout``: ``--workers`` Ray async actors, no model, a lognormal generation time of mean
``--gen-mean`` s, a small but complete image result) and the reward function is a cheap one that waits
``--reward-latency`` s on the reward worker's loop. A trainer loop in the main thread takes ``--groups-per-step``
scored groups at a time, batches them into a verl ``DataProto`` (``StepOps.build_batch``: batch tensors + GRPO
advantages) and opens the next sync window, as fully async training does minus the update and the weight sync.

The one variant, ``product``, is the product as it ships for images: the agent loop's generation requests for one
worker in one turn of its event loop go as one ``generate_many`` call (with thousands in flight a new group goes whole
to the least-loaded worker, ``AgentLoopManager._group_home``) and the reward's samples for one worker in one
turn as one ``score_many`` call of plain records (``batching.TurnCalls``), a result's tensors sent as numpy arrays
(``ImageResult.__getstate__``, as a real worker's are), the driver's garbage collector tuned as the main job's entry
point tunes it (``cluster.tune_driver_gc``). Earlier JSONs hold the variants measured before the product did this
(``baseline``: a Ray call per sample; ``serialization``, ``batched``, ``batched+gc``: benchmark-only stand-ins of
zero-copy tensors, coalesced calls and GC tuning; the code of those is in the git history).

After ``--warmup`` trained samples (by default half the in-flight window: trained and replaced), the driver
process's CPU time (``getrusage(RUSAGE_SELF)``: every thread of the driver, Ray's own included; worker processes
excluded) is read over the next ``--samples`` trained samples and divided by them. By part, from each thread's CPU time
(``/proc/self/task``): the agent loop thread (scheduling, streaming, queueing: every Ray call the agent loop, the
rollouter and the dispatcher make, and their asyncio tasks), the trainer thread (``build_batch`` timed on its own;
the rest is taking groups), and Ray's threads by name (``worker.io``, the core worker's io service: sending tasks,
receiving replies, unpickling them). Then ``--profile-samples`` more samples run under cProfile (CPU time) in the
agent loop thread and the trainer thread: the top functions by own time, the loop thread's own time by package (a
partition) and the cumulative time of its key functions (overlapping). The profiler slows the loop about 2x, so
the profile gives shares and where the time goes, the measured window the figures.

Before its warm-up each variant holds ``--idle-window`` seconds (10): the driver's CPU while the whole window is in flight and
(with a long generation time) nothing has finished yet, ``in_flight_idle``: a cost per second, not per sample (Ray
tracking the pending calls, pollers, timers). ``cpu_ms_per_sample.marginal`` is the total less that cost over the
measured window: what each further sample costs, the figure that scales to thousands of samples a second.

JSON (``--out``): ``machine`` (CPU model, cores, load average), ``config`` (every argument), and per variant:
``cpu_ms_per_sample`` (total, marginal, by part, Ray's threads by name), ``goal_met`` (total <= 1 ms),
``samples_per_s`` and ``wall_s`` of the measured window, ``driver_cores_busy``, ``box_cores_busy_by_role`` (driver,
stand-ins, reward workers, the run's other Ray processes, other jobs on the box: whether the box limits samples/s),
``live_samples_mean`` (started and not yet trained), ``ray_calls_per_sample``, ``gc`` (CPU in Python's cyclic
collector, charged to whichever thread allocated when it ran; collections per generation), the loop's own timings
(``SampleTimes.serialize_s`` / ``dispatch_s``, wall) and ``profile``. ``unit_cost_ms``: one sample's serialization
steps timed alone, and one bare Ray actor call's driver CPU. No timing is asserted anywhere
(tests/bench/test_bench_smoke.py checks the fields).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import logging
import os
import platform
import pstats
import resource
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL_MS = 1.0  # issue 40: one driver feeds a cluster generating thousands of samples a second
VARIANTS = ("product",)  # make_producer's docstring
IDLE_SETTLE_S = 2.0  # after a producer starts, before the driver is measured with everything in flight (--idle-window)
DATAPROTO_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"  # verl's switch to the numpy form of a pickled DataProto
# The agent loop's functions whose cumulative CPU the profile reports: (label, file, function).
KEY_FUNCTIONS = (
    ("Ray calls made (.remote: arguments pickled, task submitted)", "actor.py", "_actor_method_call"),
    ("reward record built (Sample.reward_input)", "sample.py", "reward_input"),
    ("draws (samples, SDE windows)", "draws.py", "make"),
    ("rollouter: starting groups (_produce)", "rollouter.py", "_produce"),
    ("rollouter: taking groups (take)", "rollouter.py", "take"),
    ("manager: one sample (_sample)", "manager.py", "_sample"),
    ("dispatcher: queue (enqueue)", "dispatcher.py", "enqueue"),
    ("dispatcher: one call (_dispatch)", "dispatcher.py", "_dispatch"),
    ("coalesced calls sent (TurnCalls._flush)", "batching.py", "_flush"),
    ("coalesced answers handed out (TurnCalls._answer)", "batching.py", "_answer"),
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # per-thread ns on a CPU (thread_cpu)
# Packages the loop thread's profiled time is split by (first match on the function's file path).
PROFILE_PACKAGES = (
    ("ray", "/ray/"),
    ("asyncio", "/asyncio/"),
    ("agent loop (manager)", "agent_loop/manager.py"),
    ("rollouter", "agent_loop/rollouter.py"),
    ("reward dispatcher", "reward/dispatcher.py"),
    ("coalesced calls (TurnCalls)", "omni_async/batching.py"),
    ("verl / tensordict", "/verl/"),
    ("verl / tensordict", "/tensordict/"),
    ("torch", "/torch/"),
    ("stand-in answer rebuild", "bench/stand_ins.py"),
    ("rest of omni_async (draws, sample, logs)", "omni_async/"),
)


def machine() -> dict[str, Any]:
    import ray
    import torch

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "load_average_start": list(os.getloadavg()),
        "note": "no GPU; the stand-in workers, reward workers and Ray's daemons share the cores with the driver",
    }


def unit_costs(args: argparse.Namespace, repeat: int = 500) -> dict[str, float]:
    """CPU ms of one sample's serialization steps, in this process, outside Ray: what the variants change. A reply is
    unpickled on Ray's io thread, which the profile of the agent loop thread does not see."""
    import pickle

    from bench.stand_ins import rebuild_generation, result_template
    from omni_async.reward.worker import sample_to_proto
    from omni_async.sample import PromptRow, Sample

    def cost(fn: Any) -> float:
        fn()
        t0 = time.process_time()
        for _ in range(repeat):
            fn()
        return (time.process_time() - t0) * 1000 / repeat

    window, latents, embeds = 2, tuple(args.latent_shape), tuple(args.embed_shape)
    product, torch_form, zero_copy = (
        result_template(window, latents, embeds, form=f) for f in ("product", "torch", "zero_copy")
    )
    pixels = np.full((args.image_size, args.image_size, 3), 7, dtype=np.uint8)
    sample = Sample(0, "0-0", PromptRow("a photo of item 0", "bench", "item 0"), 7, (0, window))
    sample.result = rebuild_generation(product, pixels, 0, 0.0, 0.0, 0).result
    record = sample.reward_input()
    chunk = sample_to_proto(record)
    out = {
        "answer unpickled, the product's form (ImageResult: tensors as numpy arrays)": cost(
            lambda: pickle.loads(product)
        ),
        "answer unpickled, tensors by torch (the product's form before)": cost(lambda: pickle.loads(torch_form)),
        "answer unpickled, tensors zero-copy": cost(lambda: pickle.loads(zero_copy)),
        "reward chunk built (sample_to_proto: a one-row DataProto)": cost(lambda: sample_to_proto(record)),
        "reward chunk pickled, DataProto by torch.save (the product's form before)": cost(
            lambda: pickle.dumps(chunk, protocol=5)
        ),
    }
    saved = os.environ.get(DATAPROTO_ENV)
    os.environ[DATAPROTO_ENV] = "numpy"
    try:
        out["reward chunk pickled, DataProto in verl's numpy form"] = cost(lambda: pickle.dumps(chunk, protocol=5))
    finally:
        if saved is None:
            os.environ.pop(DATAPROTO_ENV)
        else:
            os.environ[DATAPROTO_ENV] = saved
    out["reward record pickled as a plain dict (no DataProto: the product's)"] = cost(
        lambda: pickle.dumps(record, protocol=5)
    )
    return out


def ray_call_cost(handles: list[Any], calls: int = 2000, concurrent: int = 200) -> float:
    """Driver CPU ms of one Ray actor call made and awaited on an event loop (a stand-in's ``stats``: tiny arguments,
    a tiny reply), once the stand-ins are idle: what each per-sample call costs before anything is in it."""
    import ray

    ray.get([w.drop.remote() for w in handles])  # the last variant's calls
    while any(s["in_flight"] for s in ray.get([w.stats.remote() for w in handles])):
        time.sleep(0.2)

    async def burst() -> None:
        slots = asyncio.Semaphore(concurrent)

        async def one(i: int) -> None:
            async with slots:
                await handles[i % len(handles)].stats.remote()

        await asyncio.gather(*(one(i) for i in range(calls)))

    asyncio.run(burst())  # warm
    c0 = process_cpu()
    asyncio.run(burst())
    return (process_cpu() - c0) * 1000 / calls


def start_ray(args: argparse.Namespace) -> None:
    """A local cluster, or the one ``RAY_ADDRESS`` names. Workers find ``bench.stand_ins`` (PYTHONPATH) and run one
    BLAS / torch thread each; no process setup hook, so the stand-ins never import torch."""
    import ray

    threads = "1"
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "OMNI_ASYNC_TORCH_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
    }
    # 64 workers and the driver saturate 2 cores, and the raylet answers the GCS's health checks late: with Ray's
    # default (5 missed checks) one run had its node marked dead mid-run. Allow 3 minutes of missed checks.
    os.environ.setdefault("RAY_health_check_failure_threshold", "60")
    os.environ.setdefault("RAY_health_check_timeout_ms", "30000")
    common = {"logging_level": "warning", "log_to_driver": True, "runtime_env": {"env_vars": env}}
    if os.environ.get("RAY_ADDRESS"):  # Ray's convention: join the cluster given (the test suite's shared one)
        ray.init(address=os.environ["RAY_ADDRESS"], **common)
        return
    ray.init(
        address="local",
        num_cpus=max(16, args.reward_workers + 4),  # logical: each reward worker asks for 1, the stand-ins for 0
        num_gpus=0,
        include_dashboard=False,
        **common,
    )


@dataclass
class Producer:
    """What the measurement loop uses of the producer; built only by :func:`make_producer`."""

    agent: Any
    rollouter: Any
    ops: Any
    rollout_workers: list[Any]  # the stand-ins themselves (Ray handles), reused by the next variant
    reward_workers: list[Any]
    groups_per_step: int
    group: int
    gc_threshold: tuple[int, int, int]  # the driver's collector settings before this variant set them

    def take(self, step: int) -> list[Any]:
        """The next ``groups_per_step`` scored groups' samples (the fully async trainer's take)."""
        groups = self.agent.call(self.rollouter.take(step, self.groups_per_step))
        return [s for g in groups for s in g.samples]

    def build_batch(self, samples: list[Any]) -> Any:
        return self.ops.build_batch(samples)

    def after_update(self, step: int) -> None:
        """The next sync window opens (no weights move: the stand-ins have none)."""
        self.agent.call(self.rollouter.on_sync(step + 1))

    def live_samples(self) -> tuple[float, float]:
        """(samples started and not taken, of them generating or being scored)."""
        m = self.agent.on_loop(self.rollouter.metrics)
        generating = m["fully_async/rollouter/in_flight"]
        return (generating + m["fully_async/message_queue/size"]) * self.group, generating * self.group

    def on_loop(self, fn: Any) -> Any:
        return self.agent.on_loop(fn)

    @property
    def loop_thread_id(self) -> int:
        return self.agent._thread.native_id

    def ray_calls(self) -> dict[str, int]:
        """Ray calls the product's coalesced calls made and the items they carried: ``generate`` (the agent loop's
        ``generate_many``) and ``score`` (the dispatcher's ``score_many``)."""

        def read() -> dict[str, int]:
            calls = {"generate": self.agent._calls, "score": self.agent.dispatcher._calls}
            return {f"{name}.{k}": getattr(c, k) for name, c in calls.items() for k in ("calls", "items")}

        return self.agent.on_loop(read)

    def close(self) -> None:
        import ray

        # Cancelled tasks of the stopped producer would each log "destroyed but pending" at shutdown.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        self.agent.call(self.rollouter.stop())
        # Let the cancellations run and the dispatcher's last calls finish before the loop stops: tasks left pending
        # hold samples whose tensors would otherwise be freed by the interpreter's last collection (see main).
        self.agent.call(asyncio.sleep(1.0))
        self.agent.shutdown()
        gc.unfreeze()
        gc.set_threshold(*self.gc_threshold)
        gc.collect()
        for w in self.reward_workers:
            ray.kill(w)


def make_producer(
    *,
    variant: str,
    workers: int,
    in_flight: int,
    group: int,
    groups_per_step: int,
    groups_to_train: int,
    gen_mean_s: float,
    gen_sigma: float,
    reward_workers: int,
    reward_latency_s: float,
    reward_inflight: int,
    reward_queue: int,
    image_size: int,
    latent_shape: tuple[int, ...],
    embed_shape: tuple[int, int],
    seed: int,
    stand_ins: list[Any] | None = None,
) -> Producer:
    """The fully async producer of the trainer (``trainer.loop.RLTrainer``: agent loop, rollouter, reward side) around
    stand-in rollout workers: the one place that knows the producer's construction API.

    ``variant`` (``VARIANTS``): ``product``, built as ``RLTrainer`` builds it for images (the reward side's real
    wiring, the agent loop's coalesced generation calls) and with the driver's collector tuned as the main job's
    entry point tunes it. ``stand_ins``: the rollout workers of an earlier variant, reused (64 take minutes to start
    on 2 cores)."""
    import ray

    from bench.stand_ins import StandInRollout, result_template
    from omni_async.agent_loop.draws import Draws
    from omni_async.agent_loop.manager import AgentLoopManager
    from omni_async.agent_loop.rollouter import ProducerSettings, Rollouter
    from omni_async.cluster import tune_driver_gc
    from omni_async.modality import get_modality
    from omni_async.reward.wiring import RewardSide
    from omni_async.sample import PromptRow
    from omni_async.trainer.config import compose_untyped
    from omni_async.trainer.dataset import PromptSampler
    from omni_async.trainer.step_ops import StepOps

    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}: use {', '.join(VARIANTS)}")
    if in_flight % group:
        raise SystemExit(f"--in-flight {in_flight} must be a multiple of --group {group} (whole groups in flight)")
    cfg = compose_untyped(
        [
            "data.train_files=unused",
            f"data.train_batch_size={groups_per_step}",
            f"actor_rollout_ref.rollout.n={group}",
            f"trainer.seed={seed}",
            f"reward.num_workers={reward_workers}",
            f"reward.queue_size={reward_queue}",
            f"reward.max_inflight_per_worker={reward_inflight}",
            "reward.custom_reward_function.path=pkg://bench.stand_ins",
            "reward.custom_reward_function.name=stand_in_score",
            f"+reward.custom_reward_function.reward_kwargs.latency_s={reward_latency_s}",
        ]
    )
    # A real worker's answer as the product pickles it (ImageResult.__getstate__: its tensors as numpy arrays).
    template = result_template(int(cfg.actor_rollout_ref.rollout.algo.sde_window_size), latent_shape, embed_shape)
    if stand_ins is None:
        per_worker = -(-in_flight // workers)
        cls = ray.remote(StandInRollout).options(
            num_cpus=0, max_concurrency=max(1000, 4 * per_worker), max_restarts=0
        )  # no logical CPU: they wait on timers, they compute nothing
        stand_ins = [cls.remote(template, gen_mean_s, gen_sigma, image_size, i) for i in range(workers)]
    ray.get([w.configure.remote(template) for w in stand_ins])
    while any(s["in_flight"] for s in ray.get([w.stats.remote() for w in stand_ins])):
        time.sleep(0.2)  # the dropped calls of the last variant unwinding
    reward = RewardSide(cfg, None, None)  # the real wiring: reward-loop workers as CPU actors, their dispatcher
    reward.wait_ready()
    modality = get_modality("image")
    batch = int(cfg.actor_rollout_ref.rollout.agent.max_batch_size) if modality.name == "image" else 0
    agent = AgentLoopManager(stand_ins, reward.dispatcher_factory(), in_flight, reward.post_process, coalesce=batch)
    rows = [PromptRow(f"a photo of item {i}", "bench", f"item {i}") for i in range(max(1024, groups_per_step))]
    sampler = PromptSampler(rows, groups_per_step, shuffle=True, seed=seed)
    draws = Draws.from_config(cfg, sampler, modality.uses_window)
    ops = StepOps(cfg, modality, reward, None)
    settings = ProducerSettings(
        cap=in_flight // group,
        bound=10**9,  # no lag bound: the stand-ins' weights never change, nothing is stale
        wait_for_stale=False,
        lock_step=False,  # fully async: a step takes any scored groups
    )
    rollouter = agent.on_loop(
        lambda: Rollouter(agent, draws, settings, groups_to_train=groups_to_train, rollout_version=0)
    )
    gc_threshold = gc.get_threshold()
    tune_driver_gc()  # as trainer.main does once the trainer is built; close() undoes it for the next variant
    agent.call(rollouter.start())
    return Producer(agent, rollouter, ops, stand_ins, reward.workers, groups_per_step, group, gc_threshold)


# ---- measurement --------------------------------------------------------------------------------------------------
def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process now: native id -> (thread name, seconds). The
    scheduler's own count of the time on a CPU (``schedstat``, nanoseconds) where the kernel gives it: ``stat``'s
    utime + stime are sampled at the clock tick (10 ms), coarser than what a short run's agent loop thread spends."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            if SCHEDSTAT:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9  # its first field: ns on a CPU
            else:
                fields = stat[stat.rindex(")") + 2 :].split()
                seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
        except OSError:  # it ended meanwhile
            continue
        out[int(tid)] = (stat[stat.index("(") + 1 : stat.rindex(")")], seconds)
    return out


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_parts(a: Mark, b: Mark, loop_tid: int, main_tid: int) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds between two marks: (agent loop / trainer / other threads, the other threads by name)."""
    by_name: dict[str, float] = defaultdict(float)
    parts = {"agent loop thread": 0.0, "trainer thread": 0.0}
    for tid, (name, cpu) in b.threads.items():
        spent = cpu - a.threads.get(tid, (name, 0.0))[1]
        if tid == loop_tid:
            parts["agent loop thread"] += spent
        elif tid == main_tid:
            parts["trainer thread"] += spent
        else:
            by_name[name] += spent
    return parts, dict(by_name)


def profile_split(stats: pstats.Stats) -> tuple[dict[str, float], dict[str, float], list[dict[str, Any]], float]:
    """From a CPU-time profile: own time by package (shares, a partition), the cumulative time of the agent loop's
    key functions (seconds, overlapping), the top functions by own time, and the total."""
    by_pkg: dict[str, float] = defaultdict(float)
    key: dict[str, float] = defaultdict(float)
    rows = []
    for (path, line, fn), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        pkg = next((p for p, k in PROFILE_PACKAGES if k in path), "other")
        if path == "~":  # a builtin: counted by what it is (method of a C type, pickle, ...)
            pkg = "builtins (C functions)"
        by_pkg[pkg] += tottime
        for label, file, name in KEY_FUNCTIONS:
            if fn == name and Path(path).name == file:
                key[label] += cumtime
        rows.append(
            {
                "function": f"{Path(path).name}:{line}({fn})",
                "ncalls": ncalls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
            }
        )
    total = sum(by_pkg.values()) or 1.0
    rows.sort(key=lambda r: -r["tottime_s"])
    return {k: v / total for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])}, dict(key), rows, total


def box_cpu() -> dict[int, tuple[int, float]]:
    """CPU seconds of every process on the box now: pid -> (parent pid, seconds)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK)  # ppid, utime + stime
    return out


def box_roles(a: dict, b: dict, wall: float, stand_in_pids: set[int], reward_pids: set[int]) -> dict[str, float]:
    """Cores each role kept busy between two snapshots: is the box, not the driver, what limits samples/s? The
    run's Ray cluster is the driver's descendants (it started the cluster); the rest of the box is other jobs."""
    me = os.getpid()
    ours, grew = {me}, True
    while grew:
        new = {pid for pid, (ppid, _) in b.items() if ppid in ours} - ours
        ours |= new
        grew = bool(new)
    cores: dict[str, float] = defaultdict(float)
    for pid, (_, cpu) in b.items():
        spent = cpu - a.get(pid, (0, 0.0))[1]
        if pid == me:
            role = "driver"
        elif pid in stand_in_pids:
            role = "stand-in rollout workers"
        elif pid in reward_pids:
            role = "reward-loop workers"
        elif pid in ours:
            role = "this run's other Ray processes (raylet, GCS, agents, exiting workers)"
        else:
            role = "other jobs on the box"
        cores[role] += spent / wall
    return dict(sorted(cores.items(), key=lambda kv: -kv[1]))


@dataclass
class Mark:
    t: float
    cpu: float
    threads: dict[int, tuple[str, float]]
    box: dict[int, tuple[int, float]]
    consumed: int
    build_cpu: float
    gc_s: float
    gc_runs: tuple[int, int, int]


class GcClock:
    """CPU time the driver spends in Python's cyclic garbage collector (in whichever thread allocates when a
    collection is due: the profile charges it to the allocating function), and collections per generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.runs = [0, 0, 0]
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._started[tid] = time.thread_time()
        elif tid in self._started:
            self.seconds += time.thread_time() - self._started.pop(tid)
            self.runs[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def measure(producer: Producer, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``--warmup`` samples, measure ``--samples``, profile ``--profile-samples``; the variant's figures."""
    import ray

    loop_tid, main_tid = producer.loop_thread_id, threading.get_native_id()
    stand_in_pids = {s["pid"] for s in ray.get([w.stats.remote() for w in producer.rollout_workers])}
    reward_pids = {i["pid"] for i in ray.get([w.info.remote() for w in producer.reward_workers])}
    measured_end = args.warmup + args.samples
    end = measured_end + args.profile_samples
    consumed, build_cpu, step = 0, 0.0, 0
    marks: dict[str, Mark] = {}
    live: list[tuple[float, float]] = []
    serialize_s: list[float] = []
    dispatch_s: list[float] = []
    # CPU time, not wall: the loop's waits in epoll are not cost.
    loop_prof, main_prof = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)

    gc_clock = GcClock()

    def mark() -> Mark:
        return Mark(
            time.perf_counter(),
            process_cpu(),
            thread_cpu(),
            box_cpu(),
            consumed,
            build_cpu,
            gc_clock.seconds,
            tuple(gc_clock.runs),
        )

    # The driver while everything is in flight and (almost) nothing finishes yet: what it spends per second on
    # holding the in-flight window (Ray's pending calls, timers, polls), whatever the rate.
    def answered() -> int:
        return sum(s["answered"] for s in ray.get([w.stats.remote() for w in producer.rollout_workers]))

    time.sleep(IDLE_SETTLE_S)
    n0, c0, t0 = answered(), process_cpu(), time.perf_counter()
    time.sleep(args.idle_window)
    c1, t1 = process_cpu(), time.perf_counter()
    idle = {"driver_cores": (c1 - c0) / (t1 - t0), "seconds": t1 - t0, "answers_meanwhile": answered() - n0}

    calls_before: dict[str, int] = {}
    while consumed < end:
        if consumed >= args.warmup and "start" not in marks:
            marks["start"] = mark()
            calls_before = producer.ray_calls()
        if consumed >= measured_end and "end" not in marks:
            marks["end"] = mark()
            calls_after = producer.ray_calls()
            if args.profile_samples:
                producer.on_loop(loop_prof.enable)
                main_prof.enable()
        samples = producer.take(step)
        c0 = time.thread_time()
        producer.build_batch(samples)
        build_cpu += time.thread_time() - c0
        producer.after_update(step)
        if "start" in marks and "end" not in marks:
            serialize_s += [s.times.serialize_s for s in samples if s.times.serialize_s is not None]
            dispatch_s += [s.times.dispatch_s for s in samples if s.times.dispatch_s is not None]
            live.append(producer.live_samples())
        consumed += len(samples)
        step += 1
        if step % 16 == 0:
            print(f"  {consumed} samples trained", flush=True)
    if "end" not in marks:  # no profile phase: the measured window ends with the run
        marks["end"] = mark()
        calls_after = producer.ray_calls()
    if args.profile_samples:
        producer.on_loop(loop_prof.disable)
        main_prof.disable()
    marks["profile_end"] = mark()
    gc_clock.close()

    a, b = marks["start"], marks["end"]
    n, wall = b.consumed - a.consumed, b.t - a.t
    ms = 1000.0 / n
    parts, ray_threads = thread_parts(a, b, loop_tid, main_tid)
    build = b.build_cpu - a.build_cpu
    by_part = {
        "agent loop thread": parts["agent loop thread"] * ms,
        "trainer thread: build_batch": build * ms,
        "trainer thread: the rest": (parts["trainer thread"] - build) * ms,
        "Ray's threads": sum(ray_threads.values()) * ms,
    }
    total = (b.cpu - a.cpu) * ms
    by_part["threads that ended meanwhile, rounding"] = total - sum(by_part.values())
    # Per sample beyond what holding the window costs per second (valid while few answers came in the idle window).
    marginal = total - idle["driver_cores"] * wall * ms
    out: dict[str, Any] = {
        "cpu_ms_per_sample": {
            "total": total,
            "marginal": marginal,
            "by_part": by_part,
            "ray_threads_by_name": {k: v * ms for k, v in sorted(ray_threads.items(), key=lambda kv: -kv[1]) if v},
        },
        "goal_met": total <= GOAL_MS,
        "samples_measured": n,
        "samples_per_s": n / wall,
        "target_samples_per_s": args.in_flight / args.gen_mean,  # what the stand-ins could deliver: in flight / mean
        "wall_s": wall,
        "driver_cores_busy": (b.cpu - a.cpu) / wall,
        "in_flight_idle": idle,
        "gc": {
            "cpu_ms_per_sample": (b.gc_s - a.gc_s) * ms,  # part of the threads' figures above
            "collections_per_1000_samples": [(y - x) * 1000 / n for x, y in zip(a.gc_runs, b.gc_runs, strict=True)],
            "threshold": list(gc.get_threshold()),
        },
        "box_cores_busy_by_role": box_roles(a.box, b.box, wall, stand_in_pids, reward_pids),
        "live_samples_mean": statistics.fmean(x for x, _ in live) if live else 0.0,
        "generating_or_scoring_samples_mean": statistics.fmean(y for _, y in live) if live else 0.0,
        "loop_wall_ms_per_sample": {
            "reward_input (SampleTimes.serialize_s)": 1000 * statistics.fmean(serialize_s) if serialize_s else 0.0,
            "its share of score_many.remote (SampleTimes.dispatch_s)": (
                1000 * statistics.fmean(dispatch_s) if dispatch_s else 0.0
            ),
        },
        "ray_calls_per_sample": {
            k.replace(".calls", ""): (calls_after[k] - calls_before[k]) / n for k in calls_after if k.endswith(".calls")
        },
    }
    if args.profile_samples:
        p, q = marks["end"], marks["profile_end"]
        n_p = q.consumed - p.consumed
        loop_split, loop_key, loop_top, loop_total = profile_split(pstats.Stats(loop_prof))
        _, _, main_top, _ = profile_split(pstats.Stats(main_prof))
        out["profile"] = {
            "samples": n_p,
            "cpu_ms_per_sample_under_profiler": (q.cpu - p.cpu) * 1000 / n_p,
            "loop_thread_cpu_ms_per_sample_profiled": loop_total * 1000 / n_p,
            "loop_thread_own_time_share_by_package": loop_split,
            "loop_thread_key_functions_cum_ms_per_sample": {k: v * 1000 / n_p for k, v in loop_key.items()},
            "loop_thread_top_own_time": loop_top[: args.profile_top],
            "trainer_thread_top_own_time": main_top[: args.profile_top],
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch

    torch.set_num_threads(1)  # the driver's batching is tiny tensors: no intra-op pool spinning on a shared box
    report: dict[str, Any] = {"machine": machine(), "config": vars(args).copy(), "goal_cpu_ms_per_sample": GOAL_MS}
    t0 = time.perf_counter()
    report["unit_cost_ms"] = unit_costs(args)
    print("unit costs (CPU ms per sample):", json.dumps(report["unit_cost_ms"], indent=1), flush=True)
    start_ray(args)
    # Enough groups that the window stays full to the end of the run (the rest are cancelled at stop).
    end = args.warmup + args.samples + args.profile_samples
    groups_to_train = -(-(end + args.in_flight) // args.group) + args.groups_per_step
    stand_ins = None
    report["variants"] = {}
    for variant in args.variants:
        t_setup = time.perf_counter()
        producer = make_producer(
            variant=variant,
            workers=args.workers,
            in_flight=args.in_flight,
            group=args.group,
            groups_per_step=args.groups_per_step,
            groups_to_train=groups_to_train,
            gen_mean_s=args.gen_mean,
            gen_sigma=args.gen_sigma,
            reward_workers=args.reward_workers,
            reward_latency_s=args.reward_latency,
            reward_inflight=args.reward_inflight,
            reward_queue=args.reward_queue,
            image_size=args.image_size,
            latent_shape=tuple(args.latent_shape),
            embed_shape=tuple(args.embed_shape),
            seed=args.seed,
            stand_ins=stand_ins,
        )
        stand_ins = producer.rollout_workers
        setup_s = time.perf_counter() - t_setup
        print(
            f"{variant}: set up in {setup_s:.1f}s; {args.warmup} samples warm-up, {args.samples} measured", flush=True
        )
        try:
            result = measure(producer, args)
        finally:
            producer.close()
        report["variants"][variant] = {"setup_s": setup_s, **result}
        print_variant(variant, report["variants"][variant])
    report["unit_cost_ms"]["Ray actor call made and awaited (driver, idle stand-ins)"] = ray_call_cost(stand_ins)
    report["config"]["groups_to_train"] = groups_to_train
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report["run_wall_s"] = time.perf_counter() - t0
    ray.shutdown()
    return report


def print_variant(name: str, r: dict[str, Any]) -> None:
    c = r["cpu_ms_per_sample"]
    verdict = "met" if r["goal_met"] else "NOT met"
    print(f"\n[{name}] driver CPU {c['total']:.3f} ms/sample (goal {GOAL_MS:g} ms: {verdict})", end="")
    idle = r["in_flight_idle"]
    print(f"; {c['marginal']:.3f} beyond the {idle['driver_cores']:.3f} cores of holding the window", end="")
    print(f" ({idle['answers_meanwhile']} answers in its {idle['seconds']:.0f}s)")
    print(f"  {r['samples_measured']} samples in {r['wall_s']:.1f}s = {r['samples_per_s']:.0f} samples/s", end="")
    print(f" (stand-ins' limit {r['target_samples_per_s']:.0f}/s), {r['live_samples_mean']:.0f} live on average")
    print(f"  Ray calls per sample: {r['ray_calls_per_sample']}")
    for k, v in c["by_part"].items():
        print(f"  {v:7.3f}  {k}")
    print(
        f"  of which garbage collection {r['gc']['cpu_ms_per_sample']:.3f} ({r['gc']['collections_per_1000_samples']})"
    )
    print("  Ray's threads:", ", ".join(f"{k} {v:.3f}" for k, v in c["ray_threads_by_name"].items()))
    print("  box cores busy:", ", ".join(f"{k} {v:.2f}" for k, v in r["box_cores_busy_by_role"].items()))
    if "profile" in r:
        p = r["profile"]
        print(f"  profile over {p['samples']} samples ({p['cpu_ms_per_sample_under_profiler']:.3f} ms/sample under it)")
        shares = p["loop_thread_own_time_share_by_package"]
        print("  loop thread own time:", ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
        print(f"  loop thread, profiled {p['loop_thread_cpu_ms_per_sample_profiled']:.3f} ms/sample; cumulative:")
        for k, v in p["loop_thread_key_functions_cum_ms_per_sample"].items():
            print(f"    {v:7.3f}  {k}")
        for row in p["loop_thread_top_own_time"][:12]:
            print(f"  {row['tottime_s']:7.3f}s own {row['cumtime_s']:7.3f}s cum {row['ncalls']:>8}  {row['function']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--workers", type=int, default=64, help="stand-in rollout workers (Ray async actors)")
    p.add_argument(
        "--in-flight", type=int, default=4096, help="samples in flight (rollouter: in-flight / group groups)"
    )
    p.add_argument("--samples", type=int, default=2048, help="trained samples measured after the warm-up")
    p.add_argument(
        "--warmup", type=int, default=None, help="trained samples before measuring (default: half the window)"
    )
    p.add_argument("--profile-samples", type=int, default=512, help="samples profiled after the measured ones")
    p.add_argument("--profile-top", type=int, default=30, help="functions listed from each profile")
    p.add_argument("--gen-mean", type=float, default=60.0, help="mean generation time, s (lognormal; module doc)")
    p.add_argument("--gen-sigma", type=float, default=0.5, help="sigma of the log of the generation time")
    p.add_argument("--reward-latency", type=float, default=0.1, help="reward function's latency, s")
    p.add_argument("--reward-workers", type=int, default=4, help="real reward-loop workers (Ray actors)")
    p.add_argument("--reward-inflight", type=int, default=256, help="reward.max_inflight_per_worker")
    p.add_argument("--reward-queue", type=int, default=1024, help="reward.queue_size")
    p.add_argument("--group", type=int, default=8, help="GRPO group size (rollout.n)")
    p.add_argument("--groups-per-step", type=int, default=32, help="groups the trainer batches into one DataProto")
    p.add_argument("--image-size", type=int, default=32, help="stand-in image side, pixels (uint8 RGB)")
    p.add_argument("--latent-shape", type=int, nargs="+", default=[16, 8, 8], help="one latent's shape")
    p.add_argument("--embed-shape", type=int, nargs=2, default=[16, 64], help="prompt_embeds [tokens, dim]")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--idle-window", type=float, default=10.0, help="s the driver is measured with all in flight")
    p.add_argument("--out", default=str(ROOT / "bench/results/driver_cost_product.json"))
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if args.warmup is None:  # past the first answers' burst: half the window has been trained and replaced
        args.warmup = args.in_flight // 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    # Ray is shut down and everything written. The interpreter's last collection can still meet a zero-copy tensor
    # (a view of a buffer Ray owned) and abort on torch's internal assert in THPVariable_clear (seen once): leave
    # without it, so the exit status is the benchmark's.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
