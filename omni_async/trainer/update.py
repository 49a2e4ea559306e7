"""A step's update, the same in every mode: take the step's groups from the producer in chunks, train each chunk as
it comes, then the further epochs.

A chunk is the whole step (``mode.pipelined`` off) or ``ppo_mini_batch_size`` groups as soon as they are scored (the
mini-batch pipeline: advantages per group, so a chunk needs only its own groups). Each chunk: the colocated reward
when the rollout did not bring it (as verl: sync reward), the failure policy over what the step has seen so far,
the batch with group advantages, pi_old, and the first epoch's optimizer steps over its mini-batches. Epochs
``1..ppo_epochs-1`` run over all of the step's batches afterwards. With one chunk this is the full-batch update.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
from verl import DataProto

from omni_async.agent_loop.rollouter import Group
from omni_async.sample import Sample
from omni_async.trainer.data_parallel import SAMPLES_KEY
from omni_async.trainer.device_memory import PEAK_PREFIX
from omni_async.trainer.mode import Mode
from omni_async.trainer.step_ops import StepOps
from omni_async.trainer.timer import Timer

# Per-optimizer-step counters reported as the step's total, not its mean.
# SAMPLES_KEY (perf/samples_per_rank): the samples the busiest actor rank trained on in the step (epochs count).
SUMMED_ACTOR_METRICS = ("actor/skipped_steps", SAMPLES_KEY)


def _reduce(key: str, values: list[float]) -> float:
    if key in SUMMED_ACTOR_METRICS:
        return float(np.sum(values))
    return float(np.max(values) if key.startswith(PEAK_PREFIX) else np.mean(values))  # peaks: the step's largest


def _step_metrics(sums: dict[str, list[float]]) -> dict[str, float]:
    return {k: _reduce(k, v) for k, v in sums.items()}


def update(
    ops: StepOps,
    mode: Mode,
    take: Callable[[int, int, int], list[Group]],
    step: int,
    timer: Timer,
    group_size: int,
) -> tuple[list[Group], list[Sample], torch.Tensor, dict[str, float]]:
    """Train step ``step``. ``take(step, n, among)`` returns ``n`` scored groups of the step's ``among`` remaining
    (the producer's ``take``). Returns the step's groups, its samples, their loss mask and the actor metrics."""
    n = mode.groups_per_step
    chunk = mode.mini_batch if mode.pipelined else n
    total = n * group_size
    groups: list[Group] = []
    batches: list[DataProto] = []
    failed = 0
    sums: dict[str, list[float]] = defaultdict(list)
    while len(groups) < n:
        with timer("collect_wait"):
            taken = take(step, min(chunk, n - len(groups)), n - len(groups))
        groups += taken
        samples = [s for g in taken for s in g.samples]
        if any(s.outcome is None for s in samples):  # as in verl: reward only when rollout did not bring it
            ops.score_colocated(samples, timer)
        with timer("adv"):
            failed += sum(not s.outcome.ok for s in samples)
            # Failures only accumulate, so once past the limit the step can fail before training on more.
            ops.check_failures([s for g in groups for s in g.samples], step, total, failed_so_far=failed)
            batch = ops.build_batch(samples)
        # a later recompute of the sync window may follow an update: it runs under the window's synced weights
        ops.recompute_old_log_probs(batch, timer, keep_synced=mode.sync_period > 1 or mode.pipelined)
        for k, v in ops.train_epochs([batch], timer, range(1)).items():
            sums[k].extend(v)
        batches.append(batch)
    for k, v in ops.train_epochs(batches, timer, range(1, ops.cfg.actor_rollout_ref.actor.ppo_epochs)).items():
        sums[k].extend(v)
    samples = [s for g in groups for s in g.samples]
    # per sample, in the loss or not (a sample outside its group's Diffusion-DPO pair has no row in the batch)
    loss_mask = torch.tensor([s.advantage is not None for s in samples])
    step_timing(groups, timer)
    return groups, samples, loss_mask, _step_metrics(sums)


def step_timing(groups: list[Group], timer: Timer) -> None:
    """``timing_s/gen``: from the step's first request to its last generated sample; ``timing_s/reward_wait``: the
    scoring tail after that (a look-ahead's samples may have been made before the step began)."""
    samples = [s for g in groups for s in g.samples]
    t_start = min(s.times.requested for s in samples)
    last_generated = max(s.times.gen_end for s in samples)
    t_done = max(g.t_done for g in groups)
    timer.timing["timing_s/gen"] += max(0.0, last_generated - t_start)
    timer.timing["timing_s/reward_wait"] += max(0.0, t_done - max(last_generated, t_start))
