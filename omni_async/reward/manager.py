"""Reward manager: turns one generated sample into a typed reward outcome.

Reward functions are plain callables in verl's convention, loaded with verl's ``load_extern_object`` from
``path`` (a file, or ``pkg://module``) and ``name``::

    compute_score(data_source, solution_image | solution_str, ground_truth, extra_info, **reward_kwargs)

A function may be sync (run in a thread, off the event loop), ``async def`` (awaited), or a class (instantiated
once per manager with the kwargs, then its ``compute_score`` is used). It may return a number, a dict with a
``"score"`` key (other keys become ``reward_extra_info``), or the ``(score, text, explanation)`` tuple of the async
reward agent recipe. Anything else is an error naming the function and what it returned.

With ``reward.reward_functions.<key>: {path, name, weight, required, **kwargs}`` several functions run
concurrently and combine as ``sum_k weight_k * score_k``; each is reported as ``reward/<key>``. A failing
``required`` function fails the sample; a failing optional one is left out of the sum and reported.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

Status = Literal["ok", "failed", "timeout"]


@dataclass
class RewardOutcome:
    status: Status
    score: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    compute_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # each reward function's own score, by key

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class RewardFunctionError(TypeError):
    """A reward function returned something that is not a score."""


def normalize_result(name: str, result: Any) -> tuple[float, dict[str, Any]]:
    """Map a reward function's return value to ``(score, extra_info)``, or raise naming the function."""
    extra: dict[str, Any] = {}
    score: Any = result
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardFunctionError(f"reward function {name} returned a dict without 'score': keys "
                                      f"{sorted(result)[:8]}; return {{'score': float, ...}}")
        score, extra = result["score"], {k: v for k, v in result.items() if k != "score"}
    elif isinstance(result, tuple) and len(result) == 3:
        score, text, explanation = result
        extra = {"judge_text": text, "judge_explanation": explanation}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise RewardFunctionError(
            f"reward function {name} returned {type(result).__name__} {str(result)[:80]!r}; return a finite float, "
            "a dict with 'score', or a (score, text, explanation) tuple"
        )
    return float(score), extra


class RewardFunction:
    """One configured reward function, callable as ``await fn(sample)``."""

    def __init__(self, key: str, path: str, name: str, kwargs: dict[str, Any], weight: float = 1.0,
                 required: bool = True):
        from verl.utils.import_utils import load_extern_object

        obj = load_extern_object(module_path=path, object_name=name)
        self.key, self.weight, self.required = key, float(weight), bool(required)
        self.label = f"{name} ({path})"
        self.instance = None
        if inspect.isclass(obj):
            # Stateful reward (e.g. an HTTP client built once): instantiate once, call its compute_score.
            self.instance = obj(**kwargs)
            self.fn, self.kwargs = self.instance.compute_score, {}
        else:
            self.fn, self.kwargs = obj, kwargs
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.post_process = getattr(self.instance, "post_process_scores", None)

    async def __call__(self, sample: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        extra_info = dict(sample.get("extra_info") or {})
        extra_info.setdefault("prompt", sample.get("prompt"))  # remote judges and scorers want the prompt too
        kw = dict(data_source=sample["data_source"], ground_truth=sample["ground_truth"], extra_info=extra_info,
                  **self.kwargs)
        if "image" in sample:
            kw["solution_image"] = sample["image"]
        else:
            kw["solution_str"] = sample["response"]
        if self.is_async:
            result = await self.fn(**kw)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, lambda: self.fn(**kw))
        return normalize_result(self.label, result)


def build_reward_functions(reward_cfg: DictConfig) -> list[RewardFunction]:
    """``reward.reward_functions`` if any, else the single ``reward.custom_reward_function``."""
    multi = OmegaConf.to_container(reward_cfg.reward_functions, resolve=True) or {}
    if multi:
        fns = []
        for key, spec in multi.items():
            spec = dict(spec)
            if "path" not in spec or "name" not in spec:
                raise ValueError(f"reward.reward_functions.{key} needs 'path' and 'name'")
            path, name = spec.pop("path"), spec.pop("name")
            weight, required = spec.pop("weight", 1.0), spec.pop("required", True)
            fns.append(RewardFunction(key, path, name, spec, weight, required))
        return fns
    c = reward_cfg.custom_reward_function
    kwargs = OmegaConf.to_container(c.reward_kwargs, resolve=True) or {}
    return [RewardFunction("score", c.path, c.name, kwargs)]


def scorer_names(reward_cfg: DictConfig) -> str:
    """The configured reward functions, as error messages name them."""
    multi = OmegaConf.to_container(reward_cfg.reward_functions, resolve=True) or {}
    if multi:
        return ", ".join(f"{k}={v.get('name')} ({v.get('path')})" for k, v in multi.items())
    c = reward_cfg.custom_reward_function
    return f"{c.name} ({c.path})"


class RewardManager:
    """Scores samples with the configured function(s); never raises for a sample, returns a typed outcome."""

    def __init__(self, reward_cfg: DictConfig):
        self.functions = build_reward_functions(reward_cfg)
        self.timeout_s = float(reward_cfg.timeout_s)
        self.multi = len(reward_cfg.reward_functions) > 0

    @property
    def scorer_names(self) -> str:
        return ", ".join(f.label for f in self.functions)

    async def _score(self, sample: dict[str, Any]) -> RewardOutcome:
        results = await asyncio.gather(*(fn(sample) for fn in self.functions), return_exceptions=True)
        out = RewardOutcome("ok")
        for fn, res in zip(self.functions, results, strict=True):
            if isinstance(res, BaseException):
                if fn.required and out.ok:  # the sample fails; the other parts are kept for post-processing
                    out.status, out.error = "failed", f"{fn.label}: {type(res).__name__}: {res}"
                elif not fn.required:
                    out.extra[f"reward/{fn.key}_failed"] = f"{type(res).__name__}: {res}"
                continue
            out.parts[fn.key], fn_extra = res
            out.extra.update(fn_extra)
        if out.ok:
            self._combine(out)
        return out

    def _combine(self, out: RewardOutcome) -> None:
        """score = sum_k weight_k * part_k over the parts present; per-part metrics in multi-reward mode."""
        out.score = sum(fn.weight * out.parts[fn.key] for fn in self.functions if fn.key in out.parts)
        if self.multi:
            out.extra.update({f"reward/{k}": v for k, v in out.parts.items()})
            out.extra["reward/combined"] = out.score

    @property
    def has_post_process(self) -> bool:
        return any(fn.post_process is not None for fn in self.functions)

    def post_process_group(self, outcomes: list[RewardOutcome]) -> list[RewardOutcome]:
        """Apply each class reward's ``post_process_scores(scores) -> scores`` to one whole ``uid`` group.

        The hook sees its own function's scores for every member, ``None`` for a member that has none (failed,
        timed out), and must return a list of the same length; a number it returns for a failed member repairs
        that member (e.g. "replace failed scores by the group mean"), ``None`` leaves it failed.
        """
        for fn in self.functions:
            if fn.post_process is None:
                continue
            before = [o.parts.get(fn.key) if o.ok else None for o in outcomes]
            after = fn.post_process(list(before))
            if not isinstance(after, (list, tuple)) or len(after) != len(before):
                raise RewardFunctionError(f"{fn.label}.post_process_scores got {len(before)} scores and returned "
                                          f"{str(after)[:80]!r}; return a list of {len(before)} floats (or None)")
            for o, new in zip(outcomes, after, strict=True):
                if new is None:
                    continue
                o.parts[fn.key], _ = normalize_result(f"{fn.label}.post_process_scores", new)
                if not o.ok and all(f.key in o.parts for f in self.functions if f.required):
                    o.status, o.error = "ok", None
                    o.extra["reward/post_process_repaired"] = 1.0
        for o in outcomes:
            if o.ok:
                self._combine(o)
        return outcomes

    async def score(self, sample: dict[str, Any]) -> RewardOutcome:
        """Score one sample within ``reward.timeout_s``."""
        t0 = time.perf_counter()
        try:
            out = await asyncio.wait_for(self._score(sample), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            out = RewardOutcome("timeout", error=f"{self.scorer_names}: no result within reward.timeout_s="
                                                 f"{self.timeout_s:g}s")
        out.compute_s = time.perf_counter() - t0
        return out

    def score_batch(self, samples: list[dict[str, Any]]) -> list[RewardOutcome]:
        """All samples concurrently, in one call (the sync baseline's colocated reward); groups post-processed."""

        async def run():
            return await asyncio.gather(*(self.score(s) for s in samples))

        outcomes = asyncio.run(run())
        if self.has_post_process:
            groups: dict[str, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s["uid"], []).append(i)
            for idx in groups.values():
                self.post_process_group([outcomes[i] for i in idx])
        return outcomes
