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
from omegaconf import DictConfig, OmegaConf
from verl import DataProto

from omni_async.agent_loop.manager import AgentLoopManager, Collection, Sample
from omni_async.agent_loop.rollout_replica import SEED_VALIDATION, SEED_WINDOW, RolloutReplica, sample_seed
from omni_async.algos.advantages import group_advantages
from omni_async.algos.sde import sde_window
from omni_async.cluster import init_ray
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.manager import RewardManager, scorer_names
from omni_async.reward.pool import create_reward_workers
from omni_async.trainer.actor_worker import FlowGRPOActorWorker, sampling_config
from omni_async.trainer.config import streaming_enabled, validate
from omni_async.trainer.dataset import PromptRow, PromptSampler, load_prompts
from omni_async.trainer.metrics_logger import MetricsLogger, save_sample_grid


class RewardFailureError(RuntimeError):
    """More than ``reward.max_failure_ratio`` of a step's samples failed to get a reward."""


class Timer:
    def __init__(self) -> None:
        self.timing: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timing[f"timing_s/{name}"] += time.perf_counter() - t0


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
        if self.streaming:
            pool = self.pools.get_resource_pool("reward") if cfg.reward.reward_model.enable_resource_pool else None
            self.reward_workers = create_reward_workers(cfg.reward, pool)
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

    # ---- placement ------------------------------------------------------------------------------------------
    def _create_pools(self) -> None:
        from verl.single_controller.ray import ResourcePoolManager

        t, rm = self.cfg.trainer, self.cfg.reward.reward_model
        spec, mapping = {"actor_rollout": [t.n_gpus_per_node] * t.nnodes}, {"actor": "actor_rollout"}
        if rm.enable_resource_pool:
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
        self.actor_wg = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(FlowGRPOActorWorker), config=cfg_dict),
                                       name_prefix="actor")
        self.actor_wg.init_model()
        m, r = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.rollout
        bundles = [(pg, b) for pg in pool.get_placement_groups() for b in range(pg.bundle_count)]
        replica_cls = ray.remote(RolloutReplica)
        self.replicas = [
            replica_cls.options(
                num_cpus=1, num_gpus=0.5,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=bundles[i % len(bundles)][0],
                                                                     placement_group_bundle_index=bundles[i % len(bundles)][1]),
            ).remote(OmegaConf.to_container(m, resolve=True), vars(sampling_config(self.cfg)),
                     r.agent.max_batch_size, r.agent.max_wait_ms)
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

    def collect(self, collection: Collection, timer: Timer) -> list[Sample]:
        """Wait for a step's samples. Streamed ones arrive scored; the wait after the last image is the reward tail."""
        samples = collection.wait()
        t_done = time.time()
        last_generated = max(s.times["generated"] for s in samples)
        timer.timing["timing_s/gen"] += max(0.0, last_generated - collection.t_start)
        timer.timing["timing_s/reward_wait"] += max(0.0, t_done - max(last_generated, collection.t_start))
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

    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        cfg = self.cfg
        timer = Timer()
        if self.agent.dispatcher is not None:
            self.agent.dispatcher.reset_step_counters()
        with timer("step"):
            window = self._window(step)
            samples = self.collect(self.agent.start(self.make_samples(step, self.sampler.next_batch()), window), timer)
            batch = samples_to_batch(samples, window)
            if "rm_scores" not in batch.batch.keys():  # as in verl: reward only when rollout did not bring it
                self.score_colocated(samples, timer)
                batch = samples_to_batch(samples, window)
            with timer("adv"):
                valid = torch.tensor([s.outcome.ok for s in samples])
                failed_ratio = 1.0 - valid.float().mean().item()
                if failed_ratio > cfg.reward.max_failure_ratio or (cfg.reward.on_failure == "raise" and failed_ratio):
                    errors = sorted({s.outcome.error for s in samples if not s.outcome.ok})
                    raise RewardFailureError(
                        f"step {step}: {failed_ratio:.0%} of samples got no reward (reward.max_failure_ratio="
                        f"{cfg.reward.max_failure_ratio}, on_failure={cfg.reward.on_failure}) from scorer "
                        f"{self.scorer_names}; first errors: {errors[:3]}")
                scores = torch.tensor([s.outcome.score if s.outcome.ok else 0.0 for s in samples])
                algo = cfg.algorithm
                adv, kept = group_advantages(scores, [s.uid for s in samples], valid,
                                             norm_by_std=algo.norm_adv_by_std_in_grpo, global_std=algo.global_std,
                                             adv_clip_max=algo.adv_clip_max)
                batch.batch["advantages"], batch.batch["loss_mask"] = adv, kept
            with timer("old_log_prob"):
                if not algo.rollout_correction.bypass_mode:
                    batch.batch["old_log_probs"] = self.actor_wg.compute_log_prob(batch)[0]
            with timer("update_actor"):
                actor_metrics = self.actor_wg.update_actor(batch)[0] if kept.any() else {}
            with timer("weight_sync"):
                self.sync_weights(step + 1)
        timing = dict(timer.timing)
        timing.setdefault("timing_s/reward", 0.0)
        timing["timing_s/ref"] = actor_metrics.pop("timing_s/ref", 0.0)
        metrics = {**reward_metrics(samples, kept), **actor_metrics, **timing,
                   "perf/throughput": len(samples) / timing["timing_s/step"],
                   "rollout/policy_version": float(min(s.generated["version"] for s in samples))}
        if self.agent.dispatcher is not None:
            metrics.update(self.agent.call(_dispatcher_metrics(self.agent.dispatcher)))
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
        (path / "trainer.json").write_text(json.dumps({"step": step, "sampler": self.sampler.state_dict()}))

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
                if t.log_image_freq > 0 and done % t.log_image_freq == 0:
                    save_sample_grid(self.run_dir / "samples" / f"step_{done:04d}.png",
                                     [s.generated["image"] for s in samples],
                                     [f"{s.outcome.score:.3f}" if s.outcome.ok else s.outcome.status for s in samples])
                if (t.save_freq > 0 and done % t.save_freq == 0) or done == t.total_training_steps:
                    self.save_checkpoint(done)
        finally:
            logger.close()
            self.agent.shutdown()
        return self.run_dir


def samples_to_batch(samples: list[Sample], window: tuple[int, int]) -> DataProto:
    """The training batch; ``rm_scores`` [N, 1] only when every sample already has its reward outcome."""
    tensors = {"window_latents": torch.stack([s.generated["window_latents"] for s in samples]),
               "old_log_probs": torch.stack([s.generated["log_probs"] for s in samples])}
    if all(s.outcome is not None for s in samples):
        tensors["rm_scores"] = torch.tensor([[s.outcome.score if s.outcome.ok else 0.0] for s in samples])
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors={"prompt": np.array([s.row.prompt for s in samples], dtype=object),
                     "uid": np.array([s.uid for s in samples], dtype=object)},
        meta_info={"window_start": window[0]},
    )


async def _dispatcher_metrics(dispatcher: RewardDispatcher) -> dict[str, float]:
    return dispatcher.metrics()
