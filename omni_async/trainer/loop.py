"""The FlowGRPO step loop.

One step, as data::

    prompts (train_batch_size, each with a uid) x rollout.n
      -> rollout replicas (one request per sample)            timing_s/gen
      -> reward (sync: one colocated call after rollout)      timing_s/reward
      -> group advantages per uid, failure policy             timing_s/adv
      -> pi_old: rollout log-probs (bypass) or recomputed     timing_s/old_log_prob
      -> actor update over mini-batches of whole groups       timing_s/update_actor (ref KL inside: timing_s/ref)
      -> LoRA weights pushed to the replicas with a version   timing_s/weight_sync

How samples are generated and scored is a :class:`CollectStrategy`; the rest of the loop is the same for every
mode, so a new mode is a new strategy, never a second copy of the loop.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from verl import DataProto

from omni_async.agent_loop.rollout_replica import SEED_VALIDATION, SEED_WINDOW, RolloutReplica, sample_seed
from omni_async.algos.advantages import group_advantages
from omni_async.algos.sde import sde_window
from omni_async.cluster import init_ray
from omni_async.reward.manager import RewardManager, RewardOutcome
from omni_async.trainer.actor_worker import FlowGRPOActorWorker, sampling_config
from omni_async.trainer.config import ConfigError, streaming_enabled, validate
from omni_async.trainer.dataset import PromptRow, PromptSampler, load_prompts
from omni_async.trainer.metrics_logger import MetricsLogger, save_sample_grid


class RewardFailureError(RuntimeError):
    """More than ``reward.max_failure_ratio`` of a step's samples failed to get a reward."""


@dataclass
class Sample:
    index: int
    uid: str
    row: PromptRow
    seed: int
    generated: dict[str, Any] | None = None
    outcome: RewardOutcome | None = None
    times: dict[str, float] = field(default_factory=dict)

    def reward_input(self) -> dict[str, Any]:
        """The minimal record a reward function sees: never trajectory latents."""
        return {"prompt": self.row.prompt, "data_source": self.row.data_source,
                "ground_truth": self.row.ground_truth, "extra_info": self.row.extra_info,
                "image": self.generated["image"]}


class CollectStrategy(Protocol):
    """Fill ``sample.generated`` and ``sample.outcome`` for every sample; record phase timings."""

    def collect(self, samples: list[Sample], window: tuple[int, int], timer: Timer) -> None: ...


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


def generate_all(replicas: list, samples: list[Sample], window: tuple[int, int]) -> None:
    """One request per sample, spread round-robin; replicas batch concurrent requests themselves."""
    refs = [replicas[s.index % len(replicas)].generate.remote(s.row.prompt, s.seed, window) for s in samples]
    for s, out in zip(samples, ray.get(refs), strict=True):
        s.generated = out
        s.times.update(generated=out["t_gen_end"], gen_start=out["t_gen_start"])


class SyncCollect:
    """The baseline: generate the whole batch, then score it in one colocated reward call."""

    def __init__(self, replicas: list, reward_manager: RewardManager):
        self.replicas, self.reward_manager = replicas, reward_manager
        self.colocated_calls = 0

    def collect(self, samples: list[Sample], window: tuple[int, int], timer: Timer) -> None:
        with timer("gen"):
            generate_all(self.replicas, samples, window)
        with timer("reward"):
            self.colocated_calls += 1
            outcomes = self.reward_manager.score_batch([s.reward_input() for s in samples])
        now = time.time()
        for s, o in zip(samples, outcomes, strict=True):
            s.outcome = o
            s.times["scored"] = now


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
        self._build_actor_and_rollout()
        self.reward_manager = RewardManager(cfg.reward)
        if streaming_enabled(cfg):
            raise ConfigError("reward.streaming: streaming rewards to reward-loop workers are not available in this "
                              "build yet (only the sync baseline is). Fix: set reward.streaming=false")
        self.strategy: CollectStrategy = SyncCollect(self.replicas, self.reward_manager)

    # ---- placement ------------------------------------------------------------------------------------------
    def _build_actor_and_rollout(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager

        t = self.cfg.trainer
        # Actor and rollout replicas share the actor/rollout pool (colocated, as in verl); each bundle is one
        # device, split between the actor worker and a replica.
        self.pools = ResourcePoolManager(resource_pool_spec={"actor_rollout": [t.n_gpus_per_node] * t.nnodes},
                                         mapping={"actor": "actor_rollout"}, max_colocate_count=2)
        self.pools.create_resource_pool()
        pool = self.pools.get_resource_pool("actor")
        cfg_dict = OmegaConf.to_container(self.cfg, resolve=True)
        self.actor_wg = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(FlowGRPOActorWorker), config=cfg_dict),
                                       name_prefix="actor")
        self.actor_wg.init_model()
        m, r = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.rollout
        pgs = pool.get_placement_groups()
        bundles = [(pg, b) for pg in pgs for b in range(pg.bundle_count)]
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

    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        cfg = self.cfg
        timer = Timer()
        with timer("step"):
            samples = self.make_samples(step, self.sampler.next_batch())
            window = self._window(step)
            self.strategy.collect(samples, window, timer)
            with timer("adv"):
                valid = torch.tensor([s.outcome.ok for s in samples])
                failed_ratio = 1.0 - valid.float().mean().item()
                if failed_ratio > cfg.reward.max_failure_ratio or (cfg.reward.on_failure == "raise" and failed_ratio):
                    errors = sorted({s.outcome.error for s in samples if not s.outcome.ok})
                    raise RewardFailureError(
                        f"step {step}: {failed_ratio:.0%} of samples got no reward (reward.max_failure_ratio="
                        f"{cfg.reward.max_failure_ratio}, on_failure={cfg.reward.on_failure}) from scorer "
                        f"{self.reward_manager.scorer_names}; first errors: {errors[:3]}")
                scores = torch.tensor([s.outcome.score if s.outcome.ok else 0.0 for s in samples])
                algo = cfg.algorithm
                adv, kept = group_advantages(scores, [s.uid for s in samples], valid,
                                             norm_by_std=algo.norm_adv_by_std_in_grpo, global_std=algo.global_std,
                                             adv_clip_max=algo.adv_clip_max)
            batch = DataProto.from_dict(
                tensors={"window_latents": torch.stack([s.generated["window_latents"] for s in samples]),
                         "old_log_probs": torch.stack([s.generated["log_probs"] for s in samples]),
                         "advantages": adv, "loss_mask": kept,
                         "rm_scores": scores.unsqueeze(-1)},
                non_tensors={"prompt": np.array([s.row.prompt for s in samples], dtype=object),
                             "uid": np.array([s.uid for s in samples], dtype=object)},
                meta_info={"window_start": window[0]},
            )
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
        return metrics, samples

    # ---- validation, checkpoints ----------------------------------------------------------------------------
    def validate_step(self) -> dict[str, float]:
        """Deterministic (noise_level 0 everywhere, ODE) samples of the validation prompts, scored."""
        samples = [Sample(index=i, uid=f"val-{i}", row=row, seed=sample_seed(self.cfg.trainer.seed, 0, i, SEED_VALIDATION))
                   for i, row in enumerate(self.val_rows)]
        generate_all(self.replicas, samples, (0, 0))
        outcomes = self.reward_manager.score_batch([s.reward_input() for s in samples])
        scores = [o.score for o in outcomes if o.ok]
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
        return self.run_dir
