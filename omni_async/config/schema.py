"""Types of the trainer config: a structured schema, so a wrong type fails when the config is composed.

The YAML files stay the one place where keys and defaults are written. The schema is derived from them as
OmegaConf structured configs (dataclasses, as verl's ``BaseConfig`` sections are): each key's type is its
default's type (``bool``, ``int``, ``float``, ``str``, ``List[<element>]``, an open ``Dict[str, Any]`` for ``{}``),
except where the default cannot say — ``null`` defaults and real-valued keys written as whole numbers — which
:data:`NULLABLE` and :data:`REAL` give. Merging a composed config into the schema makes OmegaConf check every
value (``actor_rollout_ref.actor.optim.lr=fast``, ``trainer.seed=1.5``, ``reward.timeout_s=120s`` fail); the
error is re-raised as :class:`~omni_async.trainer.config.ConfigError` naming key, value and expected type.
What types cannot express (ranges, combinations) stays in ``config.validate``.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import MISSING, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, Optional, get_args, get_origin

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from omni_async.config_error import ConfigError

# Keys whose default is null: the type a value must have when set (null stays allowed).
NULLABLE: dict[str, Any] = {
    "data.val_files": Any,  # a path or a list of paths, as data.train_files
    "data.max_prompt_length": int,
    "actor_rollout_ref.model.enable_gradient_checkpointing": bool,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": int,
    "actor_rollout_ref.actor.fsdp_config.model_dtype": str,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": int,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": int,
    "actor_rollout_ref.rollout.dtype": str,
    "actor_rollout_ref.rollout.pipeline.max_sequence_length": int,
    "actor_rollout_ref.rollout.pipeline.vae_tiling": bool,
    "actor_rollout_ref.rollout.pipeline.window_batch_size": int,
    "actor_rollout_ref.rollout.server_url": str,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps": int,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.height": int,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.width": int,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.true_cfg_scale": float,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.guidance_scale": float,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.guidance_scale_2": float,
    "actor_rollout_ref.rollout.pipeline.guidance_scale_2": float,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.max_sequence_length": int,
    "actor_rollout_ref.rollout.val_kwargs.pipeline.output_type": str,
    "reward.reward_model.model_path": str,
    "distillation.teacher_models.teacher_model.model_path": str,
    "trainer.total_training_steps": int,
    "trainer.use_v1": bool,
    "trainer.v1.trainer_mode": str,
    "trainer.v1.separate_async.parameter_sync_step": int,
    "trainer.v1.separate_async.num_warmup_batches": float,
    "async_training.enable_reward_queue": bool,
    "async_training.reward_queue_size": int,
    "actor_rollout_ref.rollout.n_gpus": int,
    "actor_rollout_ref.rollout.n_gpus_per_node": int,
    "actor_rollout_ref.rollout.response_length_pareto_alpha": float,
    "rollout.nnodes": int,
    "rollout.n_gpus_per_node": int,
    "async_training.trigger_parameter_sync_step": int,
    "rollout.total_rollout_steps": int,
    "algorithm.rollout_correction.bypass_mode": bool,
    "algorithm.rollout_correction.rollout_is": str,
    "algorithm.rollout_correction.rollout_rs": str,
    # verl's thresholds: a number, or a string ("lower_upper", one per comma-separated rollout_rs option)
    "algorithm.rollout_correction.rollout_is_threshold": Any,
    "algorithm.rollout_correction.rollout_rs_threshold": Any,
    "trainer.v1.sampler.max_off_policy_threshold": int,
    "trainer.v1.sampler.max_off_policy_strategy": str,
    "trainer.ray.address": str,
    "trainer.ray.num_cpus": int,
    "trainer.ray.gpu_worker_torch_threads": int,
    "actor_rollout_ref.actor.use_kl_loss": bool,
    "actor_rollout_ref.actor.kl_loss_coef": float,
    "actor_rollout_ref.actor.optim.override_optimizer_config": dict[str, Any],
    "actor_rollout_ref.rollout.seed": int,
    "actor_rollout_ref.rollout.algo.sde_window_seed": int,
    "reward.reward_model.rollout.max_model_len": int,
    "reward.reward_model.rollout.max_num_seqs": int,
    "trainer.default_local_dir": str,
    "trainer.validation_data_dir": str,
    "trainer.rollout_data_dir": str,
    "actor_rollout_ref.actor.clip_ratio": float,
    "actor_rollout_ref.rollout.calculate_log_probs": bool,
    "algorithm.adv_clip_max": float,
    "algorithm.old_policy_decay": float,
    "actor_rollout_ref.actor.profiler.tool": str,
    "global_profiler.tool": str,
    "global_profiler.steps": list[int],
}
# Keys with a whole-number default whose values are real numbers (so 2.5 is accepted, "120s" is not).
REAL: frozenset[str] = frozenset(
    {
        "reward.timeout_s",
        "trainer.save_interval_min",
        "actor_rollout_ref.rollout.agent.max_wait_ms",
        "reward.linger_ms",
    }
)


def _element_type(items: list) -> Any:
    kinds = {type(v) for v in items}
    if len(kinds) == 1 and (kind := kinds.pop()) in (bool, int, float, str):
        return kind
    return Any


def _field(key: str, values: list[Any]) -> tuple[Any, Any]:
    """(type, dataclass field) of one key from its defaults in the config files (the first file's is the field's
    default; a null in any file makes the key nullable)."""
    value, known = values[0], [v for v in values if v is not None]
    if isinstance(value, dict):
        if not value:  # an open mapping users add keys to (reward_kwargs, reward_functions)
            return dict[str, Any], field(default_factory=dict)
        cls = _dataclass(key, [v for v in values if isinstance(v, dict)])
        return cls, field(default_factory=cls)
    if isinstance(value, list):
        return list[_element_type(value)], field(default_factory=lambda v=list(value): list(v))
    if any(isinstance(v, str) and ("${" in v or v == "???") for v in known):
        return Any, field(default=value)  # an interpolation takes its target's type; ??? = required
    kinds = {float if key in REAL and isinstance(v, int) and not isinstance(v, bool) else type(v) for v in known}
    kind = kinds.pop() if len(kinds) == 1 else NULLABLE.get(key, Any)
    if kind is float and isinstance(value, int):
        value = float(value)
    if len(known) < len(values) or key in NULLABLE:
        return Optional[NULLABLE.get(key, kind)], field(default=value)  # noqa: UP045 (OmegaConf needs Optional)
    return kind, field(default=value)


def _dataclass(prefix: str, nodes: list[dict]) -> type:
    """One dataclass for the section at ``prefix``, from that section in every config file (the first has every key:
    the others compose it and only change values)."""
    name = "".join(p.title() for p in prefix.replace(".", "_").split("_")) or "Root"
    fields = [
        (k, *_field(f"{prefix}.{k}" if prefix else k, [n.get(k) if k in n else v for n in nodes]))
        for k, v in nodes[0].items()
    ]
    return make_dataclass(f"{name}Config", fields)


CONFIG_DIR = Path(__file__).resolve().parent  # the YAML files sit beside the code that reads them


CONFIG_NAMES = ("flowgrpo_trainer", "grpo_text_trainer")  # every config file users compose from


def compose_untyped(overrides: list[str] | None = None, config_name: str = "flowgrpo_trainer") -> DictConfig:
    """Hydra's composition of ``config_name`` with ``overrides``; also callable inside ``@hydra.main`` (the entry
    point's Hydra state is put aside and restored).

    The config files have no groups, so composing is loading them once and applying the key overrides in order:
    the loaded defaults are kept per process and the overrides applied to a copy by Hydra's own override step
    (``ConfigLoaderImpl._apply_overrides_to_config``), which saves re-reading the YAML (~0.1-1 s) per compose; tests
    and the recipe checks compose hundreds of times. ``hydra.*`` and group overrides go the whole way."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    parsed = parse(list(overrides or []))
    if all(o.package is None and "/" not in o.key_or_group and not o.is_hydra_override() for o in parsed):
        cfg = copy.deepcopy(_loaded(config_name))
        ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
        return cfg
    return _hydra_compose(overrides, config_name)


@functools.cache
def _loaded(config_name: str) -> DictConfig:
    return _hydra_compose([], config_name)


def _hydra_compose(overrides: list[str] | None, config_name: str) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    outer = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides or []))
    finally:
        restore_gh_from_backup(outer)


@functools.cache
def schema() -> type:
    """The structured schema of the trainer configs' defaults (composed once per process)."""
    return _dataclass("", [OmegaConf.to_container(compose_untyped([], name), resolve=False) for name in CONFIG_NAMES])


@functools.cache
def _template() -> DictConfig:
    """The schema as a structured config, built once (0.1 s): ``OmegaConf.merge`` copies it, never changes it."""
    return OmegaConf.structured(schema())


def typed(cfg: DictConfig) -> DictConfig:
    """``cfg`` checked against the schema; a wrong type raises ``ConfigError`` naming key, value and type."""
    try:
        return OmegaConf.merge(_template(), cfg)
    except ValidationError as err:
        key, value = err.full_key, getattr(err, "value", None)
        expected = _expected(key)
        base = re.sub(r"\[\d+\]$", "", key)
        raise ConfigError(
            f"{key}={value!r}: expected {expected}, got {type(value).__name__}. Fix: set "
            f"{base} to the right type, e.g. {base}={_example(key)}"
        ) from None


def _field_of(key: str) -> Any:
    """The schema's dataclass field for ``key`` (``a.b`` or a list element ``a.b[1]``), or None."""
    cls, f = schema(), None
    for part in re.sub(r"\[\d+\]$", "", key).split("."):
        f = {x.name: x for x in fields(cls)}.get(part) if is_dataclass(cls) else None
        if f is None:
            return None
        cls = f.type
    return f


_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _expected(key: str) -> str:
    f = _field_of(key)
    if f is None:
        return "a value of the key's type"
    kind = f.type
    args = [a for a in get_args(kind) if a is not type(None)]
    if get_origin(kind) is list:
        element = _NAMES.get(args[0], "a value") if args else "a value"
        return element if key.endswith("]") else f"a list ({element} each)"
    if args and get_origin(kind) is not dict:  # Optional[X]
        kind = args[0]
    return _NAMES.get(kind, "a mapping" if get_origin(kind) is dict else getattr(kind, "__name__", str(kind)))


def _example(key: str) -> str:
    f = _field_of(key)
    if f is None:
        return "..."
    if f.default is not MISSING and f.default is not None:
        return str(f.default)
    if f.default_factory is not MISSING:
        return str(f.default_factory()).replace(" ", "").replace("'", "")
    return {int: "1", float: "1.0", bool: "true", str: "<text>"}.get(NULLABLE.get(key), "...")


@functools.lru_cache(maxsize=65536)
def _parse_one(line: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(line)


def parse(overrides: list[str]) -> list[Any]:
    """Hydra's parse of override lines (each line parsed once per process: tests and the recipe checks compose the
    same lines hundreds of times). Raises :class:`ConfigError` naming the line that does not parse."""
    from hydra.errors import HydraException

    out = []
    for line in overrides:
        try:
            out.append(_parse_one(line))
        except HydraException as err:
            raise ConfigError(
                f"{line}: {err}. Fix: write each override as key=value (Hydra's override grammar)"
            ) from None
    return out
