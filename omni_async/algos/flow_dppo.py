"""Flow-DPPO (arXiv 2606.11025): FlowGRPO's policy gradient with the ratio clip replaced by a divergence mask.

Why: the PPO clip judges the policy's move by one ratio, a single noisy sample of a high-dimensional Gaussian. On a
Flow-SDE step the old and current transitions share their std and differ only in the mean, so their KL is known
exactly from the two means; Flow-DPPO drops a sample's gradient only when that divergence is past a threshold *and*
the update would push further away (positive advantage with ratio above 1, negative with ratio below 1). Updates
that move back toward pi_old always stay.

For one window step, per sample ``i`` (``sigma_i = std_dev_t_i * sqrt_dt_i``, the ``sde`` transition std)::

    rho_i  = exp(logp_theta_i - logp_old_i)
    D_i    = mean_dims (mu_theta_i - mu_old_i)^2 / (2 sigma_i^2)        add_kl_coefficient = true (default)
    D_i    = mean_dims (mu_theta_i - mu_old_i)^2 / 2                    add_kl_coefficient = false
    drop_i = D_i >= tau and ((A_i > 0 and rho_i > 1) or (A_i < 0 and rho_i < 1))        (tau = kl_mask_threshold)
    L_pg   = mean_i w_i [not drop_i] (-A_i rho_i)
    L      = L_pg + beta * mean_i KL_i

The mask is a stop-gradient choice (no gradient through ``D``); the kept terms are unclipped. This is verl-omni's
``FlowDPPOLoss`` at a1139ba, scales per sample (unlike GRPO-Guard's batch-mean scale) and advantages as given,
unclipped: verl-omni clips none, and here the batch's advantages are not clipped to ``diffusion_loss.adv_clip_max``
for this loss either (``loss_modes.LossMode.clips_advantages``; FlowGRPO and GRPO-Guard clip them). Means run over
the kept samples (``mask``); ``w_i``: verl's decoupled-mode rollout-correction weights, as in ``loss.flow_grpo_loss``.
A sample with ``sigma = 0`` (noise level 0) has ``D = 0``, never inf.

Inputs per window step: ``log_prob`` / ``old_log_prob`` [B] (``SDEStep.log_prob``, stored ``old_log_probs[:, j]``);
``mean`` [B, ...] (``SDEStep.mean``, current weights); ``old_mean`` [B, ...] (the step's mean under pi_old: the
batch's ``old_means[:, j]``, see ``docs/losses.md``); ``std_dev_t``, ``sqrt_dt`` (``SDEStep.std_dev_t``,
``SDEStep.sqrt_dt``; [B] or broadcast to the latent), only read with ``add_kl_coefficient``.
"""

from __future__ import annotations

import torch

from omni_async.algos.masked_stats import masked_mean, masked_ratio_stats, per_sample, with_kl_term


def new_old_divergence(
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: torch.Tensor | float | None,
    sqrt_dt: torch.Tensor | float | None,
    *,
    add_kl_coefficient: bool = True,
) -> torch.Tensor:
    """``D`` [B]: the KL between the current and old step Gaussians (module docstring); without
    ``add_kl_coefficient`` the unnormalised ``mean_dims (mu_theta - mu_old)^2 / 2``. No gradient flows through it."""
    b = mean.shape[0]
    drift = ((mean.detach().float() - old_mean.detach().float()) ** 2).reshape(b, -1)
    if not add_kl_coefficient:
        return drift.mean(dim=1) / 2
    if std_dev_t is None or sqrt_dt is None:
        raise ValueError("add_kl_coefficient=True needs std_dev_t and sqrt_dt (SDEStep.std_dev_t, SDEStep.sqrt_dt)")
    sig = torch.as_tensor(std_dev_t, dtype=drift.dtype, device=drift.device)
    sdt = torch.as_tensor(sqrt_dt, dtype=drift.dtype, device=drift.device)
    # sigma per element: a [B] scale broadcasts over the sample's elements, a [B, ...] one is taken as it is.
    sig = sig.reshape(b, -1) if sig.ndim > 1 else per_sample(sig, b, drift)[:, None]
    sdt = sdt.reshape(b, -1) if sdt.ndim > 1 else per_sample(sdt, b, drift)[:, None]
    var = (sig * sdt) ** 2
    live = var > 0
    kl = drift / (2 * torch.where(live, var, torch.ones_like(var)))
    return torch.where(live, kl, torch.zeros_like(kl)).mean(dim=1)


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: torch.Tensor | float | None,
    sqrt_dt: torch.Tensor | float | None,
    kl_mask_threshold: float,
    add_kl_coefficient: bool = True,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, metrics)`` for one window step (module docstring). ``log_prob``, ``old_log_prob``,
    ``advantages``, ``mask``, ``kl``, ``is_weights``: ``[B]``; ``mean``, ``old_mean``: ``[B, ...]``. Metrics are
    verl-omni's names, as detached 0-d tensors over the kept samples (``actor/ratio_std`` biased, as there)."""
    mask = mask.bool()
    adv = advantages.detach()
    log_ratio = log_prob - old_log_prob.detach()
    # A dropped sample's log-ratio is zeroed before exp: an overflow there would put 0 * inf = NaN into the gradient.
    ratio = torch.exp(torch.where(mask, log_ratio, torch.zeros_like(log_ratio)))
    div = new_old_divergence(mean, old_mean, std_dev_t, sqrt_dt, add_kl_coefficient=add_kl_coefficient)
    with torch.no_grad():
        high = div >= kl_mask_threshold
        pos_rm = high & (ratio > 1.0) & (adv > 0)
        neg_rm = high & (ratio < 1.0) & (adv < 0)
        removed = pos_rm | neg_rm
    per_elem = torch.where(removed, torch.zeros_like(ratio), -adv * ratio)
    if is_weights is not None:
        per_elem = per_elem * is_weights.detach()
    pg_loss = masked_mean(per_elem, mask)
    loss, metrics = with_kl_term(pg_loss, kl, kl_coef, mask)
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = masked_ratio_stats(ratio.detach(), mask, unbiased=False)
        n = mask.float().sum()
        div_max = torch.where(mask, div, torch.full_like(div, float("-inf"))).max()
        metrics.update(
            {
                "actor/pg_loss": pg_loss.detach(),
                "actor/ppo_kl": masked_mean(-lr, mask),
                "actor/approx_kl": masked_mean(0.5 * lr**2, mask),
                "actor/ratio_mean": stats["mean"],
                "actor/ratio_std": stats["std"],
                "actor/ratio_min": stats["min"],
                "actor/ratio_max": stats["max"],
                "actor/kl_new_old_mean": masked_mean(div, mask),
                "actor/kl_new_old_max": torch.where(n > 0, div_max, torch.zeros_like(div_max)),
                "actor/kl_mask_fraction": masked_mean(high.float(), mask),
                "actor/pos_rm_fraction": masked_mean(pos_rm.float(), mask),
                "actor/neg_rm_fraction": masked_mean(neg_rm.float(), mask),
                "actor/masked_fraction": masked_mean(removed.float(), mask),
                "actor/unmasked_fraction": masked_mean((~removed).float(), mask),
            }
        )
    return loss, metrics
