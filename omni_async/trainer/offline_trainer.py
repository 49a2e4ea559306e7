"""Offline Diffusion-DPO (``algorithm.sample_source=offline``, verl-omni's ``DirectPreferenceRayTrainer`` with its
offline branch): the preference pairs of ``data.train_files`` (``trainer.offline_pairs``) trained with the same loss
and update as online DPO (``trainer.update``, ``StepOps``), and no rollout, no reward: no rollout workers or agent
loop, no reward-loop workers or reward pool start. The actor ranks (the hybrid layout's, which generate nothing here)
train ``data.train_batch_size`` pairs per step, ``ppo_mini_batch_size`` pairs per optimizer step; the draws of pairs
are the resumable sampler's (``trainer.dataset.PromptSampler``), so a checkpoint resumes at the next pair.
Validation has nothing to generate with (verl-omni skips it offline too)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from omegaconf import DictConfig

from omni_async.agent_loop.rollouter import Group
from omni_async.sample import Sample
from omni_async.trainer.config import total_training_steps
from omni_async.trainer.dataset import PromptSampler, first_rows
from omni_async.trainer.layout import make_layout
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.metrics import advantage_metrics, reward_metrics
from omni_async.trainer.offline_pairs import load_pairs, pair_groups
from omni_async.trainer.placement import make_pools, place
from omni_async.trainer.step_ops import StepOps
from omni_async.trainer.timeline import timeline_record
from omni_async.trainer.timer import Timer
from omni_async.trainer.update import update

logger = logging.getLogger(__name__)


class OfflinePreferenceTrainer(RLTrainer):
    """:class:`RLTrainer`'s loop (``fit``: checkpoints, resume, logging) over pairs read from disk instead of a
    producer: the state it shares with the online trainer is set here, without the agent loop and the reward side."""

    def __init__(self, cfg: DictConfig):  # no super().__init__: it starts the rollout and reward sides
        cfg = self._begin(cfg)
        pairs = first_rows(load_pairs(cfg.data.train_files), cfg.data.train_max_samples)
        self.val_rows = []  # nothing generates: no validation (verl-omni's offline trainer skips it)
        self.sampler = PromptSampler(pairs, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.total_steps = total_training_steps(cfg, len(pairs), self.mode)
        self.layout = make_layout(cfg, self.mode, self.plan.layout)
        self.placement = place(cfg, make_pools(cfg, self.layout), self.layout, self.plan.nsys)
        self.ops = StepOps(cfg, self.modality, None, self.placement.actor_wg, self.latest_checkpoint)
        self.producer, self.resume_position, self.rollout_version = None, None, 0
        self.pictures = ThreadPoolExecutor(1, thread_name_prefix="pictures")
        self.last_timeline: dict | None = None
        self._last_save = time.monotonic()
        logger.info("offline DPO: %d pairs, %d steps, no rollout and no reward", len(pairs), self.total_steps)

    def train_step(self, step: int) -> tuple[dict[str, float], list[Sample]]:
        """The step's ``data.train_batch_size`` pairs (the sampler's next draw), trained as the online step trains
        its groups (:func:`trainer.update.update`: mini-batches of whole pairs, ``ppo_epochs``)."""
        timer = Timer()
        groups = pair_groups(self.sampler.next_batch(), step, int(self.cfg.trainer.seed))

        def take(_step: int, n: int, _among: int) -> list[Group]:
            taken, groups[:] = groups[:n], groups[n:]
            return taken

        with timer("step"):
            _, samples, loss_mask, actor_metrics = update(self.ops, self.mode, take, step, timer, 2)
        timing = {**timer.timing, "timing_s/reward": 0.0}
        timing.setdefault("timing_s/ref", 0.0)
        metrics = {**reward_metrics(samples, loss_mask), **advantage_metrics(samples), **actor_metrics, **timing}
        self.last_timeline = timeline_record(step + 1, min(s.times.requested for s in samples), samples, timer)
        return metrics, samples

    def sync_weights(self, version: int) -> None:
        """Nothing samples with the weights: only the version is kept."""
        self.rollout_version = int(version)

    def close(self) -> None:
        self.pictures.shutdown(wait=True)


def make_trainer(cfg: DictConfig) -> RLTrainer:
    """The run's trainer: :class:`OfflinePreferenceTrainer` for ``algorithm.sample_source=offline`` (Diffusion-DPO on
    a dataset's pairs), else :class:`RLTrainer`."""
    return OfflinePreferenceTrainer(cfg) if cfg.algorithm.sample_source == "offline" else RLTrainer(cfg)
