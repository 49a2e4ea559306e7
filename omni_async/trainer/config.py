"""Compose and validate the trainer config.

Hydra rejects unknown keys (the config is struct-mode) and ``config.schema`` wrong types. What neither can see is a
combination that is legal key by key but cannot run, e.g. a dedicated reward pool with zero devices. Those are
checked here, at start, before any Ray actor exists, and each error names the key and the fix.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from omni_async.algos.loss_modes import LOSS_MODES
from omni_async.cluster import actor_ranks, sequence_parallel_size
from omni_async.config.model_paths import check_model_paths
from omni_async.config.overrides import check_overrides
from omni_async.config.schema import CONFIG_DIR, CONFIG_NAMES, compose_untyped, typed
from omni_async.config_error import ConfigError, ConfigErrors
from omni_async.config_error import check as _check
from omni_async.logs import check_log_level
from omni_async.modality.base import MODEL_DTYPES
from omni_async.modality.config_checks import check_loss, check_rollout
from omni_async.reward.config_checks import check_reward
from omni_async.reward.wiring import streaming_enabled
from omni_async.sample import OUTPUT_TYPES
from omni_async.trainer.layout import Layout, check_layout, layout_class
from omni_async.trainer.mode import (
    Mode,
    check_mode,
    interrupts_at_sync,
    mode_of,
    resolve_bypass_mode,
    resolve_trainer_mode,
)
from omni_async.trainer.profiling import NsysPlan, check_profiler, nsys_plan

# verl's actor kl_loss_coef default (verl/trainer/config/actor/actor.yaml; verl-omni's diffusion actor too): the KL
# coefficient of actor.use_kl_loss=true when kl_loss_coef is not set
VERL_KL_LOSS_COEF = 0.001

__all__ = [
    "CONFIG_DIR",
    "CONFIG_NAMES",
    "compose_untyped",
    "ConfigError",
    "actor_ranks",
    "compose",
    "interrupts_at_sync",
    "layout",
    "Plan",
    "plan",
    "streaming_enabled",
    "total_training_steps",
    "validate",
]


def compose(overrides: list[str] | None = None, config_name: str = "flowgrpo_trainer") -> DictConfig:
    """Compose a config the way ``python -m omni_async.trainer.main`` does (for tests, benchmarks, notebooks): the
    overrides checked key by key (``overrides.check_overrides``: verl / verl-omni keys renamed, accepted or refused,
    unknown keys refused naming the nearest ones), the YAML defaults with the overrides, then the type check
    (``config.schema.typed``)."""
    return typed(compose_untyped(check_overrides(list(overrides or []), config_name), config_name))


@dataclass(frozen=True)
class Plan:
    """What a validated config decides for the whole run, decided once (:func:`plan`) and handed down: the trainer
    gives the mode to the producer, the update and the layout, and the layout what its workers and switch need."""

    mode: Mode
    layout: type[Layout]
    nsys: NsysPlan | None  # what Nsight Systems profiles (global_profiler.*; None: nothing)


def plan(cfg: DictConfig) -> Plan:
    """The run's mode, layout and profiling from a config :func:`validate` resolved: the one place each is built
    from the config (a structure test keeps it so)."""
    return Plan(mode_of(cfg), layout_class(cfg), nsys_plan(cfg))


def layout(cfg: DictConfig) -> str:
    """The config's layout's name (logs, tests): ``disaggregated``, ``hybrid`` or ``split``."""
    return layout_class(cfg).name


def total_training_steps(cfg: DictConfig, train_rows: int, mode: Mode | None = None) -> int:
    """verl's rule: ``trainer.total_training_steps`` when set, else ``trainer.total_epochs`` passes over the training
    data, each ``train_rows // data.train_batch_size`` steps (the last partial batch is dropped, as verl's loader).

    ``async_reward.fully_async``: a step is one update of ``require_batches x ppo_mini_batch_size`` groups, and
    the run trains ``rollout.total_rollout_steps`` prompts (verl's meaning; null: as many as the lock-step run
    above, steps x ``data.train_batch_size``), so ``total_rollout_steps // (require_batches x mini-batch)`` steps."""
    t = cfg.trainer
    if t.total_training_steps is not None:
        steps = int(t.total_training_steps)
    else:
        steps = int(t.total_epochs) * (int(train_rows) // int(cfg.data.train_batch_size))
    if not cfg.async_reward.fully_async:
        return steps
    prompts = cfg.rollout.total_rollout_steps
    prompts = int(prompts) if prompts is not None else steps * int(cfg.data.train_batch_size)
    return prompts // (mode or plan(cfg).mode).groups_per_step  # (mode: the trainer's, decided once)


def validate(cfg: DictConfig) -> DictConfig:
    """Raise :class:`ConfigError` for the first combination that cannot run; return the config the run uses: a copy
    of ``cfg`` with the upstream aliases (top-level ``rollout.*``, ``trainer.v1.*``) folded into the canonical keys
    they stand for and the mode-dependent nulls resolved (``bypass_mode``). ``cfg`` itself is left as given."""
    cfg = copy.deepcopy(cfg)
    missing = OmegaConf.missing_keys(cfg)
    _check(
        not missing,
        ", ".join(sorted(missing)),
        "required but not set",
        "pass it on the command line, e.g. data.train_files=path/to/train.jsonl "
        "(examples/data/prepare_ocr_prompts.py writes a small set)",
    )
    _resolve_aliases(cfg)
    resolve_bypass_mode(cfg)

    data, arr = cfg.data, cfg.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor

    _check(
        data.train_batch_size >= 1,
        "data.train_batch_size",
        f"must be >= 1, got {data.train_batch_size}",
        "set the number of prompts per step, e.g. data.train_batch_size=8",
    )
    _check(
        rollout.n >= 2,
        "actor_rollout_ref.rollout.n",
        f"GRPO needs at least 2 samples per prompt to form a group advantage, got {rollout.n}",
        "set actor_rollout_ref.rollout.n=4 (or more)",
    )
    mb = actor.ppo_mini_batch_size
    _check(
        mb >= 1 and data.train_batch_size % mb == 0,
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        f"{mb} prompts does not divide data.train_batch_size={data.train_batch_size}",
        "choose a divisor of data.train_batch_size (mini-batches are counted in prompts)",
    )
    _check(actor.ppo_epochs >= 1, "actor_rollout_ref.actor.ppo_epochs", "must be >= 1", "set it to 1")
    if actor.use_kl_loss is False:
        actor.kl_loss_coef = 0.0  # verl's meaning: the switch turns the KL term off whatever the coefficient
    elif actor.kl_loss_coef is None:  # verl's actor default with the switch on; off without it
        actor.kl_loss_coef = VERL_KL_LOSS_COEF if actor.use_kl_loss else 0.0
    _check_optimizer(actor.optim)
    _check(
        not (actor.kl_loss_coef > 0 and arr.model.lora_rank == 0),
        "actor_rollout_ref.actor.kl_loss_coef",
        f"{actor.kl_loss_coef} needs a reference policy, which is the model with its LoRA adapter switched off; a "
        "full fine-tune (actor_rollout_ref.model.lora_rank=0) keeps no frozen reference copy",
        "set actor_rollout_ref.actor.kl_loss_coef=0, or train LoRA (actor_rollout_ref.model.lora_rank=8)",
    )

    check_rollout(cfg)
    check_loss(cfg)
    check_reward(cfg)

    _check(cfg.algorithm.adv_std_eps >= 0, "algorithm.adv_std_eps", "must be >= 0", "flow_grpo uses 1e-4")
    _check(  # verl-omni registers flow_grpo and dance_grpo to one estimator (compute_flow_grpo_outcome_advantage)
        cfg.algorithm.adv_estimator in ("grpo", "flow_grpo", "dance_grpo"),
        "algorithm.adv_estimator",
        f"{cfg.algorithm.adv_estimator!r} is not supported here (group advantages only)",
        "use grpo (verl's name) or flow_grpo / dance_grpo (verl-omni's names for the same group advantage)",
    )
    _check_rollout_correction(cfg)
    check_mode(cfg)
    _check(
        cfg.trainer.max_ckpt_to_keep != 0,
        "trainer.max_ckpt_to_keep",
        "0 would delete every checkpoint",
        "keep at least 1 (or -1 for all)",
    )
    _check(
        cfg.trainer.resume_mode in ("auto", "disable"),
        "trainer.resume_mode",
        f"unknown mode {cfg.trainer.resume_mode!r}",
        "use auto or disable",
    )
    _check(
        cfg.trainer.total_training_steps is None or cfg.trainer.total_training_steps >= 1,
        "trainer.total_training_steps",
        "must be >= 1 (or null: trainer.total_epochs passes over the data)",
        "e.g. 4",
    )
    try:
        cfg.trainer.log_level = check_log_level(cfg.trainer.log_level)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    _check_verl_keys(cfg)
    _check(
        arr.nccl_timeout > 0,
        "actor_rollout_ref.nccl_timeout",
        f"the actor ranks' collectives need a positive timeout in seconds, got {arr.nccl_timeout}",
        "use verl's default 600 (a failing rank stops the others at once whatever the value)",
    )
    _check(
        cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes >= 1,
        "trainer.n_gpus_per_node",
        "the actor/rollout pool has no devices",
        "set trainer.n_gpus_per_node=1 (or more)",
    )
    decided = plan(cfg)
    check_layout(cfg, decided.mode, decided.layout)
    _check_sequence_parallel(cfg)
    _check_mini_batch_feeds_ranks(cfg)
    check_profiler(cfg, actor_ranks(cfg))
    return cfg


def _check_sequence_parallel(cfg: DictConfig) -> None:
    """Ulysses (``models.sequence_parallel``): groups of ``sp`` actor ranks, a diffusion transformer's tokens split
    across each; built for LoRA on images / video (a full fine-tune's FSDP2 mesh and the text policy have no
    sequence-parallel path here)."""
    key = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
    arr = cfg.actor_rollout_ref
    sp, ranks = arr.actor.fsdp_config.ulysses_sequence_parallel_size, actor_ranks(cfg)
    _check(
        sp >= 1 and ranks % sp == 0,
        key,
        f"{sp} must be >= 1 and divide the {ranks} actor ranks (trainer.n_gpus_per_node x nnodes)",
        f"set it to a divisor of {ranks}, or raise trainer.n_gpus_per_node",
    )
    if sp == 1:
        return
    _check(
        arr.model.modality != "text",
        key,
        f"{sp}: sequence parallelism here splits a diffusion transformer's image / video tokens; the text policy has none",
        "set it to 1 for model.modality=text",
    )
    from omni_async.models.sequence_parallel import context_parallel_backends

    backends = context_parallel_backends()
    _check(
        arr.model.attn_backend in backends,
        key,
        f"{sp} with actor_rollout_ref.model.attn_backend={arr.model.attn_backend}, which has no context-parallel "
        "path in diffusers",
        f"use one of {', '.join(backends)} (native: torch SDPA), or set it to 1",
    )
    _check(
        arr.model.lora_rank > 0,
        key,
        f"{sp} with a full fine-tune (lora_rank=0): sequence parallelism is built for LoRA here (FSDP2 sharding over "
        "the sequence-parallel groups is not)",
        "train LoRA (actor_rollout_ref.model.lora_rank=64), or set it to 1",
    )


def _check_optimizer(optim: DictConfig) -> None:
    """``actor.optim.{betas, override_optimizer_config}``: AdamW's own arguments (verl's keys)."""
    import inspect

    import torch

    _check(
        len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
        "actor_rollout_ref.actor.optim.betas",
        f"AdamW takes two coefficients in [0, 1), got {list(optim.betas)}",
        "e.g. [0.9,0.999] (AdamW's default)",
    )
    extra = dict(optim.override_optimizer_config or {})
    allowed = set(inspect.signature(torch.optim.AdamW).parameters) - {"params", "lr", "weight_decay", "betas"}
    unknown = sorted(set(extra) - allowed)
    _check(
        not unknown,
        "actor_rollout_ref.actor.optim.override_optimizer_config",
        f"{unknown} are not arguments of torch.optim.AdamW (lr, weight_decay and betas have keys of their own)",
        f"use some of: {', '.join(sorted(allowed))}",
    )


def _check_rollout_correction(cfg: DictConfig) -> None:
    """verl's ``algorithm.rollout_correction`` keys, in both of verl's modes: decoupled (``bypass_mode=false``: the
    ratio pi_old / pi_rollout, pi_old recomputed, once per batch) and bypass (pi_old = pi_rollout: the ratio of the
    policy being trained to the rollout's, per loss call; verl's ``loss_type=ppo_clip``, so the IS weights are only
    reported and the rejection mask applies)."""
    from verl.trainer.ppo.rollout_corr_helper import (
        SUPPORTED_ROLLOUT_RS_OPTIONS,
        _parse_rollout_is_threshold,
        _parse_rollout_rs_thresholds,
    )

    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    _check(
        rc.rollout_is in (None, "token", "sequence"),
        f"{key}.rollout_is",
        f"unknown level {rc.rollout_is!r}",
        "use null, token or sequence (verl's values)",
    )
    _check(
        not rc.rollout_is_batch_normalize or rc.rollout_is is not None,
        f"{key}.rollout_is_batch_normalize",
        "normalises the IS weights, which rollout_is=null does not compute",
        "set algorithm.rollout_correction.rollout_is=token (or sequence), or drop rollout_is_batch_normalize",
    )
    if rc.rollout_is is None and rc.rollout_rs is None:
        return
    try:
        if rc.rollout_is is not None:
            _parse_rollout_is_threshold(rc.rollout_is_threshold)
        if rc.rollout_rs is not None:
            options = [o.strip() for o in str(rc.rollout_rs).split(",") if o.strip()]
            unknown = sorted(set(options) - SUPPORTED_ROLLOUT_RS_OPTIONS)
            _check(
                not unknown,
                f"{key}.rollout_rs",
                f"unknown option(s) {unknown}",
                f"use verl's: {', '.join(sorted(SUPPORTED_ROLLOUT_RS_OPTIONS))}",
            )
            _check(
                rc.rollout_rs_threshold is not None,
                f"{key}.rollout_rs_threshold",
                "rejection sampling needs a threshold (verl has no default)",
                'e.g. rollout_rs=token_k1 rollout_rs_threshold="0.5_2.0"',
            )
            _parse_rollout_rs_thresholds(options, rc.rollout_rs_threshold)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}. Fix: use verl's threshold forms (a number, or 'lower_upper')") from e


# ---- the layout and its upstream spellings ----------------------------------------------------------------------
def _fold(cfg: DictConfig, canonical: str, alias: str, unset: object) -> None:
    """``alias`` given (not null): it sets ``canonical``, unless ``canonical`` was given a different value."""
    a, c = OmegaConf.select(cfg, alias), OmegaConf.select(cfg, canonical)
    if a is None:
        return
    _check(
        c == unset or c == a,
        canonical,
        f"{canonical}={c} and {alias}={a} are the same setting given twice with different values",
        f"give only one of them (canonical: {canonical})",
    )
    OmegaConf.update(cfg, canonical, a, merge=False)


def _resolve_aliases(cfg: DictConfig) -> None:
    """verl's spellings of the rollout pool, the sync period and the V1 trainer modes, folded into this project's
    keys (both given and different: refused, naming both). Idempotent."""
    r = cfg.actor_rollout_ref.rollout
    _check(
        r.n_gpus is None,
        "actor_rollout_ref.rollout.n_gpus",
        "seed 004's count of rollout devices is spelled with verl's rollout-pool keys here",
        f"set actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node={r.n_gpus}",
    )
    _fold(cfg, "actor_rollout_ref.rollout.nnodes", "rollout.nnodes", unset=0)
    _fold(cfg, "actor_rollout_ref.rollout.n_gpus_per_node", "rollout.n_gpus_per_node", unset=None)
    _fold(
        cfg, "async_training.trigger_parameter_sync_step", "trainer.v1.separate_async.parameter_sync_step", unset=None
    )
    _fold(cfg, "reward.queue_size", "async_training.reward_queue_size", unset=64)
    queue = cfg.async_training.enable_reward_queue
    if queue is not None:
        streaming = str(cfg.reward.streaming).lower()
        _check(
            streaming in ("auto", str(queue).lower()),
            "reward.streaming",
            f"reward.streaming={streaming} and async_training.enable_reward_queue={queue} are the same setting given "
            "twice with different values",
            "give only one of them (canonical: reward.streaming)",
        )
        cfg.reward.streaming = str(queue).lower()
    resolve_trainer_mode(cfg)


def _check_verl_keys(cfg: DictConfig) -> None:
    """verl / verl-omni keys that this project implements only in some values: anything else is refused here,
    naming the key and what this project uses instead (no key is accepted and then ignored)."""
    arr, data, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    rollout, actor = arr.rollout, arr.actor
    if arr.model.modality == "text":  # images: check_loss (flow_grpo, diffusion_nft)
        _check(
            arr.model.algorithm == "grpo",
            "actor_rollout_ref.model.algorithm",
            f"{arr.model.algorithm!r} is not implemented for model.modality=text",
            "use grpo",
        )
    _check(
        data.max_prompt_length is None or data.max_prompt_length >= 1,
        "data.max_prompt_length",
        "must be >= 1 tokens",
        "e.g. 256, or null for no limit",
    )
    _check(
        rollout.tensor_model_parallel_size == 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        f"each rollout worker holds one device (TP={rollout.tensor_model_parallel_size} rollout is not implemented)",
        "set it to 1 and scale out with actor_rollout_ref.rollout.agent.num_workers",
    )
    _check(
        rollout.load_format in ("safetensors", "hf", "auto"),
        "actor_rollout_ref.rollout.load_format",
        f"{rollout.load_format!r}: rollout workers load model.path's weights from disk and then take only the "
        "trainable weights from the actor, so the frozen ones (VAE, text encoder, base) cannot be dummy",
        "set actor_rollout_ref.rollout.load_format=safetensors",
    )
    ref_mb = arr.ref.log_prob_micro_batch_size_per_gpu
    actor_mb = actor.ppo_micro_batch_size_per_gpu or actor.ppo_mini_batch_size * rollout.n
    # An SDE-window loss runs the reference in window calls of at most ref_mb samples (SamplingConfig.reference_batch);
    # the other losses' reference is one batched call per actor micro-batch.
    mode = LOSS_MODES.get(str(actor.diffusion_loss.loss_mode)) if arr.model.modality == "image" else None
    windowed = mode is not None and mode.window_loss is not None
    _check(
        ref_mb is None or ref_mb >= 1,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        f"must be >= 1 or null, got {ref_mb}",
        "e.g. 2, or null (the actor's micro-batch)",
    )
    _check(
        ref_mb is None or windowed or ref_mb >= actor_mb,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        f"the reference (adapter-off) forward runs inside each actor micro-batch of {actor_mb} samples in one call "
        f"(only an SDE-window loss such as flow_grpo splits it into calls of this size), so its batch cannot be "
        f"limited to {ref_mb}",
        "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (it bounds both), or set this key >= it (or null)",
    )
    _check_validation(cfg)
    _check_rollout_dtype(cfg)
    _check(t.total_epochs >= 1, "trainer.total_epochs", f"must be >= 1, got {t.total_epochs}", "e.g. 1")
    _check(t.log_val_generations >= 0, "trainer.log_val_generations", "must be >= 0", "e.g. 8, or 0 for none")
    _check_logger(list(t.logger))


# verl's Tracking backends that import a package of their own, which this project does not install.
_LOGGER_PACKAGES = {
    "wandb": "wandb",
    "mlflow": "mlflow",
    "swanlab": "swanlab",
    "clearml": "clearml",
    "trackio": "trackio",
    "vemlp_wandb": "volcengine_ml_platform",
    "rl_insight": "rl_insight",
}


def _check_logger(backends: list[str]) -> None:
    """``trainer.logger``: verl's ``Tracking`` backends (plus ``jsonl``, earlier releases' name for metrics.jsonl)."""
    from verl.utils.tracking import Tracking

    from omni_async.trainer.metrics_logger import LEGACY_JSONL

    known = [*Tracking.supported_backend, LEGACY_JSONL]
    unknown = sorted(set(backends) - set(known))
    _check(not unknown, "trainer.logger", f"unknown backend(s) {unknown}", f"use verl's: {', '.join(known)}")
    for backend in backends:
        if (package := _LOGGER_PACKAGES.get(backend)) is not None:
            _check(
                importlib.util.find_spec(package) is not None,
                "trainer.logger",
                f"{backend} is listed but not installed",
                f"pip install {package} (verl's Tracking imports it), "
                f"or remove {backend} from trainer.logger (e.g. trainer.logger=[console,tensorboard])",
            )


def _check_validation(cfg: DictConfig) -> None:
    """``actor_rollout_ref.rollout.val_kwargs``: the validation sampling settings (null = the training value)."""
    rollout = cfg.actor_rollout_ref.rollout
    v = rollout.val_kwargs
    _check(v.n >= 1, "actor_rollout_ref.rollout.val_kwargs.n", f"must be >= 1, got {v.n}", "e.g. 1")
    steps = v.pipeline.num_inference_steps or rollout.pipeline.num_inference_steps
    _check(steps >= 1, "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps", "must be >= 1", "e.g. 50")
    h, w = v.pipeline.height or rollout.pipeline.height, v.pipeline.width or rollout.pipeline.width
    _check(
        h % 16 == 0 and w % 16 == 0,
        "actor_rollout_ref.rollout.val_kwargs.pipeline.height/width",
        f"{h}x{w} is not a multiple of 16",
        "use e.g. 64x64 or 512x512",
    )
    _check(v.algo.noise_level >= 0, "actor_rollout_ref.rollout.val_kwargs.algo.noise_level", "must be >= 0", "0.0")
    for key, value in (("pipeline", rollout.pipeline.output_type), ("val_kwargs.pipeline", v.pipeline.output_type)):
        _check(
            value is None or value in OUTPUT_TYPES,
            f"actor_rollout_ref.rollout.{key}.output_type",
            f"{value!r} is not one of {', '.join(OUTPUT_TYPES)}",
            "pt (the reward gets pixels), latent (the clean latent and the prompt encodings) or both",
        )
    if v.algo.noise_level > 0:
        size, hi = rollout.algo.sde_window_size, int(rollout.algo.sde_window_range[1])
        _check(
            hi <= steps,
            "actor_rollout_ref.rollout.val_kwargs.algo.noise_level",
            f"validation SDE noise runs on a window of algo.sde_window_size={size} steps within "
            f"algo.sde_window_range, which passes the {steps} validation steps",
            "raise val_kwargs.pipeline.num_inference_steps, or set val_kwargs.algo.noise_level=0.0 (ODE)",
        )


def _check_rollout_dtype(cfg: DictConfig) -> None:
    """``actor_rollout_ref.rollout.dtype`` (verl-omni's; its DRM recipe samples in fp32 from a bf16-trained model):
    the rollout casts the transformer to it for each batch and back (``DiffusionPolicy.sampling_dtype``), which is
    exact only towards a wider dtype; the rollout's log-probs then come from another dtype than the update's, so
    pi_old is recomputed in model_dtype (bypass_mode=false) and the first update's ratio stays 1."""
    arr = cfg.actor_rollout_ref
    name, model = arr.rollout.get("dtype"), arr.actor.fsdp_config.model_dtype
    if name is None:
        return
    key = "actor_rollout_ref.rollout.dtype"
    _check(str(name) in MODEL_DTYPES, key, f"{name!r} is not a dtype", "bf16, fp16 or fp32 (null: model_dtype)")
    if model is not None and MODEL_DTYPES.get(str(model)) == MODEL_DTYPES[str(name)]:
        return
    _check(
        MODEL_DTYPES[str(name)] == MODEL_DTYPES["fp32"],
        key,
        f"{name} differs from actor.fsdp_config.model_dtype={model}: the rollout casts the frozen weights to its dtype "
        "and back after each batch, exact only towards a wider dtype (fp32)",
        f"drop it, or set it to fp32 or to model_dtype ({model})",
    )
    _check(
        not cfg.algorithm.rollout_correction.bypass_mode,
        key,
        f"with algorithm.rollout_correction.bypass_mode=true pi_old is the rollout's log-probs, computed in {name} "
        f"while the update computes in model_dtype={model}: the first update's ratio would be off 1 by the dtype gap",
        "set algorithm.rollout_correction.bypass_mode=false (pi_old recomputed in model_dtype: verl-omni's default, "
        "which its DRM recipe runs), or drop rollout.dtype",
    )
    _check(
        not (actor_ranks(cfg) > 1 and arr.model.lora_rank == 0),
        key,
        "a full fine-tune over several actor ranks shards the transformer (FSDP2), whose weights the rollout does not "
        "cast",
        "drop it, or train LoRA (model.lora_rank > 0)",
    )


def _check_sequence_parallel_model(cfg: DictConfig) -> None:
    """Ulysses needs a transformer diffusers gives a context-parallel plan (``models.sequence_parallel``): the
    checkpoint's pipeline class, where the driver can read it (``random:``, ``tiny:`` and local / cached
    checkpoints); otherwise the actor refuses it when it loads the model."""
    arr = cfg.actor_rollout_ref
    if arr.actor.fsdp_config.ulysses_sequence_parallel_size == 1 or arr.model.modality == "text":
        return
    from omni_async.config.model_paths import pipeline_class
    from omni_async.models.random_models import FAMILIES, family_of
    from omni_async.models.sequence_parallel import pipeline_problem
    from omni_async.models.tiny import is_random, is_tiny, resolve_model_path

    path = str(arr.model.path)
    if is_random(path):
        pipeline = FAMILIES[family_of(path)]
    else:
        pipeline = pipeline_class(resolve_model_path(path) if is_tiny(path) else path)
    problem = pipeline_problem(pipeline) if pipeline else None
    _check(
        problem is None,
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        f"{arr.actor.fsdp_config.ulysses_sequence_parallel_size} with {path!r}: {problem}, so its tokens cannot be "
        "split across ranks",
        "set it to 1, or train a model whose transformer has one (Qwen-Image, FLUX.1, Wan)",
    )


def _check_mini_batch_feeds_ranks(cfg: DictConfig) -> None:
    """Every actor rank trains on every mini-batch. A rank takes whole ``uid`` groups (``trainer.data_parallel``), so
    a mini-batch of fewer groups than ranks leaves ranks with a zero-weight padding row in every update: devices
    held and idle. verl keeps the same meaning of the key (prompts; x ``rollout.n`` samples per mini-batch) and
    requires those samples to divide over the ranks; here the unit that divides is the group."""
    # the data-parallel ranks: a sequence-parallel group of ranks trains on one share
    ranks = actor_ranks(cfg) // sequence_parallel_size(cfg)
    mb, batch = cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    fits = [m for m in range(ranks, batch + 1, ranks) if batch % m == 0]
    fix = (
        f"set actor_rollout_ref.actor.ppo_mini_batch_size={fits[0]} (a multiple of the {ranks} ranks that "
        f"divides data.train_batch_size={batch})"
        if fits
        else f"raise data.train_batch_size to a multiple of {ranks} and set ppo_mini_batch_size to a multiple of "
        f"{ranks} that divides it"
    )
    # verl / verl-omni split a mini-batch's samples (not groups) over the ranks, then each rank's share into
    # micro-batches of ppo_micro_batch_size_per_gpu (verl's prepare_micro_batches asserts it divides): say when that
    # fails there too, so a recipe written for them is not taken for one that runs there (the 64-card ones)
    arr = cfg.actor_rollout_ref
    per_prompt = 2 if cfg.algorithm.get("paired_preference", False) else arr.rollout.n  # DPO: mini-batches of pairs
    samples, micro = mb * per_prompt, arr.actor.ppo_micro_batch_size_per_gpu
    upstream = (
        f"; verl / verl-omni's update stops here too: {samples} samples / {ranks} ranks = {samples / ranks:g} per rank, not a "
        f"multiple of ppo_micro_batch_size_per_gpu={micro}"
        if micro and (samples % ranks or (samples // ranks) % micro)
        else ""
    )
    _check(
        mb >= ranks,
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        f"{mb} prompts per mini-batch = {mb} groups for {ranks} data-parallel actor ranks (trainer.n_gpus_per_node x "
        "nnodes / ulysses_sequence_parallel_size); "
        f"groups are never split, so {ranks - mb} rank(s) would train on padding rows in every update{upstream}",
        f"{fix}, or use fewer actor ranks",
    )


def check_at_start(cfg: DictConfig) -> DictConfig:
    """What a run checks on the driver before Ray starts: the config (:func:`validate`,
    its first problem) and the model paths (:func:`omni_async.config.model_paths.check_model_paths`). Raises one
    :class:`ConfigError` naming every problem found (a :class:`ConfigErrors` when there are several); returns the
    validated config."""
    problems: list[tuple[str, str]] = []

    def note(err: ConfigError) -> None:
        problems.extend(err.problems if isinstance(err, ConfigErrors) else [(_key_of(str(err)), str(err))])

    resolved = cfg
    try:
        resolved = validate(cfg)
    except ConfigError as err:
        note(err)
    try:
        check_model_paths(resolved)
        _check_sequence_parallel_model(resolved)
    except ConfigError as err:
        note(err)
    if len(problems) == 1:
        raise ConfigError(problems[0][1])
    if problems:
        raise ConfigErrors(problems)
    return resolved


def _key_of(message: str) -> str:
    """The key a :func:`omni_async.config_error.check` message starts with (``key: ...`` or ``key=value: ...``)."""
    return re.match(r"[^\s:=]+", message).group(0)
