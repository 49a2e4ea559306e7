"""The reward side of a run, wired once: judge servers, reward-loop workers + the dispatcher, the colocated manager.

- ``reward.streaming`` (verl's rule under ``auto``: stream when there is no reward model, or it has its own pool)
  decides whether rollout streams each sample to reward-loop workers, or the trainer scores the whole batch
  after rollout in one colocated call (the sync baseline).
- With ``reward.reward_model.rollout.name=vllm`` the reward pool's devices host vLLM judge servers; their URLs
  are handed to the reward functions that take a ``judge_urls`` argument (see ``reward.manager``).
- With ``distillation.enabled`` the frozen teacher (``reward.teacher``) loads on each reward-loop worker (streaming),
  or beside the colocated manager (the sync baseline).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import ray
from omegaconf import DictConfig

from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.manager import RewardManager, scorer_names
from omni_async.reward.pool import create_reward_workers, wait_ready
from omni_async.reward.teacher import Teacher, teacher_spec


def streaming_enabled(cfg: DictConfig) -> bool:
    """verl's rule: stream rewards whenever there is no reward model, or the reward model has its own pool (or
    its reward-loop workers sit beside the actor: ``reward.reward_model.colocate_with_actor``)."""
    mode = str(cfg.reward.streaming).lower()
    if mode == "auto":
        rm = cfg.reward.reward_model
        return (not rm.enable) or bool(rm.enable_resource_pool) or bool(rm.colocate_with_actor)
    return mode == "true"


class RewardSide:
    def __init__(self, cfg: DictConfig, reward_pool: Any | None, judge_pg: Any | None):
        """``reward_pool``: verl's dedicated ``RayResourcePool`` (or ``None``: CPU actors); ``judge_pg``: the
        placement group of vLLM judge servers (or ``None``). Returns once the reward-loop workers are asked to
        start; :meth:`wait_ready` waits for them (the trainer starts its actor workers meanwhile)."""
        self.cfg = cfg.reward
        self.streaming = streaming_enabled(cfg)
        self.scorer_names = scorer_names(cfg.reward)
        self.judge_urls: list[str] = []
        self.judge_servers = None  # kept for the run: the servers live as long as their Ray actors' handles
        if judge_pg is not None:
            from omni_async.reward.vllm_server import launch_judge_servers

            self.judge_servers = launch_judge_servers(cfg.reward, judge_pg)
            self.judge_urls = self.judge_servers.urls
        self.workers: list[Any] = []
        self.post_process = False
        self.teacher_spec = teacher_spec(cfg)
        if self.streaming:
            self.workers = create_reward_workers(cfg.reward, reward_pool, self.judge_urls, self.teacher_spec)
        self._colocated: RewardManager | None = None
        self._colocated_teacher: Teacher | None = None

    def wait_ready(self) -> None:
        """Block until the reward-loop workers have loaded their reward functions (raising a worker's load error)."""
        if self.workers:
            wait_ready(self.workers)
            self.post_process = ray.get(self.workers[0].has_post_process.remote())

    def dispatcher_factory(self):
        """Builds the reward queue on the agent loop (``None`` in sync mode: nothing is streamed)."""
        if not self.streaming:
            return None
        r = self.cfg
        return partial(
            RewardDispatcher,
            self.workers,
            queue_size=r.queue_size,
            max_inflight_per_worker=r.max_inflight_per_worker,
            timeout_s=r.timeout_s,
            max_resends=r.max_resends,
            scorers=self.scorer_names,
            teacher=self.teacher_spec is not None,
            linger_s=r.linger_ms / 1000.0,
        )

    @property
    def colocated(self) -> RewardManager:
        """The sync baseline's reward manager, in the trainer process; built on first use."""
        if self._colocated is None:
            self._colocated = RewardManager(self.cfg, self.judge_urls)
        return self._colocated

    @property
    def colocated_teacher(self) -> Teacher | None:
        """The sync baseline's distillation teacher, in the trainer process beside the colocated reward (its CPU);
        built on first use; ``None`` without ``distillation.enabled``."""
        if self._colocated_teacher is None and self.teacher_spec is not None:
            self._colocated_teacher = Teacher(self.teacher_spec)
        return self._colocated_teacher

    @property
    def colocated_used(self) -> bool:
        return self._colocated is not None
