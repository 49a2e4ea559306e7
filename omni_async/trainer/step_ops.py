"""The operations a training step's update is made of: colocated reward, the failure policy, the actor's batch with
group advantages, pi_old, optimizer steps over mini-batches and epochs (``trainer.update`` runs them in every mode).

``StepOps`` owns what the operations share (config, reward side, actor workers) and is the one place where a batch
is split into mini-batches and epochs (:func:`minibatches`, :meth:`StepOps.train_epochs`), so every mode does the
same optimisation math.
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

from omni_async.agent_loop.draws import SEED_AWM_STEPS, SEED_DPO_STEP, SEED_NFT_NOISE, SEED_NFT_STEPS, sample_seed
from omni_async.algos.advantages import group_advantages
from omni_async.algos.awm import draw_train_steps
from omni_async.algos.diffusion_nft import old_policy_decay, optimality_probability, refreshes_after, train_steps
from omni_async.algos.dpo import logit_normal_u, preference_pairs
from omni_async.algos.loss import BYPASS_CORRECTION_FIELDS, BYPASS_CORRECTION_KEY
from omni_async.modality import REF_TIME_KEY, Modality
from omni_async.models.lora import OLD_ADAPTER
from omni_async.reward.teacher import trajectory_fields
from omni_async.reward.wiring import RewardSide
from omni_async.sample import Sample
from omni_async.trainer.actor_core import PI_OLD_KEEP, PI_OLD_KEY, PI_OLD_LIVE, PI_OLD_SYNCED
from omni_async.trainer.timer import Timer

RANK_PROBE_TIMEOUT_S = 30.0  # after a failed actor call: how long a rank may take to answer "are you alive"


class RewardFailureError(RuntimeError):
    """More than ``reward.max_failure_ratio`` of a step's samples failed to get a reward."""


class ActorRankDiedError(RuntimeError):
    """An actor rank's process died: the optimizer state is gone, the run must resume from a checkpoint."""


def group_chunks(uids: Any, prompts_per_chunk: int) -> list[list[int]]:
    """The row indices of consecutive chunks of ``prompts_per_chunk`` whole ``uid`` groups, in order of first
    appearance: the mini-batches of :func:`minibatches`."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    order = list(groups)
    return [
        [i for u in order[k : k + prompts_per_chunk] for i in groups[u]]
        for k in range(0, len(order), prompts_per_chunk)
    ]


def minibatches(batch: DataProto, prompts_per_minibatch: int) -> list[DataProto]:
    """Split a batch into mini-batches of whole ``uid`` groups, in order of first appearance."""
    return [
        batch.select_idxs(np.array(rows)) for rows in group_chunks(batch.non_tensor_batch["uid"], prompts_per_minibatch)
    ]


class StepOps:
    def __init__(
        self,
        cfg: DictConfig,
        modality: Modality,
        reward: RewardSide,
        actor_wg: Any,
        last_checkpoint=lambda: None,
    ):
        self.cfg, self.modality, self.reward, self.actor_wg = cfg, modality, reward, actor_wg
        self.corr_metrics: dict[str, list[float]] = defaultdict(list)  # rollout_corr/* of the step's batches
        self.updated_since_sync = False  # an optimizer step ran since the rollout last took the weights
        self.last_checkpoint = last_checkpoint  # for the error when an actor rank dies

    # ---- reward -------------------------------------------------------------------------------------------------
    def score_colocated(self, samples: list[Sample], timer: Timer, teacher: bool = True) -> None:
        """The sync baseline's reward phase: one call over the whole batch, after rollout; then (``teacher``, with
        ``distillation.enabled``) the teacher's velocities of each sample's window, where the reward ran."""
        with timer("reward"):
            outcomes = self.reward.colocated.score_batch([s.reward_input() for s in samples])
        if teacher and self.reward.colocated_teacher is not None:
            with timer("teacher"):
                for s, o in zip(samples, outcomes, strict=True):
                    if o.ok:
                        o.teacher_velocity = self.reward.colocated_teacher.velocities(trajectory_fields(s.result))
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
        image = self.cfg.actor_rollout_ref.model.modality == "image"
        # images: verl-omni's diffusion_loss.adv_clip_max (flow_grpo and DiffusionNFT); text: algorithm.adv_clip_max
        clip = self.cfg.actor_rollout_ref.actor.diffusion_loss.adv_clip_max if image else algo.adv_clip_max
        mode = self.modality.mode  # the image loss's registry entry (algos.loss_modes); None for text
        # DiffusionNFT clips inside the map to the optimality probability (below); Flow-DPPO takes them unclipped
        clipped = mode is None or mode.clips_advantages
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
            adv_clip_max=clip if clipped else None,
        )
        if mode is not None and mode.preference_pairs:
            return self.preference_batch(batch, samples, adv, loss_mask)
        if mode is not None and mode.optimality_prob:
            batch.batch["reward_prob"] = optimality_probability(adv, adv_clip_max=clip, adv_mode=algo.adv_mode)[:, None]
        if mode is not None and mode.final_latents:  # DiffusionNFT, AWM: trained on the forward process
            self.forward_process_batch(batch, samples)
        if algo.drop_zero_adv_samples:  # flow_grpo filters them out of the batch: the loss mean runs over the rest
            loss_mask = loss_mask & (adv != 0)
        batch.batch["advantages"], batch.batch["loss_mask"] = adv, loss_mask
        for s, a, kept in zip(samples, adv.tolist(), loss_mask.tolist(), strict=True):
            s.advantage = a if kept else None
        return batch

    @staticmethod
    def preference_batch(batch: DataProto, samples: list[Sample], adv: torch.Tensor, kept: torch.Tensor) -> DataProto:
        """Diffusion-DPO's actor batch (verl-omni's ``DPOLoss.prepare_actor_batch``): each group's chosen and rejected
        sample among its kept ones (``algos.dpo.preference_pairs``: the highest and the lowest reward), adjacent, in
        the groups' order, so a mini-batch (whole groups) and an even micro-batch hold whole pairs; the other samples
        are outside the loss (no advantage). Each pair's forward-process draw, ``train_u`` (its timestep) and
        ``noise_seed``, comes from its chosen sample's seed: the same for both rows, and on a resume."""
        pairs = preference_pairs([s.uid for s in samples], batch.batch["rm_scores"].sum(-1).tolist(), kept.tolist())
        rows = [i for pair in pairs for i in pair]
        in_pair = set(rows)
        for i, (s, a) in enumerate(zip(samples, adv.tolist(), strict=True)):
            s.advantage = a if i in in_pair else None
        out = batch.select_idxs(np.array(rows, dtype=np.int64))
        chosen_seeds = [samples[w].seed for w, _ in pairs for _ in range(2)]
        out.batch["noise_seed"] = torch.tensor([sample_seed(x, 0, 0, SEED_NFT_NOISE) for x in chosen_seeds])
        out.batch["train_u"] = torch.tensor(
            [logit_normal_u(torch.Generator().manual_seed(sample_seed(x, 0, 0, SEED_DPO_STEP))) for x in chosen_seeds],
            dtype=torch.float64,
        )
        out.batch["advantages"] = adv[rows]
        out.batch["loss_mask"] = torch.ones(len(rows), dtype=torch.bool)
        return out

    def forward_process_batch(self, batch: DataProto, samples: list[Sample]) -> None:
        """A final-latent loss's tensors (DiffusionNFT: verl-omni's ``DiffusionNFTLoss.prepare_actor_batch``, where
        ``reward_prob`` is added beside them; AWM): the denoising steps each sample trains on (``train_steps``) and its
        forward-noise seed (from the sample's own seed).

        DiffusionNFT: ``algorithm.timestep_fraction`` of the rollout's steps, a random subset per sample from its own
        seed, so a sample trains the same whichever batch, rank or resume it lands in. AWM: its authors' draw,
        ``diffusion_loss.awm_train_timesteps`` steps stratified over ``1 .. int(N x awm_timestep_fraction)``
        (``algos.awm.stratified_train_steps``), one draw shared by every sample of a mini-batch (the authors share
        one per micro-batch; a mini-batch is the finest unit fixed before the ranks split it, so the step-start
        recompute of ``lp_old`` and every micro-batch see the same steps), seeded by the mini-batch's sample seeds
        (the same on a resume)."""
        steps = int(self.cfg.actor_rollout_ref.rollout.pipeline.num_inference_steps)
        if self.modality.mode is not None and self.modality.mode.stratified_steps:
            batch.batch["train_steps"] = self._awm_train_steps(samples, steps)
        else:
            gens = [torch.Generator().manual_seed(sample_seed(s.seed, 0, 0, SEED_NFT_STEPS)) for s in samples]
            fraction = self.cfg.algorithm.timestep_fraction
            batch.batch["train_steps"] = torch.stack([train_steps(steps, fraction, g) for g in gens])
        batch.batch["noise_seed"] = torch.tensor([sample_seed(s.seed, 0, 0, SEED_NFT_NOISE) for s in samples])

    def _awm_train_steps(self, samples: list[Sample], num_steps: int) -> torch.Tensor:
        """AWM's ``train_steps`` [B, K]: one stratified draw per mini-batch (:func:`group_chunks`, as
        :meth:`train_epochs` will split the batch), repeated over its samples."""
        actor = self.cfg.actor_rollout_ref.actor
        count, fraction = int(actor.diffusion_loss.awm_train_timesteps), actor.diffusion_loss.awm_timestep_fraction
        out = torch.empty(len(samples), count, dtype=torch.long)
        for rows in group_chunks([s.uid for s in samples], int(actor.ppo_mini_batch_size)):
            seeds = sorted(int(samples[i].seed) for i in rows)
            seed = int(np.random.SeedSequence([SEED_AWM_STEPS, *seeds]).generate_state(1)[0] & 0x7FFFFFFF)
            out[rows] = draw_train_steps(num_steps, count, fraction, torch.Generator().manual_seed(seed))
        return out

    def refresh_old_policy(self, step: int, rounds: int) -> dict[str, float]:
        """DiffusionNFT's old policy or AWM's anchor, after training step ``step`` (1-based): every
        ``algorithm.old_policy_update_interval`` steps it moves toward the trained one by ``1 - decay`` (verl-omni's
        ``_update_old_policy``), before the weight sync, which ships the old weights to the rollout when it samples
        with them (DiffusionNFT). The schedule's ``decay`` is read at ``rounds``, the feedback rounds behind the
        step's data (:func:`~omni_async.algos.staleness.feedback_rounds`: ``step`` in lock-step modes, less the lag
        when trained late). Metrics: verl-omni's ``old_policy/*`` and ``old_policy/feedback_rounds``."""
        algo = self.cfg.algorithm
        if OLD_ADAPTER not in self.cfg.actor_rollout_ref.model.policy_state_adapters:
            return {}
        if not refreshes_after(step, algo.old_policy_update_interval):
            return {"old_policy/updated": 0.0}
        decay = old_policy_decay(rounds, algo.old_policy_decay_schedule, algo.old_policy_decay)
        moved = self._actor_call("refresh_old_policy", decay)
        return {
            "old_policy/updated": 1.0,
            "old_policy/decay": decay,
            "old_policy/moved_l2": float(moved[0]),
            "old_policy/feedback_rounds": float(rounds),
        }

    def weights_synced(self) -> None:
        """The rollout now holds the actor's weights (a weight sync, or the start of a run): the next pi_old recompute
        runs on them as they are."""
        self.updated_since_sync = False

    def recompute_old_log_probs(self, batch: DataProto, timer: Timer, keep_synced: bool = False) -> None:
        """pi_old: the rollout's log-probs (bypass mode) or recomputed (verl's decoupled mode), then verl's rollout
        correction between the two when configured (:meth:`rollout_correction`).

        The recompute runs under the weights of the last sync, as verl's fully async trainer's does with
        ``trigger_parameter_sync_step`` > 1 (``_compute_old_log_prob``: the parameters saved at the sync window's
        first local update, restored for the later ones). Before the window's first optimizer step those are the live
        weights, and the recompute keeps a copy of them when a later recompute of the window may follow an update
        (``keep_synced``: a sync period > 1, or the mini-batch pipeline); every recompute after an optimizer step of
        the window swaps that copy in (``trainer.actor_core.old_log_prob``). GRPO-Guard / Flow-DPPO's pi_old means
        come from the same forwards.

        In bypass mode with ``rollout_is`` / ``rollout_rs`` the batch carries those settings to the loss
        (``algos.loss.BYPASS_CORRECTION_KEY``), as verl's ``apply_bypass_mode`` hands them to the actor's policy
        loss: the weights and the mask are between the policy being trained and the rollout's, per loss call.

        AWM with ``bypass_mode=false``: its lp_old (the matching log-likelihood at the batch's training steps) is
        recomputed the same way; DiffusionNFT has no log-probs at all."""
        rc = self.cfg.algorithm.rollout_correction
        if "old_log_probs" not in batch.batch.keys():  # a final-latent loss: no rollout log-probs
            if not rc.bypass_mode and self.modality.mode is not None and self.modality.mode.matching_log_prob:
                with timer("old_log_prob"):
                    batch.batch["old_log_probs"] = self._pi_old_call(batch, keep_synced)
            return
        if rc.bypass_mode and (rc.rollout_is is not None or rc.rollout_rs is not None):
            batch.meta_info[BYPASS_CORRECTION_KEY] = {k: rc[k] for k in BYPASS_CORRECTION_FIELDS}
        with timer("old_log_prob"):
            if not rc.bypass_mode:
                rollout_log_probs = batch.batch["old_log_probs"]
                recomputed = self._pi_old_call(batch, keep_synced)
                # GRPO-Guard / Flow-DPPO: the same forwards' window-step means replace the rollout's (pi_old's)
                for k, v in (recomputed if isinstance(recomputed, dict) else {"old_log_probs": recomputed}).items():
                    batch.batch[k] = v
                self.rollout_correction(batch, rollout_log_probs)

    def _pi_old_call(self, batch: DataProto, keep_synced: bool):
        """The actor's ``compute_log_prob`` under the last sync's weights (the live ones, kept when ``keep_synced``,
        until the window's first optimizer step)."""
        live = PI_OLD_KEEP if keep_synced else PI_OLD_LIVE
        batch.meta_info[PI_OLD_KEY] = PI_OLD_SYNCED if self.updated_since_sync else live
        try:
            return self._actor_call("compute_log_prob", batch)
        finally:
            batch.meta_info.pop(PI_OLD_KEY)

    def rollout_correction(self, batch: DataProto, rollout_log_probs: torch.Tensor) -> None:
        """verl's decoupled-mode rollout correction (``algorithm.rollout_correction.rollout_is`` / ``rollout_rs``),
        computed by verl's ``compute_rollout_correction_and_rejection_mask`` between pi_old (recomputed) and the
        rollout's log-probs: truncated IS weights ``rollout_is_weights`` (with ``rollout_is_batch_normalize``
        divided by their mean over the batch's kept tokens / window steps, verl's rule) and a rejection mask
        ``rollout_rs_mask``,
        per token (text) or per SDE-window step (image), which the loss applies (images: a 0 weight inside the
        step's mean, as verl-omni; text: out of the token-mean and its denominator, as verl's driver takes it out of
        ``response_mask``); ``rollout_corr/*`` metrics."""
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
            rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize),
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
            self.updated_since_sync = True
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
            raise self.rank_died(method, e) from e
        except RayTaskError as e:  # with data parallelism a dead rank fails the others' collective first
            if self._a_rank_is_dead():
                raise self.rank_died(method, e) from e
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

    def rank_died(self, during: str, e: Exception) -> ActorRankDiedError:
        ckpt = self.last_checkpoint()
        return ActorRankDiedError(
            f"an actor rank died during {during} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); its "
            f"optimizer state is lost. Last checkpoint: {ckpt or 'none yet'}. Rerun the same command with "
            "trainer.resume_mode=auto to continue from it"
        )
