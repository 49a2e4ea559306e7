"""FlowGRPO clipped policy loss over the SDE-window steps, with metrics.

For one window step, per sample i with log-probs of the stored transition under the current and old policy::

    rho_i   = exp(logp_theta_i - logp_old_i)
    L_pg    = mean_i max(-A_i * rho_i, -A_i * clip(rho_i, 1 - eps, 1 + eps))       (eps = clip_ratio)
    L       = L_pg + beta * mean_i KL_i                                            (beta = kl_loss_coef)

with ``KL_i = ||mu_theta - mu_ref||^2 / (2 s^2)`` (see ``sde.kl_to_reference``). Means run over the kept samples
only (``mask``); a masked sample contributes nothing to the loss or to the metrics.
"""

from __future__ import annotations

import torch


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return ``(loss, metrics)`` for one window step; all inputs are ``[B]``."""
    mask = mask.bool()
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = _masked_mean(torch.maximum(unclipped, clipped), mask)
    loss = pg_loss
    metrics: dict[str, float] = {}
    if kl is not None and kl_coef > 0:
        kl_loss = _masked_mean(kl, mask)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
    with torch.no_grad():
        m = mask.float()
        r = ratio[mask] if mask.any() else ratio.new_ones(1)
        metrics.update({
            "actor/pg_loss": pg_loss.item(),
            # k1 estimator of KL(old || new) on the sampled transitions, as verl reports it.
            "actor/ppo_kl": _masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac": _masked_mean((clipped > unclipped).float(), m).item(),
            "actor/pg_clipfrac_higher": _masked_mean((ratio > 1 + clip_ratio).float() * (adv > 0), m).item(),
            "actor/pg_clipfrac_lower": _masked_mean((ratio < 1 - clip_ratio).float() * (adv < 0), m).item(),
            "actor/ratio_mean": r.mean().item(),
            "actor/ratio_std": r.std().item() if r.numel() > 1 else 0.0,
        })
    return loss, metrics
