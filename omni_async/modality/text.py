"""Text: a causal LM trained with GRPO on token log-probs.

Batch tensors per sample: left-padded ``prompt_ids`` / ``prompt_mask``, right-padded ``response_ids`` /
``response_mask``, ``old_log_probs`` per response token (the rollout's: each token's log-prob under the weights that
generated it), ``token_versions`` (that weights version per token, -1 on padding: with partial rollout one response
may hold several), and verl's token-level ``rm_scores``: the score at the last valid response token, zeros
elsewhere. The batch comes from the driver on the CPU: the loss moves what it uses to the policy's device, and
recomputed log-probs go back on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omni_async.algos.loss import BYPASS_CORRECTION_KEY, bypass_rollout_correction, grpo_token_loss
from omni_async.modality.base import REF_TIME_KEY, Modality, rm_score, score_labels
from omni_async.models.device import device_clock
from omni_async.models.tokens import pad_rows
from omni_async.sample import Sample, TextResult


class TextModality(Modality):
    name = "text"
    uses_window = False
    pad_id = 0  # padding is masked everywhere; any id works

    def sampling_config(self, cfg: Any):
        from omni_async.models.text_policy import TextSamplingConfig

        r = cfg.actor_rollout_ref.rollout
        alpha = r.response_length_pareto_alpha
        return TextSamplingConfig(
            response_length=int(r.response_length),
            temperature=float(r.temperature),
            response_length_pareto_alpha=None if alpha is None else float(alpha),
        )

    def validation_sampling(self, cfg: Any) -> None:
        """Text validation samples with the training settings (``rollout.val_kwargs.{pipeline,algo}`` are the
        diffusion ones)."""
        return None

    def prompt_lengths(self, model_path: str, prompts: list[str]) -> list[int]:
        """Tokens per prompt for ``data.max_prompt_length``: the chat-templated prompt, as the policy feeds it."""
        from transformers import AutoTokenizer

        from omni_async.models.text_policy import chat_prompt_ids
        from omni_async.models.tiny import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(model_path))
        return [len(chat_prompt_ids(tok, p)) for p in prompts]

    def trainable_policy(self, path: str, sampling: dict[str, Any], **trainable: Any):
        from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
        from omni_async.models.tiny import is_sim

        if is_sim(path):  # a simulated device: generation and update are timed waits (models.sim_policy)
            from omni_async.models.sim_policy import SimTextPolicy

            return SimTextPolicy(path, TextSamplingConfig(**sampling), **trainable)
        return TextPolicy(path, TextSamplingConfig(**sampling), **trainable)

    def serving_client(self, model: dict[str, Any], sampling: dict[str, Any], server: dict[str, Any]):
        """A client of a vLLM server (``rollout.name=vllm``)."""
        from omni_async.models.text_policy import TextSamplingConfig
        from omni_async.models.vllm_text_policy import VLLMTextPolicy

        return VLLMTextPolicy(
            model["path"],
            TextSamplingConfig(**sampling),
            server=server,
            lora_rank=model["lora_rank"],
            lora_alpha=model["lora_alpha"],
            target_modules=list(model["target_modules"]),
        )

    def batch_tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        results: list[TextResult] = [s.result for s in samples]
        prompt_ids, prompt_mask = pad_rows([r.prompt_ids for r in results], self.pad_id, left=True)
        response_ids, response_mask = pad_rows([r.response_ids for r in results], self.pad_id, left=False)
        old = torch.zeros(response_ids.shape)
        versions = torch.full(response_ids.shape, -1, dtype=torch.int64)
        for i, r in enumerate(results):
            old[i, : len(r.log_probs)] = r.log_probs
            versions[i, : len(r.versions)] = r.versions
        rm = torch.zeros(response_ids.shape)
        last = (response_mask.sum(-1) - 1).clamp(min=0)
        rm[torch.arange(len(samples)), last] = torch.tensor([rm_score(s) for s in samples])
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "old_log_probs": old,
            "token_versions": versions,
            "rm_scores": rm,
        }

    def log_probs(self, policy, batch) -> torch.Tensor:
        """The recompute's log-probs [B, Lr], on the CPU (they go back to the driver)."""
        return self._log_probs(policy, batch).cpu()

    @staticmethod
    def _log_probs(policy, batch) -> torch.Tensor:
        b = batch.batch
        return policy.log_probs(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])

    def loss_units(self, batch) -> int:
        """The tokens in the loss's denominator: the kept samples' response tokens, less the ones decoupled-mode
        rejection took out (verl's driver takes them out of ``response_mask``, so its ``batch_num_tokens`` does not
        count them). Bypass-mode rejection happens inside the loss call and is counted, as verl's."""
        b = batch.batch
        units = b["response_mask"].bool() & b["loss_mask"].bool()[:, None]
        if "rollout_rs_mask" in b.keys():
            units = units & b["rollout_rs_mask"].bool()
        return int(units.sum())

    def backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float = 1.0
    ) -> dict[str, list[float]]:
        device = policy.device
        response_mask, old_log_probs, advantages = (
            batch.batch[k].to(device) for k in ("response_mask", "old_log_probs", "advantages")
        )
        token_mask = response_mask.float() * loss_mask.to(device)[:, None].float()
        # verl's decoupled rollout correction (StepOps.rollout_correction): IS weights and the rejection mask.
        is_w, rs = (
            batch.batch[k].to(device) if k in batch.batch.keys() else None
            for k in ("rollout_is_weights", "rollout_rs_mask")
        )
        if rs is not None:
            token_mask = token_mask * rs.float()
        log_prob = self._log_probs(policy, batch)
        corr: dict[str, float] = {}
        kept = None
        if bypass := batch.meta_info.get(BYPASS_CORRECTION_KEY):
            # verl's bypass-mode rollout correction, between the current policy and the rollout: rejected tokens
            # weigh 0 (the token-mean's denominator keeps them), its IS weights are reported (the PPO ratio is
            # already that ratio, clipped)
            kept, corr = bypass_rollout_correction(log_prob, old_log_probs, token_mask, bypass)
        ref, ref_s = None, 0.0
        if actor_cfg.kl_loss_coef > 0:
            t0 = device_clock(device)
            with torch.no_grad(), policy.reference():
                ref = self._log_probs(policy, batch)
            ref_s = device_clock(device) - t0
        loss, metrics = grpo_token_loss(
            log_prob,
            old_log_probs,
            advantages[:, None].expand_as(token_mask),
            token_mask,
            clip_ratio=actor_cfg.clip_ratio,
            ref_log_prob=ref,
            kl_coef=actor_cfg.kl_loss_coef,
            rollout_is_weights=is_w,
            keep=kept,
        )
        (loss * loss_scale).backward()
        return {**{k: [v] for k, v in {**metrics, **corr}.items()}, REF_TIME_KEY: [ref_s]}

    def save_samples(self, out_dir: Path, step: int, samples: list[Sample]) -> Path:
        """A JSONL of prompt, response and reward per sample."""
        path = Path(out_dir) / f"step_{step:04d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(
                json.dumps({"uid": s.uid, "prompt": s.row.prompt, "response": s.result.response, "reward": label})
                + "\n"
                for s, label in zip(samples, score_labels(samples), strict=True)
            )
        )
        return path
