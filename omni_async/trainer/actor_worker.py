"""The FlowGRPO actor: a verl ``Worker`` run through ``RayWorkerGroup`` on the actor/rollout pool.

It owns the trainable copy of the policy and the optimizer. ``update_actor`` takes a ``DataProto`` with, per
sample: the stored SDE-window latents, the behaviour log-probs (pi_old), the advantage and a loss mask; it splits
the batch into mini-batches of ``ppo_mini_batch_size`` *prompts* (a ``uid`` group is never split), and for each
mini-batch accumulates gradients over the window steps before one clipped AdamW step.
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

from omni_async.algos.loss import flow_grpo_loss
from omni_async.algos.sde import kl_to_reference
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig


def sampling_config(cfg) -> SamplingConfig:
    r = cfg.actor_rollout_ref.rollout
    return SamplingConfig(height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
                          noise_level=r.algo.noise_level, sde_type=r.algo.sde_type,
                          true_cfg_scale=float(r.pipeline.true_cfg_scale), guidance_scale=float(r.pipeline.guidance_scale),
                          num_frames=int(r.num_frames))


def minibatch_indices(uids: np.ndarray, prompts_per_minibatch: int) -> list[np.ndarray]:
    """Split sample indices into mini-batches of whole uid groups, in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    order = list(groups)
    return [np.array([i for u in order[k:k + prompts_per_minibatch] for i in groups[u]])
            for k in range(0, len(order), prompts_per_minibatch)]


class FlowGRPOActorWorker(Worker):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.cfg = OmegaConf.create(config)
        torch.set_num_threads(int(os.environ.get("OMNI_ASYNC_TORCH_THREADS", "1")))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        m, a = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.actor
        torch.manual_seed(int(self.cfg.trainer.seed))
        self.policy = DiffusionPolicy(m.path, sampling_config(self.cfg), lora_rank=m.lora_rank,
                                      lora_alpha=m.lora_alpha, target_modules=list(m.target_modules))
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=a.optim.lr,
                                           weight_decay=a.optim.weight_decay)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.weights_state_dict()

    def _window_log_probs(self, cond, latents: torch.Tensor, start: int, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return torch.stack([self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1]).log_prob
                                for j in range(latents.shape[1] - 1)], 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        """Log-probs of the stored transitions under the current weights (pi_old when not bypassed)."""
        cond = self.policy.encode(list(data.non_tensor_batch["prompt"]))
        return self._window_log_probs(cond, data.batch["window_latents"], int(data.meta_info["window_start"]), False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        a = self.cfg.actor_rollout_ref.actor
        start = int(data.meta_info["window_start"])
        uids = data.non_tensor_batch["uid"]
        sums: dict[str, list[float]] = defaultdict(list)
        for _ in range(a.ppo_epochs):
            for idx in minibatch_indices(uids, int(a.ppo_mini_batch_size)):
                mb = data.select_idxs(idx)
                mask = mb.batch["loss_mask"].bool()
                if not mask.any():
                    continue
                cond = self.policy.encode(list(mb.non_tensor_batch["prompt"]))
                latents, old_lp, adv = mb.batch["window_latents"], mb.batch["old_log_probs"], mb.batch["advantages"]
                n_steps = latents.shape[1] - 1
                self.optimizer.zero_grad(set_to_none=True)
                for j in range(n_steps):  # gradient accumulation across window steps: one graph alive at a time
                    out = self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
                    kl = None
                    if a.kl_loss_coef > 0:
                        with torch.no_grad(), self.policy.reference():
                            ref = self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
                        kl = kl_to_reference(out.mean, ref.mean, out.std)
                    loss, metrics = flow_grpo_loss(out.log_prob, old_lp[:, j], adv, mask, clip_ratio=a.clip_ratio,
                                                   kl=kl, kl_coef=a.kl_loss_coef)
                    (loss / n_steps).backward()
                    for k, v in metrics.items():
                        sums[k].append(v)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), a.grad_clip)
                self.optimizer.step()
                sums["actor/grad_norm"].append(float(grad_norm))
        return {k: float(np.mean(v)) for k, v in sums.items()}

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
