"""A simulated device: a text policy whose generation and update are timed waits (``sim:text``; images:
``sim:image``, :mod:`omni_async.models.sim_image_policy`).

``actor_rollout_ref.model.path=sim:text`` (``modality=text``) builds :class:`SimTextPolicy` on every rollout worker
and trainer rank. It is ``tiny:qwen2`` (its tokenizer, its LoRA or full weights, the real optimizer step, weight
syncs, checkpoints) with the two device computations replaced by waits that hold no CPU, as a GPU kernel does not:

- **a decode step** of a continuously batched session (``TextPolicy.decode``'s contract: rows join between two
  tokens, leave after their last, stop after the current token when ``should_stop``): ``token_s + row_token_s x
  rows`` seconds per token of the batch, ``prefill_s`` when rows join. A response's length is its seeded budget
  (``text_policy.length_budget``: ``rollout.response_length`` with ``response_length_pareto_alpha``'s long tail);
  its tokens are drawn from its seed (uniform over the vocabulary, no EOS), each with log-prob 0.
- **the update's forward**: ``update_token_s x response tokens`` seconds with gradients (forward + backward),
  a third of it without (a log-prob recompute). It returns log-probs 0 joined to the trainable weights by a zero
  term, so the loss, its backward and the optimizer step run on the real (tiny) weights.

So everything but the device (the driver, agent loop, rollouter, reward workers, Ray, the switch policy, weight
syncs) runs as it ships, and the device's time is set by the workload, not by this machine's cores. The timings are
``actor_rollout_ref.model.override_config`` keys (:class:`SimTimings`; another key is refused at start). Each
device records its waits (:attr:`SimTextPolicy.busy`): busy = their union over the wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from omni_async.models.text_policy import TextPolicy, TextSamplingConfig, length_budget
from omni_async.models.tiny import SIM_BASE
from omni_async.sample import TextResult


@dataclass(frozen=True)
class SimTimings:
    """Seconds of device time (``actor_rollout_ref.model.override_config`` of a ``sim:`` source)."""

    # The defaults: bench/switch_sim.py's long-tail workload (a large model's decode step on a GPU).
    token_s: float = 0.01  # one decode step of the batch, whatever its rows
    row_token_s: float = 0.00125  # and per row in it (a batch's compute grows with its rows)
    prefill_s: float = 0.01  # rows joining the batch (their prompts encoded)
    update_token_s: float = 0.0005  # the update's forward + backward per response token (a recompute: a third)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def sim_override_problems(override: dict[str, Any], keys: list[str] | None = None) -> list[str]:
    """What is wrong with a ``sim:`` source's ``override_config``: unknown keys (``keys``: its timings', by default
    ``sim:text``'s), negative or non-numeric values."""
    keys = SimTimings.keys() if keys is None else keys
    problems = [f"unknown key {k!r} (a sim: source takes {', '.join(keys)})" for k in override if k not in keys]
    for k, v in override.items():
        if k in keys and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            problems.append(f"{k}={v!r} must be a number of seconds >= 0")
    return problems


GENERATE, UPDATE = "generate", "update"  # what a wait stands for


@dataclass
class DeviceClock:
    """The simulated device's waits: each as (start, end, what) on the wall clock (``time.time``, comparable across
    the box's processes), so a benchmark clips them to its measured window."""

    spans: list[tuple[float, float, str]] = field(default_factory=list)
    asked_s: float = 0.0  # the waits asked for (a loaded host's sleep overshoots: the spans are what they took)

    def wait(self, seconds: float, what: str) -> None:
        if seconds <= 0:
            return
        self.asked_s += seconds
        t0 = time.time()
        time.sleep(seconds)
        self.spans.append((t0, time.time(), what))

    def busy_s(self, start: float = float("-inf"), end: float = float("inf"), what: str | None = None) -> float:
        """Seconds of waits (of ``what``, or all) inside ``[start, end]`` (the waits run on one device thread: they
        never overlap)."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b, w in self.spans if what in (None, w))


@dataclass
class _SimRow:
    key: Any
    prompt_ids: list[int]
    resume: TextResult | None
    tokens: list[int]  # the response's every token (its budget, drawn from its seed)
    at: int  # tokens it has


class SimTextPolicy(TextPolicy):
    """``tiny:qwen2`` with simulated device time (module docstring)."""

    def __init__(self, model_path: str, sampling: TextSamplingConfig, **options: Any):
        override = dict(options.pop("override_config", None) or {})
        problems = sim_override_problems(override)
        if problems:
            raise ValueError(f"actor_rollout_ref.model.override_config for {model_path!r}: {'; '.join(problems)}")
        self.timings = SimTimings(**{k: float(v) for k, v in override.items()})
        self.busy = DeviceClock()
        super().__init__(SIM_BASE, sampling, **options)
        self._vocab = int(self.model.config.vocab_size)
        self._eos = set(self.eos_ids)

    def _draw_tokens(self, seed: int) -> list[int]:
        s = self.sampling
        n = length_budget(seed, s.response_length, s.response_length_pareto_alpha)
        drawn = np.random.default_rng([int(seed), 0x5111]).integers(0, self._vocab, size=n).tolist()
        return [t if t not in self._eos else (t + 1) % self._vocab for t in drawn]  # no early EOS: the budget rules

    def decode(
        self,
        admit: Callable[[int], list[tuple[Any, list[int], int, TextResult | None]]],
        emit: Callable[[Any, TextResult], None],
        *,
        capacity: int,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """``TextPolicy.decode``'s loop with waits for the device: joining rows get their first token with the
        prefill, every step one token per row."""
        t = self.timings
        rows: list[_SimRow] = []
        while True:
            free = capacity - len(rows)
            if free > 0:
                new = admit(free)
                if new:
                    for key, prompt_ids, seed, r in new:
                        have = len(r.response_ids) if r is not None else 0
                        rows.append(_SimRow(key, prompt_ids, r, self._draw_tokens(seed), have + 1))
                    self.busy.wait(t.prefill_s, GENERATE)
            if not rows:
                return
            for r in [r for r in rows if r.at >= len(r.tokens)]:
                rows.remove(r)
                emit(r.key, self._result(r, finished=True))
            if not rows:
                continue
            if should_stop is not None and should_stop():
                for r in rows:
                    emit(r.key, self._result(r, finished=False))
                return
            self.busy.wait(t.token_s + t.row_token_s * len(rows), GENERATE)
            for r in rows:
                r.at += 1

    def _result(self, r: _SimRow, finished: bool) -> TextResult:
        response_ids = r.tokens[: min(r.at, len(r.tokens))]
        prev = r.resume
        new = len(response_ids) - (len(prev.response_ids) if prev is not None else 0)
        log_probs = torch.zeros(new)
        return TextResult(
            prompt_ids=r.prompt_ids,
            response_ids=response_ids,
            response=self.tok.decode(response_ids, skip_special_tokens=True),
            log_probs=torch.cat([prev.log_probs, log_probs]) if prev is not None else log_probs,
            versions=prev.versions.clone() if prev is not None else torch.zeros(0, dtype=torch.int64),
            # an unfinished response continues from its token count (its tokens are a function of its seed)
            rng_state=None if finished else torch.tensor([len(response_ids)]),
        )

    def log_probs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Log-probs 0 [B, Lr] after the update's device time; with gradients they hang on the trainable weights
        (a zero term), so the backward and the optimizer step run."""
        share = 1.0 if torch.is_grad_enabled() else 1.0 / 3.0
        self.busy.wait(self.timings.update_token_s * float(response_mask.sum()) * share, UPDATE)
        out = torch.zeros(response_ids.shape, device=self.device)
        if torch.is_grad_enabled():
            out = out + 0.0 * sum(p.sum() for p in self.trainable_parameters())
        return out
