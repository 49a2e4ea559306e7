"""The two choices that make a training mode, as small strategies the one step loop calls.

*Where a step's samples come from* (:class:`OnPolicy`, :class:`OneStepOffPolicy`) and *how they become optimizer
steps* (:class:`FullBatchUpdate`, :class:`PipelinedUpdate`). Any pair works, with streaming or sync reward::

    sync / stream          OnPolicy         + FullBatchUpdate
    stream+pipeline        OnPolicy         + PipelinedUpdate   (async_reward.update_pipeline)
    stream+one_step_off    OneStepOffPolicy + FullBatchUpdate   (async_reward.one_step_off_policy)
    all                    OneStepOffPolicy + PipelinedUpdate
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from omni_async.agent_loop.manager import Collection, Sample

# The named modes of the benchmarks and tests, as config overrides.
MODE_OVERRIDES: dict[str, list[str]] = {
    "sync": ["reward.streaming=false"],
    "stream": ["reward.streaming=true"],
    "stream+pipeline": ["reward.streaming=true", "async_reward.update_pipeline=true"],
    "stream+one_step_off": ["reward.streaming=true", "async_reward.one_step_off_policy=true"],
    "all": ["reward.streaming=true", "async_reward.update_pipeline=true", "async_reward.one_step_off_policy=true"],
}

if TYPE_CHECKING:
    from omni_async.trainer.loop import FlowGRPOTrainer, Timer


class OnPolicy:
    """Step k's rollout starts at step k with the newest weights; weights are pushed right after the update."""

    def __init__(self, trainer: FlowGRPOTrainer):
        self.trainer = trainer

    def collection(self, step: int) -> Collection:
        return self.trainer.start_collection(step)

    def after_update(self, step: int, timer: Timer) -> None:
        with timer("weight_sync"):
            self.trainer.sync_weights(step + 1)


class OneStepOffPolicy:
    """Step k+1's rollout starts before step k trains, with the weights step k's own batch came from.

    Its samples generate and stream to the reward workers while step k updates the actor, so step k+1 finds
    its batch (mostly) generated and scored. The policy that generated a batch is one update behind the one
    trained (``async_reward/policy_version_lag`` = 1); the loss uses the rollout log-probs as pi_old. New
    weights are pushed only once the look-ahead rollout has finished generating, so no sample mixes versions.
    """

    def __init__(self, trainer: FlowGRPOTrainer):
        self.trainer = trainer
        self.pending: tuple[int, Collection] | None = None

    def collection(self, step: int) -> Collection:
        t = self.trainer
        if self.pending is not None and self.pending[0] == step:
            current = self.pending[1]
        else:  # the first step, or the first after a resume
            current = t.start_collection(step)
        self.pending = None
        if step + 1 < t.cfg.trainer.total_training_steps:
            self.pending = (step + 1, t.start_collection(step + 1))
        return current

    def after_update(self, step: int, timer: Timer) -> None:
        with timer("wait_next_rollout"):
            if self.pending is not None:
                self.pending[1].generated.result()
        with timer("weight_sync"):
            self.trainer.sync_weights(step + 1)


class FullBatchUpdate:
    """Wait for the whole batch (scored by streaming, or by the colocated reward), then update over mini-batches."""

    def __init__(self, trainer: FlowGRPOTrainer):
        self.trainer = trainer

    def run(self, collection: Collection, step: int, timer: Timer) -> tuple[list[Sample], torch.Tensor, dict]:
        t = self.trainer
        samples = t.collect(collection, timer)
        if any(s.outcome is None for s in samples):  # as in verl: reward only when rollout did not bring it
            t.score_colocated(samples, timer)
        with timer("adv"):
            t.check_failures(samples, step, len(samples))
            batch = t.training_batch(samples, collection.window)
        with timer("old_log_prob"):
            if not t.cfg.algorithm.rollout_correction.bypass_mode:
                batch.batch["old_log_probs"] = t.actor_wg.compute_log_prob(batch)[0]
        kept = batch.batch["loss_mask"]
        with timer("update_actor"):
            actor_metrics = t.actor_wg.update_actor(batch)[0] if kept.any() else {}
        return samples, kept, actor_metrics


class PipelinedUpdate:
    """An optimizer step as soon as ``ppo_mini_batch_size`` complete groups are scored; the rest keep arriving.

    Advantages are per group (a group's statistics need only that group), which is why ``global_std`` is refused
    with this strategy. Every group of the step is used exactly once; the last mini-batch may be smaller.
    """

    def __init__(self, trainer: FlowGRPOTrainer):
        self.trainer = trainer
        self.minibatch_uids: list[list[str]] = []  # of the last step, in training order

    def run(self, collection: Collection, step: int, timer: Timer) -> tuple[list[Sample], torch.Tensor, dict]:
        t = self.trainer
        per_mb = int(t.cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        total = len(collection.samples)
        ready: list[list[Sample]] = []
        failed = 0
        sums: dict[str, list[float]] = defaultdict(list)
        kept: dict[int, bool] = {}
        self.minibatch_uids = []

        def train(groups: list[list[Sample]]) -> None:
            members = [s for g in groups for s in g]
            with timer("adv"):
                batch = t.training_batch(members, collection.window)
            kept.update({s.index: bool(k) for s, k in zip(members, batch.batch["loss_mask"], strict=True)})
            self.minibatch_uids.append([g[0].uid for g in groups])
            if batch.batch["loss_mask"].any():
                with timer("update_actor"):
                    for k, v in t.actor_wg.update_actor(batch)[0].items():
                        sums[k].append(v)

        for group in collection.iter_groups():
            failed += sum(not s.outcome.ok for s in group)
            # Failures only accumulate, so once past the limit the step can fail before training on more.
            t.check_failures(collection.samples, step, total, failed_so_far=failed)
            ready.append(group)
            if len(ready) == per_mb:
                train(ready)
                ready = []
        if ready:
            train(ready)
        samples = t.collect(collection, timer)
        mask = torch.tensor([kept[s.index] for s in samples])
        return samples, mask, {k: float(np.mean(v)) for k, v in sums.items()}
