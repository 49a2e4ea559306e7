"""The actor's Ray-free core: one optimizer step on a mini-batch and the log-prob recompute.

``ActorWorker`` (a verl ``Worker`` under Ray) calls these; so does ``bench/gpu_step.py`` on a bare GPU machine
that has PyTorch, diffusers, transformers and peft but neither Ray nor verl. That is why this module imports
neither: a batch is anything shaped like verl's ``DataProto`` (``.batch`` a mapping of batch-first tensors,
``.meta_info``, ``.split(n)``, ``len()``), e.g. :class:`TensorBatch`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_async.modality import REF_TIME_KEY, Modality
from omni_async.models.offload import optimizer_state_on_device
from omni_async.trainer.data_parallel import (
    DataParallel,
    full_params,
    grad_norm_value,
    lockstep,
    loss_scales,
    merge_rank_metrics,
    sharded_params,
)

# Which weights a pi_old recompute runs under (``meta_info[PI_OLD_KEY]`` of its batch; ``trainer.step_ops`` sets it):
# the live ones; the live ones, kept as the synced weights first (the first recompute after a weight sync, when
# updates may follow before the next sync); or the kept synced weights (a recompute after an update of the window).
PI_OLD_KEY = "pi_old_weights"
PI_OLD_LIVE, PI_OLD_KEEP, PI_OLD_SYNCED = "live", "keep_synced", "synced"


@dataclass
class TensorBatch:
    """The part of ``DataProto`` the modalities' losses read, without verl (whose import starts with Ray's)."""

    batch: dict[str, torch.Tensor]
    meta_info: dict[str, Any] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.batch.values())))

    def split(self, size: int) -> list[TensorBatch]:
        return [
            TensorBatch(
                {k: v[i : i + size] for k, v in self.batch.items()},
                dict(self.meta_info),
                {k: v[i : i + size] for k, v in self.non_tensor_batch.items()},
            )
            for i in range(0, len(self), size)
        ]


def accumulate_gradients(
    modality: Modality, policy: Any, data: Any, actor_cfg: Any, dp: DataParallel | None = None
) -> dict[str, list[float]]:
    """Gradients of one mini-batch's loss, in micro-batches of ``actor_cfg.ppo_micro_batch_size_per_gpu`` samples.

    A micro-batch's loss is a mean over its own loss units (kept samples, or kept tokens), so its gradient is
    weighted by ``units_micro / units_minibatch``: the sum equals the gradient of the un-micro-batched loss. With
    data parallelism ``data`` is this rank's share and ``units_minibatch`` counts every rank's units
    (``trainer.data_parallel.loss_scales``); a sharded (FSDP2) model runs as many passes as the busiest rank.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    micro = data.split(int(actor_cfg.ppo_micro_batch_size_per_gpu or len(data)))
    units = [float(modality.loss_units(mb)) for mb in micro]
    scales = loss_scales(units, dp)
    every_pass = dp is not None and dp.sharded  # each forward/backward is a collective there
    if every_pass:
        micro, scales = lockstep(micro, scales, dp)
        units += [0.0] * (len(micro) - len(units))
    for mb, n, scale in zip(micro, units, scales, strict=True):
        if n == 0 and not every_pass:
            continue
        out = modality.backward(policy, mb, mb.batch["loss_mask"].bool(), actor_cfg, loss_scale=scale)
        if n > 0:
            for k, v in out.items():
                metrics[k].extend(v)
    return metrics


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float) -> float | None:
    """Clip the gradient norm and step; as verl's actor, a non-finite norm skips the step (``None``) instead of
    writing NaN into the weights."""
    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    if not torch.isfinite(grad_norm):
        return None
    optimizer.step()
    return float(grad_norm)


def offload_frozen(policy: Any, offload: bool) -> None:
    """``param_offload`` for a policy that has frozen parts to move (a diffusion pipeline's text encoder and VAE); a
    causal LM trains its one model, so the worker refuses the key for text at start."""
    if offload:
        policy.offload_frozen(True)


def begin_step(policy: Any, param_offload: bool) -> None:
    """A new training step: ``param_offload`` may move the frozen modules off the device once more (at most one
    round trip per step, ``DiffusionPolicy.offload_frozen``)."""
    if param_offload:
        policy.begin_step()


def train_minibatch(
    modality: Modality,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    data: Any,
    actor_cfg: Any,
    *,
    param_offload: bool = False,
    optimizer_offload: bool = False,
    dp: DataParallel | None = None,
) -> dict[str, list[float]]:
    """One optimizer step on one mini-batch (``loss_mask`` marks the samples in the loss): micro-batched backward
    (:func:`accumulate_gradients`), gradient clip, optimizer step; the metrics as lists (one entry per loss call).
    With ``param_offload`` the frozen text encoder and VAE are on the CPU meanwhile; with ``optimizer_offload`` the
    optimizer state is on the device only for the step. With ``dp`` (data parallelism) ``data`` is this rank's share
    and the step is the whole group's: LoRA gradients all-reduced (a sum), an FSDP2 model's reduce-scattered.
    """
    offload_frozen(policy, param_offload)
    sharded = dp is not None and dp.sharded
    if sharded:
        sharded_params(policy.trainable)
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(modality, policy, data, actor_cfg, dp)
    if dp is not None and not sharded:
        dp.all_reduce_grads(policy.trainable_parameters())
    with optimizer_state_on_device(optimizer, optimizer_offload):
        grad_norm = clipped_step(optimizer, policy.trainable_parameters(), actor_cfg.grad_clip)
    policy.refresh_working_weights()  # the compute-dtype copy takes the stepped fp32 masters (models.lora)
    if sharded:
        full_params(policy.trainable)  # generation and log-probs run on the gathered weights until the next update
    metrics["actor/skipped_steps"].append(0.0 if grad_norm is not None else 1.0)
    metrics["actor/grad_norm"].append(grad_norm if grad_norm is not None else 0.0)
    metrics.setdefault(REF_TIME_KEY, [])
    return metrics


def update_minibatch(
    modality: Modality, policy: Any, optimizer: torch.optim.Optimizer, data: Any, actor_cfg: Any, **offload: bool
) -> dict[str, float]:
    """:func:`train_minibatch` on one process (``offload``: its ``param_offload`` / ``optimizer_offload``), its
    metrics summarised (means; ``timing_s/ref`` the total)."""
    return merge_rank_metrics(
        [train_minibatch(modality, policy, optimizer, data, actor_cfg, **offload)], time_keys=(REF_TIME_KEY,)
    )


def compute_log_prob(
    modality: Modality, policy: Any, data: Any, micro_batch_size: int | None = None, *, param_offload: bool = False
) -> torch.Tensor:
    """Log-probs of the stored trajectories under the current weights, in micro-batches of ``micro_batch_size``
    samples (``rollout.log_prob_micro_batch_size_per_gpu``; ``None`` = all at once); a dict of per-row tensors when
    the modality returns one (GRPO-Guard / Flow-DPPO: the log-probs and the window-step means)."""
    offload_frozen(policy, param_offload)
    with torch.no_grad():
        parts = [modality.log_probs(policy, mb) for mb in data.split(int(micro_batch_size or len(data)))]
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)


def old_log_prob(
    modality: Modality,
    policy: Any,
    data: Any,
    micro_batch_size: int | None = None,
    *,
    param_offload: bool = False,
    gather: Callable[[], None] | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """pi_old's recompute (verl's decoupled mode): :func:`compute_log_prob` under the weights of the last weight
    sync, as verl's fully async trainer recomputes ``old_log_prob`` at every local update of a sync window with the
    parameters it saved at the window's first one. ``data.meta_info[PI_OLD_KEY]`` says how (``PI_OLD_*``):
    ``PI_OLD_KEEP`` keeps the live weights (then still the synced ones) first, ``PI_OLD_SYNCED`` swaps the kept ones
    in for the forwards and the live ones back after (``gather``: FSDP2's gather of the shards, see
    ``TrainableModule.synced_weights``)."""
    how = data.meta_info.get(PI_OLD_KEY, PI_OLD_LIVE)
    if how not in (PI_OLD_LIVE, PI_OLD_KEEP, PI_OLD_SYNCED):
        raise ValueError(f"unknown {PI_OLD_KEY} {how!r}")
    if how == PI_OLD_KEEP:
        policy.keep_synced_weights()
    weights = policy.synced_weights(gather) if how == PI_OLD_SYNCED else contextlib.nullcontext()
    with weights:
        return compute_log_prob(modality, policy, data, micro_batch_size, param_offload=param_offload)
