"""The FlowGRPO step loop.

One step, as data::

    prompts (train_batch_size, each with a uid) x rollout.n
      -> agent loop: one task per sample on the rollout replicas     timing_s/gen
         stream mode: each finished sample -> reward queue -> reward-loop worker, while the rest generate
                                                                     timing_s/reward_wait (tail after last image)
      -> reward, only if rollout did not bring rm_scores (sync mode) timing_s/reward
      -> group advantages per uid, failure policy                    timing_s/adv
      -> pi_old: rollout log-probs (bypass) or recomputed            timing_s/old_log_prob
      -> actor update over mini-batches of whole groups              timing_s/update_actor (ref KL: timing_s/ref)
      -> LoRA weights pushed to the replicas with a version          timing_s/weight_sync

Sync and stream differ only in whether the agent loop has a reward dispatcher; the loop itself is one.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from verl import DataProto

from omni_async.agent_loop.manager import AgentLoopManager, Collection, Sample
from omni_async.agent_loop.rollout_replica import SEED_VALIDATION, SEED_WINDOW, RolloutReplica, sample_seed
from omni_async.algos.advantages import group_advantages
from omni_async.algos.sde import sde_window
from omni_async.cluster import init_ray
from omni_async.models.factory import sampling_config
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.manager import RewardManager, scorer_names
from omni_async.reward.pool import create_reward_workers
from omni_async.trainer.actor_worker import ACTOR_WORKERS
from omni_async.trainer.batch import samples_to_batch
from omni_async.trainer.config import streaming_enabled, validate
from omni_async.trainer.dataset import PromptRow, PromptSampler, load_prompts
from omni_async.trainer.metrics_logger import MetricsLogger, save_samples
from omni_async.trainer.strategies import FullBatchUpdate, OneStepOffPolicy, OnPolicy, PipelinedUpdate
from omni_async.trainer.timeline import save_timeline, timeline_record


class RewardFailureError(RuntimeError):
    """More than ``reward.max_failure_ratio`` of a step's samples failed to get a reward."""


class Timer:
    """Accumulates ``timing_s/<phase>`` durations and keeps each phase's wall-clock span for the timeline."""

    def __init__(self) -> None:
        self.timing: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str):
        t0, w0 = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.timing[f"timing_s/{name}"] += time.perf_counter() - t0
            self.spans.append((name, w0, time.time()))


def reward_metrics(samples: list[Sample], kept: torch.Tensor) -> dict[str, float]:
    ok = [s for s in samples if s.outcome.ok]
    scores = np.array([s.outcome.score for s in ok]) if ok else np.zeros(1)
    groups: dict[str, list[float]] = defaultdict(list)
    for s in ok:
        groups[s.uid].append(s.outcome.score)
    stds = [float(np.std(v)) for v in groups.values() if len(v) >= 2]
    compute = np.array([s.outcome.compute_s for s in samples])
    m = {
        "critic/rewards/mean": float(scores.mean()), "critic/rewards/max": float(scores.max()),
        "critic/rewards/min": float(scores.min()),
        "critic/rewards/std_mean": float(np.mean(stds)) if stds else 0.0,
        "critic/rewards/zero_std_ratio": float(np.mean([s == 0 for s in stds])) if stds else 0.0,
        "reward/failed": float(sum(s.outcome.status == "failed" for s in samples)),
        "reward/timed_out": float(sum(s.outcome.status == "timeout" for s in samples)),
        "reward/masked": float((~kept).sum()),
        "timing_s/reward_compute/mean": float(compute.mean()), "timing_s/reward_compute/max": float(compute.max()),
        "timing_s/reward_compute/p95": float(np.percentile(compute, 95)),
    }
    overhead = [s.times["serialize_s"] + s.times["dispatch_s"] for s in samples if "dispatch_s" in s.times]
    if overhead:  # streaming cost per sample: building its chunk + handing it to Ray (not queueing, not scoring)
        m["timing_s/stream_overhead/median"] = float(np.median(overhead))
    for key in {k for s in ok for k in s.outcome.extra if k.startswith("reward/")}:
        vals = [s.outcome.extra[key] for s in ok if isinstance(s.outcome.extra.get(key), (int, float))]
        if vals:
            m[key] = float(np.mean(vals))
    return m


class FlowGRPOTrainer:
    def __init__(self, cfg: DictConfig):
        self.cfg = validate(cfg)
        init_ray(cfg)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.sampler = PromptSampler(load_prompts(cfg.data.train_files), cfg.data.train_batch_size,
                                     cfg.data.shuffle, cfg.data.seed)
        self.val_rows = load_prompts(cfg.data.val_files)[: cfg.data.val_batch_size] if cfg.data.val_files else []
        self._create_pools()
        self._build_actor_and_rollout()
        self.streaming = streaming_enabled(cfg)
        self.scorer_names = scorer_names(cfg.reward)
        self.reward_manager: RewardManager | None = None  # the colocated (sync) reward, built on first use
        self.reward_workers: list = []
        dispatcher_factory = None
        if self.judge_pg is not None:
            # The reward pool's devices go to vLLM judge servers; reward functions (streamed or colocated) are
            # their clients.
            from omni_async.reward.vllm_server import launch_judge_servers

            with open_dict(cfg):
                kwargs = cfg.reward.custom_reward_function.reward_kwargs
                kwargs.base_url, kwargs.backend = launch_judge_servers(cfg.reward, self.judge_pg), "openai"
        if self.streaming:
            own_pool = cfg.reward.reward_model.enable_resource_pool and self.judge_pg is None
            self.reward_workers = create_reward_workers(cfg.reward,
                                                        self.pools.get_resource_pool("reward") if own_pool else None)
            r = cfg.reward
            dispatcher_factory = partial(RewardDispatcher, self.reward_workers, queue_size=r.queue_size,
                                         max_inflight_per_worker=r.max_inflight_per_worker, timeout_s=r.timeout_s,
                                         max_resends=r.max_resends)
        agent = cfg.actor_rollout_ref.rollout.agent
        self.agent = AgentLoopManager(self.replicas, dispatcher_factory,
                                      max_generating=agent.num_workers * agent.max_batch_size * 2)
        if self.streaming:
            self.agent.post_process = ray.get(self.reward_workers[0].has_post_process.remote())
        self.colocated_reward_calls = 0
        self.sampler_state_before: dict[int, dict] = {}  # sampler state before each step's prompts were drawn
        a = cfg.async_reward
        self.source = (OneStepOffPolicy if a.one_step_off_policy else OnPolicy)(self)
        self.update = (PipelinedUpdate if a.update_pipeline else FullBatchUpdate)(self)
        self.last_timeline: dict | None = None

    # ---- placement ------------------------------------------------------------------------------------------
    def _create_pools(self) -> None:
        from verl.single_controller.ray import ResourcePoolManager

        t, rm = self.cfg.trainer, self.cfg.reward.reward_model
        spec, mapping = {"actor_rollout": [t.n_gpus_per_node] * t.nnodes}, {"actor": "actor_rollout"}
        self.judge_pg = None
        if rm.enable and rm.rollout.name == "vllm":  # TP-device bundles for vLLM judge servers (see vllm_server)
            from omni_async.reward.vllm_server import judge_placement_group

            self.judge_pg = judge_placement_group(self.cfg.reward)
        elif rm.enable_resource_pool:
            spec["reward_pool"], mapping["reward"] = [rm.n_gpus_per_node] * rm.nnodes, "reward_pool"
        # Actor and rollout replicas share the actor/rollout pool (colocated, as in verl): each bundle is one
        # device, split between the actor worker and a replica. The reward pool is separate placement groups.
        self.pools = ResourcePoolManager(resource_pool_spec=spec, mapping=mapping, max_colocate_count=2)
        self.pools.create_resource_pool()

    def _build_actor_and_rollout(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        pool = self.pools.get_resource_pool("actor")
        cfg_dict = OmegaConf.to_container(self.cfg, resolve=True)
        actor_cls = ACTOR_WORKERS[self.cfg.actor_rollout_ref.model.modality]
        self.actor_wg = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(actor_cls), config=cfg_dict),
                                       name_prefix="actor")
        self.actor_wg.init_model()
        m, r = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.rollout
        bundles = [(pg, b) for pg in pool.get_placement_groups() for b in range(pg.bundle_count)]
        rollout_server = None
        if r.name == "vllm":  # text rollout through a vLLM server per replica (see models/vllm_text_policy)
            rollout_server = {k: r[k] for k in ("server_python", "server_url", "gpu_memory_utilization",
                                                 "server_args")}
        replica_cls = ray.remote(RolloutReplica)
        self.replicas = [
            replica_cls.options(
                num_cpus=1, num_gpus=0.5,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=bundles[i % len(bundles)][0],
                                                                     placement_group_bundle_index=bundles[i % len(bundles)][1]),
            ).remote(OmegaConf.to_container(m, resolve=True), vars(sampling_config(self.cfg)),
                     r.agent.max_batch_size, r.agent.max_wait_ms, rollout_server)
            for i in range(r.agent.num_workers)
        ]

    def sync_weights(self, version: int) -> None:
        weights = self.actor_wg.get_weights()[0]
        ray.get([rep.set_weights.remote(weights, version) for rep in self.replicas])

    # ---- one step -------------------------------------------------------------------------------------------
    def _window(self, step: int) -> tuple[int, int]:
        algo = self.cfg.actor_rollout_ref.rollout.algo
        gen = torch.Generator().manual_seed(sample_seed(self.cfg.trainer.seed, step, 0, SEED_WINDOW))
        w = sde_window(self.cfg.actor_rollout_ref.rollout.num_inference_steps, algo.sde_window_size,
                       tuple(algo.sde_window_range), gen)
        return w.start, w.stop

    def make_samples(self, step: int, rows: list[PromptRow]) -> list[Sample]:
        n = self.cfg.actor_rollout_ref.rollout.n
        return [Sample(index=p * n + k, uid=f"{step}-{p}", row=row, seed=sample_seed(self.cfg.trainer.seed, step, p * n + k))
                for p, row in enumerate(rows) for k in range(n)]

    def start_collection(self, step: int) -> Collection:
        """Draw step ``step``'s prompts and start generating (and, when streaming, scoring) its samples."""
        # Only the newest states can still be checkpointed (see save_checkpoint); older ones are dropped.
        self.sampler_state_before = {k: v for k, v in self.sampler_state_before.items() if k >= step - 1}
        self.sampler_state_before[step] = self.sampler.state_dict()
        return self.agent.start(self.make_samples(step, self.sampler.next_batch()), self._window(step))

    def collect(self, collection: Collection, timer: Timer) -> list[Sample]:
        """Wait for a step's samples. Streamed ones arrive scored; the wait after the last image is the reward tail."""
        with timer("collect_wait"):
            samples = collection.wait()
        last_generated = max(s.times["generated"] for s in samples)
        timer.timing["timing_s/gen"] += max(0.0, last_generated - collection.t_start)
        timer.timing["timing_s/reward_wait"] += max(0.0, collection.t_done - max(last_generated, collection.t_start))
        return samples

    def score_colocated(self, samples: list[Sample], timer: Timer) -> None:
        """The sync baseline's reward phase: one call over the whole batch, after rollout."""
        if self.reward_manager is None:
            self.reward_manager = RewardManager(self.cfg.reward)
        with timer("reward"):
            self.colocated_reward_calls += 1
            outcomes = self.reward_manager.score_batch([s.reward_input() for s in samples])
        now = time.time()
        for s, o in zip(samples, outcomes, strict=True):
            s.outcome = o
            s.times["scored"] = now

    def check_failures(self, samples: list[Sample], step: int, total: int, failed_so_far: int | None = None) -> None:
        """The failure policy: raise once more than ``reward.max_failure_ratio`` of the step's samples failed."""
        r = self.cfg.reward
        failed = failed_so_far if failed_so_far is not None else sum(not s.outcome.ok for s in samples)
        ratio = failed / total
        if ratio > r.max_failure_ratio or (r.on_failure == "raise" and failed):
            errors = sorted({s.outcome.error for s in samples if s.outcome is not None and not s.outcome.ok})
            raise RewardFailureError(
                f"step {step}: {ratio:.0%} of samples got no reward (reward.max_failure_ratio={r.max_failure_ratio}, "
                f"on_failure={r.on_failure}) from scorer {self.scorer_names}; first errors: {errors[:3]}")

    def training_batch(self, samples: list[Sample], window: tuple[int, int]) -> DataProto:
        """Scored samples -> the actor's batch, with group advantages and the loss mask (failed samples out)."""
        algo = self.cfg.algorithm
        valid = torch.tensor([s.outcome.ok for s in samples])
        batch = samples_to_batch(samples, window)
        adv, kept = group_advantages(batch.batch["rm_scores"].sum(-1), [s.uid for s in samples], valid,
                                     norm_by_std=algo.norm_adv_by_std_in_grpo, global_std=algo.global_std,
                                     adv_clip_max=algo.adv_clip_max)
        batch.batch["advantages"], batch.batch["loss_mask"] = adv, kept
        return batch

    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        timer = Timer()
        if self.agent.dispatcher is not None:
            self.agent.dispatcher.reset_step_counters()
        with timer("step"):
            collection = self.source.collection(step)
            samples, kept, actor_metrics = self.update.run(collection, step, timer)
            self.source.after_update(step, timer)
        timing = dict(timer.timing)
        timing.setdefault("timing_s/reward", 0.0)
        timing["timing_s/ref"] = actor_metrics.pop("timing_s/ref", 0.0)
        version = min(s.generated["version"] for s in samples)
        metrics = {**reward_metrics(samples, kept), **actor_metrics, **timing,
                   "perf/throughput": len(samples) / timing["timing_s/step"],
                   "rollout/policy_version": float(version), "async_reward/policy_version_lag": float(step - version)}
        if self.agent.dispatcher is not None:
            metrics.update(self.agent.on_loop(self.agent.dispatcher.metrics))
        self.last_timeline = timeline_record(step + 1, collection, samples, timer)
        return metrics, samples

    # ---- validation, checkpoints ----------------------------------------------------------------------------
    def validate_step(self) -> dict[str, float]:
        """Deterministic (noise_level 0 everywhere, ODE) samples of the validation prompts, scored."""
        samples = [Sample(index=i, uid=f"val-{i}", row=row, seed=sample_seed(self.cfg.trainer.seed, 0, i, SEED_VALIDATION))
                   for i, row in enumerate(self.val_rows)]
        samples = self.agent.start(samples, (0, 0)).wait()
        if any(s.outcome is None for s in samples):
            self.score_colocated(samples, Timer())
        scores = [s.outcome.score for s in samples if s.outcome.ok]
        return {"val/reward/mean": float(np.mean(scores)) if scores else float("nan")}

    def _ckpt_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def save_checkpoint(self, step: int) -> None:
        path = self._ckpt_dir(step)
        self.actor_wg.save_checkpoint(str(path))
        # A look-ahead rollout (one-step off-policy) may already have drawn the next prompts: save the sampler as
        # it was before that, so a resumed run trains on exactly those prompts (regenerated with its weights).
        sampler = self.sampler_state_before.get(step, self.sampler.state_dict())
        (path / "trainer.json").write_text(json.dumps({"step": step, "sampler": sampler}))

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p.parent for p in (self.run_dir / "checkpoints").glob("step_*/trainer.json"))
        return done[-1] if done else None

    def resume(self) -> int:
        if self.cfg.trainer.resume_mode != "auto" or (ckpt := self.latest_checkpoint()) is None:
            return 0
        state = json.loads((ckpt / "trainer.json").read_text())
        self.actor_wg.load_checkpoint(str(ckpt))
        self.sampler.load_state_dict(state["sampler"])
        return int(state["step"])

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> Path:
        t = self.cfg.trainer
        start = self.resume()
        self.sync_weights(start)
        logger = MetricsLogger(self.run_dir, list(t.logger), t.total_training_steps, start)
        try:
            for step in range(start, t.total_training_steps):
                metrics, samples = self.train_step(step)
                done = step + 1
                if t.test_freq > 0 and self.val_rows and done % t.test_freq == 0:
                    metrics.update(self.validate_step())
                logger.log(done, metrics)
                if t.log_timeline_freq > 0 and done % t.log_timeline_freq == 0:
                    save_timeline(self.run_dir, self.last_timeline)
                if t.log_image_freq > 0 and done % t.log_image_freq == 0:
                    save_samples(self.run_dir / "samples", done, samples)
                if (t.save_freq > 0 and done % t.save_freq == 0) or done == t.total_training_steps:
                    self.save_checkpoint(done)
        finally:
            logger.close()
            self.agent.shutdown()
        return self.run_dir

