"""Reward statistics per GRPO group, for metrics (the advantages themselves are in ``advantages``).

For the ok samples of each group g with at least 2 members::

    std_g          = sqrt(mean_i (r_i - mean_g r)^2)        (population std: how spread the group's rewards are)
    std_mean       = mean_g std_g
    zero_std_ratio = |{g : std_g = 0}| / |groups|           (groups that give no learning signal)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np


def group_reward_stats(scores: Sequence[float], uids: Sequence[str]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for score, uid in zip(scores, uids, strict=True):
        groups[uid].append(float(score))
    stds = [float(np.std(v)) for v in groups.values() if len(v) >= 2]
    return {
        "std_mean": float(np.mean(stds)) if stds else 0.0,
        "zero_std_ratio": float(np.mean([s == 0 for s in stds])) if stds else 0.0,
    }
