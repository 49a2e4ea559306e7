"""FlowGRPO clipped policy loss over the SDE-window steps, with metrics.

For one window step, per sample i with log-probs of the stored transition under the current and old policy::

    rho_i   = exp(logp_theta_i - logp_old_i)
    L_pg    = mean_i w_i max(-A_i * rho_i, -A_i * clip(rho_i, 1 - eps, 1 + eps))   (eps = clip_ratio)
    L       = L_pg + beta * mean_i KL_i                                            (beta = kl_loss_coef)

with ``KL_i = mean_dims (mu_theta - mu_ref)^2 / (2 std_dev_t^2)``, flow_grpo's scale (see ``sde.kl_to_reference``).
``w_i = 1`` unless verl's decoupled rollout correction is on (``algorithm.rollout_correction.rollout_is``): then
``w_i = min(pi_old_i / pi_rollout_i, C)``, the truncated importance weight of the step (verl's
``compute_rollout_correction_weights``, computed on the driver), as verl's ``compute_policy_loss_vanilla`` multiplies
its per-token loss by ``rollout_is_weights``.
Means run over the kept samples only (``mask``); a masked sample contributes nothing to the loss or to the metrics.

**Rejected steps** (verl's rejection sampling, ``algorithm.rollout_correction.rollout_rs``) are not taken out of
``mask``: they enter as ``w_i = 0`` (:func:`correction_weights`), so the mean's denominator still counts them::

    L_pg = sum_i m_i w_i l_i / sum_i m_i,     w_i = IS_i x keep_i   (decoupled; bypass: w_i = keep_i)

as verl-omni folds the rejection mask into ``rollout_is_weights`` in both modes (``rollout_correction.
apply_rollout_correction_to_diffusion_batch``, ``losses._apply_bypass_rc``) and ``FlowGRPOLoss`` takes
``torch.mean`` over every sample of the step. Text follows verl's token loss instead (:func:`grpo_token_loss`).
"""

from __future__ import annotations

import torch

from omni_async.algos.masked_stats import masked_mean, with_kl_term


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, metrics)`` for one window step; all inputs are ``[B]``. The metrics are detached 0-d tensors
    on the inputs' device: reading them (``.item()``) waits for the device, so a caller reads them once, after its
    backward passes, not once per metric per step."""
    mask = mask.bool()
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_sample = torch.maximum(unclipped, clipped)
    if is_weights is not None:  # verl's decoupled-mode rollout correction: w_i multiplies the clipped term
        per_sample = per_sample * is_weights.detach()
    pg_loss = masked_mean(per_sample, mask)
    loss, metrics = with_kl_term(pg_loss, kl, kl_coef, mask)
    with torch.no_grad():
        m = mask.float()
        n = m.sum()
        # Over the kept samples, without indexing by the mask (a device sync); no kept sample reads ratio 1, std 0.
        ratio_mean = torch.where(n > 0, masked_mean(ratio, m), torch.ones_like(n))
        ratio_var = ((ratio - ratio_mean) ** 2 * m).sum() / (n - 1).clamp(min=1.0)  # unbiased, as torch.std
        metrics.update(
            {
                "actor/pg_loss": pg_loss.detach(),
                # k1 estimator of KL(old || new) on the sampled transitions, as verl reports it.
                "actor/ppo_kl": masked_mean(-log_ratio, mask),
                "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), m),
                "actor/pg_clipfrac_higher": masked_mean((ratio > 1 + clip_ratio).float() * (adv > 0), m),
                "actor/pg_clipfrac_lower": masked_mean((ratio < 1 - clip_ratio).float() * (adv < 0), m),
                "actor/ratio_mean": ratio_mean,
                "actor/ratio_std": ratio_var.sqrt(),
            }
        )
    return loss, metrics


# verl's rollout correction settings in bypass mode (algorithm.rollout_correction with bypass_mode=true and rollout_is
# or rollout_rs): the trainer puts them in the batch's meta_info under this key, as verl's apply_bypass_mode hands
# them to the actor's policy loss, and the loss computes the weights and the mask per micro-batch.
BYPASS_CORRECTION_KEY = "rollout_correction"
BYPASS_CORRECTION_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)


def bypass_rollout_correction(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, spec: dict
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rollout correction in bypass mode (pi_old = pi_rollout), for one loss call: verl's
    ``compute_rollout_correction_and_rejection_mask`` between the *current* policy (``log_prob``, detached) and the
    rollout's log-probs, as verl's ``compute_policy_loss_bypass_mode`` and verl-omni's ``diffusion_loss`` compute it.
    With their default ``loss_type=ppo_clip`` the IS weights pi_theta / pi_rollout are only reported (the PPO ratio
    is already that ratio, clipped). Returns the keep flags (``mask`` with the rejected elements off; ``mask`` as
    given when ``rollout_rs`` is off), which the losses apply as a 0 / 1 weight, the denominator keeping the
    rejected elements (:func:`correction_weights`, :func:`grpo_token_loss`'s ``keep``), and verl's metrics under the
    names verl's actor reports them (``actor/rollout_corr/*``). Inputs ``[B, T]``: text tokens, or one SDE-window
    step per call (``T = 1``, as verl-omni's per-step loss)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    mask = mask.bool()
    if not mask.any():  # nothing in the loss (verl's helper refuses an empty mask)
        return mask, {}
    with torch.no_grad():
        _, kept, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach().float(),
            rollout_log_prob=rollout_log_prob.float(),
            response_mask=mask.float(),
            **{k: spec.get(k) for k in BYPASS_CORRECTION_FIELDS},
        )
    return mask & kept.bool(), {f"actor/{k}": float(v) for k, v in metrics.items()}


def correction_weights(is_weights: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """The image losses' per-sample multiplier ``w = IS x keep`` (``None`` when neither is given): verl-omni's fold
    of the rejection mask into ``rollout_is_weights`` (decoupled: ``IS = min(pi_old / pi_rollout, C)`` and the
    driver's keep flags; bypass: the loss call's keep flags alone). A rejected step weighs 0 and stays in the mean's
    denominator (module docstring)."""
    if keep is None:
        return is_weights
    keep = keep.float()
    return keep if is_weights is None else is_weights * keep


# verl's dual-clip bound for negative advantages (its ``actor.clip_ratio_c`` default).
DUAL_CLIP_RATIO_C = 3.0
# verl's low-variance KL estimator (k3): KL ~= exp(ref - logp) - (ref - logp) - 1, clamped.
TEXT_KL_ESTIMATOR = "low_var_kl"


def grpo_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    clip_ratio: float,
    ref_log_prob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO for text, token level, with verl's ``core_algos`` (vanilla PPO clip, token-mean aggregation)::

        rho_t = exp(logp_theta_t - logp_old_t)
        l_t   = max(-A * rho_t, -A * clip(rho_t, 1 - eps, 1 + eps))      (dual clip at c = 3 for A < 0)
        L_pg  = sum_t m_t k_t l_t / sum_t m_t,    L = L_pg + beta * sum_t m_t KL_k3(theta_t || ref_t) / sum_t m_t

    All inputs are ``[B, T]``; ``advantages`` is the sample's advantage broadcast over its tokens and
    ``token_mask`` (``m``) is the response mask times the sample's loss mask (a failed sample contributes nothing).
    ``rollout_is_weights`` [B, T]: verl's decoupled-mode truncated IS weights, multiplying each token's clipped
    term (verl's ``compute_policy_loss_vanilla`` applies them). Decoupled-mode rejection is already out of
    ``token_mask``: verl's driver takes it out of ``response_mask`` before the update, so it leaves the token-mean's
    denominator too (``compute_rollout_correction_and_add_to_batch``; the engine's ``batch_num_tokens`` counts the
    rejected-out mask).

    ``keep`` (``k``, [B, T], bypass mode: :func:`bypass_rollout_correction`'s flags, 1 elsewhere): rejected tokens
    weigh 0 in the policy-gradient term while the denominator and the KL term keep them, as verl's
    ``compute_policy_loss_bypass_mode`` aggregates with the engine's ``batch_num_tokens`` (counted on the loss mask
    before the loss call rejects anything) and ``ppo_loss`` takes the KL over ``response_mask``.
    """
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

    # bypass rejection: the token-mean's denominator is the mask before it (verl's batch_num_tokens), at least 1 (a
    # zero-weight padding pass of FSDP's lock-step has no token at all)
    batch_info = {} if keep is None else {"batch_num_tokens": max(float(token_mask.sum()), 1.0), "dp_size": 1}
    loss_cfg = OmegaConf.create(
        {
            "clip_ratio": clip_ratio,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "clip_ratio_c": DUAL_CLIP_RATIO_C,
            "global_batch_info": batch_info,
        }
    )
    pg_loss, m = get_policy_loss_fn("vanilla")(
        old_log_prob,
        log_prob,
        advantages,
        token_mask if keep is None else token_mask * keep.to(token_mask.dtype),
        loss_agg_mode="token-mean",
        config=loss_cfg,
        rollout_is_weights=rollout_is_weights,
    )
    loss = pg_loss
    metrics = {"actor/pg_loss": pg_loss.item(), **{k: float(v) for k, v in m.items()}}
    if ref_log_prob is not None and kl_coef > 0:
        kl = agg_loss(kl_penalty(log_prob, ref_log_prob, TEXT_KL_ESTIMATOR), token_mask, "token-mean")
        loss = loss + kl_coef * kl
        metrics["actor/kl_loss"] = kl.item()
    with torch.no_grad():
        ratio = torch.exp(log_prob - old_log_prob)[token_mask.bool()]
        metrics["actor/ratio_mean"] = float(ratio.mean()) if ratio.numel() else 1.0
    return loss, metrics
