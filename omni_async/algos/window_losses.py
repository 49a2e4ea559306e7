"""The SDE-window losses behind one signature, so the image modality calls the registry's (``LossMode.window_loss``)
instead of naming each loss: ``loss(step, diffusion_loss) -> (loss, metrics)`` for one window step.

Each adapter passes its loss's inputs as the loss takes them (the numbers are the loss's own); the math and its
reference live in the loss's module (``loss.flow_grpo_loss``, ``grpo_guard``, ``flow_dppo``, ``dance_grpo``,
``distill``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_async.algos.dance_grpo import dance_grpo_loss
from omni_async.algos.distill import distill_kl_loss
from omni_async.algos.flow_dppo import flow_dppo_loss
from omni_async.algos.grpo_guard import grpo_guard_loss
from omni_async.algos.loss import flow_grpo_loss
from omni_async.algos.sde import SDEStep


@dataclass(frozen=True)
class WindowStepInputs:
    """One window step of a micro-batch, as the modality has it: the step scored under the current weights
    (``out``: log-prob, mean, std_dev_t, sqrt_dt), the stored old log-probs and (GRPO-Guard, Flow-DPPO) pi_old's
    means of this step, the advantages [B] (clipped already where the loss mode clips), the kept samples, the KL term
    to the reference (or None), the rollout-correction weights (or None) and (DiffusionOPD) the step's mean computed
    from the frozen teacher's velocity (or None)."""

    out: SDEStep
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_mean: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    kl_coef: float = 0.0
    is_weights: torch.Tensor | None = None
    teacher_mean: torch.Tensor | None = None


# (step, actor_rollout_ref.actor.diffusion_loss) -> (loss, metrics)
WindowLoss = Callable[[WindowStepInputs, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _common(s: WindowStepInputs) -> dict[str, Any]:
    return {"kl": s.kl, "kl_coef": s.kl_coef, "is_weights": s.is_weights}


def flow_grpo_window(s: WindowStepInputs, dl: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return flow_grpo_loss(s.out.log_prob, s.old_log_prob, s.advantages, s.mask, clip_ratio=dl.clip_ratio, **_common(s))


def dance_grpo_window(s: WindowStepInputs, dl: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return dance_grpo_loss(s.out.log_prob, s.old_log_prob, s.advantages, s.mask, clip_ratio=dl.clip_ratio, **_common(s))


def grpo_guard_window(s: WindowStepInputs, dl: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return grpo_guard_loss(
        s.out.log_prob, s.old_log_prob, s.advantages, s.mask, mean=s.out.mean, old_mean=s.old_mean,
        std_dev_t=s.out.std_dev_t, sqrt_dt=s.out.sqrt_dt, clip_ratio=dl.clip_ratio, **_common(s),
    )  # fmt: skip


def flow_dppo_window(s: WindowStepInputs, dl: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return flow_dppo_loss(
        s.out.log_prob, s.old_log_prob, s.advantages, s.mask, mean=s.out.mean, old_mean=s.old_mean,
        std_dev_t=s.out.std_dev_t, sqrt_dt=s.out.sqrt_dt, kl_mask_threshold=dl.kl_mask_threshold,
        add_kl_coefficient=dl.add_kl_coefficient, **_common(s),
    )  # fmt: skip


def distill_kl_window(s: WindowStepInputs, dl: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return distill_kl_loss(s.out.mean, s.teacher_mean, s.out.std_dev_t, s.mask, kl=s.kl, kl_coef=s.kl_coef)
