"""Step time of every training mode on the same seeded workload, against the sync baseline of the same run.

    .venv/bin/python bench/async_reward.py [--steps 8] [--out bench/results/async_reward.json]

Each mode trains the tiny model (``--modality image``: tiny:qwen_image; ``text``: tiny:qwen2, GRPO) for ``--warmup`` + ``--steps`` steps on real Ray actors (a fresh cluster per mode)
with the simulated remote scorer: a seeded uniform 1-40 s latency per sample scaled by ``--latency-scale``
(25 ms - 1 s by default), served at most ``--scorer-capacity`` requests at a time (a remote judge's concurrency
limit). The sync baseline's colocated reward and the single reward-loop worker of the streaming modes go through
the same capacity. Only the steps after warm-up are measured, and one more step runs after them unmeasured
(``TAIL_STEPS``: a look-ahead mode's last step of a run has no next rollout to overlap; fully async: ceil(1 + s)
steps, which train what the rollouter generated ahead during the measured ones, so that counts as busy).

``--actor-ranks 2`` trains data-parallel on two actor ranks (one rollout worker each); on a CPU box the two share
its cores, so it is recorded for the record (``samples_per_rank``, ``throughput``), not expected to be faster:
``bench/results/async_reward_ranks{1,2}.json``.

``bound_s`` is the physical lower bound of a mode's step, computed per step from parts measured in the sync run
of the same workload (same prompts and seeds, hence the same per-sample latencies), then averaged:

- ``rollout``  time to generate the batch (``timing_s/gen``)
- ``train``    the step after the batch is in (advantages, update, weight sync)
- ``last``     when the last reward arrives if each sample is sent the moment its image exists: the scorer's
               FIFO schedule (``capacity`` servers) of the measured ready times and latencies
- ``busy``     the scorer's time for the batch when all of it arrives at once (the sync reward phase)
- ``work``     the scorer's throughput limit per step: sum of latencies / capacity
- ``minibatches`` = ``train_batch_size / ppo_mini_batch_size``

    sync:                 rollout + busy + train
    stream:               max(rollout, last) + train
    stream+pipeline:      max(rollout, last) + train / minibatches  (only the last mini-batch must follow the last reward)
    stream+one_step_off:  max(rollout, train, work)                 (steady state: each period generates, trains and
    all:                  max(rollout, train, work)                  scores one batch, overlapped)

The overlapped bounds assume rollout and training run on different devices: the one-step-off recipe's split
layout (``--layout split``, the default here: ``actor_rollout_ref.hybrid_engine=False``) and the disaggregated one.
With ``--layout hybrid`` one process per device does both, so generation and update take turns and the overlapped
modes' bound is max(rollout + train, work). ``--layout hybrid,disaggregated`` runs both layouts in one run on the
same devices (hybrid: ``--rollout-devices + --actor-ranks`` ranks) and writes them under ``layouts``; each layout's
bounds and ``hidden_fraction`` come from its own sync run, and ``to_bound`` = mean step / bound. ``--layout disaggregated``
puts ``--rollout-devices`` inference-only rollout workers on a rollout pool and ``--actor-ranks`` trainer ranks on
theirs (weights over a gloo group, ``checkpoint_engine.backend=nccl``); ``--pin-cores`` pins each rollout worker and
trainer rank (all its threads) to a core of its own, so on a CPU box the two pools really run side by side, and with
a rollout pool the run's other processes (driver, reward workers, Ray's daemons) to the trainer ranks' cores.
Per mode the JSON also has ``samples_per_s``, each pool's busy fraction over the measured window (rollout: the
union of the device batches of every sample of the run, warm-up and tail steps included since a look-ahead mode
generates the next step's batch during the measured ones, clipped to the window; trainer: old-log-prob + update +
weight sync) and ``own_bound_s`` = max(rollout busy, trainer busy) per measured step of the mode itself (issue 29's
bound max(generation, update + weight sync) with each side costed as it ran in this mode, contention included: mean
step / own bound is how far the schedule is from keeping the busier pool busy). ``rollout_idle``: the rollout pool's
idle gaps in the window, split by the trainer phase that ran meanwhile and by whether a request was waiting at a
worker; ``cpu_s_per_step``: CPU seconds per measured step of the driver, the rollout workers, the trainer ranks, the
reward workers, Ray's other processes and everything else on the box (the box is shared); ``rollout_batch_sizes``:
how many device batches of each size the rollout workers ran. ``--long-tail-alpha`` gives text responses
heavy-tailed lengths (``actor_rollout_ref.rollout.response_length_pareto_alpha``).

For one-step off-policy, one step's "rollout + reward tail" is not a bound here: the look-ahead collection starts
when the previous step starts, so its reward tail may run into the next period; what remains is throughput.
``hidden_fraction = (T_sync - T_mode) / (T_sync - bound_mode)`` on mean step times: the share of the hideable
time a mode hid. Means, not medians, because the overlapped modes carry work from one step into the next.

``--fully-async-staleness 0.5,1,2,3`` runs another comparison (issue 30): fully async training
(``async_reward.fully_async``, one update = ``--batch`` prompts in ``--batch / --mini-batch`` mini-batches, a sync
after every update) on the disaggregated layout (1 rollout + 1 trainer device) at each staleness threshold, against
the hybrid layout's colocated sync and one-step-off on the same 2 devices (2 ranks), every process pinned to a core
of its own. Per row: samples/s over the measured steps, ×one-step-off, each pool's busy fraction, the largest lag, and
the bound (``fully_async_bound``): the smallest of latency-bound = samples in flight / (judge latency + generation +
update), device-bound = samples / busy time of the busier pool (hybrid: generation + update take turns on each
device) and judge-bound = calls served at once (judge capacity or the reward loop's in-flight limit) / latency.
``--min-latency 2 --max-latency 3 --latency-scale 1 --scorer-capacity 0`` is a remote judge of 2-3 s with ample
concurrency; ``--modality text --long-tail-alpha 1.2 --lora-rank 8`` the long tail (LoRA: hybrid one-step-off
snapshots a LoRA adapter only).

``--hybrid-switch both`` runs each fully async row twice in the same run, with the trainer device lending a hand to
generation when a step waits for groups (``trainer.v1.separate_async.hybrid_rollout.enable_switch``, rows ``...
switch``) and without; the trainer's busy fraction then counts the generation it did while lent
(``busy_fraction.trainer_lent``, also in ``trainer``), the rollout's only the rollout worker's batches.

``step1`` per mode: ``actor/ratio_mean`` and ``actor/pg_clipfrac_lower`` of the first training step (warm-up
included), as the trainer logs them (means over the step's mini-batches). Its first mini-batch scores the rollout's
samples before any optimizer step with the rollout's log-probs as pi_old (bypass mode), so with one mini-batch per
step (``--mini-batch`` = ``--batch``) a ratio other than 1 is a rollout/update mismatch.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_async.trainer.mode import MODE_OVERRIDES  # noqa: E402

# Steps run after the measured ones and not measured: a look-ahead mode's last step has no next rollout to start or
# wait for, so measuring it would flatter one-step-off.
TAIL_STEPS = 1
# The cores this benchmark may use (--pin-cores spreads the run's processes over them).
CORES = sorted(os.sched_getaffinity(0))
# --hybrid-switch: the trainer device lends a hand to generation when a step waits for groups (issue 39).
SWITCH_ON = "trainer.v1.separate_async.hybrid_rollout.enable_switch=true"
# Reported for the first training step of every mode (module docstring).
STEP1_KEYS = ("actor/ratio_mean", "actor/pg_clipfrac_lower")


def workload(args, data: Path) -> list[str]:
    modality = (
        [f"actor_rollout_ref.rollout.response_length={args.response_length}"]
        if args.modality == "text"
        else [
            f"actor_rollout_ref.rollout.height={args.size}",
            f"actor_rollout_ref.rollout.width={args.size}",
            f"actor_rollout_ref.rollout.num_inference_steps={args.denoise_steps}",
            f"actor_rollout_ref.rollout.algo.sde_window_range=[0,{min(5, args.denoise_steps)}]",
        ]
    )
    return [
        *modality,
        f"data.train_files={data}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={args.model}",
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.rollout.n={args.group}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch}",
        f"actor_rollout_ref.rollout.agent.max_batch_size={args.device_batch}",
        "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.simulated",
        f"+reward.custom_reward_function.reward_kwargs.latency_scale={args.latency_scale}",
        f"+reward.custom_reward_function.reward_kwargs.seed={args.seed}",
        f"+reward.custom_reward_function.reward_kwargs.capacity={args.scorer_capacity}",
        "reward.num_workers=1",
        f"+reward.custom_reward_function.reward_kwargs.min_latency_s={args.min_latency}",
        f"+reward.custom_reward_function.reward_kwargs.max_latency_s={args.max_latency}",
        *(
            [f"reward.max_inflight_per_worker={args.reward_inflight}", f"reward.queue_size={args.reward_inflight}"]
            if args.reward_inflight is not None
            else []
        ),
        f"trainer.seed={args.seed}",
        f"trainer.total_training_steps={args.warmup + args.steps + max(TAIL_STEPS, getattr(args, 'tail_steps', 0))}",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        *layout_overrides(args),
        *([f"actor_rollout_ref.model.lora_rank={args.lora_rank}"] if args.lora_rank is not None else []),
        *(["actor_rollout_ref.model.lora_alpha=16"] if args.modality == "image" else []),  # (text: the config's 16)
        *(
            [f"actor_rollout_ref.rollout.response_length_pareto_alpha={args.long_tail_alpha}"]
            if args.long_tail_alpha is not None
            else []
        ),
    ]


def layout_overrides(args) -> list[str]:
    if args.layout == "disaggregated":
        return [
            f"trainer.n_gpus_per_node={args.actor_ranks}",
            "actor_rollout_ref.rollout.nnodes=1",
            f"actor_rollout_ref.rollout.n_gpus_per_node={args.rollout_devices}",
            f"actor_rollout_ref.rollout.agent.num_workers={args.rollout_devices}",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ]
    return [
        f"actor_rollout_ref.hybrid_engine={args.layout == 'hybrid'}",
        f"trainer.n_gpus_per_node={args.actor_ranks}",
        f"actor_rollout_ref.rollout.agent.num_workers={args.actor_ranks}",
    ]


def pin_cores(trainer) -> dict[str, int]:
    """Each rollout worker and trainer rank (every thread of its process) on a core of its own, round robin.

    With a rollout pool (split / disaggregated layout) the run's other processes (the driver with its agent loop,
    the reward workers, Ray's daemons) go on the trainer ranks' cores, so a rollout worker's core is its own as a GPU
    would be (on the 2-core box they otherwise took turns on it with the rollout worker). In the hybrid layout every
    core generates and trains, so they stay unpinned."""
    import psutil
    import ray

    cores = CORES
    handles = list(trainer.placement.actor_wg.workers)
    if not trainer.layout.rollout_is_actor:
        handles = list(trainer.placement.rollout_workers) + handles

    def pin(self, core):
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {core})
        return os.getpid()

    pinned = {
        int(ray.get(h.__ray_call__.remote(pin, cores[i % len(cores)]))): cores[i % len(cores)]
        for i, h in enumerate(handles)
    }
    others = set(cores)  # (every core again after an earlier mode pinned the driver)
    if not trainer.layout.rollout_is_actor:
        rollout = {cores[i % len(cores)] for i in range(len(trainer.placement.rollout_workers))}
        others = (set(pinned.values()) - rollout) or others
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        if proc.pid in pinned:
            continue
        try:
            for t in proc.threads():
                os.sched_setaffinity(t.id, others)
        except (psutil.Error, OSError):  # gone, or a thread that ended meanwhile
            pass
    return {str(pid): core for pid, core in pinned.items()}


def ray_stats(handle) -> dict:
    import ray

    return ray.get(handle.stats.remote())


def process_roles(trainer) -> dict[str, set[int]]:
    """The pids of the run's processes by role (for :func:`cpu_by_role`); the hybrid layout's trainer ranks are its
    rollout workers too."""
    import ray

    def pids(handles) -> set[int]:
        return set(ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles]))

    p = trainer.placement
    roles = {"driver (agent loop, trainer loop)": {os.getpid()}}
    if trainer.layout.rollout_is_actor:
        roles["trainer ranks (also rollout)"] = pids(p.actor_wg.workers)
    else:
        roles["rollout workers"] = pids(p.rollout_workers)
        roles["trainer ranks"] = pids(p.actor_wg.workers)
    if getattr(trainer.reward, "workers", None):
        roles["reward workers"] = pids(trainer.reward.workers)
    return roles


def union_length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged(intervals))


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint sorted intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def rollout_idle(samples: list, spans: list[tuple[str, float, float]], window: tuple[float, float], steps: int) -> dict:
    """Where the rollout pool idled during the measured window (no device batch on any rollout worker), from the
    samples' timestamps: each idle gap's seconds split by what the trainer was doing meanwhile (its timer phases;
    ``between phases`` = the driver between two of them, e.g. from one step to the next) and by whether a request
    was waiting at a worker (sent, its batch not yet started: the worker's batcher or event loop) or none was out
    (the driver had not sent the next one: back-pressure or the step's schedule)."""
    lo, hi = window
    busy = [(max(a, lo), min(b, hi)) for a, b in merged([(s.times.gen_start, s.times.gen_end) for s in samples])]
    busy = [(a, b) for a, b in busy if b > a]
    edges = [lo] + [x for ab in busy for x in ab] + [hi]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
    by_phase: dict[str, float] = {}
    waiting = 0.0
    for g0, g1 in gaps:
        covered = 0.0
        for name, a, b in spans:
            overlap = min(b, g1) - max(a, g0)
            if overlap > 0:
                by_phase[name] = by_phase.get(name, 0.0) + overlap
                covered += overlap
        by_phase["between phases"] = by_phase.get("between phases", 0.0) + max(0.0, (g1 - g0) - covered)
        if any(s.times.requested is not None and s.times.requested <= g0 and s.times.gen_start >= g1 for s in samples):
            waiting += g1 - g0
    total = sum(b - a for a, b in gaps)
    return {
        "idle_s": total,
        "idle_s_per_step": total / max(steps, 1),
        "gaps": len(gaps),
        "by_trainer_phase_s": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
        "request_waiting_at_a_worker_s": waiting,
        "no_request_out_s": total - waiting,
    }


def cpu_snapshot() -> dict[int, tuple[bool, float]]:
    """CPU seconds (user + system) of every process on the box, and whether it belongs to this run (the driver's
    descendants: the Ray session it started, its workers and daemons)."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    out = {}
    for p in psutil.process_iter(["pid", "cpu_times"]):
        times = p.info["cpu_times"]
        if times is not None:
            out[p.info["pid"]] = (p.info["pid"] in ours, times.user + times.system)
    return out


def cpu_by_role(before: dict, after: dict, roles: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_snapshot` s, per role: the given pids' roles, ``ray (other)`` for
    the run's other processes (Ray's daemons, other workers), ``rest of the box`` for everything else."""
    out: dict[str, float] = {}
    for pid, (ours, t1) in after.items():
        used = t1 - before.get(pid, (ours, 0.0))[1]
        role = next((r for r, pids in roles.items() if pid in pids), None)
        if role is None:
            role = "ray (other)" if ours else "rest of the box"
        out[role] = out.get(role, 0.0) + max(0.0, used)
    return out


def run_mode(name: str, overrides: list[str], args, data: Path, out_dir: Path) -> dict:
    from omni_async.cluster import shutdown_ray
    from omni_async.trainer.config import compose
    from omni_async.trainer.loop import FlowGRPOTrainer

    shutdown_ray()
    cfg = compose(
        [*workload(args, data), f"trainer.run_dir={out_dir / name}", *overrides],
        config_name="grpo_text_trainer" if args.modality == "text" else "flowgrpo_trainer",
    )
    trainer = FlowGRPOTrainer(cfg)
    pinned = pin_cores(trainer) if args.pin_cores else {}
    roles = process_roles(trainer)
    trainer.sync_weights(0)
    steps, step1 = [], {}
    # Every sample of the run (warm-up and tail steps included: a look-ahead mode generates the next step's batch
    # during the measured ones) and every trainer phase, for the pools' busy time and the rollout's idle gaps.
    all_samples: list = []
    spans: list[tuple[str, float, float]] = []
    window = [float("inf"), 0.0]
    cpu: list[dict] = []
    try:
        # The run's every step: a fully async run's tail steps train what its rollouter generated during the
        # measured window (left out, that generation would count as the rollout pool idling).
        for step in range(args.warmup + args.steps + max(TAIL_STEPS, getattr(args, "tail_steps", 0))):
            t_start = time.time()
            if step == args.warmup:
                cpu.append(cpu_snapshot())
            metrics, samples = trainer.train_step(step)
            all_samples += samples
            spans += [(p["phase"], p["start"], p["end"]) for p in trainer.last_timeline["trainer"]]
            if step == 0:
                step1 = {k: metrics.get(k) for k in STEP1_KEYS}
            if not args.warmup <= step < args.warmup + args.steps:
                continue
            window = [min(window[0], t_start), time.time()]
            if step == args.warmup + args.steps - 1:
                cpu.append(cpu_snapshot())
            t0 = trainer.last_timeline["t0"]
            ready = [s.times.gen_end - t0 for s in samples]
            latency = [s.outcome.extra["simulated_latency_s"] for s in samples]
            parts = {
                "rollout_s": metrics["timing_s/gen"],
                "latency_mean_s": statistics.fmean(latency),
                "train_s": metrics["timing_s/step"] - metrics["timing_s/collect_wait"] - metrics["timing_s/reward"],
                "last_s": fifo_makespan(ready, latency, args.scorer_capacity),
                "busy_s": fifo_makespan([0.0] * len(latency), latency, args.scorer_capacity),
                "work_s": sum(latency) / args.scorer_capacity if args.scorer_capacity > 0 else max(latency),
            }
            steps.append({"metrics": metrics, "parts": parts, "samples": len(samples)})
            print(f"  {name:20s} step {step + 1}: {metrics['timing_s/step']:.2f}s", flush=True)
        batch_sizes = [ray_stats(h)["batch_sizes"] for h in trainer.placement.rollout_workers]
    finally:
        trainer.close()
        shutdown_ray()
    med = lambda key: statistics.median(s["metrics"].get(key, 0.0) for s in steps)  # noqa: E731
    timing_keys = [
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/reward_wait",
        "timing_s/collect_wait",
        "timing_s/update_actor",
        "timing_s/weight_sync",
        "timing_s/update_weights",
        "timing_s/wait_next_rollout",
        "weight_sync/bytes",
        "training/off_policy/trajectory_staleness/mean",
        "timing_s/reward_compute/mean",
        "timing_s/reward_compute/max",
        "timing_s/stream_overhead/median",
        "training/off_policy/trajectory_staleness/max",
        "fully_async/rollouter/idle_ratio",
        "fully_async/trainer/idle_ratio",
        "fully_async/count/dropped_stale_samples",
        "fully_async/static/max_required_samples",
        "timing_s/old_log_prob",
        "timing_s/switch_wait",
        "timing_s/switch_to_rollout",
        "timing_s/switch_to_trainer",
        "separate_async/switch/lent_busy_seconds",
        "separate_async/switch/drain_seconds",
    ]
    step_s = [s["metrics"]["timing_s/step"] for s in steps]
    wall = max(window[1] - window[0], 1e-9)

    def busy(spans: list[tuple[float, float]]) -> float:
        return union_length(
            [(max(a, window[0]), min(b, window[1])) for a, b in spans if b > window[0] and a < window[1]]
        )

    # Samples a lent trainer device made (hybrid_rollout.enable_switch) are the trainer pool's generation work.
    rollout_busy = busy([(s.times.gen_start, s.times.gen_end) for s in all_samples if not s.lent])
    lent_busy = busy([(s.times.gen_start, s.times.gen_end) for s in all_samples if s.lent])
    n_steps = len(steps)
    cpu_s = cpu_by_role(cpu[0], cpu[1], roles) if len(cpu) == 2 else {}
    trainer_busy = (
        sum(
            s["metrics"].get(k, 0.0)
            for s in steps
            for k in ("timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights")
        )
        + lent_busy
    )
    return {
        "layout": args.layout,
        "pinned_cores": pinned,
        "overrides": overrides,
        "wall_s": wall,
        "samples": sum(s["samples"] for s in steps),
        "trainer_busy_s": trainer_busy,
        "rollout_busy_s": rollout_busy,
        "lent_busy_s": lent_busy,
        "switch": SWITCH_ON in overrides,
        "latency_mean_s": statistics.fmean(s["parts"]["latency_mean_s"] for s in steps),
        "samples_per_s": sum(s["samples"] for s in steps) / wall,
        # trainer: update + weight sync + the generation it did while lent (trainer_lent, also inside trainer)
        "busy_fraction": {
            "rollout": rollout_busy / wall,
            "trainer": trainer_busy / wall,
            "trainer_lent": lent_busy / wall,
        },
        "lent_samples": sum(s["metrics"].get("separate_async/switch/lent_samples", 0.0) for s in steps),
        "switches": sum(s["metrics"].get("separate_async/switch/count", 0.0) for s in steps),
        # Issue 29's bound max(generation, update + weight sync) from this mode's own run, per step: the rollout
        # pool's busy time (its device batches) and the trainer's (update + sync), so mean step / own bound is how
        # far the schedule is from keeping the busier pool busy, whatever the contention made each side cost.
        "own_bound_s": max(rollout_busy, trainer_busy) / max(n_steps, 1),
        "rollout_idle": rollout_idle([s for s in all_samples if not s.lent], spans, (window[0], window[1]), n_steps),
        "cpu_s_per_step": {k: v / max(n_steps, 1) for k, v in sorted(cpu_s.items(), key=lambda kv: -kv[1])},
        "rollout_batch_sizes": {
            str(k): sum(b.count(k) for b in batch_sizes) for k in sorted({x for b in batch_sizes for x in b})
        },
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "mean_step_s": statistics.fmean(step_s),
        "timing": {k: med(k) for k in timing_keys if any(k in s["metrics"] for s in steps)},
        "parts_per_step": [s["parts"] for s in steps],
        "reward_mean": [s["metrics"]["critic/rewards/mean"] for s in steps],
        "policy_version_lag": med("async_reward/policy_version_lag"),
        "throughput": med("perf/samples_per_s"),
        "samples_per_rank": med("perf/samples_per_rank"),
        "step1": step1,
    }


def fifo_makespan(ready: list[float], latency: list[float], capacity: int) -> float:
    """When the last of the samples is scored by a FIFO service of ``capacity`` servers (0 = unlimited)."""
    if capacity <= 0:
        return max(r + lat for r, lat in zip(ready, latency, strict=True))
    free = [0.0] * capacity
    end = 0.0
    for r, lat in sorted(zip(ready, latency, strict=True)):
        start = max(r, heapq.heappop(free))
        heapq.heappush(free, start + lat)
        end = max(end, start + lat)
    return end


def bounds(p: dict, minibatches: int, shared_devices: bool = False) -> dict[str, float]:
    """Every mode's lower bound for one step, from that step's sync-run parts (see the module docstring).

    ``shared_devices`` (hybrid layout): generation and update take turns on every device, so the overlapped modes
    can hide only the reward: max(rollout + train, work)."""
    ready = max(p["rollout_s"], p["last_s"])
    overlapped = (
        max(p["rollout_s"] + p["train_s"], p["work_s"])
        if shared_devices
        else max(p["rollout_s"], p["train_s"], p["work_s"])
    )
    return {
        "sync": p["rollout_s"] + p["busy_s"] + p["train_s"],
        "stream": ready + p["train_s"],
        "stream+pipeline": ready + p["train_s"] / minibatches,
        "stream+one_step_off": overlapped,
        "all": overlapped,
    }


def reward_inflight(args) -> int:
    """The reward-loop worker's concurrent calls in this run: ``--reward-inflight`` or the shipped config's."""
    if args.reward_inflight is not None:
        return int(args.reward_inflight)
    from omegaconf import OmegaConf

    return int(OmegaConf.load(ROOT / "omni_async/config/flowgrpo_trainer.yaml").reward.max_inflight_per_worker)


def fully_async_bound(
    r: dict, in_flight_samples: float, step_samples: int, capacity: int = 0, reward_inflight: int = 0
) -> dict[str, float]:
    """A row's throughput bounds from its own run, samples/s (the smallest is the bound):

    - latency-bound: samples in flight / (judge latency + generation + update), with the generation and update
      time of one step's samples (for the lock-step modes ``timing_s/gen`` and ``timing_s/update_actor``; for
      fully async the pools' busy time per step's worth of samples);
    - device-bound: samples / max(rollout busy s, trainer busy s) when the two pools are separate (disaggregated;
      with the switch on, samples / max(update s, (generation s + update s) / 2): generation may run on both),
      samples / (rollout busy s + trainer busy s) / devices when both jobs share the devices (hybrid: generation
      and update take turns on each device);
    - judge-bound: the calls served at once / mean judge latency, where that is the smaller of the judge's
      capacity (``--scorer-capacity`` > 0) and the reward-loop worker's ``reward.max_inflight_per_worker``
      (``reward_inflight``; one worker here).
    """
    n = r["samples"]
    gen = r["rollout_busy_s"] / n * step_samples
    upd = r["trainer_busy_s"] / n * step_samples
    latency = in_flight_samples / (r["latency_mean_s"] + gen + upd)
    if r["layout"] == "disaggregated" and r.get("switch"):
        # the trainer device also generates: the update stays on it, generation spreads over both devices
        update = r["trainer_busy_s"] - r["lent_busy_s"]
        device = n / max(update, (r["rollout_busy_s"] + r["trainer_busy_s"]) / 2)
    elif r["layout"] == "disaggregated":
        device = n / max(r["rollout_busy_s"], r["trainer_busy_s"])
    else:  # hybrid: each of the 2 devices generates and updates in turn, its half of the samples
        device = n / (r["rollout_busy_s"] / 2 + r["trainer_busy_s"])
    limits = [c for c in (capacity, reward_inflight) if c > 0]
    judge = min(limits) / r["latency_mean_s"] if limits else None
    return {
        "latency_bound": latency,
        "device_bound": device,
        "judge_bound": judge,
        "bound": min(latency, device, judge if judge is not None else latency),
        "in_flight_samples": in_flight_samples,
    }


def compare_fully_async(args, staleness: list[float]) -> None:
    """Fully async (disaggregated: 1 rollout + 1 trainer device) at each staleness against the hybrid layout's
    colocated sync and one-step-off on the same 2 devices (2 ranks), each process pinned to its own core."""
    from argparse import Namespace

    from omni_async.trainer.mode import fully_async_overrides

    # A run ends with steps that train what is already generated (one-step-off's last step has no look-ahead; fully
    # async's last ceil(1 + s) updates drain the rollouter): they run after the measured steps (``tail_steps`` in
    # the run's total, not measured), so each row is measured in its steady state.
    hybrid = Namespace(**{**vars(args), "layout": "hybrid", "actor_ranks": 2, "tail_steps": 1})
    disagg = Namespace(**{**vars(args), "layout": "disaggregated", "actor_ranks": 1, "rollout_devices": 1})
    per_update = args.batch // args.mini_batch
    step_samples = args.batch * args.group
    rows = {
        "colocated sync": (hybrid, MODE_OVERRIDES["sync"], step_samples),
        "hybrid one-step-off": (hybrid, MODE_OVERRIDES["stream+one_step_off"], 2 * step_samples),
    }
    for st in staleness:  # one update = one lock-step step's prompts (require_batches mini-batches)
        cap = int((1 + st) * per_update * args.mini_batch)  # groups per window (K = 1)
        disagg_s = Namespace(**{**vars(disagg), "tail_steps": math.ceil(1 + st)})
        # text: verl's partial rollout (default) continues a response in flight at a sync under the new weights;
        # off, the rollout worker lets it finish first and takes no new request meanwhile (its long tail idles rows)
        text = (
            [f"async_training.partial_rollout={str(args.partial_rollout).lower()}"] if args.modality == "text" else []
        )
        fully = [*fully_async_overrides(st), *text, f"async_training.require_batches={per_update}"]
        if args.hybrid_switch in ("off", "both"):
            rows[f"fully_async s={st:g}"] = (disagg_s, fully, cap * args.group)
        if args.hybrid_switch in ("on", "both"):  # the trainer device lends a hand to generation (issue 39)
            rows[f"fully_async s={st:g} switch"] = (disagg_s, [*fully, SWITCH_ON], cap * args.group)
    load = {"before": os.getloadavg()}
    t0 = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text(
            "".join(
                json.dumps(
                    {
                        "prompt": f"a sign that says WORD{i}",
                        "data_source": "bench",
                        "reward_model": {"ground_truth": f"WORD{i}"},
                    }
                )
                + "\n"
                for i in range(256)
            )
        )
        inflight = reward_inflight(args)
        for name, (a, overrides, in_flight) in rows.items():
            results[name] = run_mode(name.replace(" ", "_").replace("=", ""), overrides, a, data, Path(tmp) / "runs")
            results[name].update(
                fully_async_bound(results[name], in_flight, step_samples, args.scorer_capacity, inflight)
            )
    load["after"] = os.getloadavg()
    base = results["hybrid one-step-off"]["samples_per_s"]
    for name, r in results.items():
        r["x_one_step_off"] = r["samples_per_s"] / base
        if name.endswith(" switch") and name.removesuffix(" switch") in results:  # issue 39: on over off
            r["x_switch_off"] = r["samples_per_s"] / results[name.removesuffix(" switch")]["samples_per_s"]
    report = {
        "rows": results,
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "load_average": load,
            "cpu_count": os.cpu_count(),
            "wall_s": time.time() - t0,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"\n{'row':24s} {'samples/s':>9s} {'x 1-off':>7s} {'bound/s':>8s} {'lat.b':>6s} {'dev.b':>6s} {'judge':>6s} "
        f"{'rollout':>7s} {'trainer':>7s} {'lent':>5s} {'lag max':>7s}"
    )
    for name, r in results.items():
        print(
            f"{name:24s} {r['samples_per_s']:9.2f} {r['x_one_step_off']:7.2f} {r['bound']:8.2f} "
            f"{r['latency_bound']:6.2f} {r['device_bound']:6.2f} {r['judge_bound'] or float('inf'):6.2f} "
            f"{r['busy_fraction']['rollout']:7.2f} "
            f"{r['busy_fraction']['trainer']:7.2f} "
            f"{r['busy_fraction']['trainer_lent']:5.2f} "
            f"{r['timing'].get('training/off_policy/trajectory_staleness/max', 0.0):7.1f}"
        )
    print(f"\nwritten: {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modality", choices=["image", "text"], default="image")
    p.add_argument("--model", default=None, help="default: tiny:qwen_image (image), tiny:qwen2 (text)")
    p.add_argument("--response-length", type=int, default=64, help="text: max new tokens")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--denoise-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--mini-batch", type=int, default=2, help="prompts per optimizer step")
    p.add_argument("--device-batch", type=int, default=4, help="rollout request batching (max_batch_size)")
    p.add_argument("--latency-scale", type=float, default=1 / 40)
    p.add_argument("--scorer-capacity", type=int, default=8, help="requests the scorer serves at once (0 = no limit)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--layout",
        default="split",
        help="split: rollout replicas beside the actor (hybrid_engine=False); hybrid: one process per device; "
        "disaggregated: rollout workers on their own pool (rollout.nnodes=1); a comma list runs each "
        "on the same devices and writes them side by side",
    )
    p.add_argument("--rollout-devices", type=int, default=1, help="disaggregated: rollout workers (devices)")
    p.add_argument("--pin-cores", action="store_true", help="each rollout worker / trainer rank on its own core")
    p.add_argument("--long-tail-alpha", type=float, default=None, help="text: response_length_pareto_alpha")
    p.add_argument(
        "--actor-ranks",
        type=int,
        choices=[1, 2],
        default=1,
        help="data-parallel actor ranks (trainer.n_gpus_per_node; one rollout worker each)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="actor_rollout_ref.model.lora_rank (default: image 8, alpha 16, the config's default when the "
        "results in bench/results were measured; text the config's, a full fine-tune, which the hybrid layout's "
        "one-step-off refuses)",
    )
    p.add_argument("--modes", default=",".join(MODE_OVERRIDES))
    p.add_argument("--min-latency", type=float, default=1.0, help="simulated scorer: min latency before scaling")
    p.add_argument("--max-latency", type=float, default=40.0, help="simulated scorer: max latency before scaling")
    p.add_argument(
        "--reward-inflight",
        type=int,
        default=None,
        help="reward.max_inflight_per_worker and queue_size (default: config's 32 / 64)",
    )
    p.add_argument(
        "--fully-async-staleness",
        default=None,
        help="e.g. 0.5,1,2,3: compare fully async (disaggregated, 1+1 devices) at these thresholds with "
        "colocated sync and hybrid one-step-off (2 ranks); ignores --modes / --layout",
    )
    p.add_argument(
        "--partial-rollout",
        choices=["true", "false"],
        default="true",
        help="text, fully async rows: async_training.partial_rollout (verl's default true)",
    )
    p.add_argument(
        "--hybrid-switch",
        choices=["off", "on", "both"],
        default="off",
        help="--fully-async-staleness rows: trainer.v1.separate_async.hybrid_rollout.enable_switch (both: each row "
        "twice, switch off and on, in one run)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/async_reward.json")
    args = p.parse_args()
    args.model = args.model or ("tiny:qwen2" if args.modality == "text" else "tiny:qwen_image")
    if args.lora_rank is None and args.modality == "image":
        args.lora_rank = 8  # LoRA r8 / alpha 16: the image runs' recorded results (the config's default is now 0)
    args.partial_rollout = args.partial_rollout == "true"
    if args.fully_async_staleness:
        compare_fully_async(args, [float(x) for x in args.fully_async_staleness.split(",")])
        return
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODE_OVERRIDES):
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODE_OVERRIDES)}")
    if bad := set(args.layout.split(",")) - {"split", "hybrid", "disaggregated"}:
        p.error(f"--layout: unknown {sorted(bad)}; choose from split, hybrid, disaggregated")
    if "sync" not in modes:
        p.error("--modes must include sync: every figure is relative to the sync baseline of the same run")

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text(
            "".join(
                json.dumps(
                    {
                        "prompt": f"a sign that says WORD{i}",
                        "data_source": "bench",
                        "reward_model": {"ground_truth": f"WORD{i}"},
                    }
                )
                + "\n"
                for i in range(256)
            )
        )
        t0 = time.time()
        layouts = args.layout.split(",")
        reports = {lay: layout_report(lay, modes, args, data, Path(tmp) / "runs" / lay) for lay in layouts}
    minibatches = args.batch // args.mini_batch
    config = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "minibatches": minibatches,
        "machine": f"{platform.machine()} {platform.processor()}",
        "load_average_at_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "wall_s": time.time() - t0,
        "bound_parts_from": "sync run of the same layout, per step",
        "hidden_fraction_on": "mean step times",
    }
    report = {**reports[layouts[0]], "config": config} if len(layouts) == 1 else {"layouts": reports, "config": config}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for lay in layouts:
        print_table(lay, reports[lay])
    print(f"\nwritten: {args.out}")


def layout_report(lay: str, modes: list[str], args, data: Path, runs: Path) -> dict:
    """Every mode on one layout, with bounds and hidden fractions from that layout's own sync run. In a comparison
    (``--layout hybrid,disaggregated``) a hybrid or split layout gets as many actor ranks as the disaggregated one
    has devices in all (rollout + trainer), so both run on the same devices."""
    own = argparse.Namespace(**{**vars(args), "layout": lay})
    if lay != "disaggregated" and "disaggregated" in args.layout.split(","):
        own.actor_ranks = args.rollout_devices + args.actor_ranks
    results = {name: run_mode(name, MODE_OVERRIDES[name], own, data, runs) for name in modes}
    minibatches = args.batch // args.mini_batch
    per_step = [bounds(p, minibatches, shared_devices=lay == "hybrid") for p in results["sync"]["parts_per_step"]]
    t_sync = results["sync"]["mean_step_s"]
    hidden = {}
    for name, r in results.items():
        r["bound_s"] = statistics.fmean(b[name] for b in per_step)
        r["ratio_to_sync"] = r["median_step_s"] / results["sync"]["median_step_s"]
        if name != "sync":
            hideable = t_sync - r["bound_s"]
            hidden[name] = (t_sync - r["mean_step_s"]) / hideable if hideable > 1e-9 else float("nan")
        r["to_bound"] = r["mean_step_s"] / r["bound_s"]
    return {
        "modes": results,
        "hidden_fraction": hidden,
        "devices": {
            "actor_ranks": own.actor_ranks,
            "rollout_devices": own.rollout_devices if lay == "disaggregated" else 0,
        },
    }


def print_table(lay: str, report: dict) -> None:
    results, hidden = report["modes"], report["hidden_fraction"]
    print(f"\nlayout {lay} ({report['devices']})")
    print(
        f"{'mode':22s} {'median step s':>13s} {'x sync':>7s} {'mean step s':>11s} {'bound s':>8s} {'hidden':>7s} "
        f"{'overhead ms':>11s} {'step-1 ratio':>12s} {'clipfrac_lower':>14s} {'own bound':>9s} {'rollout busy':>12s} "
        f"{'idle s/step':>11s}"
    )
    for name, r in results.items():
        ovh = r["timing"].get("timing_s/stream_overhead/median")
        print(
            f"{name:22s} {r['median_step_s']:13.2f} {r['ratio_to_sync']:7.2f} {r['mean_step_s']:11.2f} "
            f"{r['bound_s']:8.2f} {hidden.get(name, float('nan')):7.2f} "
            f"{'' if ovh is None else f'{ovh * 1000:.2f}':>11s} {_fmt(r['step1'], STEP1_KEYS[0]):>12s} "
            f"{_fmt(r['step1'], STEP1_KEYS[1]):>14s} {r['own_bound_s']:9.2f} {r['busy_fraction']['rollout']:12.2f} "
            f"{r['rollout_idle']['idle_s_per_step']:11.2f}"
        )


def _fmt(values: dict, key: str) -> str:
    return "" if values.get(key) is None else f"{values[key]:.6f}"


if __name__ == "__main__":
    main()
