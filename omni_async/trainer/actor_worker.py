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
from omni_async.modality import REF_TIME_KEY, get_modality
from omni_async.modality.base import model_dtype


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
        """Log-probs of the stored trajectories under the current weights (pi_old when not bypassed)."""
        with torch.no_grad():
            return self.modality.log_probs(self.policy, data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_minibatch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on one mini-batch (``loss_mask`` marks the samples in the loss)."""
        a = self.cfg.actor_rollout_ref.actor
        loss_mask = data.batch["loss_mask"].bool()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, list[float]] = defaultdict(list, self.modality.backward(self.policy, data, loss_mask, a))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), a.grad_clip)
        self.optimizer.step()
        metrics["actor/grad_norm"].append(float(grad_norm))
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
