"""Reward manager: turns one generated sample into a typed reward outcome.

Reward functions are plain callables in verl's convention, loaded from ``path`` (a file, or ``pkg://module``)
and ``name`` (``reward.contract.check_reward_function``; no path = dispatch by ``data_source`` as verl does)::

    compute_score(data_source, solution_image | solution_str, ground_truth, extra_info, **reward_kwargs)

``solution_image`` is what verl-omni passes: a uint8 torch tensor ``(C, H, W)``, or ``(C, F, H, W)`` for a video.
An edited image's input images (Qwen-Image-Edit's rows) come in ``extra_info["condition_images"]`` (verl-omni's name
for them), a list of tensors in the same form: verl-omni hands a reward function its side data there (``audio``,
``latents_clean``). With ``rollout.pipeline.output_type=latent`` (verl-omni's DRM recipe) ``solution_image`` is the
clean latent instead (fp32, the pipeline's latent layout) and ``extra_info`` holds the prompt encodings
(``prompt_embeds``, ``pooled_prompt_embeds``); with ``both`` the pixels, and ``extra_info["latents_clean"]`` too
(``sample.ImageResult.reward_fields``).

A function may be sync (run in a thread, off the event loop), ``async def`` (awaited), or a class (instantiated
once per manager with the kwargs, then its ``compute_score`` is used). It may return a number, a dict with a
``"score"`` key (other keys become ``reward_extra_info``), or the ``(score, text, explanation)`` tuple of the async
reward agent recipe. Anything else is an error naming the function and what it returned.

With ``reward.reward_functions.<key>: {path, name, weight, required, **kwargs}`` several functions run
concurrently and combine as ``sum_k weight_k * score_k``; each is reported as ``reward/<key>``. As in verl-omni's
``MultiVisualRewardManager``, each of them is called with only the arguments it declares (all with ``**kwargs``). A failing
``required`` function fails the sample; a failing optional one is left out of the sum and reported.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from omni_async.reward.contract import check_reward_function, declared_arguments
from omni_async.reward.pixels import to_solution_image
from omni_async.reward.scores import RewardFunctionError, normalize_result
from omni_async.sample import EXTRA_TENSORS, RewardOutcome, from_wire

# verl's reward-function argument for the generated sample, per modality (see ``sample.*Result.reward_fields``).
SOLUTION_FIELDS = ("solution_image", "solution_str")
# The argument through which a reward function receives the URLs of the run's vLLM judge servers.
JUDGE_URLS_ARG = "judge_urls"
# verl-omni's GenRM convention (``verl_omni.reward_loop.reward_manager.visual``): the judge server as ``host:port``
# (``reward_router_address``) and the served model's name (``model_name`` = reward.reward_model.model_path).
ROUTER_ARG = "reward_router_address"
ROUTER_MODEL_ARG = "model_name"
# The argument through which a reward function receives the judge model, reward.reward_model.model_path: the one
# key for it (the vLLM judge servers serve the same path), so reward kwargs may not name another model.
JUDGE_MODEL_ARG = "judge_model_path"


@dataclass(frozen=True)
class RewardSpec:
    """One reward function as the config gives it: ``reward.reward_functions.<key>`` or the single
    ``reward.custom_reward_function`` (key ``score``)."""

    key: str
    config_key: str  # where it is configured, for error messages
    path: str | None
    name: str | None
    kwargs: dict[str, Any]
    weight: float = 1.0
    required: bool = True

    @property
    def only_declared(self) -> bool:
        """An entry of ``reward.reward_functions`` gets only the arguments it declares (verl-omni's
        ``MultiVisualRewardManager``); the single reward gets all of them (its ``VisualRewardManager``)."""
        return self.config_key != "reward.custom_reward_function"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.path})" if self.path else "default_compute_score (by data_source)"

    def kwarg_key(self, kwarg: str) -> str:
        """The config key of one of the function's extra arguments."""
        single = self.config_key == "reward.custom_reward_function"  # its extra arguments sit under reward_kwargs
        return f"{self.config_key}.{'reward_kwargs.' if single else ''}{kwarg}"


def check_judge_model_kwargs(spec: RewardSpec, obj: Any) -> None:
    """A function that takes the judge model (``judge_model_path``) gets ``reward.reward_model.model_path``; a
    model path in its own kwargs would be a second key for the same model, so it is refused."""
    try:
        takes = JUDGE_MODEL_ARG in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return
    for kwarg in ("model_path", JUDGE_MODEL_ARG):
        if takes and kwarg in spec.kwargs:
            raise ValueError(
                f"{spec.kwarg_key(kwarg)}: {spec.label} takes its judge model from "
                "reward.reward_model.model_path (the one key for the judge model; vLLM judge servers "
                f"serve it too). Fix: set reward.reward_model.model_path={spec.kwargs[kwarg]} and drop "
                f"{spec.kwarg_key(kwarg)}"
            )


def reward_specs(reward_cfg: DictConfig) -> list[RewardSpec]:
    """``reward.reward_functions`` if any, else the single ``reward.custom_reward_function``: the one parser of
    the reward config, for the config check at start, the managers and error messages."""
    multi = OmegaConf.to_container(reward_cfg.reward_functions, resolve=True) or {}
    specs = []
    for key, spec in multi.items():
        spec, config_key = dict(spec), f"reward.reward_functions.{key}"
        if not spec.get("path") or not spec.get("name"):
            raise ValueError(
                f"{config_key} needs 'path' and 'name'. Fix: set {config_key}.path=<file or "
                f"pkg://module> and {config_key}.name=<function>"
            )
        path, name = spec.pop("path"), spec.pop("name")
        weight, required = spec.pop("weight", 1.0), spec.pop("required", True)
        specs.append(RewardSpec(key, config_key, path, name, spec, float(weight), bool(required)))
    if specs:
        return specs
    c = reward_cfg.custom_reward_function
    return [
        RewardSpec(
            "score",
            "reward.custom_reward_function",
            c.path,
            c.name,
            OmegaConf.to_container(c.reward_kwargs, resolve=True) or {},
        )
    ]


class RewardFunction:
    """One configured reward function, callable as ``await fn(sample)``."""

    def __init__(self, spec: RewardSpec, judge_urls: list[str] | None = None, judge_model_path: str | None = None):
        obj = check_reward_function(spec.path, spec.name, spec.config_key)
        check_judge_model_kwargs(spec, obj)
        self.only_declared = spec.only_declared
        kwargs = dict(spec.kwargs)
        self.key, self.weight, self.required, self.label = spec.key, spec.weight, spec.required, spec.label
        self.instance = None
        params = inspect.signature(obj).parameters
        self.takes_judge_urls = bool(judge_urls) and (JUDGE_URLS_ARG in params or ROUTER_ARG in params)
        if self.takes_judge_urls and JUDGE_URLS_ARG in params:
            kwargs = {**kwargs, JUDGE_URLS_ARG: list(judge_urls)}
        if ROUTER_ARG in params:
            self._route(spec, params, kwargs, judge_urls, judge_model_path)
        if JUDGE_MODEL_ARG in params:
            kwargs[JUDGE_MODEL_ARG] = judge_model_path
        if inspect.isclass(obj):
            # Stateful reward (e.g. an HTTP client built once): instantiate once, call its compute_score.
            self.instance = obj(**kwargs)
            self.fn, self.kwargs = self.instance.compute_score, {}
        else:
            self.fn, self.kwargs = obj, kwargs
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.post_process = getattr(self.instance, "post_process_scores", None)

    @staticmethod
    def _route(
        spec: RewardSpec, params, kwargs: dict[str, Any], judge_urls: list[str] | None, judge_model_path: str | None
    ) -> None:
        """Fill verl-omni's GenRM arguments: the run's judge server, or one the user names in the kwargs."""
        given = kwargs.get(ROUTER_ARG)
        if judge_urls and given:
            raise ValueError(
                f"{spec.kwarg_key(ROUTER_ARG)}={given}: this run starts its own judge servers "
                f"({judge_urls}) and hands one to {spec.label}. Fix: drop {spec.kwarg_key(ROUTER_ARG)}, or stop "
                "the run's judge servers to use yours"
            )
        if judge_urls:
            kwargs[ROUTER_ARG] = router_address(judge_urls[0])
        elif not given and params[ROUTER_ARG].default is inspect.Parameter.empty:
            raise ValueError(
                f"{spec.label} needs '{ROUTER_ARG}' (a judge server's host:port) and this run has "
                "none. Fix: reward.reward_model.rollout.name=vllm (judge servers on the reward pool), "
                f"or {spec.kwarg_key(ROUTER_ARG)}=<host:port> of a running OpenAI-compatible server"
            )
        if ROUTER_MODEL_ARG in params and ROUTER_MODEL_ARG not in kwargs and judge_model_path:
            kwargs[ROUTER_MODEL_ARG] = judge_model_path

    async def __call__(self, sample: dict[str, Any], executor: ThreadPoolExecutor | None = None) -> _Call:
        """Call the function on one sample (``Sample.reward_input()``); sync functions run on ``executor``."""
        extra_info = dict(sample.get("extra_info") or {})
        extra_info.setdefault("prompt", sample.get("prompt"))  # remote judges and scorers want the prompt too
        if "condition_images" in sample:
            extra_info["condition_images"] = sample["condition_images"]
        extra_info.update(sample.get(EXTRA_TENSORS) or {})  # output_type latent / both: the prompt encodings, ...
        kw = dict(
            data_source=sample["data_source"], ground_truth=sample["ground_truth"], extra_info=extra_info, **self.kwargs
        )
        kw.update({k: sample[k] for k in SOLUTION_FIELDS if k in sample})
        if self.only_declared:
            kw = declared_arguments(self.fn, kw)
        call = _Call(submitted=time.perf_counter())

        def run():
            call.started = time.perf_counter()
            try:
                return self.fn(**kw)
            finally:
                call.finished = time.perf_counter()

        if self.is_async:
            call.started = time.perf_counter()
            try:
                result = await self.fn(**kw)
            finally:
                call.finished = time.perf_counter()
        else:
            result = await asyncio.get_running_loop().run_in_executor(executor, run)
        call.score, call.extra = normalize_result(self.label, result)
        return call


@dataclass
class _Call:
    """One reward-function call: its result and when it was submitted, actually started and finished."""

    submitted: float
    started: float = float("nan")
    finished: float = float("nan")
    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def build_reward_functions(reward_cfg: DictConfig, judge_urls: list[str] | None = None) -> list[RewardFunction]:
    """``reward.reward_functions`` if any, else the single ``reward.custom_reward_function``.

    ``judge_urls`` (the vLLM judge servers on the reward pool) go to every function that takes ``judge_urls``;
    a function in verl-omni's GenRM form (``reward_router_address``, e.g. its ``genrm_ocr.compute_score_ocr``)
    gets the first of them as ``host:port`` — the reward worker rotates the list so workers spread over the
    servers — and ``model_name`` = ``reward.reward_model.model_path``. If there are servers and no function takes
    them, that is a configuration error. ``reward.reward_model.
    model_path`` goes to every function that takes ``judge_model_path``.
    """
    model_path = OmegaConf.select(reward_cfg, "reward_model.model_path", default=None)
    fns = [RewardFunction(spec, judge_urls, model_path) for spec in reward_specs(reward_cfg)]
    if judge_urls and not any(fn.takes_judge_urls for fn in fns):
        raise ValueError(
            f"reward.reward_model.rollout.name=vllm started judge servers at {judge_urls}, but no "
            f"reward function ({', '.join(f.label for f in fns)}) takes a '{JUDGE_URLS_ARG}' or '{ROUTER_ARG}' argument; "
            "use pkg://omni_async.reward.scorers.vlm_judge or add the argument to yours"
        )
    return fns


def router_address(url: str) -> str:
    """A judge server's base URL as verl-omni's GenRM rewards take it: ``host:port`` (they add ``http://`` and
    ``/v1/chat/completions`` themselves).

    >>> router_address("http://10.0.0.7:8001/v1")
    '10.0.0.7:8001'
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"judge server URL {url!r} has no host:port; judge servers are given as http://host:port")
    return f"{parts.hostname}:{parts.port}"


def scorer_names(reward_cfg: DictConfig) -> str:
    """The configured reward functions, as error messages name them."""
    specs = reward_specs(reward_cfg)
    if len(reward_cfg.reward_functions) > 0:
        return ", ".join(f"{s.key}={s.label}" for s in specs)
    return specs[0].label


def is_latent(solution_image: Any) -> bool:
    """A clean latent (``output_type=latent``: a floating-point tensor, as verl-omni's reward managers tell it from
    uint8 pixels), not pixels."""
    return getattr(solution_image, "is_floating_point", lambda: False)()


def _decoded(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


class RewardManager:
    """Scores samples with the configured function(s); never raises for a sample, returns a typed outcome."""

    def __init__(self, reward_cfg: DictConfig, judge_urls: list[str] | None = None):
        self.functions = build_reward_functions(reward_cfg, judge_urls)
        self.timeout_s = float(reward_cfg.timeout_s)
        self.multi = len(reward_cfg.reward_functions) > 0
        # Sync (blocking) functions get a thread per in-flight call: the event loop's default pool has only
        # min(32, cpu + 4) threads, which would cap a blocking judge at ~6 concurrent calls on this box.
        self.executor = ThreadPoolExecutor(
            max_workers=int(reward_cfg.max_inflight_per_worker), thread_name_prefix="reward-fn"
        )

    @property
    def scorer_names(self) -> str:
        return ", ".join(f.label for f in self.functions)

    async def _score(self, sample: dict[str, Any]) -> RewardOutcome:
        sample = {**sample, **from_wire({k: sample[k] for k in ("solution_image", EXTRA_TENSORS) if k in sample})}
        if "solution_image" in sample and not is_latent(sample["solution_image"]):
            # verl-omni's form: uint8 torch (C, H, W), or (C, F, H, W) for a video; a latent (output_type=latent)
            # is handed over as the rollout made it
            sample = {**sample, "solution_image": to_solution_image(sample["solution_image"])}
        if "condition_images" in sample:  # encoded bytes (Sample.reward_input) -> the same form as solution_image
            sample = {
                **sample,
                "condition_images": [to_solution_image(_decoded(b)) for b in sample["condition_images"]],
            }
        results = await asyncio.gather(*(fn(sample, self.executor) for fn in self.functions), return_exceptions=True)
        out = RewardOutcome("ok")
        calls = [r for r in results if isinstance(r, _Call)]
        if calls:  # the function calls themselves, and the wait for a thread before they ran
            out.compute_s = max(c.finished - c.started for c in calls)
            out.wait_s = max(c.started - c.submitted for c in calls)
        for fn, res in zip(self.functions, results, strict=True):
            if isinstance(res, BaseException):
                if fn.required and out.ok:  # the sample fails; the other parts are kept for post-processing
                    out.status, out.error = "failed", f"{fn.label}: {type(res).__name__}: {res}"
                elif not fn.required:
                    out.extra[f"reward/{fn.key}_failed"] = f"{type(res).__name__}: {res}"
                continue
            out.parts[fn.key] = res.score
            out.extra.update(res.extra)
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
                raise RewardFunctionError(
                    f"{fn.label}.post_process_scores got {len(before)} scores and returned "
                    f"{str(after)[:80]!r}; return a list of {len(before)} floats (or None)"
                )
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
            return await asyncio.wait_for(self._score(sample), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return RewardOutcome(
                "timeout",
                error=f"{self.scorer_names}: no result within reward.timeout_s={self.timeout_s:g}s",
                compute_s=time.perf_counter() - t0,
            )

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
