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
        "critic/rewards/mean": float(scores.mean()), "critic/rewards/max": float(scores.max()),
        "critic/rewards/min": float(scores.min()), "critic/rewards/std": float(scores.std()),
        "critic/rewards/std_mean": stats["std_mean"], "critic/rewards/zero_std_ratio": stats["zero_std_ratio"],
        "reward/failed": float(sum(s.outcome.status == "failed" for s in samples)),
        "reward/timed_out": float(sum(s.outcome.status == "timeout" for s in samples)),
        "reward/masked": float((~loss_mask.bool()).sum()),
        "timing_s/reward_compute/mean": float(compute.mean()), "timing_s/reward_compute/max": float(compute.max()),
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
