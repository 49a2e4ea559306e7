"""Statistics over the kept samples of a batch (``mask``), computed without indexing by the mask.

Indexing by a boolean mask (``x[mask]``) waits for the device to learn the result's size; these helpers multiply by
the mask instead (``torch.where``, so a dropped sample's inf or NaN stays out too), so a loss can build its metrics
as device tensors and the caller reads them once after backward. A batch with no kept sample gives the neutral value
each helper names (never NaN).
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i m_i x_i / max(sum_i m_i, 1)`` over ``[B]`` tensors: 0 when no sample is kept."""
    keep = mask.bool()
    return torch.where(keep, x, torch.zeros_like(x)).sum() / keep.to(x.dtype).sum().clamp(min=1.0)


def with_kl_term(
    pg_loss: torch.Tensor, kl: torch.Tensor | None, kl_coef: float, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``L = L_pg + beta * masked_mean(KL)`` (``beta = kl_coef``; the term only with ``kl`` given and ``beta > 0``),
    and the metric ``actor/kl_loss``: the KL term every window loss (Flow-GRPO, GRPO-Guard, Flow-DPPO) adds."""
    if kl is None or kl_coef <= 0:
        return pg_loss, {}
    kl_loss = masked_mean(kl, mask)
    return pg_loss + kl_coef * kl_loss, {"actor/kl_loss": kl_loss.detach()}


def per_sample(x: torch.Tensor | float, batch: int, like: torch.Tensor) -> torch.Tensor:
    """A per-sample scale as ``[B]``: a float, a 0-d tensor, ``[B]``, or ``[B, ...]`` broadcast over a sample's
    elements (``SDEStep.std_dev_t`` is expanded to the latent's shape) averaged over its non-batch dims."""
    t = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        return t.expand(batch)
    return t.reshape(t.shape[0], -1).mean(dim=1) if t.ndim > 1 else t


def masked_ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> dict[str, torch.Tensor]:
    """Mean, std, min and max of ``ratio`` over the kept samples; with none kept: 1, 0, 1, 1 (an untouched policy).

    ``unbiased``: divide the variance by ``n - 1`` (``torch.std``'s default) or by ``n``; one kept sample has std 0.
    """
    keep = mask.bool()
    n = keep.to(ratio.dtype).sum()
    one = torch.ones_like(n)
    mean = torch.where(n > 0, masked_mean(ratio, keep), one)
    denom = (n - 1).clamp(min=1.0) if unbiased else n.clamp(min=1.0)
    std = (masked_mean((ratio - mean) ** 2, keep) * n.clamp(min=1.0) / denom).sqrt()
    rmin = torch.where(n > 0, torch.where(keep, ratio, torch.full_like(ratio, float("inf"))).min(), one)
    rmax = torch.where(n > 0, torch.where(keep, ratio, torch.full_like(ratio, float("-inf"))).max(), one)
    return {"mean": mean, "std": std, "min": rmin, "max": rmax}
