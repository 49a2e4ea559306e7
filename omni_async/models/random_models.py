"""``random:<family>`` model sources: a published pipeline's architecture with random weights, built on the device.

``actor_rollout_ref.model.path=random:qwen_image`` (or ``random:sd3.5_medium``, ``random:wan2.1_t2v_1.3b``,
``random:wan2.2_ti2v_5b``, ``random:flux.1_dev``) builds the pipeline of that checkpoint from its published configs
(:data:`omni_async.models.published.PUBLISHED`, the memory plan's) with each class's own random initialisation,
directly on the policy's device in ``fsdp_config.model_dtype``: every weight is created once, where it will live (no
host copy, no fp32 copy first). A user runs their exact recipe on it for a few steps to see memory and speed before
downloading the weights; the GPU checks measure this project with it. The images are noise: rewards mean nothing.

The text encoders keep the real vocabulary sizes (the embedding tables' memory), while the tokenizers are the
byte-level ones :mod:`omni_async.models.tiny` builds (one token per byte, so a prompt is several times more tokens
than under the real BPE tokenizer: text-encoder time is an upper bound, the denoiser's is exact).
:func:`omni_async.models.tiny.resolve_model_path` turns ``random:<family>`` into a cached directory holding those
tokenizers (``tokenizer/``, ``tokenizer_2/``, ... as the checkpoint's), which is what the prompt-length check reads.

``actor_rollout_ref.model.override_config`` (verl's key, which overrides an LLM's Hugging Face config) changes the
configs per component: ``{transformer: {num_layers: 1}, text_encoder: {text_config: {num_hidden_layers: 1}}}``
shrinks Qwen-Image so that tests build it on a CPU. A key the component's class does not take is refused, naming
the component and the key.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_async.models.published import PUBLISHED, build, config_class
from omni_async.models.tiny import (
    RANDOM_PREFIX,
    RANDOM_TOKENIZERS,
    is_random,
    resolve_model_path,
    unknown_random_family,
)

__all__ = ["FAMILIES", "RANDOM_PREFIX", "build_pipeline", "configs", "family_of", "is_random", "override_problems"]

_SEED = 1234  # every rank builds the same weights (data-parallel ranks must start from one model)

# family -> the diffusers pipeline it builds (its tokenizers: models.tiny.RANDOM_TOKENIZERS)
FAMILIES: dict[str, str] = {
    "qwen_image": "QwenImagePipeline",
    "sd3.5_medium": "StableDiffusion3Pipeline",
    "wan2.1_t2v_1.3b": "WanPipeline",
    "wan2.2_ti2v_5b": "WanPipeline",
    "flux.1_dev": "FluxPipeline",
}
assert set(FAMILIES) == set(PUBLISHED) == set(RANDOM_TOKENIZERS)

# The spec entries that are modules with weights (the rest: scheduler, sizes the memory plan reads).
_MODULE_PARTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")


def family_of(path: str) -> str:
    """The family of ``random:<family>``; an unknown one is refused naming the known ones."""
    name = str(path)[len(RANDOM_PREFIX) :]
    if name not in FAMILIES:
        raise ValueError(f"{path!r}: {unknown_random_family(name)}")
    return name


def components(family: str) -> dict[str, tuple[str, str, dict]]:
    """The family's modules with weights: ``{component: (library, class, published config)}``."""
    spec = PUBLISHED[family]
    return {part: spec[part] for part in _MODULE_PARTS if part in spec}


def override_problems(family: str, override: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with ``override_config`` for ``random:<family>``: unknown components or keys (none: ``[]``)."""
    problems: list[str] = []
    parts = components(family)
    for part, keys in (override or {}).items():
        if part not in parts:
            problems.append(
                f"override_config.{part}: random:{family} has no component {part!r} (its components: "
                f"{', '.join(parts)})"
            )
            continue
        if not isinstance(keys, Mapping):
            problems.append(f"override_config.{part}={keys!r}: give the component's config keys, e.g. {part}.<key>=1")
            continue
        library, cls_name, config = parts[part]
        problems += [f"override_config.{part}.{p}" for p in _unknown_keys(library, cls_name, config, keys)]
    return problems


def _unknown_keys(library: str, cls_name: str, config: dict, keys: Mapping[str, Any]) -> list[str]:
    """``key: why`` for each override key ``cls_name`` does not take (nested for a transformers sub-config)."""
    cfg_cls = config_class(library, cls_name)
    if cfg_cls is None:  # diffusers: the class's constructor arguments are its config
        known = set(inspect.signature(getattr(__import__("diffusers"), cls_name).__init__).parameters) - {"self"}
        return [
            f"{k}: {cls_name} takes no such argument (its config keys: {', '.join(sorted(known))})"
            for k in keys
            if k not in known
        ]
    return _unknown_config_keys(cfg_cls(**config), keys, cls_name, "")


def _unknown_config_keys(cfg: Any, keys: Mapping[str, Any], cls_name: str, prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in keys.items():
        if not hasattr(cfg, k):
            known = sorted(n for n in cfg.to_dict() if not n.startswith("_"))
            out.append(f"{prefix}{k}: {cls_name}'s config has no such key (its keys: {', '.join(known)})")
        elif isinstance(v, Mapping) and hasattr(getattr(cfg, k), "to_dict"):  # a sub-config (text_config, ...)
            out += _unknown_config_keys(getattr(cfg, k), v, cls_name, f"{prefix}{k}.")
    return out


def _merge(base: dict, over: Mapping[str, Any]) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def configs(family: str, override: Mapping[str, Any] | None = None) -> dict[str, tuple[str, str, dict]]:
    """The family's component configs with ``override_config`` applied (refused, naming every bad key, first)."""
    override = override or {}
    problems = override_problems(family, override)
    if problems:
        raise ValueError(
            f"actor_rollout_ref.model.override_config does not fit random:{family}: " + "; ".join(problems)
        )
    return {
        part: (lib, cls, _merge(cfg, override.get(part, {}))) for part, (lib, cls, cfg) in components(family).items()
    }


def build_pipeline(
    path: str,
    override: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizers: Callable[[str], Any] | None = None,
):
    """The ``random:<family>`` pipeline: its modules built on ``device`` in ``dtype`` (seeded: the same weights on
    every rank), its scheduler from the published config, its tokenizers from the cached directory
    (``resolve_model_path``; ``tokenizers``: a loader by subfolder instead)."""
    import diffusers

    family = family_of(path)
    pipeline_cls, subfolders = FAMILIES[family], RANDOM_TOKENIZERS[family]
    if tokenizers is None:
        from transformers import AutoTokenizer

        root = resolve_model_path(path)

        def tokenizers(sub: str) -> Any:
            return AutoTokenizer.from_pretrained(root, subfolder=sub)

    spec = PUBLISHED[family]
    _, sched_cls, sched_cfg = spec["scheduler"]
    dev = torch.device(device)
    cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(_SEED)
        modules = {part: build(*built, dtype=dtype, device=dev) for part, built in configs(family, override).items()}
    return getattr(diffusers, pipeline_cls)(
        scheduler=getattr(diffusers, sched_cls)(**sched_cfg),
        **{sub: tokenizers(sub) for sub in subfolders},
        **modules,
        **spec.get("pipeline_kwargs", {}),
    )
