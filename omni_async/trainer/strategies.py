"""The two choices that make a training mode, as small strategies the one step loop calls.

*Where a step's samples come from* (:class:`OnPolicy`, :class:`OneStepOffPolicy`) and *how they become optimizer
steps* (:class:`FullBatchUpdate`, :class:`PipelinedUpdate`). Any pair works, with streaming or sync reward::

    sync / stream          OnPolicy         + FullBatchUpdate
    stream+pipeline        OnPolicy         + PipelinedUpdate   (async_reward.update_pipeline)
    stream+one_step_off    OneStepOffPolicy + FullBatchUpdate   (async_reward.one_step_off_policy)
    all                    OneStepOffPolicy + PipelinedUpdate
    fully_async            FullyAsync       + FullBatchUpdate   (async_reward.fully_async: a step is one update
                                                                 of require_batches x ppo_mini_batch_size groups)
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch
from verl import DataProto

from omni_async.agent_loop.manager import Collection
from omni_async.agent_loop.rollouter import Rollouter
from omni_async.sample import Sample
from omni_async.trainer.config import fully_async_bounds, groups_per_update
from omni_async.trainer.data_parallel import SAMPLES_KEY
from omni_async.trainer.step_ops import StepOps
from omni_async.trainer.timer import Timer

# The named modes of the benchmarks and tests, as config overrides.
MODE_OVERRIDES: dict[str, list[str]] = {
    "sync": ["reward.streaming=false"],
    "stream": ["reward.streaming=true"],
    "stream+pipeline": ["reward.streaming=true", "async_reward.update_pipeline=true"],
    "stream+one_step_off": ["reward.streaming=true", "async_reward.one_step_off_policy=true"],
    "all": ["reward.streaming=true", "async_reward.update_pipeline=true", "async_reward.one_step_off_policy=true"],
}


def fully_async_overrides(staleness: float) -> list[str]:
    """The fully async mode at ``async_training.staleness_threshold=staleness`` (needs a rollout pool)."""
    return ["reward.streaming=true", "async_reward.fully_async=true", f"async_training.staleness_threshold={staleness}"]


class OnPolicy:
    """Step k's rollout starts at step k with the newest weights; weights are pushed right after the update."""

    def __init__(self, ops: StepOps):
        self.ops = ops

    def collection(self, step: int) -> Collection:
        return self.ops.start_collection(step)

    def after_update(self, step: int, timer: Timer) -> None:
        self.ops.publish(step + 1, timer)

    def metrics(self, step_s: float) -> dict[str, float]:
        return {}


class OneStepOffPolicy:
    """Step k+1's rollout starts before step k trains, with the weights step k's own batch came from.

    Its samples generate and stream to the reward workers while step k updates the actor, so step k+1 finds
    its batch (mostly) generated and scored. The policy that generated a batch is one update behind the one
    trained (``async_reward/policy_version_lag`` = 1); the loss uses the rollout log-probs as pi_old. New
    weights are pushed only once the look-ahead rollout has finished generating, so no sample mixes versions.
    """

    def __init__(self, ops: StepOps, total_steps: int):
        self.ops, self.total_steps = ops, total_steps
        self.pending: tuple[int, Collection] | None = None

    def collection(self, step: int) -> Collection:
        if self.pending is not None and self.pending[0] == step:
            current = self.pending[1]
        else:  # the first step, or the first after a resume
            current = self.ops.start_collection(step)
        self.pending = None
        if step + 1 < self.total_steps:
            self.pending = (step + 1, self.ops.start_collection(step + 1))
        return current

    def after_update(self, step: int, timer: Timer) -> None:
        if not self.ops.sync_due(step + 1):  # no new weights this step: the look-ahead keeps generating
            return
        with timer("wait_next_rollout"):
            if self.pending is not None:
                self.pending[1].all_generated.result()
        self.ops.publish(step + 1, timer)

    def metrics(self, step_s: float) -> dict[str, float]:
        return {}


class FullyAsync:
    """Each step takes ``require_batches x ppo_mini_batch_size`` scored groups from the rollouter, which never stops
    (``agent_loop.rollouter``: production bounded per sync window, lag bounded per group); every
    ``trigger_parameter_sync_step`` steps the weights go to the rollout workers and a new window opens.

    Draws are the lock-step modes' (``data.train_batch_size`` prompts, seeds from (seed, draw, index)), so a fully
    async run sees the same prompts and samples-per-seed as a lock-step one; only the weights that generate them
    and the grouping into updates differ.
    """

    def __init__(self, ops: StepOps, total_steps: int):
        self.ops, self.total_steps = ops, int(total_steps)
        cfg = ops.cfg
        self.n = groups_per_update(cfg)
        self.cap, self.bound = fully_async_bounds(cfg)
        self.wait_for_stale = cfg.trainer.v1.sampler.max_off_policy_strategy == "wait"
        self.rollouter: Rollouter | None = None
        self.resume_position: dict | None = None  # set by the trainer's resume before the first step
        self.waited_s = 0.0
        self._t_metrics = time.perf_counter()

    def _draw(self, d: int) -> tuple[dict, list[Sample]]:
        state = self.ops.sampler.state_dict()
        return state, self.ops.make_samples(d, self.ops.sampler.next_batch())

    def _start(self, step: int) -> None:
        pos = self.resume_position or {}
        if pos.get("sampler") is not None:
            self.ops.sampler.load_state_dict(pos["sampler"])
        self.rollouter = self.ops.agent.on_loop(
            lambda: Rollouter(
                self.ops.agent,
                self._draw,
                self.ops.sampler.state_dict,
                cap=self.cap,
                bound=self.bound,
                wait_for_stale=self.wait_for_stale,
                groups_to_train=(self.total_steps - step) * self.n,
                rollout_version=step,
                first_draw=int(pos.get("draw", 0)),
                finished=pos.get("finished"),
            )
        )
        self.ops.agent.call(self.rollouter.start())
        self._t_metrics = time.perf_counter()

    def collection(self, step: int) -> Collection:
        if self.rollouter is None:
            self._start(step)
        t0 = time.perf_counter()
        groups = self.ops.agent.call(self.rollouter.take(step, self.n))
        self.waited_s = time.perf_counter() - t0
        samples = [s for g in groups for s in g.samples]
        collection = Collection(samples)
        collection.t_start = min(s.times.gen_start for s in samples)
        collection.t_done = max(g.t_done for g in groups)
        collection.all_generated.set_result(None)
        collection.groups.put(None)
        collection.done.set_result(samples)
        return collection

    def after_update(self, step: int, timer: Timer) -> None:
        if self.ops.sync_due(step + 1):
            self.ops.publish(step + 1, timer)
            self.ops.agent.call(self.rollouter.on_sync(step + 1))

    def position(self) -> dict | None:
        """The rollouter's data position for a checkpoint (``Rollouter.position``)."""
        return None if self.rollouter is None else self.ops.agent.on_loop(self.rollouter.position)

    def metrics(self, step_s: float) -> dict[str, float]:
        now = time.perf_counter()
        wall, self._t_metrics = now - self._t_metrics, now
        rollout_idle = self.ops.agent.take_idle_s()
        m = self.ops.agent.on_loop(self.rollouter.metrics)
        m["fully_async/trainer/idle_ratio"] = self.waited_s / step_s if step_s > 0 else 0.0
        m["fully_async/rollouter/idle_ratio"] = min(1.0, rollout_idle / wall) if wall > 0 else 0.0
        return m

    def stop(self) -> None:
        if self.rollouter is not None:
            self.ops.agent.call(self.rollouter.stop())


# Per-optimizer-step counters reported as the step's total, not its mean.
# SAMPLES_KEY (perf/samples_per_rank): the samples the busiest actor rank trained on in the step (epochs count).
SUMMED_ACTOR_METRICS = ("actor/skipped_steps", SAMPLES_KEY)


def _mean(sums: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.sum(v) if k in SUMMED_ACTOR_METRICS else np.mean(v)) for k, v in sums.items()}


class FullBatchUpdate:
    """Wait for the whole batch (scored by streaming, or by the colocated reward), then update over mini-batches."""

    def __init__(self, ops: StepOps):
        self.ops = ops

    def run(self, collection: Collection, step: int, timer: Timer) -> tuple[list[Sample], torch.Tensor, dict]:
        ops = self.ops
        samples = ops.collect(collection, timer)
        if any(s.outcome is None for s in samples):  # as in verl: reward only when rollout did not bring it
            ops.score_colocated(samples, timer)
        with timer("adv"):
            ops.check_failures(samples, step, len(samples))
            batch = ops.build_batch(samples)
        ops.recompute_old_log_probs(batch, timer)
        sums = ops.train_epochs([batch], timer, range(ops.cfg.actor_rollout_ref.actor.ppo_epochs))
        return samples, batch.batch["loss_mask"], _mean(sums)


class PipelinedUpdate:
    """An optimizer step as soon as ``ppo_mini_batch_size`` complete groups are scored; the rest keep arriving.

    Advantages are per group (a group's statistics need only that group), which is why ``global_std`` is refused
    with this strategy. The first epoch trains each mini-batch on arrival; further epochs (``ppo_epochs`` > 1) run
    over all of the step's mini-batches afterwards, as in the full-batch update. The last mini-batch may be
    smaller.
    """

    def __init__(self, ops: StepOps):
        self.ops = ops

    def run(self, collection: Collection, step: int, timer: Timer) -> tuple[list[Sample], torch.Tensor, dict]:
        ops = self.ops
        per_mb = int(ops.cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        total = len(collection.samples)
        ready: list[list[Sample]] = []
        trained: list[DataProto] = []
        failed = 0
        sums: dict[str, list[float]] = defaultdict(list)
        loss_mask: dict[int, bool] = {}

        def train(groups: list[list[Sample]]) -> None:
            members = [s for g in groups for s in g]
            with timer("adv"):
                batch = ops.build_batch(members)
            loss_mask.update({s.index: bool(k) for s, k in zip(members, batch.batch["loss_mask"], strict=True)})
            trained.append(batch)
            for k, v in ops.optimizer_step(batch, timer).items():
                sums[k].append(v)

        for group in collection.iter_groups():
            failed += sum(not s.outcome.ok for s in group)
            # Failures only accumulate, so once past the limit the step can fail before training on more.
            ops.check_failures(collection.samples, step, total, failed_so_far=failed)
            ready.append(group)
            if len(ready) == per_mb:
                train(ready)
                ready = []
        if ready:
            train(ready)
        samples = ops.collect(collection, timer)
        for k, v in ops.train_epochs(trained, timer, range(1, ops.cfg.actor_rollout_ref.actor.ppo_epochs)).items():
            sums[k].extend(v)
        return samples, torch.tensor([loss_mask[s.index] for s in samples]), _mean(sums)
