"""The operations a training step is made of. The strategies (``trainer.strategies``) compose them into modes.

``StepOps`` owns what the operations share (config, prompt sampler, agent loop, reward side, actor workers) and
is the one place where a batch is split into mini-batches and epochs (:func:`minibatches`,
:meth:`StepOps.train_epochs`), so every mode does the same optimisation math.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import DictConfig
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from verl import DataProto

from omni_async.agent_loop.manager import AgentLoopManager, Collection, RolloutWorkersLostError
from omni_async.agent_loop.rollout_replica import SEED_WINDOW, sample_seed
from omni_async.algos.advantages import group_advantages
from omni_async.algos.sde import sde_window
from omni_async.modality import REF_TIME_KEY, Modality
from omni_async.reward.wiring import RewardSide
from omni_async.sample import Sample
from omni_async.trainer.config import sync_period_steps
from omni_async.trainer.dataset import PromptSampler
from omni_async.trainer.pool_sync import PoolSync
from omni_async.trainer.timer import Timer

RANK_PROBE_TIMEOUT_S = 30.0  # after a failed actor call: how long a rank may take to answer "are you alive"


class RewardFailureError(RuntimeError):
    """More than ``reward.max_failure_ratio`` of a step's samples failed to get a reward."""


class ActorRankDiedError(RuntimeError):
    """An actor rank's process died: the optimizer state is gone, the run must resume from a checkpoint."""


def minibatches(batch: DataProto, prompts_per_minibatch: int) -> list[DataProto]:
    """Split a batch into mini-batches of whole ``uid`` groups, in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, u in enumerate(batch.non_tensor_batch["uid"]):
        groups[u].append(i)
    order = list(groups)
    return [
        batch.select_idxs(np.array([i for u in order[k : k + prompts_per_minibatch] for i in groups[u]]))
        for k in range(0, len(order), prompts_per_minibatch)
    ]


class StepOps:
    def __init__(
        self,
        cfg: DictConfig,
        modality: Modality,
        sampler: PromptSampler,
        agent: AgentLoopManager,
        reward: RewardSide,
        actor_wg: Any,
        rollout_workers: list[Any],
        hybrid: bool = False,
        last_checkpoint=lambda: None,
        layout: str | None = None,
    ):
        self.cfg, self.modality, self.sampler, self.agent, self.reward = cfg, modality, sampler, agent, reward
        self.actor_wg, self.rollout_workers, self.hybrid = actor_wg, rollout_workers, hybrid
        self.layout = layout or ("hybrid" if hybrid else "split")
        # Disaggregated layout: the weights go to the rollout pool by checkpoint_engine.backend (trainer.pool_sync).
        self.pool_sync = (
            PoolSync(cfg, actor_wg, rollout_workers, on_death=agent.worker_died)
            if self.layout == "disaggregated"
            else None
        )
        self.sync_period = sync_period_steps(cfg)  # steps between weight syncs (async_training.*)
        self.sync_bytes = 0  # bytes moved by weight syncs since the last step_metrics read
        self.rollout_version = 0  # the newest weights version published to the rollout (what a collection is for)
        self.corr_metrics: dict[str, list[float]] = defaultdict(list)  # rollout_corr/* of the step's batches
        self.last_checkpoint = last_checkpoint  # for the error when an actor rank dies
        self.sampler_state_before: dict[int, dict] = {}  # sampler state before each step's prompts were drawn
        # Split layout: (object ref of the newest weights, version), for a restarted replica. The hybrid layout's
        # rollout workers are actor ranks, never restarted.
        self._weights: tuple[Any, int] | None = None

    # ---- rollout ------------------------------------------------------------------------------------------------
    def window(self, step: int, index: int) -> tuple[int, int] | None:
        """The SDE window of sample ``index`` of step ``step``, or ``None`` for a modality without one.

        A pure function of (trainer seed, step, index), so every layout, batching and regeneration agrees. With
        ``rollout.algo.sde_window_per_sample`` (default) each sample draws its own, as verl-omni's SD3 / Qwen-Image
        request batches draw one per row; false: one per step, shared by all its samples (sample 0's).
        """
        if not self.modality.uses_window:
            return None
        r = self.cfg.actor_rollout_ref.rollout
        draw = index if r.algo.sde_window_per_sample else 0
        gen = torch.Generator().manual_seed(sample_seed(self.cfg.trainer.seed, step, draw, SEED_WINDOW))
        w = sde_window(r.num_inference_steps, r.algo.sde_window_size, tuple(r.algo.sde_window_range), gen)
        return w.start, w.stop

    def make_samples(self, step: int, rows: list) -> list[Sample]:
        n = self.cfg.actor_rollout_ref.rollout.n
        return [
            Sample(
                index=i,
                uid=f"{step}-{p}",
                row=row,
                seed=sample_seed(self.cfg.trainer.seed, step, i),
                window=self.window(step, i),
            )
            for p, row in enumerate(rows)
            for i in range(p * n, p * n + n)
        ]

    def start_collection(self, step: int) -> Collection:
        """Draw step ``step``'s prompts and start generating (and, when streaming, scoring) its samples, for the weights
        published last (a rollout worker that stages syncs generates them with those although newer ones arrive)."""
        # Only the newest states can still be checkpointed (see the trainer's save_checkpoint).
        self.sampler_state_before = {k: v for k, v in self.sampler_state_before.items() if k >= step - 1}
        self.sampler_state_before[step] = self.sampler.state_dict()
        return self.agent.start(self.make_samples(step, self.sampler.next_batch()), version=self.rollout_version)

    def collect(self, collection: Collection, timer: Timer) -> list[Sample]:
        """Wait for a step's samples. Streamed ones arrive scored; the wait after the last one is the reward tail."""
        with timer("collect_wait"):
            try:
                samples = collection.wait()
            except RolloutWorkersLostError as e:
                if self.hybrid:  # the rollout workers are the actor ranks
                    raise self._rank_died("rollout", e) from e
                raise
        last_generated = max(s.times.gen_end for s in samples)
        timer.timing["timing_s/gen"] += max(0.0, last_generated - collection.t_start)
        timer.timing["timing_s/reward_wait"] += max(0.0, collection.t_done - max(last_generated, collection.t_start))
        return samples

    def sync_weights(self, version: int, activate: bool = True) -> None:
        """Make ``version`` the rollout's weights.

        Hybrid layout: the rollout generates with the model it trains, so this is a version bump (and a device-local
        LoRA snapshot when updates overlap generation). Split layout: rank 0's trainable weights go into Ray's
        object store once and every rollout replica reads them from there. Disaggregated layout: by
        ``checkpoint_engine.backend`` (``trainer.pool_sync``: the object store for LoRA, or a bucketed broadcast
        from rank 0 over a process group with the rollout workers).

        ``activate=False`` (only where :attr:`sync_stages`): the rollout workers stage the set while they generate and
        write it in before the first request for ``version`` or newer, not at once.
        """
        self.rollout_version = int(version)
        if self.hybrid:
            ray.get([w.set_rollout_version.remote(version) for w in self.rollout_workers])
            return
        if self.pool_sync is not None:
            self.sync_bytes += self.pool_sync.sync(version, activate)
            return
        ref = self.actor_wg.workers[0].get_weights.remote()
        self._weights = (ref, version)
        ray.get([w.set_weights.remote(ref, version, activate) for w in self.rollout_workers])

    @property
    def sync_stages(self) -> bool:
        """Whether the rollout workers receive a sync while they generate and write it in between two device batches
        (``agent_loop.weight_staging``): rollout replicas (split or disaggregated layout) whose set fits their
        staging. Not the hybrid layout, whose rollout is the trainer's own model."""
        if self.hybrid:
            return False
        return self.pool_sync is None or self.pool_sync.stages

    def sync_due(self, version: int) -> bool:
        """Whether the weights of ``version`` (after ``version`` steps) go to the rollout: every
        ``sync_period`` steps (``async_training.trigger_parameter_sync_step``)."""
        return version % self.sync_period == 0

    def publish(self, version: int, timer: Timer, activate: bool = True) -> None:
        """The end of a step's update: sync when due, timed as ``timing_s/update_weights`` (verl's name;
        ``timing_s/weight_sync`` is the same time under this project's first name). ``activate``: as
        :meth:`sync_weights`."""
        if not self.sync_due(version):
            return
        with timer("update_weights"):
            self.sync_weights(version, activate)
        timer.timing["timing_s/weight_sync"] = timer.timing["timing_s/update_weights"]

    def take_sync_bytes(self) -> int:
        n, self.sync_bytes = self.sync_bytes, 0
        return n

    async def restore_worker(self, worker: Any) -> None:
        """Give a restarted rollout worker the newest weights (it came back with the initial ones)."""
        if self.pool_sync is not None:
            await self.pool_sync.restore(worker)
        elif self._weights is not None:
            await worker.set_weights.remote(*self._weights)

    # ---- reward -------------------------------------------------------------------------------------------------
    def score_colocated(self, samples: list[Sample], timer: Timer) -> None:
        """The sync baseline's reward phase: one call over the whole batch, after rollout."""
        with timer("reward"):
            outcomes = self.reward.colocated.score_batch([s.reward_input() for s in samples])
        now = time.time()
        for s, o in zip(samples, outcomes, strict=True):
            s.outcome, s.times.scored = o, now

    def check_failures(self, samples: list[Sample], step: int, total: int, failed_so_far: int | None = None) -> None:
        """The failure policy: raise once more than ``reward.max_failure_ratio`` of the step's samples failed."""
        r = self.cfg.reward
        failed = failed_so_far if failed_so_far is not None else sum(not s.outcome.ok for s in samples)
        ratio = failed / total
        if ratio > r.max_failure_ratio or (r.on_failure == "raise" and failed):
            errors = sorted({s.outcome.error for s in samples if s.outcome is not None and not s.outcome.ok})
            raise RewardFailureError(
                f"step {step}: {ratio:.0%} of samples got no reward (reward.max_failure_ratio={r.max_failure_ratio}, "
                f"on_failure={r.on_failure}) from scorer {self.reward.scorer_names}; first errors: {errors[:3]}"
            )

    # ---- update -------------------------------------------------------------------------------------------------
    def build_batch(self, samples: list[Sample]) -> DataProto:
        """Scored samples -> the actor's batch, with group advantages and the ``loss_mask``: the samples in the loss
        (failed samples and groups left with < 2 out; with ``algorithm.drop_zero_adv_samples`` zero-advantage ones
        too)."""
        algo = self.cfg.algorithm
        batch = DataProto.from_dict(
            tensors=self.modality.batch_tensors(samples),
            non_tensors={
                "prompt": np.array([s.row.prompt for s in samples], dtype=object),
                "uid": np.array([s.uid for s in samples], dtype=object),
                "index": np.array([s.index for s in samples], dtype=np.int64),
            },
        )
        adv, loss_mask = group_advantages(
            batch.batch["rm_scores"].sum(-1),
            [s.uid for s in samples],
            torch.tensor([s.outcome.ok for s in samples]),
            epsilon=algo.adv_std_eps,
            std_unbiased=algo.adv_std_unbiased,
            norm_by_std=algo.norm_adv_by_std_in_grpo,
            global_std=algo.global_std,
            adv_clip_max=algo.adv_clip_max,
        )
        if algo.drop_zero_adv_samples:  # flow_grpo filters them out of the batch: the loss mean runs over the rest
            loss_mask = loss_mask & (adv != 0)
        batch.batch["advantages"], batch.batch["loss_mask"] = adv, loss_mask
        for s, a, kept in zip(samples, adv.tolist(), loss_mask.tolist(), strict=True):
            s.advantage = a if kept else None
        return batch

    def recompute_old_log_probs(self, batch: DataProto, timer: Timer) -> None:
        """pi_old: the rollout's log-probs (bypass mode) or recomputed under the current weights (verl's decoupled
        mode), then verl's rollout correction between the two when configured (:meth:`rollout_correction`)."""
        with timer("old_log_prob"):
            if not self.cfg.algorithm.rollout_correction.bypass_mode:
                rollout_log_probs = batch.batch["old_log_probs"]
                batch.batch["old_log_probs"] = self._actor_call("compute_log_prob", batch)
                self.rollout_correction(batch, rollout_log_probs)

    def rollout_correction(self, batch: DataProto, rollout_log_probs: torch.Tensor) -> None:
        """verl's decoupled-mode rollout correction (``algorithm.rollout_correction.rollout_is`` / ``rollout_rs``),
        computed by verl's ``compute_rollout_correction_and_rejection_mask`` between pi_old (recomputed) and the
        rollout's log-probs: truncated IS weights ``rollout_is_weights`` and a rejection mask ``rollout_rs_mask``,
        per token (text) or per SDE-window step (image), which the loss applies; ``rollout_corr/*`` metrics."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.rollout_is is None and rc.rollout_rs is None:
            return
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        old = batch.batch["old_log_probs"]
        keep = batch.batch["loss_mask"].bool()[:, None]
        mask = (
            batch.batch["response_mask"].bool()
            if "response_mask" in batch.batch.keys()
            else torch.ones_like(old, dtype=torch.bool)
        ) & keep
        if not mask.any():  # nothing in the loss: nothing to correct
            return
        weights, rs_mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old.float(),
            rollout_log_prob=rollout_log_probs.float(),
            response_mask=mask.float(),
            rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold,
        )
        if weights is not None:
            batch.batch["rollout_is_weights"] = weights.batch["rollout_is_weights"]
        if rc.rollout_rs is not None:
            batch.batch["rollout_rs_mask"] = rs_mask.float()
        for k, v in metrics.items():
            self.corr_metrics[k].append(float(v))

    def take_corr_metrics(self) -> dict[str, float]:
        """The step's ``rollout_corr/*`` metrics (means over its batches); resets them."""
        out = {k: float(np.mean(v)) for k, v in self.corr_metrics.items()}
        self.corr_metrics.clear()
        return out

    def optimizer_step(self, minibatch: DataProto, timer: Timer) -> dict[str, float]:
        """One optimizer step of the actor on one mini-batch; nothing when no sample of it is in the loss."""
        if not minibatch.batch["loss_mask"].any():
            return {}
        with timer("update_actor"):
            metrics = self._actor_call("update_minibatch", minibatch)
        timer.timing[REF_TIME_KEY] += metrics.pop(REF_TIME_KEY, 0.0)  # part of update_actor, also shown alone
        return metrics

    def train_epochs(self, batches: list[DataProto], timer: Timer, epochs: range) -> dict[str, list[float]]:
        """``ppo_epochs`` passes: for each epoch in ``epochs``, one optimizer step per mini-batch of each batch."""
        sums: dict[str, list[float]] = defaultdict(list)
        per_mb = int(self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        for _ in epochs:
            for batch in batches:
                for mb in minibatches(batch, per_mb):
                    for k, v in self.optimizer_step(mb, timer).items():
                        sums[k].append(v)
        return sums

    def _actor_call(self, method: str, data: DataProto):
        try:
            return getattr(self.actor_wg, method)(data)  # the ranks' shares, merged (trainer.data_parallel)
        except RayActorError as e:
            raise self._rank_died(method, e) from e
        except RayTaskError as e:  # with data parallelism a dead rank fails the others' collective first
            if self._a_rank_is_dead():
                raise self._rank_died(method, e) from e
            raise

    def _a_rank_is_dead(self) -> bool:
        for w in self.actor_wg.workers:
            try:
                ray.get(w.stats.remote(), timeout=RANK_PROBE_TIMEOUT_S)
            except RayActorError:
                return True
            except GetTimeoutError:
                pass
        return False

    def _rank_died(self, during: str, e: Exception) -> ActorRankDiedError:
        ckpt = self.last_checkpoint()
        return ActorRankDiedError(
            f"an actor rank died during {during} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); its "
            f"optimizer state is lost. Last checkpoint: {ckpt or 'none yet'}. Rerun the same command with "
            "trainer.resume_mode=auto to continue from it"
        )
