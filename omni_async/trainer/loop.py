"""The step loop, one for every modality, mode and layout.

One sample, from prompt to gradient::

    rollouter (agent_loop.rollouter, the only producer)   draws prompts (agent_loop.draws), starts whole groups
      -> agent loop: one task per sample on a rollout worker (the layout's), each finished sample streamed to the
         reward queue -> reward-loop worker, while the rest generate                         timing_s/gen
      -> a scored group waits in the rollouter until a step takes it                          timing_s/collect_wait
    update (trainer.update): per chunk of groups (the step, or a mini-batch as it is scored)
      -> reward, only if rollout did not bring it (sync reward)                               timing_s/reward
      -> group advantages per uid, failure policy                                             timing_s/adv
      -> pi_old: rollout log-probs (bypass) or recomputed                                     timing_s/old_log_prob
      -> actor update over mini-batches of whole groups                                       timing_s/update_actor
    weights to the rollout every sync period (the layout's sync), a new production window    timing_s/update_weights

The mode (``trainer.mode.Mode``) is the rollouter's settings and the update's chunk size; the layout
(``trainer.layout``) is placement, weight sync and worker restore. This class wires the run (placement, reward side,
agent loop), runs the loop, validates, logs, checkpoints and hands pictures to a background thread.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from ray.exceptions import ActorUnavailableError, RayActorError

from omni_async.agent_loop.draws import SEED_VALIDATION, Draws, sample_seed
from omni_async.agent_loop.manager import AgentLoopManager, RolloutWorkersLostError
from omni_async.agent_loop.producer import Producer
from omni_async.agent_loop.rollouter import Group, Rollouter
from omni_async.algos.sde import sde_window
from omni_async.algos.staleness import feedback_rounds
from omni_async.cluster import init_ray, reward_pool_size
from omni_async.modality import modality_of
from omni_async.reward.wiring import RewardSide
from omni_async.sample import Sample
from omni_async.trainer.atomic_files import write_text_atomic
from omni_async.trainer.config import check_at_start, plan, total_training_steps
from omni_async.trainer.dataset import PromptSampler, check_prompt_lengths, first_rows, load_prompts
from omni_async.trainer.layout import make_layout
from omni_async.trainer.metrics import (
    advantage_metrics,
    discard_metrics,
    off_policy_metrics,
    response_length_metrics,
    reward_metrics,
    throughput_metrics,
    validation_metrics,
)
from omni_async.trainer.metrics_logger import MetricsLogger
from omni_async.trainer.mode import Mode
from omni_async.trainer.placement import make_pools, place
from omni_async.trainer.profiling import StepWindows, require_nsys
from omni_async.trainer.step_ops import RewardFailureError, StepOps
from omni_async.trainer.timeline import save_timeline, timeline_record
from omni_async.trainer.timer import Timer
from omni_async.trainer.update import update

__all__ = ["RLTrainer", "FlowGRPOTrainer", "RewardFailureError"]

logger = logging.getLogger(__name__)

# Samples in flight per rollout worker between "asked for" and "queued for reward": one device batch generating
# and one forming. More only grows the queue in front of a slow reward; fewer idles the device between batches.
GENERATING_BATCHES_PER_WORKER = 2
# Validation draws its samples' seeds from (SEED_VALIDATION, step 0) and, with val_kwargs.algo.noise_level > 0, its
# SDE window from (SEED_VALIDATION, step 1): fixed for the run, so every validation is comparable.
VALIDATION_WINDOW_STEP = 1
# A pool idle for more than this share of the last IDLE_WINDOW steps is logged as a WARNING (with what to change).
IDLE_WARNING = 0.5
IDLE_WINDOW = 10


class RLTrainer:
    def __init__(self, cfg: DictConfig):
        cfg = self._begin(cfg)
        train_rows = first_rows(load_prompts(cfg.data.train_files), cfg.data.train_max_samples)
        self.val_rows = (
            first_rows(load_prompts(cfg.data.val_files), cfg.data.val_max_samples, cfg.data.val_batch_size)
            if cfg.data.val_files
            else []
        )
        check_prompt_lengths(
            train_rows + self.val_rows,
            cfg.data.max_prompt_length,
            lambda prompts: self.modality.prompt_lengths(cfg.actor_rollout_ref.model.path, prompts),
        )
        self.sampler = PromptSampler(train_rows, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.draws = Draws.from_config(cfg, self.sampler, self.modality.uses_window)
        self.total_steps = total_training_steps(cfg, len(train_rows), self.mode)
        self.layout = make_layout(cfg, self.mode, self.plan.layout)
        pools = make_pools(cfg, self.layout)
        # The reward workers start (process, imports, reward functions) while the actor workers load the model: the
        # two start-ups overlap instead of adding up.
        self.reward = RewardSide(cfg, pools.reward_pool, pools.judge_pg)
        self.placement = place(cfg, pools, self.layout, self.plan.nsys)
        self.reward.wait_ready()
        # verl's perf/throughput divides by every device of the run (its resource pools; here also the judges').
        self.n_devices = self.placement.pools.get_n_gpus() + (reward_pool_size(cfg) if self.placement.judge_pg else 0)
        agent = cfg.actor_rollout_ref.rollout.agent
        self.agent = AgentLoopManager(
            self.placement.rollout_workers,
            self.reward.dispatcher_factory(),
            agent.num_workers * agent.max_batch_size * GENERATING_BATCHES_PER_WORKER,
            self.reward.post_process,
            restore_worker=self.layout.restore,
            restartable=not self.layout.rollout_is_actor,
            # An image's requests sent together share a device batch and finish together: a call per worker per
            # turn, a device batch at most. A text response ends at its own token and is answered alone.
            coalesce=agent.max_batch_size if self.modality.name == "image" else 0,
        )
        self.layout.on_death = self.agent.worker_died
        self.ops = StepOps(cfg, self.modality, self.reward, self.placement.actor_wg, self.latest_checkpoint)
        # The trainer's handle on the rollouter (on the agent loop): started at the first step (after a resume: at
        # its position).
        self.producer: Producer | None = None
        self.resume_position: dict | None = None
        self.rollout_version = 0  # the weights version the rollout workers hold
        self.pictures = ThreadPoolExecutor(1, thread_name_prefix="pictures")  # never on the training path
        self.last_timeline: dict | None = None
        self._idle: list[tuple[float, float]] = []
        # the rollouter's dropped samples, their staleness sum and dropped groups at the last step
        self._dropped_before = (0.0, 0.0, 0.0)
        self._t_metrics = time.perf_counter()
        self._last_save = time.monotonic()
        logger.info(
            "mode %s (cap %d groups per sync window, lag bound %d, %d groups per step), %s layout, %d steps",
            self.mode.name,
            self.mode.cap,
            self.mode.bound,
            self.mode.groups_per_step,
            self.layout.name,
            self.total_steps,
        )

    def _begin(self, given: DictConfig) -> DictConfig:
        """What every trainer does first (offline DPO's too): the config checked, Ray joined, the plan decided, the
        resolved config written to the run directory. Returns the validated config, the one the run reads
        (``validate`` leaves ``given`` as it was)."""
        self.cfg = cfg = check_at_start(given)  # before Ray starts: a typo costs a second, not a cluster start
        # Decided once from the validated config, then handed down: nothing below reads the mode, the layout or the
        # profiling plan from cfg.
        self.plan = plan(self.cfg)
        self.mode = self.plan.mode
        require_nsys(self.plan.nsys)  # global_profiler.tool=nsys: the binary Ray's nsight plugin calls, before Ray
        init_ray(cfg)
        self.modality = modality_of(self.cfg)
        self.run_dir = Path(cfg.trainer.run_dir)
        # The resolved config beside the curves it produced: which loss and settings made a run is on record.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        return cfg

    # ---- the producer -----------------------------------------------------------------------------------------
    @property
    def rollouter(self) -> Rollouter | None:
        """The running rollouter, for tests that inspect it on the agent loop (the trainer goes through
        :attr:`producer`)."""
        return self.producer.rollouter if self.producer is not None else None

    @rollouter.setter
    def rollouter(self, value: None) -> None:
        if value is not None:  # a rollouter is started through Producer.start, never set from outside
            raise ValueError("only None: forget the stopped producer")
        self.producer = None

    def sync_weights(self, version: int) -> None:
        """Make ``version`` the rollout's weights at once (the start of a run, or a test's)."""
        self.layout.sync(version)
        self.rollout_version = int(version)
        self.ops.weights_synced()

    def _start_producer(self, step: int) -> None:
        pos = self.resume_position or {}
        if pos.get("sampler") is not None:
            self.sampler.load_state_dict(pos["sampler"])
        self.producer = Producer.start(
            self.agent,
            self.draws,
            self.mode.producer,
            groups_to_train=(self.total_steps - step) * self.mode.groups_per_step,
            rollout_version=self.rollout_version,
            first_draw=int(pos.get("draw", 0)),
            finished=pos.get("finished"),
        )
        self._t_metrics = time.perf_counter()

    def set_mode(self, mode: Mode) -> None:
        """Go on in another mode with the same groups per step (tests, benchmarks): the producer takes the new
        settings in place, keeping the groups it has started (a lock-step draw started under version v stays v's)."""
        self.mode = mode
        self.layout.set_mode(mode)
        if self.producer is not None:
            self.producer.set_settings(mode.producer)

    def _take(self, step: int, n: int, among: int, timer: Timer) -> list[Group]:
        """The step's next groups, through the layout (which may lend the trainer devices to generation meanwhile)."""
        try:
            return self.layout.collect(self.producer, step, n, among, timer)
        except RolloutWorkersLostError as e:
            if self.layout.rollout_is_actor:  # the rollout workers are the actor ranks
                raise self.ops.rank_died("rollout", e) from e
            raise
        except (RayActorError, ActorUnavailableError) as e:  # a trainer rank lent to generation died
            raise self.ops.rank_died("generation on a lent trainer device", e) from e

    def after_update(self, step: int, timer: Timer) -> None:
        """Every sync period, the new weights to the rollout and a new production window. Staged beside generation
        where the layout can; where it cannot (the hybrid layout), or a lock-step draw must keep its one version and
        the set is written in place, once every started sample is generated."""
        version = step + 1
        if version % self.mode.sync_period:
            return
        quiet = self.layout.sync_needs_idle_rollout or (self.mode.lock_step and not self.layout.stages)
        if quiet:
            with timer("wait_next_rollout"):
                self.producer.quiesce()
        # Staged (written in before the first request for it) only while a draw generates beside it; with nothing in
        # flight in lock-step the set is written at once, so the rollout holds the newest weights between steps.
        activate = quiet or (self.mode.lock_step and not self.producer.live_groups())
        with timer("update_weights"):  # verl's name; timing_s/weight_sync is this project's first name for it
            self.layout.sync(version, activate=activate)
        timer.timing["timing_s/weight_sync"] = timer.timing["timing_s/update_weights"]
        self.rollout_version = version
        self.ops.weights_synced()
        self.producer.publish(version)

    def producer_metrics(self, step_s: float, waited_s: float) -> dict[str, float]:
        """The rollouter's counters and both pools' idle shares (verl's fully async names)."""
        now = time.perf_counter()
        wall, self._t_metrics = now - self._t_metrics, now
        m = self.producer.metrics()
        now_dropped = (
            m["fully_async/count/dropped_stale_samples"],
            m.pop("fully_async/count/dropped_staleness_sum"),
            m["fully_async/count/dropped_stale_groups"],
        )
        n, s, groups = (a - b for a, b in zip(now_dropped, self._dropped_before, strict=True))
        self._dropped_before = now_dropped
        m["training/off_policy/dropped_samples"] = n  # this step's samples of groups dropped past the lag bound
        # verl v1's names (its replay buffer's stale-group eviction): groups evicted this step, and the versions each
        # spanned (step - version + 1, its max_off_policy_threshold's count; the mean over their samples)
        m["training/off_policy/evicted_samples"] = groups
        if n > 0:
            m["training/off_policy/evicted_samples_staleness/mean"] = s / n + 1
        trainer_idle = waited_s / step_s if step_s > 0 else 0.0
        rollout_idle = min(1.0, self.agent.take_idle_s() / wall) if wall > 0 else 0.0
        m["fully_async/trainer/idle_ratio"], m["fully_async/rollouter/idle_ratio"] = trainer_idle, rollout_idle
        # Each pool's busy share of the step (the trainer's counts the time its devices generated while lent).
        m["perf/busy_fraction/trainer_pool"] = 1.0 - trainer_idle
        m["perf/busy_fraction/rollout_pool"] = 1.0 - rollout_idle
        self._idle = [*self._idle[-(IDLE_WINDOW - 1) :], (trainer_idle, rollout_idle)]
        if len(self._idle) == IDLE_WINDOW:
            trainer_mean = sum(t for t, _ in self._idle) / IDLE_WINDOW
            rollout_mean = sum(r for _, r in self._idle) / IDLE_WINDOW
            if trainer_mean > IDLE_WARNING:
                logger.warning(
                    "the trainer waited for samples %.0f %% of the last %d steps: the run is rollout-bound (more "
                    "rollout workers, or more staleness: async_training.staleness_threshold with "
                    "async_reward.fully_async=true)",
                    100 * trainer_mean,
                    IDLE_WINDOW,
                )
            if rollout_mean > IDLE_WARNING:
                logger.warning(
                    "the rollout workers had no request %.0f %% of the last %d steps: production waits for the "
                    "trainer (mode %s, cap %d groups per sync window)",
                    100 * rollout_mean,
                    IDLE_WINDOW,
                    self.mode.name,
                    self.mode.cap,
                )
            self._idle = []
        return m

    # ---- one step -------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        timer = Timer()
        with timer("step"):
            if self.producer is None:
                self._start_producer(step)
            groups, samples, loss_mask, actor_metrics = update(
                self.ops,
                self.mode,
                lambda step, n, among: self._take(step, n, among, timer),
                step,
                timer,
                int(self.cfg.actor_rollout_ref.rollout.n),
            )
            # DiffusionNFT's old policy, before the sync: refreshed by the step count, its ramp read at the rounds
            # of feedback behind the step's data (the step itself unless trained late)
            rounds = feedback_rounds(g.version() for g in groups)
            actor_metrics.update(self.ops.refresh_old_policy(step + 1, rounds))
            self.after_update(step, timer)
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
            **off_policy_metrics(samples, step, partial=not self.mode.lock_step),
            "weight_sync/bytes": float(self.layout.take_sync_bytes()),
            **self.ops.take_corr_metrics(),
        }
        layout_metrics = self.layout.step_metrics(self.agent)
        # Time a lent trainer device generated is work, not waiting (verl v1: switch_wait is not idle).
        waited = timing.get("timing_s/collect_wait", 0.0) - layout_metrics.get(
            "separate_async/switch/lent_busy_seconds", 0.0
        )
        metrics.update(layout_metrics)
        metrics.update(self.producer_metrics(timing["timing_s/step"], max(0.0, waited)))
        metrics.update(discard_metrics(metrics))
        if self.cfg.actor_rollout_ref.model.modality == "text":
            metrics.update(response_length_metrics(samples, int(self.cfg.actor_rollout_ref.rollout.response_length)))
        t0 = min(s.times.requested for s in samples)
        self.last_timeline = timeline_record(step + 1, t0, samples, timer)
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
        samples = self.agent.generate(samples, sampling=sampling)
        if any(s.outcome is None for s in samples):
            self.ops.score_colocated(samples, Timer(), teacher=False)  # validation trains nothing
        if self.cfg.trainer.log_val_generations > 0:
            self.modality.save_samples(
                self._out_dir("validation_data_dir", "validation"),
                step,
                samples[: int(self.cfg.trainer.log_val_generations)],
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
            sampling.get("num_inference_steps", r.pipeline.num_inference_steps),
            r.algo.sde_window_size,
            tuple(r.algo.sde_window_range),
            gen,
        )
        return w.start, w.stop

    def _out_dir(self, key: str, default: str) -> Path:
        """``trainer.<key>`` (verl's directory keys) when set, else ``{run_dir}/<default>``."""
        given = self.cfg.trainer[key]
        return Path(given) if given is not None else self.run_dir / default

    def _ckpt_dir(self, step: int) -> Path:
        return self._out_dir("default_local_dir", "checkpoints") / f"step_{step:06d}"

    def _checkpoints(self) -> list[Path]:
        return sorted(p.parent for p in self._out_dir("default_local_dir", "checkpoints").glob("step_*/trainer.json"))

    def save_checkpoint(self, step: int) -> None:
        """The actor's weights and optimizer, and the producer's position: the oldest draw with a group not yet
        trained, the sampler state before it and the groups of that draw and later ones already trained (a resumed
        run makes those draws again and regenerates the rest from their seeds, with the checkpoint's weights)."""
        path = self._ckpt_dir(step)
        self.placement.actor_wg.save_checkpoint(str(path))
        if self.producer is not None:
            position = self.producer.position()
        else:
            position = {"draw": step, "sampler": self.sampler.state_dict(), "finished": {}}
        # Written last and atomically: its presence marks the checkpoint complete (a kill before leaves the last one).
        write_text_atomic(path / "trainer.json", json.dumps({"step": step, **position}))
        self._last_save = time.monotonic()
        logger.info("checkpoint saved at step %d: %s (next draw %d)", step, path, position["draw"])
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
        step = int(state["step"])
        # A lock-step checkpoint of earlier releases has no draw: it drew one batch per step and trained all of them.
        self.resume_position = {
            "draw": int(state.get("draw", step)),
            "sampler": state["sampler"],
            "finished": state.get("finished") or {},
        }
        self.sampler.load_state_dict(state["sampler"])
        logger.info("resumed from %s at step %d (draw %d)", ckpt, step, self.resume_position["draw"])
        return step

    def _checkpoint_due(self, done: int) -> bool:
        t = self.cfg.trainer
        if done == self.total_steps or (t.save_freq > 0 and done % t.save_freq == 0):
            return True
        return t.save_interval_min > 0 and time.monotonic() - self._last_save >= 60.0 * t.save_interval_min

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> Path:
        t = self.cfg.trainer
        start = self.resume()
        self.sync_weights(start)
        logger_ = MetricsLogger(
            self.run_dir,
            list(t.logger),
            self.total_steps,
            start,
            label=t.experiment_name,
            project=t.project_name,
            config=OmegaConf.to_container(self.cfg, resolve=True),
        )
        profile = StepWindows(self.plan.nsys, self.placement.actor_wg)  # global_profiler.steps, 1-based
        try:
            if t.val_before_train and self.val_rows:  # logged at the starting step, as verl does
                logger_.log(start, self.validate_step(start), advance=False)
            for step in range(start, self.total_steps):
                done = step + 1
                profile.before(done)
                metrics, samples = self.train_step(step)
                if t.test_freq > 0 and self.val_rows and done % t.test_freq == 0:
                    metrics.update(self.validate_step(done))
                logger_.log(done, metrics)
                if t.log_timeline_freq > 0 and done % t.log_timeline_freq == 0:
                    self.pictures.submit(save_timeline, self.run_dir, self.last_timeline)
                if t.log_image_freq > 0 and done % t.log_image_freq == 0:
                    self.pictures.submit(
                        self.modality.save_samples, self._out_dir("rollout_data_dir", "samples"), done, samples
                    )
                if self._checkpoint_due(done):
                    self.save_checkpoint(done)
                profile.after(done)  # verl's window holds the step's validation and checkpoint too
            profile.close()
        finally:
            logger_.close()
            self.close()
        return self.run_dir

    def close(self) -> None:
        """Stop the producer and the agent loop; wait for the pictures still being drawn. Idempotent."""
        if self.producer is not None:
            self.producer.stop()
            self.producer = None
        if self.agent.loop.is_running():
            self.agent.shutdown()
        self.pictures.shutdown(wait=True)


FlowGRPOTrainer = RLTrainer  # the name of the first releases, kept for existing scripts
