"""What every modality provides (:class:`Modality`) and the helpers they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from omni_async.sample import Sample


class Modality(Protocol):
    name: str
    uses_window: bool  # generation takes an SDE window (diffusion) or not (text)

    def sampling_config(self, cfg: Any) -> Any:
        """The policy's sampling settings from the trainer config (a dataclass; shipped to workers as a dict)."""

    def build_policy(self, model: dict[str, Any], sampling: dict[str, Any], device: str = "cpu",
                     rollout_server: dict[str, Any] | None = None) -> Any:
        """The trainable policy on ``device`` (or a client of an inference server, for a rollout worker)."""

    def batch_tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """The actor's tensors for scored samples, including verl's ``rm_scores``."""

    def log_probs(self, policy: Any, batch: Any) -> torch.Tensor:
        """Log-probs of the stored trajectories under the policy's current weights."""

    def backward(self, policy: Any, batch: Any, loss_mask: torch.Tensor, actor_cfg: Any) -> dict[str, list[float]]:
        """Accumulate one mini-batch's gradients; return its metrics."""

    def save_samples(self, out_dir: Path, step: int, samples: list[Sample]) -> Path:
        """Something a person can look at: an image grid, or a JSONL of responses."""


# A backward's seconds spent in the reference policy (KL): reported as the step's timing_s/ref.
REF_TIME_KEY = "timing_s/ref"


def score_labels(samples: list[Sample]) -> list[str]:
    return [f"{s.outcome.score:.3f}" if s.outcome.ok else s.outcome.status for s in samples]


def rm_score(s: Sample) -> float:
    """A failed sample's ``rm_scores`` entry: 0, and its ``loss_mask`` keeps it out of every statistic."""
    return s.outcome.score if s.outcome.ok else 0.0
