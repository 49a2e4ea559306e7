"""GRPO-Guard (arXiv 2510.22319): FlowGRPO's clipped loss on a regulated importance ratio, per SDE-window step.

Why: on a Flow-SDE step both policies share the transition std ``s`` and differ only in the mean, so for a
transition drawn from the old policy, ``x' = mu_old + s * eps``,

    log rho = -||mu_theta - mu_old||^2_mean / (2 s^2) - mean(eps * (mu_theta - mu_old)) / s

whose expectation is the negative "ratio-mean bias" ``-b``: the raw ratio sits below 1 as soon as the policy moves,
so the clip acts lopsidedly (more on the low side), and its spread grows as ``s`` shrinks (late, low-noise steps
clip far more than early ones). GRPO-Guard adds ``b`` back (centring the log-ratio) and multiplies by ``s``
(equalising its spread across steps), then rescales the step's loss by ``1 / |dt|``.

For one window step, with ``std_dev_t`` and ``sqrt_dt = sqrt(-dt)`` of the step (``sde`` only: there
``s = std_dev_t * sqrt_dt`` is the transition std) and ``A_i`` the advantages clipped to ``adv_clip_max``::

    S       = mean_i(sqrt_dt_i) * mean_i(std_dev_t_i)                    (one scalar per step, batch means)
    b_i     = mean_dims (mu_theta_i - mu_old_i)^2 / (2 S^2)               (the ratio-mean bias)
    rho_i   = exp((logp_theta_i - logp_old_i + b_i) * S)
    L_pg    = mean_i w_i max(-A_i rho_i, -A_i clip(rho_i, 1 - eps, 1 + eps)) / mean_i(sqrt_dt_i)^2
    L       = L_pg + beta * mean_i KL_i

(``eps = clip_ratio``; verl-omni's GRPO-Guard recipe uses ``2e-6``, since ``S`` shrinks the log-ratio). This is
verl-omni's ``GRPOGuardLoss`` at a1139ba. Batch means run over the kept samples (``mask``): verl-omni has no masked
samples in its batch, so both agree on the kept ones. ``S`` is one number per step as there, also when the
samples' windows differ (then it mixes the scales of the denoising steps the batch's samples are at).
The KL term, the ``is_weights`` (verl's decoupled-mode rollout correction) and the metrics are as in
``loss.flow_grpo_loss``; the ratio metrics describe the regulated ``rho``, ``actor/ppo_kl`` the raw log-ratio.
A step with ``S = 0`` (noise level 0: no density) has ``rho = 1`` and no bias, never NaN.

Inputs the caller needs per window step (all on one device):

- ``log_prob`` / ``old_log_prob`` [B]: ``SDEStep.log_prob`` now, the stored ``old_log_probs[:, j]``;
- ``mean`` [B, ...]: ``SDEStep.mean`` under the current weights (with gradient);
- ``old_mean`` [B, ...]: the same step's mean under pi_old, the batch's ``old_means[:, j]`` (stored by the rollout in
  bypass mode, returned by the old-log-prob recompute otherwise: ``docs/losses.md``);
- ``std_dev_t``, ``sqrt_dt``: ``SDEStep.std_dev_t`` and ``SDEStep.sqrt_dt`` ([B] or broadcast to the latent).
"""

from __future__ import annotations

import torch

from omni_async.algos.masked_stats import masked_mean, masked_ratio_stats, per_sample, with_kl_term


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: torch.Tensor | float,
    sqrt_dt: torch.Tensor | float,
    clip_ratio: float,
    adv_clip_max: float | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, metrics)`` for one window step (module docstring). ``log_prob``, ``old_log_prob``,
    ``advantages``, ``mask``, ``kl``, ``is_weights``: ``[B]``; ``mean``, ``old_mean``: ``[B, ...]``.
    ``adv_clip_max``: clip the advantages here (verl-omni's ``diffusion_loss.adv_clip_max``); ``None`` when they
    were clipped already (``algorithm.adv_clip_max``). Metrics are detached 0-d tensors, read once by the caller."""
    mask = mask.bool()
    b = log_prob.shape[0]
    adv = advantages.detach()
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    sqrt_dt_bar = masked_mean(per_sample(sqrt_dt, b, log_prob).detach(), mask)
    scale = sqrt_dt_bar * masked_mean(per_sample(std_dev_t, b, log_prob).detach(), mask)
    live = scale > 0
    safe_scale = torch.where(live, scale, torch.ones_like(scale))
    drift = (mean.float() - old_mean.detach().float()) ** 2
    drift = drift.reshape(b, -1).mean(dim=1)
    bias = torch.where(live, drift / (2 * safe_scale**2), torch.zeros_like(drift))
    log_ratio = log_prob - old_log_prob.detach()
    # A dropped sample's exponent is zeroed before exp: an overflow there would put 0 * inf = NaN into the gradient.
    ratio = torch.exp(torch.where(mask, (log_ratio + bias) * scale, torch.zeros_like(log_ratio)))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_elem = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_elem = per_elem * is_weights.detach()
    # Dividing by |dt| (sqrt_dt^2) undoes the S^2 the ratio's gradient carries, so steps weigh alike.
    dt_bar = torch.where(sqrt_dt_bar > 0, sqrt_dt_bar**2, torch.ones_like(sqrt_dt_bar))
    pg_loss = masked_mean(per_elem, mask) / dt_bar
    loss, metrics = with_kl_term(pg_loss, kl, kl_coef, mask)
    with torch.no_grad():
        stats = masked_ratio_stats(ratio.detach(), mask)
        metrics.update(
            {
                "actor/pg_loss": pg_loss.detach(),
                "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask),
                "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
                "actor/pg_clipfrac_higher": masked_mean((ratio > 1 + clip_ratio).float() * (adv > 0), mask),
                "actor/pg_clipfrac_lower": masked_mean((ratio < 1 - clip_ratio).float() * (adv < 0), mask),
                "actor/ratio_mean": stats["mean"],
                "actor/ratio_std": stats["std"],
                "actor/ratio_mean_bias": masked_mean(bias.detach(), mask),
            }
        )
    return loss, metrics
