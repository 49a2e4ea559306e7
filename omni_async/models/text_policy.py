"""A causal LM (transformers) as a GRPO policy: chat-template prompts, seeded sampling with response log-probs,
log-prob recompute, LoRA via peft (or full fine-tune), reference = adapter off.

Sampling is reproducible per sample: each row draws its tokens from its own ``torch.Generator(seed)`` on the model's
device, so a response depends on (weights, prompt, seed, device) only, not on which other prompts share the batch
(up to the float noise of left padding). Inputs are moved to the model's device here; what leaves the policy
(``TextResult``) is on the CPU.

Decoding is continuously batched (:meth:`TextPolicy.generate_stream`, as vLLM's scheduler does): a response leaves
the batch after its last token and a waiting request takes its row before the next token, so a batch with a long
response in it does not run its other rows as padding, and each response reaches its reward the moment it ends.

Partial rollout (fully async, text): ``should_stop`` ends a batch after its current token (a weight sync is waiting);
the responses not done come back unfinished with their generators' states and are continued later (``resume``),
possibly under other weights. Such a response depends also on where it was interrupted, not only on its seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from omni_async.models.loading import causal_lm_load_kwargs
from omni_async.models.lora import PolicyOptions, TrainableModule
from omni_async.models.rollout_policy import refuse_inapplicable
from omni_async.models.tiny import resolve_model_path
from omni_async.models.tokens import eos_ids, pad_rows
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


def hf_config_overrides(path: str, override: dict | None) -> dict[str, Any]:
    """verl's ``actor_rollout_ref.model.override_config`` for a causal LM: Hugging Face config keys set over the
    checkpoint's (``from_pretrained(path, config=...)``); a key the config does not have is refused by name."""
    if not override:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    unknown = [k for k in override if not hasattr(config, k)]
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.model.override_config: {type(config).__name__} has no key {', '.join(unknown)} "
            "(verl's meaning for a text model: keys of the model's Hugging Face config.json)"
        )
    for k, v in override.items():
        setattr(config, k, v)
    return {"config": config}


class TextPolicy(TrainableModule):
    continuous_batching: ClassVar[bool] = True  # generate_stream: responses join and leave between tokens

    def __init__(self, model_path: str, sampling: TextSamplingConfig, **options: Any):
        """``options``: :class:`~omni_async.models.lora.PolicyOptions` (LoRA, device, frozen weights' dtype)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        opts = PolicyOptions(**options)
        path = resolve_model_path(model_path)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, **hf_config_overrides(path, opts.override_config), **causal_lm_load_kwargs(opts.device, opts.dtype)
        )
        self.model.requires_grad_(False)
        self.sampling = sampling
        self.eos_ids = eos_ids(self.model.generation_config.eos_token_id, self.tok)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.init_trainable(self.model, opts.lora_rank, opts.lora_alpha, opts.target_modules or ["q_proj", "v_proj"])
        if opts.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- sampling -------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> list[int]:
        return chat_prompt_ids(self.tok, prompt)

    def generate(
        self,
        prompts: list[str],
        seeds: list[int],
        windows: list[range] | None = None,
        *,
        sampling: dict[str, Any] | None = None,
        resume: list[TextResult | None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[TextResult]:
        """One response per (prompt, seed): token ids up to and including EOS, text, per-token log-probs. (No SDE
        windows; the sampling settings are the policy's own: ``models.rollout_policy``.)

        ``resume[i]``: an interrupted response of that prompt and seed, continued from where it stopped (its tokens
        stay, new ones follow). ``should_stop()`` is asked after each token: once true, the batch returns and the
        responses not done come back unfinished (partial rollout at a weight sync)."""
        refuse_inapplicable(type(self).__name__, windows=windows, sampling=sampling)
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
        """Sample the responses of ``prompt_rows`` (see :meth:`generate`): one decoding batch that none joins.

        A continued response is prompted with its prompt and the tokens it has (the prefix is encoded again under
        the weights loaded now, as verl's partial rollout resubmits ``prompt_ids + response_ids``) and draws from its
        saved generator state, with what is left of its length budget; with unchanged weights it ends as the
        uninterrupted response would (up to the float noise of re-encoding the prefix)."""
        resume = resume or [None] * len(prompt_rows)
        rows = list(enumerate(zip(prompt_rows, seeds, resume, strict=True)))
        out: dict[int, TextResult] = {}

        def admit(free: int) -> list[tuple[int, list[int], int, TextResult | None]]:
            taken = [(i, *row) for i, row in rows[:free]]
            del rows[:free]
            return taken

        self.decode(admit, out.__setitem__, capacity=len(prompt_rows), should_stop=should_stop)
        return [out[i] for i in range(len(prompt_rows))]

    def generate_stream(
        self,
        admit: Callable[[int], list[tuple[Any, str, int, TextResult | None]]],
        emit: Callable[[Any, TextResult], None],
        *,
        capacity: int,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Continuous batching (a rollout worker's session, ``batcher.GenerationBatcher``): ``admit(free)``
        returns up to ``free`` new requests ``(key, prompt, seed, resume)`` and is asked before every token while
        fewer than ``capacity`` responses are in flight; each response goes to ``emit(key, result)`` the moment it
        ends, so it reaches its reward while the others go on. Returns when nothing is in flight and ``admit`` gives
        nothing (or, with ``should_stop``, after emitting the responses in flight unfinished)."""

        def admit_ids(free: int) -> list[tuple[Any, list[int], int, TextResult | None]]:
            return [
                (key, r.prompt_ids if r is not None else self.prompt_ids(p), seed, r) for key, p, seed, r in admit(free)
            ]

        with torch.no_grad():
            self.decode(admit_ids, emit, capacity=capacity, should_stop=should_stop)

    def decode(
        self,
        admit: Callable[[int], list[tuple[Any, list[int], int, TextResult | None]]],
        emit: Callable[[Any, TextResult], None],
        *,
        capacity: int,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """The decoding loop of :meth:`sample_from_ids` and :meth:`generate_stream` (``admit`` gives prompt token
        ids). A response leaves the batch after its last token and free rows are filled before the next one: the
        device runs the responses it has, not the padding of the longest one (a long-tail batch of 4 is ~50 %
        padding under static batching). Where the model's cache is not a plain full-attention ``DynamicCache`` (a
        sliding-window layer), rows join only while the batch is empty: static batches."""
        batch = _DecodeBatch(self)
        while True:
            free = capacity - len(batch.rows)
            if free > 0 and (batch.splice_ok or not batch.rows):
                new = admit(free)
                if new:
                    batch.join(new)
            if not batch.rows:
                return
            for key, result in batch.pop_done():
                emit(key, result)
            if not batch.rows:
                continue
            if should_stop is not None and should_stop():
                for key, result in batch.interrupt():
                    emit(key, result)
                return
            batch.step()

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


@dataclass
class _Row:
    """One response in a :class:`_DecodeBatch`."""

    key: Any
    prompt_ids: list[int]
    prev: list[int]  # the tokens it came with (a continued response)
    resume: TextResult | None
    gen: torch.Generator
    left: int  # tokens it may still draw (its length budget less what it has)
    tokens: list[int] = field(default_factory=list)
    logps: list[torch.Tensor] = field(default_factory=list)  # one 0-d tensor per token, on the device
    done: bool = False


class _DecodeBatch:
    """Responses decoding together, each with its own generator and budget; rows join (their prompts encoded in one
    forward, the caches left-padded to a common length) and leave (their cache rows dropped) between two tokens.

    Every row's next token is sampled but not yet in the cache (``nxt``); positions come from the attention mask, so
    left padding of any width, and trimming columns no row attends to, leave each row's computation unchanged up to
    float noise."""

    def __init__(self, policy: TextPolicy):
        self.p = policy
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, T]: which cached positions each row attends to
        self.nxt: torch.Tensor | None = None  # [B]
        self.splice_ok = True  # set False by a cache this class cannot splice (see TextPolicy.decode)
        self.temp = max(float(policy.sampling.temperature), 1e-5)
        self.eos = torch.tensor(policy.eos_ids, dtype=torch.long, device=policy.device)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Each row's next token from its own generator; records it and its log-prob."""
        logp = torch.log_softmax(logits.float() / self.temp, dim=-1)
        nxt = torch.stack([torch.multinomial(logp[i].exp(), 1, generator=r.gen)[0] for i, r in enumerate(rows)])
        lp = logp.gather(-1, nxt[:, None])[:, 0]
        ended = torch.isin(nxt, self.eos).tolist()
        for i, (r, tok) in enumerate(zip(rows, nxt.tolist(), strict=True)):
            r.tokens.append(tok)
            r.logps.append(lp[i])
            r.done = ended[i] or len(r.tokens) >= r.left
        return nxt

    def join(self, new: list[tuple[Any, list[int], int, TextResult | None]]) -> None:
        p = self.p
        rows = []
        for key, prompt_ids, seed, r in new:
            g = torch.Generator(device=p.device)  # where the probs are
            if r is not None:
                g.set_state(r.rng_state)
            else:
                g.manual_seed(int(seed))
            prev = r.response_ids if r is not None else []
            budget = length_budget(seed, p.sampling.response_length, p.sampling.response_length_pareto_alpha)
            rows.append(_Row(key, prompt_ids, list(prev), r, g, budget - len(prev)))
        ids, mask = (t.to(p.device) for t in pad_rows([r.prompt_ids + r.prev for r in rows], p.pad_id, left=True))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = p.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        nxt = self._sample(out.logits[:, -1], rows)
        cache = out.past_key_values
        if not self.rows:
            self.rows, self.cache, self.mask, self.nxt = rows, cache, mask, nxt
            self.splice_ok = _plain_layers(cache) is not None
            return
        old, new_ = _plain_layers(self.cache), _plain_layers(cache)
        width = max(self.mask.shape[1], mask.shape[1])
        for a, b in zip(old, new_, strict=True):
            a.keys = torch.cat([_pad_left(a.keys, width, -2), _pad_left(b.keys, width, -2)])
            a.values = torch.cat([_pad_left(a.values, width, -2), _pad_left(b.values, width, -2)])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
        self.nxt = torch.cat([self.nxt, nxt])
        self.rows += rows

    def step(self) -> None:
        """One token for every row."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        pos = (self.mask.cumsum(-1) - 1)[:, -1:]
        out = self.p.model(
            input_ids=self.nxt[:, None],
            attention_mask=self.mask,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.nxt = self._sample(out.logits[:, -1], self.rows)

    def pop_done(self) -> list[tuple[Any, TextResult]]:
        """The rows that ended, as results; their cache rows and the columns no row attends to any more go."""
        done = [r for r in self.rows if r.done]
        if not done:
            return []
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[i] for i in keep]
        if self.rows:
            index = torch.tensor(keep, device=self.mask.device)
            self.mask, self.nxt = self.mask[index], self.nxt[index]
            if self.splice_ok:
                first = int(self.mask.any(0).int().argmax())  # columns before it are padding in every row left
                self.mask = self.mask[:, first:]
                for layer in _plain_layers(self.cache):
                    layer.keys = layer.keys[index, :, first:]
                    layer.values = layer.values[index, :, first:]
            else:
                self.cache.batch_select_indices(index)
        return [(r.key, self._result(r, finished=True)) for r in done]

    def interrupt(self) -> list[tuple[Any, TextResult]]:
        """Every row in flight, unfinished (partial rollout), with its generator's state to continue from."""
        rows, self.rows = self.rows, []
        return [(r.key, self._result(r, finished=False)) for r in rows]

    def _result(self, r: _Row, finished: bool) -> TextResult:
        response_ids = r.prev + r.tokens
        logps = torch.stack(r.logps).cpu()
        return TextResult(
            prompt_ids=r.prompt_ids,
            response_ids=response_ids,
            response=self.p.tok.decode(response_ids, skip_special_tokens=True),
            log_probs=torch.cat([r.resume.log_probs, logps]) if r.resume is not None else logps,
            versions=r.resume.versions.clone() if r.resume is not None else torch.zeros(0, dtype=torch.int64),
            rng_state=None if finished else r.gen.get_state(),
        )


def _plain_layers(cache: Any) -> list | None:
    """The layers of a cache whose rows and columns can be spliced (full-attention ``DynamicLayer``s), else None."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return layers


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width`` (cache positions no row attends to)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
