"""The actor: a verl ``Worker`` per actor/rollout device, run through ``RayWorkerGroup``.

It owns the trainable copy of the policy and the optimizer. The trainer splits a step's batch into mini-batches
(``trainer.step_ops.minibatches``: whole ``uid`` groups, every epoch) and calls :meth:`ActorWorker.update_minibatch`
once per optimizer step; what a trajectory is and how its loss is computed is the modality's
(``omni_async.modality``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from omni_async.cluster import configure_worker
from omni_async.modality import REF_TIME_KEY, Modality, get_modality
from omni_async.modality.base import model_dtype


def accumulate_gradients(modality: Modality, policy: Any, data: DataProto, actor_cfg: Any) -> dict[str, list[float]]:
    """Gradients of one mini-batch's loss, in micro-batches of ``actor_cfg.ppo_micro_batch_size_per_gpu`` samples.

    A micro-batch's loss is a mean over its own loss units (kept samples, or kept tokens), so its gradient is
    weighted by ``units_micro / units_minibatch``: the sum equals the gradient of the un-micro-batched loss.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    micro = data.split(int(actor_cfg.ppo_micro_batch_size_per_gpu or len(data)))
    units = [float(modality.loss_units(mb)) for mb in micro]
    for mb, n in zip(micro, units, strict=True):
        if n == 0:
            continue
        for k, v in modality.backward(policy, mb, mb.batch["loss_mask"].bool(), actor_cfg,
                                      loss_scale=n / sum(units)).items():
            metrics[k].extend(v)
    return metrics


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float) -> float | None:
    """Clip the gradient norm and step; as verl's actor, a non-finite norm skips the step (``None``) instead of
    writing NaN into the weights."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if not torch.isfinite(grad_norm):
        return None
    optimizer.step()
    return float(grad_norm)


class ActorWorker(Worker):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.cfg = OmegaConf.create(config)
        self.device = configure_worker()
        self.modality = get_modality(self.cfg.actor_rollout_ref.model.modality)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        m, a = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.actor
        torch.manual_seed(int(self.cfg.trainer.seed))
        sampling = vars(self.modality.sampling_config(self.cfg))
        dtype = model_dtype(a.fsdp_config.model_dtype, self.device)
        self.policy = self.modality.build_policy(OmegaConf.to_container(m, resolve=True), sampling, self.device,
                                                 dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=a.optim.lr,
                                           weight_decay=a.optim.weight_decay)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.weights_state_dict()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        """Log-probs of the stored trajectories under the current weights (pi_old when not bypassed), in
        micro-batches of ``rollout.log_prob_micro_batch_size_per_gpu`` samples."""
        size = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu or len(data)
        with torch.no_grad():
            return torch.cat([self.modality.log_probs(self.policy, mb) for mb in data.split(int(size))])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_minibatch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on one mini-batch (``loss_mask`` marks the samples in the loss).

        The mini-batch runs in micro-batches of ``actor.ppo_micro_batch_size_per_gpu`` samples with gradients
        accumulated; each micro-batch's loss (a mean over its own loss units) is weighted by its share of the
        mini-batch's units, so the step equals the un-micro-batched one.
        """
        a = self.cfg.actor_rollout_ref.actor
        self.optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(self.modality, self.policy, data, a)
        grad_norm = clipped_step(self.optimizer, self.policy.trainable_parameters(), a.grad_clip)
        metrics["actor/skipped_steps"].append(0.0 if grad_norm is not None else 1.0)
        metrics["actor/grad_norm"].append(grad_norm if grad_norm is not None else 0.0)
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out[REF_TIME_KEY] = float(np.sum(metrics[REF_TIME_KEY]))
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save({"weights": self.policy.weights_state_dict(), "optimizer": self.optimizer.state_dict()},
                   os.path.join(path, "actor.pt"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        state = torch.load(os.path.join(path, "actor.pt"), weights_only=True)
        self.policy.load_weights_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
