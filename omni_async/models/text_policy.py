"""A causal LM (transformers) as a GRPO policy: chat-template prompts, seeded sampling with response log-probs,
log-prob recompute, LoRA via peft (or full fine-tune), reference = adapter off.

Sampling is reproducible per sample: each row draws its tokens from its own ``torch.Generator(seed)`` on the model's
device, so a response depends on (weights, prompt, seed, device) only, not on which other prompts share the batch
(up to the float noise of left padding). Inputs are moved to the model's device here; what leaves the policy
(``TextResult``) is on the CPU.

Partial rollout (fully async, text): ``should_stop`` ends a batch after its current token (a weight sync is waiting);
the responses not done come back unfinished with their generators' states and are continued later (``resume``),
possibly under other weights. Such a response depends also on where it was interrupted, not only on its seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_async.models.loading import causal_lm_load_kwargs
from omni_async.models.lora import TrainableModule
from omni_async.models.tiny import resolve_model_path
from omni_async.sample import TextResult


def chat_prompt_ids(tok, prompt: str) -> list[int]:
    """The token ids the policy is prompted with: the user turn in the tokenizer's chat template."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@dataclass
class TextSamplingConfig:
    response_length: int = 32  # max new tokens
    temperature: float = 1.0
    response_length_pareto_alpha: float | None = None  # a per-response length budget with a long tail (length_budget)


LONG_TAIL_SPREAD = 10.0  # the shortest budget is response_length / 10


def length_budget(seed: int, response_length: int, alpha: float | None) -> int:
    """A response's token budget: ``response_length`` when ``alpha`` is None, else
    ``round(response_length * min(1, X / 10))`` with ``X = (1 - u)^(-1/alpha)`` ~ Pareto(alpha) (X >= 1) and ``u``
    uniform from the sample's seed (its own stream, so the tokens drawn are unchanged). Lengths then vary x10 with a
    heavy tail: ``P(budget = response_length) = 10^-alpha``."""
    if alpha is None:
        return int(response_length)
    import numpy as np

    u = float(np.random.default_rng([int(seed), 0x7A11]).random())
    x = (1.0 - u) ** (-1.0 / float(alpha))
    return max(1, min(int(response_length), int(round(response_length * x / LONG_TAIL_SPREAD))))


class TextPolicy(TrainableModule):
    def __init__(
        self,
        model_path: str,
        sampling: TextSamplingConfig,
        *,
        lora_rank: int = 8,
        lora_alpha: int = 16,
        target_modules: list[str] | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(model_path)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, **causal_lm_load_kwargs(device, dtype))
        self.model.requires_grad_(False)
        self.sampling = sampling
        # generation_config.eos_token_id is an int or a list (Qwen2.5/Qwen3-Instruct: [<|im_end|>, <|endoftext|>]);
        # a response stops at the first of any of them.
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tok.eos_token_id
        self.eos_ids: list[int] = [int(e) for e in ([] if eos is None else [eos] if isinstance(eos, int) else eos)]
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.init_trainable(self.model, lora_rank, lora_alpha, target_modules or ["q_proj", "v_proj"])
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- sampling -------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> list[int]:
        return chat_prompt_ids(self.tok, prompt)

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate(
        self,
        prompts: list[str],
        seeds: list[int],
        *,
        resume: list[TextResult | None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[TextResult]:
        """One response per (prompt, seed): token ids up to and including EOS, text, per-token log-probs.

        ``resume[i]``: an interrupted response of that prompt and seed, continued from where it stopped (its tokens
        stay, new ones follow). ``should_stop()`` is asked after each token: once true, the batch returns and the
        responses not done come back unfinished (partial rollout at a weight sync)."""
        rows = [
            r.prompt_ids if r is not None else self.prompt_ids(p)
            for p, r in zip(prompts, resume or [None] * len(prompts), strict=True)
        ]
        return self.sample_from_ids(rows, seeds, resume=resume, should_stop=should_stop)

    @torch.no_grad()
    def sample_from_ids(
        self,
        prompt_rows: list[list[int]],
        seeds: list[int],
        *,
        resume: list[TextResult | None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[TextResult]:
        """Sample the responses of ``prompt_rows`` (see :meth:`generate`).

        A continued response is prompted with its prompt and the tokens it has (the prefix is encoded again under
        the weights loaded now, as verl's partial rollout resubmits ``prompt_ids + response_ids``) and draws from its
        saved generator state, with what is left of its length budget; with unchanged weights it ends as the
        uninterrupted response would (up to the float noise of re-encoding the prefix)."""
        n = len(prompt_rows)
        resume = resume or [None] * n
        prev = [r.response_ids if r is not None else [] for r in resume]
        ids, mask = self._left_pad([p + q for p, q in zip(prompt_rows, prev, strict=True)])
        gens = []
        for s, r in zip(seeds, resume, strict=True):
            g = torch.Generator(device=ids.device)  # where the probs are
            if r is not None:
                g.set_state(r.rng_state)
            else:
                g.manual_seed(int(s))
            gens.append(g)
        temp = max(float(self.sampling.temperature), 1e-5)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        budgets = [
            length_budget(s, self.sampling.response_length, self.sampling.response_length_pareto_alpha) for s in seeds
        ]
        left_list = [b - len(q) for b, q in zip(budgets, prev, strict=True)]  # tokens each row may still draw
        left = torch.tensor(left_list, device=self.device)
        tokens, logps = [], []
        past, cur = None, ids
        stopped = False
        for t in range(max(left_list)):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -cur.shape[1] :]
            out = self.model(input_ids=cur, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float() / temp, dim=-1)
            nxt = torch.stack([torch.multinomial(logp[i].exp(), 1, generator=gens[i])[0] for i in range(n)])
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            tokens.append(nxt)
            logps.append(logp.gather(-1, nxt[:, None])[:, 0])
            done |= torch.isin(nxt, eos) | (left <= t + 1)
            cur = nxt[:, None]
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            if done.all():
                break
            if should_stop is not None and should_stop():
                stopped = True  # the rows not done come back unfinished, with their generators' states
                break
        tokens, logps = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()  # one copy to the host
        finished = done.cpu().tolist()
        records = []
        for i in range(n):
            row = tokens[i].tolist()
            length = next((k + 1 for k, t in enumerate(row) if t in self.eos_ids), len(row))  # cut after 1st EOS
            length = min(length, left_list[i])  # or at the sample's length budget
            response_ids = prev[i] + row[:length]
            r = resume[i]
            records.append(
                TextResult(
                    prompt_ids=prompt_rows[i],
                    response_ids=response_ids,
                    response=self.tok.decode(response_ids, skip_special_tokens=True),
                    log_probs=torch.cat([r.log_probs, logps[i, :length]])
                    if r is not None
                    else logps[i, :length].clone(),
                    versions=r.versions.clone() if r is not None else torch.zeros(0, dtype=torch.int64),
                    rng_state=gens[i].get_state() if stopped and not finished[i] else None,
                )
            )
        return records

    def log_probs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Per-token log-probs [B, Lr] of the responses (prompts left-padded, responses right-padded), on the model's
        device (the loss's graph runs there); the inputs may be anywhere (the driver's batch is on the CPU)."""
        prompt_ids, prompt_mask, response_ids, response_mask = (
            t.to(self.device) for t in (prompt_ids, prompt_mask, response_ids, response_mask)
        )
        ids = torch.cat([prompt_ids, response_ids], 1)
        mask = torch.cat([prompt_mask, response_mask], 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        lr = response_ids.shape[1]
        logits = logits[:, -lr - 1 : -1].float() / max(float(self.sampling.temperature), 1e-5)
        return torch.log_softmax(logits, -1).gather(-1, response_ids[..., None])[..., 0]
