"""Flow-matching SDE step with log-probability (FlowGRPO), the KL to the reference policy, and the SDE window.

Convention (diffusers FlowMatch): ``x_sigma = (1 - sigma) * x0 + sigma * eps``, the model predicts the velocity
``v = eps - x0``, and sampling walks sigma from 1 down to 0. The deterministic (ODE) Euler step is

    x_next = x + (sigma_next - sigma) * v                                         (diffusers' Euler step)

Two stochastic variants turn the step into a Gaussian ``x_next ~ N(mu, s^2)``. With ``dt = sigma_next - sigma < 0``
and ``sigma_max`` = the schedule's second sigma (``sigmas[1]``):

``sde`` (Flow-GRPO; flow_grpo ``sd3_sde_with_logprob.py``, verl-omni ``FlowMatchSDEDiscreteScheduler``)::

    std_dev_t = noise_level * sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    mu        = x * (1 + std_dev_t^2 / (2 sigma) * dt) + v * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt
    s         = std_dev_t * sqrt(-dt)
    log_prob  = mean_dims[ -(x_next - mu)^2 / (2 s^2) - log s - log sqrt(2 pi) ]      (full Gaussian density)

(the sigma = 1 guard replaces sigma only in the denominator, exactly as both references do).

``cps`` (coefficients-preserving sampling; flow_grpo / verl-omni ``sde_type == "cps"``)::

    std_dev_t = s = sigma_next * sin(noise_level * pi / 2)
    x0^  = x - sigma * v ,   eps^ = x + (1 - sigma) * v
    mu   = (1 - sigma_next) * x0^ + sqrt(sigma_next^2 - s^2) * eps^
    log_prob = mean_dims[ -(x_next - mu)^2 ]                 cps_log_prob="flow_grpo" (default; the references'
                                                            form: no 1/(2 s^2), no normaliser)
    log_prob = mean_dims[ Gaussian density as for sde ]      cps_log_prob="gaussian"

``dance_sde`` (DanceGRPO; verl-omni ``sde_type == "dance_sde"``, ``algos.dance_grpo``)::

    std_dev_t = s = noise_level * sqrt(-dt)
    mu        = x * (1 + noise_level^2 / (2 sigma) * dt) + v * (1 + noise_level^2 (1 - sigma) / (2 sigma)) * dt
    log_prob  = mean_dims[ Gaussian density as for sde ]

All three reduce to the Euler step exactly when ``noise_level = 0``; the log-prob is then 0 (a point mass has no
density). A window step with ``sigma_next = 0`` under ``cps`` has ``s = 0``: the flow_grpo form is finite there
(the references' own value); the Gaussian form and the KL, which would divide by ``s = 0``, take 0 for that
sample instead of NaN/inf (the transition is deterministic, it carries no density and no KL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni_async.algos.dance_grpo import DANCE_SDE, dance_sde_mean_std

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
CPS_LOG_PROBS = ("flow_grpo", "gaussian")
SDE_TYPES = ("sde", "cps", DANCE_SDE)  # rollout.algo.sde_type


@dataclass
class SDEStep:
    prev_sample: torch.Tensor  # x_next, [B, ...]
    log_prob: torch.Tensor  # [B]
    mean: torch.Tensor  # mu, [B, ...]
    std: torch.Tensor  # s, the transition's std (x_next = mu + s * noise), broadcast to mean
    std_dev_t: torch.Tensor  # the references' std_dev_t (sde: s / sqrt(-dt); cps, dance_sde: s): the KL's scale
    # sqrt(sigma - sigma_next) = sqrt(-dt), broadcast to mean: verl-omni's ``sqrt_dt`` (GRPO-Guard, Flow-DPPO scales)
    sqrt_dt: torch.Tensor | None = None


def _bcast(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.ndim - 1))) if t.ndim > 0 else t


def _mean_dims(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """``log N(x; mean, std^2)`` elementwise, averaged over non-batch dims -> ``[B]`` (flow_grpo's sde log-prob).

    Elements with ``std == 0`` (a deterministic transition) count as 0 rather than NaN, with finite gradients.
    """
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device).expand_as(mean)
    live = std > 0
    safe = torch.where(live, std, torch.ones_like(std))
    lp = -((x.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _LOG_SQRT_2PI
    return _mean_dims(torch.where(live, lp, torch.zeros_like(lp)))


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sde_type: str = "sde",  # sde | cps | dance_sde
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    cps_log_prob: str = "flow_grpo",
) -> SDEStep:
    """One stochastic denoising step ``x_sigma -> x_sigma_next`` and the log-prob of the result (module docstring).

    Give ``prev_sample`` to score a stored transition (training), or ``noise`` (standard normal, same shape as
    ``sample``) to draw one (rollout). ``sigma_max`` replaces ``sigma = 1`` in the denominator of the ``sde``
    variant's ``std_dev_t`` (where ``sigma / (1 - sigma)`` is infinite); pass the schedule's second sigma, as
    flow_grpo and verl-omni do. ``cps_log_prob`` picks the ``cps`` log-prob: ``"flow_grpo"`` (the references'
    ``-(x_next - mu)^2``, averaged) or ``"gaussian"`` (the full log-density).
    """
    if cps_log_prob not in CPS_LOG_PROBS:
        raise ValueError(f"unknown cps_log_prob {cps_log_prob!r}; use one of {CPS_LOG_PROBS}")
    dtype = sample.dtype
    v, x = velocity.float(), sample.float()
    sigma, sigma_next = _bcast(sigma, x), _bcast(sigma_next, x)
    dt = sigma_next - sigma
    if sde_type == "sde":
        at_one = sigma >= 1.0
        if sigma_max is None:
            if bool(at_one.any()):
                raise ValueError(
                    "an sde step at sigma = 1 needs sigma_max (the schedule's second sigma, "
                    "as flow_grpo uses) to replace sigma in 1 - sigma"
                )
            sigma_max = 0.0
        denom = 1 - torch.where(at_one, torch.as_tensor(sigma_max, dtype=x.dtype, device=x.device), sigma)
        std_dev_t = noise_level * torch.sqrt(sigma / denom)
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev_t * torch.sqrt(-dt)
    elif sde_type == DANCE_SDE:
        mean, std = dance_sde_mean_std(v, x, sigma, sigma_next, noise_level)
        std_dev_t = std  # verl-omni's dance_sde returns the transition std as std_dev_t (its KL's scale)
    elif sde_type == "cps":
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        std = std_dev_t
        pred_x0, pred_eps = x - sigma * v, x + (1 - sigma) * v
        # sigma_next^2 - s^2 = (sigma_next cos(noise_level pi/2))^2 >= 0; the clamp only absorbs rounding.
        mean = (1 - sigma_next) * pred_x0 + torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0)) * pred_eps
    else:
        raise ValueError(f"unknown sde_type {sde_type!r}; use one of {SDE_TYPES}")
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).expand_as(mean)
    std_dev_t = torch.as_tensor(std_dev_t, dtype=x.dtype, device=x.device).expand_as(mean)
    if prev_sample is None:
        if noise is None:
            raise ValueError("give either prev_sample (to score) or noise (to sample)")
        prev_sample = mean + std * noise.float()
    prev_sample = prev_sample.float()
    if noise_level <= 0:  # deterministic step: the density is a point mass, no log-prob to speak of
        log_prob = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    elif sde_type == "cps" and cps_log_prob == "flow_grpo":
        log_prob = _mean_dims(-((prev_sample.detach() - mean) ** 2))
    else:
        log_prob = gaussian_log_prob(prev_sample, mean, std)
    sqrt_dt = torch.sqrt(torch.clamp(-dt, min=0.0)).expand_as(mean)
    return SDEStep(prev_sample.to(dtype), log_prob, mean, std, std_dev_t, sqrt_dt)


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor | float) -> torch.Tensor:
    """KL term between the policy's and the reference's step Gaussians -> ``[B]``::

        KL = mean_dims[ (mu_theta - mu_ref)^2 ] / (2 std_dev_t^2)

    as flow_grpo (``scripts/train_sd3.py``) and verl-omni (``KLLoss``) compute it, with their ``std_dev_t``
    (``SDEStep.std_dev_t``: for ``sde`` it is ``s / sqrt(-dt)``, without the step's ``sqrt(-dt)``; for ``cps`` it
    is ``s``), so a recipe's ``kl_loss_coef`` transfers. Passing ``SDEStep.std`` instead gives the exact KL of the
    two transition Gaussians (larger by ``1 / |dt|`` for ``sde``). Elements with ``std_dev_t == 0`` (``cps`` at
    ``sigma_next = 0``) count as 0.
    """
    std_dev_t = torch.as_tensor(std_dev_t, dtype=mean.dtype, device=mean.device).expand_as(mean)
    live = std_dev_t > 0
    safe = torch.where(live, std_dev_t, torch.ones_like(std_dev_t))
    kl = (mean - ref_mean) ** 2 / (2 * safe**2)
    return _mean_dims(torch.where(live, kl, torch.zeros_like(kl)))


def sde_window(num_steps: int, window_size: int, window_range: tuple[int, int], generator: torch.Generator) -> range:
    """Denoising step indices that run stochastically (and are trained); the others run as ODE.

    The whole window lies inside ``[lo, hi)``: its start is drawn uniformly from ``lo .. hi - window_size``
    (inclusive), as verl-omni (``request_batch.sample_per_sample_sde_windows``: ``randint(lo, hi - size + 1)``) and
    flow_grpo's pipelines (Python's inclusive ``random.randint(lo, hi - size)``) draw it. The window may include the
    last step (``sigma_next = 0``); ``sde_step_with_logprob`` stays finite there.
    """
    lo, hi = (int(v) for v in window_range)
    if hi - lo < window_size:
        raise ValueError(f"sde_window_range [{lo}, {hi}) holds fewer steps than sde_window_size={window_size}")
    if lo < 0 or hi > num_steps:
        raise ValueError(f"sde_window_range [{lo}, {hi}) is not within the {num_steps} denoising steps")
    start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator).item())
    return range(start, start + window_size)
