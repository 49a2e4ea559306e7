"""Group-relative advantages (GRPO) over samples sharing a prompt ``uid``.

For sample i in group g (samples of the same prompt that were scored successfully)::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)         per-group std (GRPO, default)
    A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)     global_std=True (std of all kept samples of the batch)
    A_i = r_i - mean_g(r)                              norm_by_std=False (Dr. GRPO)

then clipped to ``[-adv_clip_max, adv_clip_max]``. ``std`` is

- by default the biased (population, ddof=0) std with ``eps = 1e-4``: flow_grpo's ``PerPromptStatTracker``
  (``np.std(...) + 1e-4``, per prompt or, with ``global_std``, over the batch);
- with ``std_unbiased=True`` the unbiased (ddof=1) ``torch.std``: verl's ``compute_grpo_outcome_advantage``
  (which uses ``eps = 1e-6``) and verl-omni's ``compute_flow_grpo_outcome_advantage`` (``eps = 1e-4``).

The centring ``r_i - mean_g(r)`` is verl's ``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo=False``);
the std division is done here so that either std can be chosen. Masked samples (failed rewards) take no part in
any statistic; a group left with fewer than 2 kept samples has no baseline and is dropped (its samples masked).
A zero-std group gets advantage 0 (even with ``eps = 0``).
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
    epsilon: float = 1e-4,
    std_unbiased: bool = False,
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
        sub, sub_uids = scores[idx], uids[idx.numpy()]
        centred, _ = compute_grpo_outcome_advantage(
            sub.unsqueeze(-1), torch.ones_like(sub).unsqueeze(-1), sub_uids, norm_adv_by_std_in_grpo=False
        )
        centred = centred.squeeze(-1)
        if norm_by_std:
            ddof = 1 if std_unbiased else 0
            if global_std:
                std = sub.std(correction=ddof).expand_as(sub)
            else:
                group_std = {u: sub[torch.from_numpy(sub_uids == u)].std(correction=ddof) for u in set(sub_uids)}
                std = torch.stack([group_std[u] for u in sub_uids])
            centred = centred / (std + epsilon)
        # A zero-std group has centred scores of exactly 0; with eps=0 that is 0/0. It carries no signal: 0.
        adv[idx] = torch.nan_to_num(centred, nan=0.0)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv, kept
