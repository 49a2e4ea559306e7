"""Diffusion-DPO (Wallace et al., CVPR 2024, arXiv 2311.12908) on flow-matching models, as verl-omni computes it
(``verl_omni/trainer/diffusion/diffusion_algos.py``: ``DPOLoss``; its noise and timesteps:
``verl_omni/pipelines/utils.py``: ``sample_noise_and_timesteps``; the formula: its ``docs/algo/diffusion_dpo.md``).
Written here from those, not copied.

**Pairs** (verl-omni's ``DPOLoss.build_online_dpo_pair_indices``, :func:`preference_pairs`): per prompt (``uid``
group, in order of first appearance) with at least 2 samples, the samples sorted by reward, highest first (a stable
sort: ties keep their order), the first is the chosen ``x0^w`` and the last the rejected ``x0^l``; the actor's batch
lays them out adjacent, ``[w_0, l_0, w_1, l_1, ...]``. Offline DPO reads the pair from its dataset row. Here a sample
whose reward call failed is not a candidate (``reward.on_failure=mask``), so a group needs 2 scored members.

**Forward process**, one draw per pair shared by its two samples (verl-omni repeats it over the pair)::

    u     = sigmoid(n),  n ~ N(0, 1)                             diffusers' logit_normal density (mean 0, std 1)
    k     = floor(u * T)                                         T = the scheduler's num_train_timesteps
    t     = sigma_k of the scheduler's training grid             (:func:`train_index`)
    x_t   = (1 - t) x0 + t eps,  eps ~ N(0, I)                   the same eps for x0^w and x0^l

**Loss** (verl-omni's ``DPOLoss.compute_loss``; ``v`` the (CFG-guided) velocity predictions at ``x_t, t``)::

    e(v, x0)    = mean_dims (v - (eps - x0))^2                   the flow-matching error
    d(x0)       = e(v_theta, x0) - e(v_ref, x0)                  v_ref: the frozen reference (LoRA: adapter off)
    z           = -beta / 2 * (d(x0^w) - d(x0^l))                beta = diffusion_loss.dpo_beta
    L           = -mean_pairs log sigmoid(z)

so the loss falls when the policy improves on the reference more for the chosen sample than for the rejected one.
Metrics, verl-omni's: ``actor/dpo_loss`` (L), ``actor/implicit_acc`` (share of pairs with z > 0),
``rewards/chosen`` (mean of ``-beta/2 d(x0^w)``), ``rewards/rejected`` (of ``-beta/2 d(x0^l)``),
``rewards/margins`` (of their difference, = mean z).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def preference_pairs(uids: Sequence[str], scores: Sequence[float], kept: Sequence[bool]) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` row indices, one pair per ``uid`` group with at least 2 kept rows, in order of the
    groups' first appearance (module docstring: verl-omni's rule on the kept rows)."""
    groups: dict[str, list[int]] = {}
    for i, (u, ok) in enumerate(zip(uids, kept, strict=True)):
        if ok:
            groups.setdefault(u, []).append(i)
    pairs = []
    for rows in groups.values():
        if len(rows) >= 2:
            ranked = sorted(rows, key=lambda i: float(scores[i]), reverse=True)
            pairs.append((ranked[0], ranked[-1]))
    return pairs


def train_index(u: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """``k = floor(u * T)`` (int64), the training-grid index of each pair's timestep from its ``u`` in (0, 1)
    (module docstring)."""
    return (u.double() * int(num_train_timesteps)).long().clamp(0, int(num_train_timesteps) - 1)


def logit_normal_u(generator: torch.Generator) -> float:
    """One ``u = sigmoid(n)``, ``n ~ N(0, 1)`` from ``generator`` (diffusers' ``logit_normal`` timestep density)."""
    return float(torch.sigmoid(torch.randn((), generator=generator)))


def matching_error(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``e`` ``[B]``: ``mean_dims (v - (noise - x0))^2``, in fp32 at least (verl-omni's ``.float()``)."""
    dt = torch.promote_types(v.dtype, torch.float32)
    return ((v.to(dt) - (noise.to(dt) - x0.to(dt))) ** 2).flatten(1).mean(1)


def dpo_loss(
    v_theta: torch.Tensor,
    v_ref: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(L, metrics)`` (module docstring) over rows laid out ``[w_0, l_0, w_1, l_1, ...]``: ``v_theta`` (with
    gradient), ``v_ref`` (without), ``x0`` and ``noise`` ``[2P, ...]``. Metrics are detached 0-d tensors."""
    if v_theta.shape[0] < 2 or v_theta.shape[0] % 2:
        raise ValueError(f"DPO needs adjacent (chosen, rejected) rows, an even batch; got {v_theta.shape[0]} rows")
    d = matching_error(v_theta, x0, noise) - matching_error(v_ref.detach(), x0, noise)
    chosen, rejected = -0.5 * float(beta) * d[0::2], -0.5 * float(beta) * d[1::2]
    z = chosen - rejected
    loss = -F.logsigmoid(z).mean()
    with torch.no_grad():
        metrics = {
            "actor/dpo_loss": loss.detach(),
            "actor/implicit_acc": (z > 0).float().mean(),
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margins": z.mean(),
        }
    return loss, metrics
