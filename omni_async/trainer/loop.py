"""The step loop, one for every modality and mode.

One step, as data::

    prompts (train_batch_size, each with a uid) x rollout.n
      -> agent loop: one task per sample on the rollout workers     timing_s/gen
         stream mode: each finished sample -> reward queue -> reward-loop worker, while the rest generate
                                                                     timing_s/reward_wait (tail after last sample)
      -> reward, only if rollout did not bring rm_scores (sync mode) timing_s/reward
      -> group advantages per uid, failure policy                    timing_s/adv
      -> pi_old: rollout log-probs (bypass) or recomputed            timing_s/old_log_prob
      -> actor update over mini-batches of whole groups              timing_s/update_actor
      -> weights pushed to the rollout workers with a version        timing_s/update_weights (= timing_s/weight_sync)

Where the samples come from and how they become optimizer steps are the two strategies (``strategies``); the
operations they compose are ``step_ops.StepOps``. This class wires the run (placement, reward side, agent loop),
runs the loop, validates, logs and checkpoints.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from omni_async.agent_loop.manager import AgentLoopManager
from omni_async.agent_loop.rollout_replica import SEED_VALIDATION, sample_seed
from omni_async.algos.sde import sde_window
from omni_async.cluster import init_ray, reward_pool_size
from omni_async.modality import get_modality
from omni_async.reward.wiring import RewardSide
from omni_async.sample import Sample
from omni_async.trainer.config import total_training_steps, validate
from omni_async.trainer.dataset import PromptSampler, check_prompt_lengths, load_prompts
from omni_async.trainer.metrics import (
    advantage_metrics,
    off_policy_metrics,
    response_length_metrics,
    reward_metrics,
    throughput_metrics,
    validation_metrics,
)
from omni_async.trainer.metrics_logger import MetricsLogger
from omni_async.trainer.placement import make_pools, place
from omni_async.trainer.step_ops import RewardFailureError, StepOps
from omni_async.trainer.strategies import FullBatchUpdate, FullyAsync, OneStepOffPolicy, OnPolicy, PipelinedUpdate
from omni_async.trainer.timeline import save_timeline, timeline_record
from omni_async.trainer.timer import Timer

__all__ = ["RLTrainer", "FlowGRPOTrainer", "RewardFailureError"]

# Samples in flight per rollout worker between "asked for" and "queued for reward": one device batch generating
# and one forming. More only grows the queue in front of a slow reward; fewer idles the device between batches.
GENERATING_BATCHES_PER_WORKER = 2
# Validation draws its samples' seeds from (SEED_VALIDATION, step 0) and, with val_kwargs.algo.noise_level > 0, its
# SDE window from (SEED_VALIDATION, step 1): fixed for the run, so every validation is comparable.
VALIDATION_WINDOW_STEP = 1


class RLTrainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = validate(cfg)
        init_ray(cfg)
        self.modality = get_modality(cfg.actor_rollout_ref.model.modality)
        self.run_dir = Path(cfg.trainer.run_dir)
        train_rows = load_prompts(cfg.data.train_files)
        self.val_rows = load_prompts(cfg.data.val_files)[: cfg.data.val_batch_size] if cfg.data.val_files else []
        check_prompt_lengths(
            train_rows + self.val_rows,
            cfg.data.max_prompt_length,
            lambda prompts: self.modality.prompt_lengths(cfg.actor_rollout_ref.model.path, prompts),
        )
        self.sampler = PromptSampler(train_rows, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.total_steps = total_training_steps(cfg, len(train_rows))
        pools = make_pools(cfg)
        # The reward workers start (process, imports, reward functions) while the actor workers load the model: the
        # two start-ups overlap instead of adding up.
        self.reward = RewardSide(cfg, pools.reward_pool, pools.judge_pg)
        self.placement = place(cfg, pools)
        self.reward.wait_ready()
        # verl's perf/throughput divides by every device of the run (its resource pools; here also the judges').
        self.n_devices = self.placement.pools.get_n_gpus() + (reward_pool_size(cfg) if self.placement.judge_pg else 0)
        agent = cfg.actor_rollout_ref.rollout.agent
        self.agent = AgentLoopManager(
            self.placement.rollout_workers,
            self.reward.dispatcher_factory(),
            agent.num_workers * agent.max_batch_size * GENERATING_BATCHES_PER_WORKER,
            self.reward.post_process,
            restore_worker=lambda w: self.ops.restore_worker(w),
            restartable=not self.placement.hybrid,
        )
        self.ops = StepOps(
            cfg,
            self.modality,
            self.sampler,
            self.agent,
            self.reward,
            self.placement.actor_wg,
            self.placement.rollout_workers,
            self.placement.hybrid,
            last_checkpoint=self.latest_checkpoint,
            layout=self.placement.layout,
        )
        a = cfg.async_reward
        if a.fully_async:
            self.source = FullyAsync(self.ops, self.total_steps)
        elif a.one_step_off_policy:
            self.source = OneStepOffPolicy(self.ops, self.total_steps)
        else:
            self.source = OnPolicy(self.ops)
        self.update = (PipelinedUpdate if a.update_pipeline else FullBatchUpdate)(self.ops)
        self.last_timeline: dict | None = None
        self._last_save = time.monotonic()

    # ---- one step -------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        timer = Timer()
        with timer("step"):
            collection = self.source.collection(step)
            samples, loss_mask, actor_metrics = self.update.run(collection, step, timer)
            self.source.after_update(step, timer)
        timing = dict(timer.timing)
        timing.setdefault("timing_s/reward", 0.0)
        timing.setdefault("timing_s/ref", 0.0)
        version = min(s.version for s in samples)  # the oldest weights in the step (a sample's first token's)
        metrics = {
            **reward_metrics(samples, loss_mask),
            **advantage_metrics(samples),
            **actor_metrics,
            **timing,
            **self.agent.step_metrics(),
            **throughput_metrics(samples, timing["timing_s/step"], self.n_devices),
            "rollout/policy_version": float(version),
            "async_reward/policy_version_lag": float(step - version),
            **off_policy_metrics(samples, step, partial=isinstance(self.source, FullyAsync)),
            "weight_sync/bytes": float(self.ops.take_sync_bytes()),
            **self.ops.take_corr_metrics(),
            **self.source.metrics(timing["timing_s/step"]),
        }
        if self.cfg.actor_rollout_ref.model.modality == "text":
            metrics.update(response_length_metrics(samples, int(self.cfg.actor_rollout_ref.rollout.response_length)))
        self.last_timeline = timeline_record(step + 1, collection, samples, timer)
        return metrics, samples

    # ---- validation, checkpoints ----------------------------------------------------------------------------
    def validate_step(self, step: int = 0) -> dict[str, float]:
        """``rollout.val_kwargs.n`` samples per validation prompt with the validation sampling settings (the rest of
        ``val_kwargs``; at noise level 0 deterministic ODE), scored; the first ``trainer.log_val_generations`` are
        written to ``{run_dir}/validation/step_XXXX.{png,jsonl}``."""
        n = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
        samples = [
            Sample(
                index=i * n + k,
                uid=f"val-{i}",
                row=row,
                seed=sample_seed(self.cfg.trainer.seed, 0, i * n + k, SEED_VALIDATION),
            )
            for i, row in enumerate(self.val_rows)
            for k in range(n)
        ]
        sampling = self.modality.validation_sampling(self.cfg)
        if self.modality.uses_window:
            window = self._validation_window(sampling)
            for s in samples:
                s.window = window
        samples = self.agent.start(samples, sampling=sampling).wait()
        if any(s.outcome is None for s in samples):
            self.ops.score_colocated(samples, Timer())
        if self.cfg.trainer.log_val_generations > 0:
            self.modality.save_samples(
                self.run_dir / "validation", step, samples[: int(self.cfg.trainer.log_val_generations)]
            )
        return validation_metrics(samples)

    def _validation_window(self, sampling: dict) -> tuple[int, int]:
        """No SDE step at noise level 0; else a window as training draws one, fixed for the run and shared by every
        validation sample."""
        if not sampling.get("noise_level"):
            return 0, 0
        r = self.cfg.actor_rollout_ref.rollout
        gen = torch.Generator().manual_seed(
            sample_seed(self.cfg.trainer.seed, VALIDATION_WINDOW_STEP, 0, SEED_VALIDATION)
        )
        w = sde_window(
            sampling.get("num_inference_steps", r.num_inference_steps),
            r.algo.sde_window_size,
            tuple(r.algo.sde_window_range),
            gen,
        )
        return w.start, w.stop

    def _ckpt_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def _checkpoints(self) -> list[Path]:
        return sorted(p.parent for p in (self.run_dir / "checkpoints").glob("step_*/trainer.json"))

    def save_checkpoint(self, step: int) -> None:
        path = self._ckpt_dir(step)
        self.placement.actor_wg.save_checkpoint(str(path))
        # A look-ahead rollout (one-step off-policy) may already have drawn the next prompts: save the sampler as
        # it was before that, so a resumed run trains on exactly those prompts (regenerated with its weights).
        sampler = self.ops.sampler_state_before.get(step, self.sampler.state_dict())
        state = {"step": step, "sampler": sampler}
        if isinstance(self.source, FullyAsync):
            # Fully async: the oldest draw with a group not yet trained and which groups of it (and later draws)
            # are done; a resumed run makes those draws again and regenerates the rest from their seeds.
            state["fully_async"] = self.source.position()
        (path / "trainer.json").write_text(json.dumps(state))
        self._last_save = time.monotonic()
        keep = int(self.cfg.trainer.max_ckpt_to_keep)
        if keep > 0:
            for old in self._checkpoints()[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def latest_checkpoint(self) -> Path | None:
        done = self._checkpoints()
        return done[-1] if done else None

    def resume(self) -> int:
        if self.cfg.trainer.resume_mode != "auto" or (ckpt := self.latest_checkpoint()) is None:
            return 0
        state = json.loads((ckpt / "trainer.json").read_text())
        self.placement.actor_wg.load_checkpoint(str(ckpt))
        self.sampler.load_state_dict(state["sampler"])
        if isinstance(self.source, FullyAsync):
            # A lock-step checkpoint has no rollouter position: it drew one batch per step and trained all of them,
            # so draw numbering (the seeds' and uids' draw index) goes on at its step with the sampler as saved.
            self.source.resume_position = state.get("fully_async") or {"draw": int(state["step"])}
        return int(state["step"])

    def _checkpoint_due(self, done: int) -> bool:
        t = self.cfg.trainer
        if done == self.total_steps or (t.save_freq > 0 and done % t.save_freq == 0):
            return True
        return t.save_interval_min > 0 and time.monotonic() - self._last_save >= 60.0 * t.save_interval_min

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> Path:
        t = self.cfg.trainer
        start = self.resume()
        self.ops.sync_weights(start)
        logger = MetricsLogger(
            self.run_dir,
            list(t.logger),
            self.total_steps,
            start,
            label=t.experiment_name,
            project=t.project_name,
            config=OmegaConf.to_container(self.cfg, resolve=True),
        )
        try:
            if t.val_before_train and self.val_rows:  # logged at the starting step, as verl does
                logger.log(start, self.validate_step(start), advance=False)
            for step in range(start, self.total_steps):
                metrics, samples = self.train_step(step)
                done = step + 1
                if t.test_freq > 0 and self.val_rows and done % t.test_freq == 0:
                    metrics.update(self.validate_step(done))
                logger.log(done, metrics)
                if t.log_timeline_freq > 0 and done % t.log_timeline_freq == 0:
                    save_timeline(self.run_dir, self.last_timeline)
                if t.log_image_freq > 0 and done % t.log_image_freq == 0:
                    self.modality.save_samples(self.run_dir / "samples", done, samples)
                if self._checkpoint_due(done):
                    self.save_checkpoint(done)
        finally:
            logger.close()
            if isinstance(self.source, FullyAsync):
                self.source.stop()
            self.agent.shutdown()
        return self.run_dir


FlowGRPOTrainer = RLTrainer  # the name of the first releases, kept for existing scripts
