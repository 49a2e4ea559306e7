"""Flow-matching SDE step with Gaussian log-probability (FlowGRPO), and the SDE window.

Convention (diffusers FlowMatch): ``x_sigma = (1 - sigma) * x0 + sigma * eps``, the model predicts the velocity
``v = eps - x0``, and sampling walks sigma from 1 down to 0. The deterministic (ODE) Euler step is

    x_next = x + (sigma_next - sigma) * v                                         (diffusers' Euler step)

Two stochastic variants turn the step into a Gaussian ``x_next ~ N(mu, s^2)`` whose log-density is the policy's
log-prob. With ``dt = sigma_next - sigma < 0``:

``sde`` (Flow-GRPO, from the reverse-time SDE with the same marginals)::

    std_t = noise_level * sqrt(sigma / (1 - sigma))          (sigma = 1 replaced by the next-largest sigma)
    mu    = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
    s     = std_t * sqrt(-dt)

``cps`` (coefficients-preserving sampling)::

    s     = sigma_next * sin(noise_level * pi / 2)
    x0^   = x - sigma * v ,   eps^ = x + (1 - sigma) * v
    mu    = (1 - sigma_next) * x0^ + sqrt(sigma_next^2 - s^2) * eps^

Both reduce to the Euler step exactly when ``noise_level = 0``. The log-prob is the Gaussian log-density
``-(x_next - mu)^2 / (2 s^2) - log s - log sqrt(2 pi)`` averaged over all non-batch dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStep:
    prev_sample: torch.Tensor  # x_next, [B, ...]
    log_prob: torch.Tensor  # [B]
    mean: torch.Tensor  # mu, [B, ...]
    std: torch.Tensor  # s, broadcastable to mean


def _bcast(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.ndim - 1))) if t.ndim > 0 else t


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2), averaged over non-batch dims -> [B]."""
    lp = -((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sde_type: str = "sde",
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """One stochastic denoising step ``x_sigma -> x_sigma_next`` and the log-prob of the result.

    Give ``prev_sample`` to score a stored transition (training), or ``noise`` (standard normal, same shape as
    ``sample``) to draw one (rollout). ``sigma_max`` is the value that replaces ``sigma = 1`` in the ``sde``
    variant, where ``sigma / (1 - sigma)`` is infinite; use the schedule's second sigma.
    """
    dtype = sample.dtype
    v, x = velocity.float(), sample.float()
    sigma, sigma_next = _bcast(sigma, x), _bcast(sigma_next, x)
    dt = sigma_next - sigma
    if sde_type == "sde":
        guarded = torch.where(sigma >= 1.0, torch.as_tensor(sigma_max if sigma_max is not None else 0.999,
                                                            dtype=x.dtype, device=x.device), sigma)
        std_t = noise_level * torch.sqrt(guarded / (1 - guarded))
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        pred_x0, pred_eps = x - sigma * v, x + (1 - sigma) * v
        mean = (1 - sigma_next) * pred_x0 + torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0)) * pred_eps
    else:
        raise ValueError(f"unknown sde_type {sde_type!r}; use 'sde' or 'cps'")
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).expand_as(mean) if torch.is_tensor(std) else std
    if prev_sample is None:
        if noise is None:
            raise ValueError("give either prev_sample (to score) or noise (to sample)")
        prev_sample = mean + std * noise.float()
    prev_sample = prev_sample.float()
    if noise_level > 0:
        log_prob = gaussian_log_prob(prev_sample, mean, std)
    else:  # deterministic step: the density is a point mass, no log-prob to speak of
        log_prob = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    return SDEStep(prev_sample.to(dtype), log_prob, mean, std)


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians sharing std s: ``||mu_theta - mu_ref||^2 / (2 s^2)``, averaged over non-batch dims."""
    kl = (mean - ref_mean) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def sde_window(num_steps: int, window_size: int, window_range: tuple[int, int], generator: torch.Generator) -> range:
    """Denoising step indices that run stochastically (and are trained); the others run as ODE.

    The start is drawn uniformly from ``[lo, hi)``; the window is ``[start, start + window_size)``.
    """
    lo, hi = window_range
    if not (0 <= lo < hi and hi - 1 + window_size <= num_steps):
        raise ValueError(f"sde_window_range {window_range} with size {window_size} exceeds {num_steps} steps")
    start = int(torch.randint(lo, hi, (1,), generator=generator).item())
    return range(start, start + window_size)
