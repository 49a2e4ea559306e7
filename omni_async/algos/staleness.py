"""Freshness control of fully async training, as numbers (no Ray, no asyncio).

Symbols: ``s`` = ``async_training.staleness_threshold``, ``K`` = ``trigger_parameter_sync_step`` (updates between
weight syncs), ``R`` = ``require_batches``, ``m`` = ``ppo_mini_batch_size`` (prompts = GRPO groups). One update
(one trainer step) takes ``n = R * m`` groups; a sync window is ``K`` updates, ``W = K * n`` groups.

The weights version of a sample is the trainer step whose weights generated it (the project's convention: the
version synced after ``v`` updates is ``v``); a text response continued across a sync (partial rollout) has the
version of its first token, its oldest (verl's ``param_version_start``); a group's version is its oldest member's.
Its lag when trained at step ``v`` is ``v - version``: verl v1's ``trajectory_staleness_worst`` (equal to its
``trajectory_staleness``, measured from the newest version, unless a partial rollout spans versions). Every bound
here limits this lag, so no token of a trained sample is older than the bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def groups_per_window(staleness_threshold: float, sync_steps: int, require_batches: int, mini_batch: int) -> int:
    """verl's ``max_required_samples``: groups the rollouter may start per sync window, counting those still
    unconsumed from the previous window::

        cap = floor((1 + s) * K * R * m)

    ``s = 0`` gives ``W``: synchronous; ``s = 1``: one window ahead (one-step-off when ``K = 1``).
    """
    return int((1.0 + float(staleness_threshold)) * int(sync_steps) * int(require_batches) * int(mini_batch))


def lag_bound(cap: int, groups_per_update: int) -> int:
    """The largest lag a trained group can have when at most ``cap`` groups are started per window and the
    trainer takes the oldest first::

        B = ceil(cap / n) - 1

    A group started in the window after the sync at step ``g`` is among at most ``cap`` groups (the window's and
    the ones left over) and the trainer takes ``n`` per step, so it is trained by step ``g + ceil(cap / n) - 1``.
    ``cap >= W`` makes ``B >= K - 1`` (every update of a window trains on that window's version at least).
    """
    return math.ceil(int(cap) / int(groups_per_update)) - 1


def effective_bound(cap: int, groups_per_update: int, max_off_policy_threshold: int | None) -> tuple[int, int]:
    """``(cap, B)`` with verl v1's version span ``v - g + 1 <= T`` (``trainer.v1.sampler.max_off_policy_threshold``)
    folded in: ``B' = min(B, T - 1)`` and the production cap lowered to what ``B'`` can absorb, ``cap' = min(cap,
    (B' + 1) * n)``, so the rollouter does not start groups that could only be dropped."""
    bound = lag_bound(cap, groups_per_update)
    if max_off_policy_threshold is None:
        return int(cap), bound
    bound = min(bound, int(max_off_policy_threshold) - 1)
    return min(int(cap), (bound + 1) * int(groups_per_update)), bound


def feedback_rounds(group_versions: Iterable[int]) -> int:
    """How many rounds of sampling, scoring and training stand behind a step's data: ``1 + max g`` over the weights
    versions ``g`` of the groups the step trains on. In a lock-step run step ``k`` (1-based) trains on version
    ``k - 1`` and this is ``k``; trained late, it is the step less the newest group's lag (at staleness 3 in steady
    state ``k - 3``, and 1 for each of the first four steps, which all train on version 0's samples). DiffusionNFT's
    old-policy ramp counts these (:func:`omni_async.algos.diffusion_nft.old_policy_decay`)."""
    versions = [int(v) for v in group_versions]
    if not versions:
        raise ValueError("feedback_rounds: a step trains on at least one group; got none")
    return 1 + max(versions)
