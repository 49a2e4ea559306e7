"""Trainer devices lending a hand to generation, on simulated devices (issue 52 item 4).

    .venv/bin/python bench/switch_sim.py --workload long_tail_text|update_heavy|image_batches --out FILE [--steps 8]

Fully async training on the disaggregated layout, 1 rollout + 1 trainer device, run twice in one process: with
``trainer.v1.separate_async.hybrid_rollout.enable_switch`` off, then on. The devices are simulated
(``actor_rollout_ref.model.path=sim:text``, ``omni_async.models.sim_policy``; ``sim:image``,
``omni_async.models.sim_image_policy``): a decode step or an image batch and the update's forward + backward are
timed waits that hold no CPU, as GPU kernels, so what the switch gains or costs is not hidden
by this box's 2 cores (the CPU measurements: docs/fully_async.md). Everything else is the product as it ships: the
driver, the rollouter, the agent loop, the reward-loop worker (a simulated remote scorer), the switch policy, the
weight syncs over Ray, the metrics.

Workloads (:data:`WORKLOADS`; the device times are ``sim:text``'s and ``sim:image``'s ``override_config`` keys):

- ``long_tail_text``: responses of up to 128 tokens with a Pareto(1.2) length tail (a tenth of that up to all of
  it, mean ~36), up to 8 rows per decode step of 10 ms + 1.25 ms a row (a large model's decode step on a GPU); an
  update of 0.5 ms per response token. The rollout device is the busier one: generation ~3 s a step (32 responses,
  ~1,150 tokens), the update ~0.6 s.
- ``update_heavy``: 32-token responses, no tail; an update of 4 ms per response token. The trainer device is the
  busier one (update ~4 s a step, generation ~2.6 s): the switch should cost little.
- ``image_batches``: text-to-image on ``sim:image`` (the image modality's batcher, batches of up to 8 images, an SDE
  window of 2 steps): a device batch of 0.2 s + 0.1 s an image (a step's 32 images ~4 s), an update of 20 ms per
  sample and window step (~1.3 s a step, its pi_old recompute a third more). The rollout device is the busier one;
  an image batch cannot stop between tokens, so a switch back waits for the lent batch to end.

Device times of this size keep the host's share (the driver's, the reward worker's: milliseconds of CPU a sample)
small beside them, as on GPUs; on this shared 2-core box that CPU time still stretches under load, so each JSON
records the load average.

A step is 8 groups of 4 (``require_batches`` 2 x ``ppo_mini_batch_size`` 4), staleness 2 (``--staleness``), a sync
every update. Measured: ``--warmup`` steps unmeasured, then ``--steps`` steps, then ``--tail`` unmeasured ones (they train what
the rollouter made ahead during the measured ones). ``samples_per_s`` = samples trained in the measured steps over
their wall time; ``busy`` = each device's waits (its own clock, :class:`~omni_async.models.sim_policy.DeviceClock`)
inside that window over it, the trainer's counting the generation it did while lent. Output JSON:
``{"off": {"samples_per_s", "busy": {"rollout", "trainer"}, ...}, "on": {...}, "switches": N, "x_off": on/off, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SWITCH_ON = "trainer.v1.separate_async.hybrid_rollout.enable_switch=true"


# Per measured step in the JSON: where its time went and what the switch did.
STEP_KEYS = (
    "timing_s/step",
    "timing_s/collect_wait",
    "timing_s/switch_to_rollout",
    "timing_s/switch_wait",
    "timing_s/switch_to_trainer",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "separate_async/decision/sampleable_count",
    "separate_async/decision/waiting_samples",
    "separate_async/switch/lent_samples",
    "separate_async/switch/requeued",
    "separate_async/switch/continued",
    "separate_async/switch/drain_seconds",
)


def timings(**seconds: float) -> list[str]:
    return [f"++actor_rollout_ref.model.override_config.{k}={v}" for k, v in seconds.items()]


WORKLOADS: dict[str, list[str]] = {
    "long_tail_text": [
        "actor_rollout_ref.rollout.response_length=128",
        "actor_rollout_ref.rollout.response_length_pareto_alpha=1.2",
        *timings(token_s=0.01, row_token_s=0.00125, prefill_s=0.01, update_token_s=0.0005),
    ],
    "update_heavy": [
        "actor_rollout_ref.rollout.response_length=32",
        *timings(token_s=0.01, row_token_s=0.00125, prefill_s=0.01, update_token_s=0.004),
    ],
    "image_batches": [
        "actor_rollout_ref.model.path=sim:image",
        "actor_rollout_ref.rollout.height=32",
        "actor_rollout_ref.rollout.width=32",
        "actor_rollout_ref.rollout.num_inference_steps=4",
        "actor_rollout_ref.rollout.algo.sde_window_size=2",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
        *timings(batch_s=0.2, image_s=0.1, update_step_s=0.02),
    ],
}
# The trainer config each workload's modality starts from (sim:text's unless named here).
CONFIG_NAMES = {"image_batches": "flowgrpo_trainer"}


def base_overrides(train_file: Path, steps: int, staleness: float = 2, seed: int = 7) -> list[str]:
    """Fully async on 1 rollout + 1 trainer simulated device (module docstring); ``steps``: the run's every step."""
    return [
        f"data.train_files={train_file}",
        "data.shuffle=false",
        "actor_rollout_ref.model.path=sim:text",
        "actor_rollout_ref.model.lora_rank=8",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "async_training.require_batches=2",
        f"async_training.staleness_threshold={staleness:g}",
        "actor_rollout_ref.rollout.agent.max_batch_size=8",
        # the disaggregated layout: one rollout device, one trainer device
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # fully async (verl v1's separate_async), a sync after every update, waiting rather than dropping
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.sampler.max_off_policy_strategy=wait",
        # a remote scorer of 20-100 ms a sample with ample concurrency (it is not what bounds the run)
        "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.simulated",
        "+reward.custom_reward_function.reward_kwargs.latency_scale=0.02",
        "+reward.custom_reward_function.reward_kwargs.min_latency_s=1.0",
        "+reward.custom_reward_function.reward_kwargs.max_latency_s=5.0",
        f"+reward.custom_reward_function.reward_kwargs.seed={seed}",
        "reward.num_workers=1",
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "trainer.log_image_freq=-1",
        "trainer.log_timeline_freq=-1",
    ]


def write_prompts(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "data_source": "x", "reward_model": {"ground_truth": ""}}) + "\n"
            for i in range(n)
        )
    )
    return path


def device_spans(handle: Any) -> list[tuple[float, float, str]]:
    """A simulated device's waits (``SimTextPolicy.busy``), read from its Ray actor."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: list(self.policy.busy.spans)))


def busy_in(spans: list[tuple[float, float, str]], start: float, end: float, what: str | None = None) -> float:
    """Seconds of the device's waits (of ``what``: generate / update, or all) inside ``[start, end]``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b, w in spans if what in (None, w))


def run(
    overrides: list[str], run_dir: Path, warmup: int, steps: int, tail: int, config_name: str = "grpo_text_trainer"
) -> dict[str, Any]:
    """One training run; the measured steps' samples/s, each device's busy fraction and the switch's metrics."""
    from omni_async.cluster import shutdown_ray
    from omni_async.trainer.config import compose
    from omni_async.trainer.loop import RLTrainer

    shutdown_ray()
    cfg = compose([*overrides, f"trainer.run_dir={run_dir}"], config_name=config_name)
    trainer = RLTrainer(cfg)
    measured: list[dict[str, float]] = []
    samples = 0
    try:
        trainer.sync_weights(0)
        start = end = 0.0
        for step in range(warmup + steps + tail):
            if step == warmup:
                start = time.time()
            metrics, got = trainer.train_step(step)
            if warmup <= step < warmup + steps:
                measured.append(metrics)
                samples += len(got)
                end = time.time()
        rollout = device_spans(trainer.placement.rollout_workers[0])
        actor = device_spans(trainer.placement.actor_wg.workers[0])
    finally:
        trainer.close()
        shutdown_ray()
    wall = end - start
    total = lambda key: sum(m.get(key, 0.0) for m in measured)  # noqa: E731
    return {
        "samples_per_s": samples / wall,
        "busy": {"rollout": busy_in(rollout, start, end) / wall, "trainer": busy_in(actor, start, end) / wall},
        # the trainer device's generation while lent (inside busy.trainer)
        "trainer_lent_busy": busy_in(actor, start, end, "generate") / wall,
        "samples": samples,
        "wall_s": wall,
        "step_s": [m["timing_s/step"] for m in measured],
        "switches": int(total("separate_async/switch/count")),
        "lent_samples": int(total("separate_async/switch/lent_samples")),
        "switch_wait_s": total("timing_s/switch_wait"),
        "switch_to_rollout_s": total("timing_s/switch_to_rollout"),
        "switch_to_trainer_s": total("timing_s/switch_to_trainer"),
        "collect_wait_s": total("timing_s/collect_wait"),
        "update_actor_s": total("timing_s/update_actor"),
        "per_step": [{k.split("/", 1)[1]: round(m[k], 4) for k in STEP_KEYS if k in m} for m in measured],
        "staleness_mean": sum(m.get("training/off_policy/trajectory_staleness/mean", 0.0) for m in measured)
        / max(len(measured), 1),
    }


def measure(
    workload: str,
    out_dir: Path,
    warmup: int = 2,
    steps: int = 8,
    tail: int = 2,
    staleness: float = 2,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The workload with the switch off, then on (same seeds, same prompts); ``extra``: overrides after the
    workload's (a test's shorter responses)."""
    train = write_prompts(out_dir / "train.jsonl", 64)
    base = [*base_overrides(train, warmup + steps + tail, staleness), *WORKLOADS[workload], *extra]
    config_name = CONFIG_NAMES.get(workload, "grpo_text_trainer")
    off = run(base, out_dir / "off", warmup, steps, tail, config_name)
    on = run([*base, SWITCH_ON], out_dir / "on", warmup, steps, tail, config_name)
    return {"off": off, "on": on, "switches": on["switches"], "x_off": on["samples_per_s"] / off["samples_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tail", type=int, default=2)
    p.add_argument("--staleness", type=float, default=2, help="async_training.staleness_threshold")
    args = p.parse_args()
    load_before = os.getloadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.workload, Path(tmp), args.warmup, args.steps, args.tail, args.staleness)
    result["config"] = {
        "workload": args.workload,
        "overrides": WORKLOADS[args.workload],
        "warmup": args.warmup,
        "steps": args.steps,
        "tail": args.tail,
        "staleness": args.staleness,
        "devices": f"1 rollout + 1 trainer, simulated ({'sim:image' if args.workload in CONFIG_NAMES else 'sim:text'})",
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("off", "on"):
        r = result[name]
        print(
            f"{name}: {r['samples_per_s']:.2f} samples/s, busy rollout {r['busy']['rollout']:.2f} "
            f"trainer {r['busy']['trainer']:.2f}, switches {r['switches']}"
        )
    print(f"on/off {result['x_off']:.3f}; written: {args.out}")


if __name__ == "__main__":
    main()
