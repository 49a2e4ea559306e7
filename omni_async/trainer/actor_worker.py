"""The actors: verl ``Worker`` s run through ``RayWorkerGroup`` on the actor/rollout pool.

Each owns the trainable copy of the policy and the optimizer. ``update_actor`` takes a ``DataProto`` with the
samples' trajectories, behaviour log-probs (pi_old), advantages and a loss mask; it splits the batch into
mini-batches of ``ppo_mini_batch_size`` *prompts* (a ``uid`` group is never split) and takes one clipped AdamW
step per mini-batch. What a trajectory is and how its loss is computed is the modality's:

- :class:`FlowGRPOActorWorker` (images / video): stored SDE-window latents, FlowGRPO loss per window step with
  gradients accumulated across the window steps (one graph alive at a time);
- :class:`TextGRPOActorWorker` (LLM): prompt / response token ids, GRPO with verl's ``core_algos`` (clipped
  policy loss, token-mean aggregation, KL estimator).
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
from omni_async.models.factory import build_policy, sampling_config


def minibatch_indices(uids: np.ndarray, prompts_per_minibatch: int) -> list[np.ndarray]:
    """Split sample indices into mini-batches of whole uid groups, in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    order = list(groups)
    return [np.array([i for u in order[k:k + prompts_per_minibatch] for i in groups[u]])
            for k in range(0, len(order), prompts_per_minibatch)]


class _PolicyActorWorker(Worker):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.cfg = OmegaConf.create(config)
        torch.set_num_threads(int(os.environ.get("OMNI_ASYNC_TORCH_THREADS", "1")))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        m, a = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.actor
        torch.manual_seed(int(self.cfg.trainer.seed))
        self.policy = build_policy(OmegaConf.to_container(m, resolve=True), vars(sampling_config(self.cfg)))
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=a.optim.lr,
                                           weight_decay=a.optim.weight_decay)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.weights_state_dict()

    def backward_minibatch(self, mb: DataProto, mask: torch.Tensor) -> dict[str, list[float]]:
        """Accumulate the mini-batch's gradients; return its metrics."""
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        a = self.cfg.actor_rollout_ref.actor
        sums: dict[str, list[float]] = defaultdict(list)
        for _ in range(a.ppo_epochs):
            for idx in minibatch_indices(data.non_tensor_batch["uid"], int(a.ppo_mini_batch_size)):
                mb = data.select_idxs(idx)
                mask = mb.batch["loss_mask"].bool()
                if not mask.any():
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                for k, v in self.backward_minibatch(mb, mask).items():
                    sums[k].extend(v)
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


class FlowGRPOActorWorker(_PolicyActorWorker):
    def _window_log_probs(self, cond, latents: torch.Tensor, start: int) -> torch.Tensor:
        return torch.stack([self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1]).log_prob
                            for j in range(latents.shape[1] - 1)], 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        """Log-probs of the stored transitions under the current weights (pi_old when not bypassed)."""
        with torch.no_grad():
            cond = self.policy.encode(list(data.non_tensor_batch["prompt"]))
            return self._window_log_probs(cond, data.batch["window_latents"], int(data.meta_info["window_start"]))

    def backward_minibatch(self, mb: DataProto, mask: torch.Tensor) -> dict[str, list[float]]:
        a = self.cfg.actor_rollout_ref.actor
        start = int(mb.meta_info["window_start"])
        cond = self.policy.encode(list(mb.non_tensor_batch["prompt"]))
        latents, old_lp, adv = mb.batch["window_latents"], mb.batch["old_log_probs"], mb.batch["advantages"]
        n_steps = latents.shape[1] - 1
        metrics: dict[str, list[float]] = defaultdict(list)
        for j in range(n_steps):  # gradient accumulation across window steps: one graph alive at a time
            out = self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
            kl = None
            if a.kl_loss_coef > 0:
                with torch.no_grad(), self.policy.reference():
                    ref = self.policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
                kl = kl_to_reference(out.mean, ref.mean, out.std)
            loss, m = flow_grpo_loss(out.log_prob, old_lp[:, j], adv, mask, clip_ratio=a.clip_ratio, kl=kl,
                                     kl_coef=a.kl_loss_coef)
            (loss / n_steps).backward()
            for k, v in m.items():
                metrics[k].append(v)
        return metrics


class TextGRPOActorWorker(_PolicyActorWorker):
    def _log_probs(self, b) -> torch.Tensor:
        return self.policy.log_probs(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        with torch.no_grad():
            return self._log_probs(data.batch)

    def backward_minibatch(self, mb: DataProto, mask: torch.Tensor) -> dict[str, list[float]]:
        from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

        a = self.cfg.actor_rollout_ref.actor
        b = mb.batch
        token_mask = b["response_mask"].float() * mask[:, None].float()  # failed samples contribute nothing
        adv = b["advantages"][:, None].expand_as(token_mask)
        log_prob = self._log_probs(b)
        loss_cfg = OmegaConf.create({"clip_ratio": a.clip_ratio, "clip_ratio_low": None, "clip_ratio_high": None,
                                     "clip_ratio_c": 3.0, "global_batch_info": {}})
        pg_loss, m = get_policy_loss_fn("vanilla")(b["old_log_probs"], log_prob, adv, token_mask,
                                                   loss_agg_mode="token-mean", config=loss_cfg)
        loss, metrics = pg_loss, {"actor/pg_loss": [float(pg_loss)], **{k: [float(v)] for k, v in m.items()}}
        if a.kl_loss_coef > 0:
            with torch.no_grad(), self.policy.reference():
                ref = self._log_probs(b)
            kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), token_mask, "token-mean")
            loss = loss + a.kl_loss_coef * kl
            metrics["actor/kl_loss"] = [float(kl)]
        ratio = torch.exp(log_prob - b["old_log_probs"])[token_mask.bool()]
        metrics["actor/ratio_mean"] = [float(ratio.mean())] if ratio.numel() else [1.0]
        loss.backward()
        return metrics


ACTOR_WORKERS = {"image": FlowGRPOActorWorker, "text": TextGRPOActorWorker}
