"""DiffusionOPD's ``distill_kl`` (on-policy distillation from a frozen teacher) as verl-omni computes it.

The student samples its own trajectories (the SDE window, as Flow-GRPO); a frozen teacher replays each stored state
``x_t`` of the window through its own transformer on the student's noise grid, and the student's step Gaussian is
pulled toward the teacher's. Both transitions are Gaussians with the student's std, so their KL is closed-form. For
one window step, with ``mu_theta`` the student's step mean under the current weights (with gradient), ``mu_T`` the
same step's mean computed from the teacher's velocity ``v_T`` at the same ``x_t`` (the same SDE step: ``sde``, ``cps``
or ``dance_sde``, the same ``noise_level``), ``sigma_t`` the step's ``std_dev_t`` (``sde.SDEStep.std_dev_t``) and the
kept samples ``m``::

    KL_i = mean_dims (mu_theta_i - mu_T_i)^2 / (2 sigma_t^2)
    L    = sum_i m_i KL_i / sum_i m_i                                  (+ kl_loss_coef * KL to the reference)

This is verl-omni's ``DistillKLLoss`` at a1139ba (``verl_omni/trainer/diffusion/diffusion_algos.py``,
``@register_diffusion_loss("distill_kl")``: ``((prev_sample_mean - teacher_prev_sample_mean) ** 2).mean(dim=(1, 2))
/ (2 * std_dev_t**2)``, then the batch mean), metric ``actor/distill_kl_loss``. verl-omni has no masked samples in its
batch; here the mean runs over the kept ones (a sample whose reward failed is out, as for every loss), so both agree
on the kept ones. A step with ``std_dev_t = 0`` (``cps`` at ``sigma_next = 0``) adds 0, never NaN
(``sde.kl_to_reference``, the same formula against the reference).

What the teacher ships per sample is its velocity ``v_T`` at each window step ``[W, ...]``, not ``mu_T``: the step mean
is linear in the velocity and the rest of it (``x_t``, the sigmas, the SDE type) is the student's, so the update
computes ``mu_T`` with the student's own step function; the teacher needs only its transformer (and CFG).
Advantages, old log-probs and the clip play no part: the reward is monitored only (verl-omni's recipe).
"""

from __future__ import annotations

import torch

from omni_async.algos.masked_stats import masked_mean, with_kl_term
from omni_async.algos.sde import kl_to_reference


def distill_kl_loss(
    mean: torch.Tensor,
    teacher_mean: torch.Tensor,
    std_dev_t: torch.Tensor | float,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, metrics)`` for one window step (module docstring). ``mean``, ``teacher_mean``: ``[B, ...]``;
    ``std_dev_t``: a float, ``[B]``-broadcastable or the latent's shape; ``mask``, ``kl``: ``[B]``. The teacher's mean
    carries no gradient. Metrics are detached 0-d tensors: ``actor/distill_kl_loss`` (and ``actor/kl_loss`` with the
    reference term)."""
    mask = mask.bool()
    dtype = torch.promote_types(mean.dtype, torch.float32)  # at least fp32: bf16 would swamp mu_theta - mu_T
    per_sample = kl_to_reference(mean.to(dtype), teacher_mean.detach().to(dtype), std_dev_t)
    distill = masked_mean(per_sample, mask)
    loss, metrics = with_kl_term(distill, kl, kl_coef, mask)
    metrics["actor/distill_kl_loss"] = distill.detach()
    return loss, metrics
