"""A step's metrics from its samples: rewards, failures, retries, reward-call timings."""

from __future__ import annotations

import numpy as np
import torch

from omni_async.algos.group_stats import group_reward_stats
from omni_async.sample import Sample

# Per-sample counters a reward function may return in its dict (e.g. the HTTP scorer client's retries); each is
# summed over the step's samples into ``reward/<key>``.
SUMMED_EXTRA_COUNTERS = ("http_retries", "http_timeouts")


def reward_metrics(samples: list[Sample], loss_mask: torch.Tensor) -> dict[str, float]:
    ok = [s for s in samples if s.outcome.ok]
    scores = np.array([s.outcome.score for s in ok]) if ok else np.zeros(1)
    stats = group_reward_stats([s.outcome.score for s in ok], [s.uid for s in ok])
    compute = np.array([s.outcome.compute_s for s in samples])
    wait = np.array([s.outcome.wait_s for s in samples])
    m = {
        "critic/rewards/mean": float(scores.mean()),
        "critic/rewards/max": float(scores.max()),
        "critic/rewards/min": float(scores.min()),
        "critic/rewards/std": float(scores.std()),
        "critic/rewards/std_mean": stats["std_mean"],
        "critic/rewards/zero_std_ratio": stats["zero_std_ratio"],
        "reward/failed": float(sum(s.outcome.status == "failed" for s in samples)),
        "reward/timed_out": float(sum(s.outcome.status == "timeout" for s in samples)),
        "reward/masked": float((~loss_mask.bool()).sum()),
        "timing_s/reward_compute/mean": float(compute.mean()),
        "timing_s/reward_compute/max": float(compute.max()),
        "timing_s/reward_compute/p95": float(np.percentile(compute, 95)),
        "timing_s/reward_thread_wait/max": float(wait.max()),
    }
    overhead = [s.times.serialize_s + s.times.dispatch_s for s in samples if s.times.dispatch_s is not None]
    if overhead:  # streaming cost per sample: building its chunk + handing it to Ray (not queueing, not scoring)
        m["timing_s/stream_overhead/median"] = float(np.median(overhead))
    for key in SUMMED_EXTRA_COUNTERS:
        m[f"reward/{key}"] = float(sum(s.outcome.extra.get(key, 0) or 0 for s in samples))
    for key in {k for s in ok for k in s.outcome.extra if k.startswith("reward/")}:
        vals = [s.outcome.extra[key] for s in ok if isinstance(s.outcome.extra.get(key), (int, float))]
        if vals:
            m[key] = float(np.mean(vals))
    return m


def validation_metrics(samples: list[Sample]) -> dict[str, float]:
    """Validation rewards under verl's names: ``val-core/{data_source}/reward/mean@{n}`` (and ``best@n/*``,
    ``worst@n/*`` from verl's ``process_validation_metrics``, bootstrapped over each prompt's ``n`` samples);
    statistics that are not the core ones go under ``val-aux/``, as verl / verl-omni sort them. Failed reward calls
    are left out (as in training); ``val-aux/reward/failed`` counts them."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    ok = [s for s in samples if s.outcome.ok]
    out: dict[str, float] = {"val-aux/reward/failed": float(len(samples) - len(ok))}
    by_source = process_validation_metrics(
        [s.row.data_source for s in ok], [s.uid for s in ok], {"reward": [s.outcome.score for s in ok]}
    )
    for source, per_var in by_source.items():
        for var, stats in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in stats)
            for name, value in stats.items():
                core = name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(value)
    return out


def validation_reward_mean(row: dict) -> float | None:
    """The mean validation reward of a ``metrics.jsonl`` row: ``val-core/*/reward/mean@n`` averaged over data
    sources (one number for the reward curve), or ``None`` where the row has no validation. Rows of runs from
    earlier releases carry ``val/reward/mean`` instead."""
    vals = [v for k, v in row.items() if k.startswith("val-core/") and "/reward/mean@" in k]
    if not vals and "val/reward/mean" in row:
        vals = [row["val/reward/mean"]]
    return float(np.mean(vals)) if vals else None


def advantage_metrics(samples: list[Sample]) -> dict[str, float]:
    """verl's ``critic/advantages/{mean,max,min}`` over the samples in the loss. verl takes them over valid
    response tokens, so a text sample weighs as many times as it has response tokens; an image counts once."""
    kept = [s for s in samples if s.advantage is not None]
    if not kept:
        return {}
    adv = np.array([s.advantage for s in kept])
    weight = np.array([len(getattr(s.result, "response_ids", [None])) for s in kept], dtype=float)
    return {
        "critic/advantages/mean": float((adv * weight).sum() / max(weight.sum(), 1.0)),
        "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
    }


def response_length_metrics(samples: list[Sample], max_length: int) -> dict[str, float]:
    """Text: verl's ``response_length/{mean,max,min,clip_ratio}`` (clip_ratio: share of responses that reached
    ``rollout.response_length``)."""
    lengths = np.array([len(s.result.response_ids) for s in samples if s.result is not None])
    if lengths.size == 0:
        return {}
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_length).mean()),
    }


def throughput_metrics(samples: list[Sample], step_s: float, n_devices: int) -> dict[str, float]:
    """verl's / verl-omni's ``perf/throughput``: images (verl-omni) or prompt + response tokens (verl) per second
    per device of the run (all pools), with ``perf/total_num_images`` / ``perf/total_num_tokens`` and
    ``perf/time_per_step``; ``perf/samples_per_s`` (project-only) is the samples per second of all devices."""
    text = all(hasattr(s.result, "response_ids") for s in samples)
    if text:
        units = float(sum(len(s.result.prompt_ids) + len(s.result.response_ids) for s in samples))
        out = {"perf/total_num_tokens": units}
    else:
        units = float(len(samples))
        out = {"perf/total_num_images": units}
    return {
        **out,
        "perf/time_per_step": step_s,
        "perf/throughput": units / (step_s * max(n_devices, 1)),
        "perf/samples_per_s": len(samples) / step_s,
    }


def discard_metrics(step_metrics: dict[str, float]) -> dict[str, float]:
    """``training/discarded_samples``: the samples this step threw away, whatever the reason, from the step's counters:

    - ``rollout/discarded_at_sync``: generations in flight thrown away and started again. verl-omni aborts every
      diffusion sample in flight when it switches to training and regenerates it; here a sample in flight at a sync
      finishes under the version that started it (an image), or is continued (a text response, partial rollout), so
      this is 0 by construction, except a text response interrupted on a trainer rank lent to generation, going back
      to training, without partial rollout (its tokens are thrown away);
    - ``training/off_policy/dropped_samples``: the samples of groups dropped past the lag bound
      (``max_off_policy_strategy=drop``; fully async).

    (A rollout worker's death also makes samples generate again, counted in ``rollout/regenerated``: a failure.)"""
    return {
        "training/discarded_samples": float(
            step_metrics.get("rollout/discarded_at_sync", 0.0)
            + step_metrics.get("training/off_policy/dropped_samples", 0.0)
        )
    }


def off_policy_metrics(samples: list[Sample], step: int, partial: bool) -> dict[str, float]:
    """How old the trained samples' weights are, under verl v1's names (``verl/trainer/v1``): a trajectory spans the
    versions ``[oldest, newest]`` that generated its tokens (``Sample.version_span``; one version unless a partial
    rollout continued it across a sync), and is trained at version ``step``:

    - ``training/off_policy/trajectory_staleness/*``: ``step - newest`` (verl v1's primary staleness, a lower bound)
    - ``training/off_policy/trajectory_staleness_worst/*``: ``step - oldest`` (what the lag bound limits)
    - ``training/off_policy/trajectory_spans/*``: ``newest - oldest + 1`` versions in one trajectory

    ``partial`` (fully async): verl's fully-async ``fully_async/partial/{total_partial_num, partial_ratio,
    max_partial_span}``: trajectories continued across a sync, their share, the largest ``newest - oldest``."""
    span = np.array([s.version_span for s in samples], dtype=np.float64)
    oldest, newest = span[:, 0], span[:, 1]
    out = {}
    for name, v in (
        ("trajectory_staleness", step - newest),
        ("trajectory_staleness_worst", step - oldest),
        ("trajectory_spans", newest - oldest + 1),
    ):
        out[f"training/off_policy/{name}/mean"] = float(v.mean())
        out[f"training/off_policy/{name}/max"] = float(v.max())
    if partial:
        diff = newest - oldest
        out["fully_async/partial/total_partial_num"] = float((diff > 0).sum())
        out["fully_async/partial/partial_ratio"] = float((diff > 0).mean())
        out["fully_async/partial/max_partial_span"] = float(diff.max())
    return out
