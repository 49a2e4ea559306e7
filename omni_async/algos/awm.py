"""Advantage Weighted Matching (AWM; Xue et al., arXiv 2509.25050): policy gradient for diffusion whose objective is
the pretraining one, the flow-matching loss on clean samples, weighted by each sample's advantage.

Source of the exact form: the authors' code, ``github.com/scxue/advantage_weighted_matching`` at ``be51372``
(``scripts/train_sd3_awm.py``: ``compute_log_prob_awm`` and the training loop; ``config/dgx_awm.py``: the GenEval,
OCR and PickScore recipes); the paper's abstract: AWM "uses the same score/flow-matching loss as pretraining ... and
reweights each sample by its advantage". The math is written here from those, not copied.

**Data** (DiffusionNFT's data path, ``algos.loss_modes``): clean samples ``x0`` drawn by the *current* policy (the
authors' ``train.off_policy=False`` in every recipe), one reward each, FlowGRPO's group advantages ``A``.

**Forward process** (``diffusion_nft.forward_noised``): at the rollout's sigma ``t`` of a training step,
``x_t = (1 - t) x0 + t eps``, ``eps ~ N(0, I)``, target velocity ``v = eps - x0``.

**Training steps** (the authors' ``time_type=discrete_wo_init``, their GenEval and OCR recipes:
:func:`stratified_train_steps`): ``K`` (``train_timesteps``, 6) of the rollout's ``N`` denoising steps, one per
stratum of ``1 .. M``, ``M = int(N * timestep_fraction)`` (their 0.9), the same ``K`` steps for every sample of a
micro-batch (they repeat one draw over the micro-batch's samples); step 0 (``t = 1``, pure noise) and the steps from
``M`` on are never trained.

**Matching log-likelihood** of sample ``i`` at training step ``t`` (the authors' ``log_prob``, per ``weighting``)::

    e_i,t  = mean_dims (v_theta(x_t, t) - (eps - x0))^2                   the flow-matching error
    lp_i,t = -e_i,t                                                       weighting=uniform
    lp_i,t = -t * ((e_i,t + d)^p - d^p) / p,    d = 1e-10                 weighting=ghuber (p = ghuber_power)

(every recipe of the authors: ``ghuber``, ``p = 0.25``: a concave, "generalised Huber" reading of the error that
damps large errors, times ``t``). The matching error is ``-lp``.

**Loss** (the authors' ``loss_type=exp_first``: one ratio per sample and training step)::

    A^_i   = clip(A_i, -c, c) / c                                         c = adv_clip_max (their advantage_max = 1)
    rho    = exp(lp_i,t - lp_old_i,t)
    L_pg   = mean_{i,t} max(-A^_i rho, -A^_i clip(rho, 1 - eps, 1 + eps))  eps = clip_ratio (their clip_range)
    L      = L_pg + lambda_ref * mean_{i,t} mean_dims (v_theta - v_ref)^2  v_ref: the adapter-off model
                  + lambda_old * mean_{i,t} mean_dims (v_theta - v_old)^2  v_old: the EMA anchor (``old`` adapter)

``L_pg`` is FlowGRPO's clipped ratio (``loss.flow_grpo_loss``) on the matching log-likelihood instead of the SDE
step's. ``lp_old`` is the log-likelihood under the weights the step began with: the authors detach the current one in
the first accumulation group and compute it beforehand for later ones. Here, with ``lp_old = sg(lp)`` (no recompute,
``bypass_mode=true``) ``rho = 1`` and the gradient is ``mean_{i,t} A^_i grad(-lp_i,t)``: a sample with ``A > 0`` has
its matching error lowered, one with ``A < 0`` raised, in proportion to ``|A|`` (the advantage-weighted matching
loss); with a recompute (``bypass_mode=false``) later mini-batches of the step see ``rho != 1`` and the clip.

``v_ref``, ``v_old`` carry no gradient; ``lambda_ref`` is the authors' ``train.beta`` (its ``kl_weight=Uniform``),
``lambda_old`` their ``train.ema_beta`` (``kl_ema_weight=Uniform``), the anchor refreshed after each step by
``old <- d old + (1 - d) theta`` with ``d = min(0.001 k, 0.3)`` (their ``kl_ema_decay_type=linear``,
``kl_ema_decay=0.3``: schedule ``linear_to_0_3`` of :data:`diffusion_nft.DECAY_SCHEDULES`). Means over the kept
samples (``mask``).
"""

from __future__ import annotations

import torch

from omni_async.algos.loss import flow_grpo_loss
from omni_async.algos.masked_stats import masked_mean

WEIGHTINGS = ("uniform", "ghuber")
GHUBER_DELTA = 1e-10  # the authors' offset inside the power (keeps its gradient finite at a zero error)


def stratified_train_steps(num_steps: int, count: int, fraction: float, u: torch.Tensor) -> torch.Tensor:
    """The AWM authors' training steps (``time_type=discrete_wo_init``; ``train_sd3_awm.py``): ``count`` (``K``)
    indices into the rollout's ``num_steps`` (``N``) denoising steps, one per stratum of ``1 .. M``::

        M      = int(N * fraction)                                  (their train.timestep_fraction, 0.9)
        b_k    = 1 + k (M - 1) / K,                k = 0..K         the strata's bounds
        lo_k   = floor(b_k),   hi_k = floor(b_{k+1})
        step_k = lo_k + floor(u_k (hi_k - lo_k)),  u_k ~ U[0, 1)    a stratum narrower than a step gives lo_k

    so step 0 (``t = 1``) and the steps from ``M`` on are never drawn (``M = 1``: every step is step 1). ``u`` [K],
    in [0, 1). The bounds are computed exactly (integer arithmetic); the authors' float32 ``torch.linspace`` agrees
    at their recipes' sizes and can round an exact integer bound down by one at some others (``M = 15, K = 26``).
    Returns ``[K]`` (int64), in stratum order."""
    n, k, top = int(num_steps), int(count), int(int(num_steps) * float(fraction))
    if k < 1 or n < 2 or top < 1:
        raise ValueError(
            f"AWM's stratified steps need count >= 1, num_steps >= 2 and int(num_steps x fraction) >= 1; got count "
            f"{k}, num_steps {n}, fraction {fraction}"
        )
    bounds = torch.tensor([1 + (j * (top - 1)) // k for j in range(k + 1)], dtype=torch.long)
    lo, hi = bounds[:-1], bounds[1:]
    return lo + (u.double() * (hi - lo).double()).floor().long()


def draw_train_steps(num_steps: int, count: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """:func:`stratified_train_steps` with ``u ~ U[0, 1)^K`` from ``generator`` (one draw, shared by the samples
    that train together)."""
    return stratified_train_steps(num_steps, count, fraction, torch.rand(int(count), generator=generator))


def matching_log_prob(
    v_theta: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, *, weighting: str, ghuber_power: float
) -> torch.Tensor:
    """``lp`` ``[B]`` (module docstring): the weighted flow-matching error of ``v_theta`` against ``target = eps - x0``,
    negated; ``sigma`` ``[B]`` the step's ``t``."""
    err = ((v_theta - target) ** 2).mean(tuple(range(1, v_theta.ndim)))
    if weighting == "uniform":
        return -err
    if weighting == "ghuber":
        p = float(ghuber_power)
        return -sigma.to(err.dtype) * ((err + GHUBER_DELTA) ** p - GHUBER_DELTA**p) / p
    raise ValueError(f"awm weighting={weighting!r}: use one of {', '.join(WEIGHTINGS)}")


def velocity_gap(v: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_i mean_dims (v - other)^2`` over the kept samples, ``other`` without gradient (the KL terms)."""
    return masked_mean(((v - other.detach()) ** 2).mean(tuple(range(1, v.ndim))), mask)


def awm_loss(
    v_theta: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    adv_clip_max: float,
    clip_ratio: float,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    old_log_prob: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    ref_kl_coef: float = 0.0,
    v_old: torch.Tensor | None = None,
    old_kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one training step (module docstring). ``v_theta, x0, noise`` ``[B, ...]`` fp32 (``x_t``
    was ``forward_noised(x0, sigma, noise)``), ``sigma, advantages, mask`` ``[B]``; ``old_log_prob`` ``[B]`` the
    step-start ``lp`` (``None``: ``rho = 1``). Metrics: verl's ``actor/{pg_loss, ppo_kl, pg_clipfrac, ...}`` on
    ``rho``, ``actor/fm_loss`` (mean matching error ``e``), ``actor/ref_kl_loss``, ``actor/old_kl_loss``,
    ``actor/total_loss``; detached 0-d tensors."""
    c = float(adv_clip_max)
    adv = advantages.detach().to(v_theta.dtype).clamp(-c, c) / c
    lp = matching_log_prob(v_theta, noise - x0, sigma, weighting=weighting, ghuber_power=ghuber_power)
    old = lp.detach() if old_log_prob is None else old_log_prob.to(lp)
    loss, metrics = flow_grpo_loss(lp, old, adv, mask, clip_ratio=clip_ratio)
    for key, v, coef in (("ref_kl_loss", v_ref, ref_kl_coef), ("old_kl_loss", v_old, old_kl_coef)):
        if v is not None and coef > 0:
            gap = velocity_gap(v_theta, v, mask)
            loss = loss + float(coef) * gap
            metrics[f"actor/{key}"] = gap.detach()
    with torch.no_grad():
        err = ((v_theta - (noise - x0)) ** 2).mean(tuple(range(1, v_theta.ndim)))
        metrics["actor/fm_loss"] = masked_mean(err, mask)
        metrics["actor/total_loss"] = loss.detach()
    return loss, metrics
