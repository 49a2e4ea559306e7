"""Group-relative advantages (GRPO) over samples sharing a prompt ``uid``.

For sample i in group g (samples of the same prompt that were scored successfully)::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)         per-group std (GRPO, default)
    A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)     global_std=True (batch-wide std of the kept samples)
    A_i = r_i - mean_g(r)                              norm_by_std=False (Dr. GRPO)

then clipped to ``[-adv_clip_max, adv_clip_max]``. std is the unbiased sample std, as in verl. Masked samples
(failed rewards) take no part in any statistic; a group left with fewer than 2 kept samples has no baseline and
is dropped (its samples masked). The per-group arithmetic is verl's ``compute_grpo_outcome_advantage``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage


def group_advantages(
    scores: torch.Tensor,
    uids: Sequence[str] | np.ndarray,
    valid: torch.Tensor | None = None,
    *,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    global_std: bool = False,
    adv_clip_max: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(advantages [N], kept [N] bool)``; ``kept`` is ``valid`` minus groups smaller than 2."""
    scores = scores.detach().float().reshape(-1)
    uids = np.asarray(uids, dtype=object)
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.reshape(-1).bool()
    counts = Counter(u for u, ok in zip(uids, valid.tolist(), strict=True) if ok)
    kept = valid & torch.tensor([counts[u] >= 2 for u in uids], dtype=torch.bool)
    adv = torch.zeros_like(scores)
    if kept.any():
        idx = kept.nonzero().squeeze(-1)
        sub = scores[idx].unsqueeze(-1)
        centred, _ = compute_grpo_outcome_advantage(
            sub, torch.ones_like(sub), uids[idx.numpy()], epsilon=epsilon,
            norm_adv_by_std_in_grpo=norm_by_std and not global_std,
        )
        centred = centred.squeeze(-1)
        if norm_by_std and global_std:
            centred = centred / (scores[idx].std() + epsilon)
        # A zero-std group has centred scores of exactly 0; with eps=0 that is 0/0. It carries no signal: 0.
        adv[idx] = torch.nan_to_num(centred, nan=0.0)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv, kept
