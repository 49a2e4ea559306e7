"""Compose and validate the trainer config.

Hydra rejects unknown keys (the config is struct-mode) and ``config_schema`` wrong types. What neither can see is a
combination that is legal key by key but cannot run, e.g. a dedicated reward pool with zero devices. Those are
checked here, at start, before any Ray actor exists, and each error names the key and the fix.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from omni_async.cluster import reward_pool_size, rollout_pool_size
from omni_async.reward.wiring import streaming_enabled

__all__ = [
    "ConfigError",
    "actor_ranks",
    "compose",
    "fully_async_bounds",
    "groups_per_update",
    "interrupts_at_sync",
    "layout",
    "streaming_enabled",
    "sync_period_steps",
    "total_training_steps",
    "validate",
]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


class ConfigError(ValueError):
    """A config combination that cannot run; the message names the key and how to fix it."""


CONFIG_NAMES = ("flowgrpo_trainer", "grpo_text_trainer")  # every config file users compose from


def compose_untyped(overrides: list[str] | None = None, config_name: str = "flowgrpo_trainer") -> DictConfig:
    """Hydra's composition of ``config_name`` with ``overrides``; also callable inside ``@hydra.main`` (the entry
    point's Hydra state is put aside and restored)."""
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


def compose(overrides: list[str] | None = None, config_name: str = "flowgrpo_trainer") -> DictConfig:
    """Compose a config the way ``python -m omni_async.trainer.main`` does (for tests, benchmarks, notebooks): the
    YAML defaults, the overrides, then the type check (``config_schema.typed``)."""
    from omni_async.trainer.config_schema import typed

    return typed(compose_untyped(overrides, config_name))


def total_training_steps(cfg: DictConfig, train_rows: int) -> int:
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
    return prompts // groups_per_update(cfg)


def groups_per_update(cfg: DictConfig) -> int:
    """Fully async: GRPO groups (prompts) one trainer step takes, ``require_batches x ppo_mini_batch_size``."""
    return int(cfg.async_training.require_batches) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)


def interrupts_at_sync(cfg: DictConfig) -> bool:
    """Whether a weight sync interrupts the responses being generated, which are then continued under the new
    weights: verl's ``async_training.partial_rollout`` in fully async training, for text. Images are one device
    batch each: a sample in flight at a sync finishes under the version that started it (never interrupted)."""
    return bool(
        cfg.async_reward.fully_async
        and cfg.async_training.partial_rollout
        and cfg.actor_rollout_ref.model.modality == "text"
    )


def fully_async_bounds(cfg: DictConfig) -> tuple[int, int]:
    """Fully async: ``(cap, B)``: groups the rollouter may start per sync window and the largest lag a trained
    group may have (``algos.staleness``; verl-omni's ``max_off_policy_threshold`` tightens both)."""
    from omni_async.algos.staleness import effective_bound, groups_per_window

    a, n = cfg.async_training, groups_per_update(cfg)
    cap = groups_per_window(
        a.staleness_threshold,
        sync_period_steps(cfg),
        a.require_batches,
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
    )
    return effective_bound(cap, n, cfg.trainer.v1.sampler.max_off_policy_threshold)


def actor_ranks(cfg: DictConfig) -> int:
    """Data-parallel actor ranks: one per device of the actor pool, ``trainer.n_gpus_per_node x nnodes``, in every
    layout (the disaggregated layout's rollout pool is its own)."""
    return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)


def _check(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}. Fix: {fix}")


def _check_reward_functions(reward: DictConfig, modality: str) -> None:
    """Load every configured reward function here, on the driver, so a wrong path or name fails at once with the
    config key (not inside a Ray actor half a minute later). No path: dispatch by ``data_source``, as verl does."""
    from omni_async.reward.contract import check_reward_function
    from omni_async.reward.manager import check_judge_model_kwargs, reward_specs

    try:
        for spec in reward_specs(reward):
            check_judge_model_kwargs(
                spec, check_reward_function(spec.path, spec.name, spec.config_key, spec.kwargs, modality)
            )
    except ValueError as e:  # a RewardConfigError, or a reward_functions entry without path / name
        raise ConfigError(str(e)) from e


def validate(cfg: DictConfig) -> DictConfig:
    """Raise :class:`ConfigError` for the first combination that cannot run; return ``cfg``, with the upstream
    aliases (top-level ``rollout.*``, ``trainer.v1.*``) folded into the canonical keys they stand for."""
    missing = OmegaConf.missing_keys(cfg)
    _check(
        not missing,
        ", ".join(sorted(missing)),
        "required but not set",
        "pass it on the command line, e.g. data.train_files=path/to/train.jsonl "
        "(examples/data/prepare_ocr_prompts.py writes a small set)",
    )
    _resolve_aliases(cfg)

    data, arr = cfg.data, cfg.actor_rollout_ref
    rollout, actor, reward = arr.rollout, arr.actor, cfg.reward

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
    _check(
        not (actor.kl_loss_coef > 0 and arr.model.lora_rank == 0),
        "actor_rollout_ref.actor.kl_loss_coef",
        f"{actor.kl_loss_coef} needs a reference policy, which is the model with its LoRA adapter switched off; a "
        "full fine-tune (actor_rollout_ref.model.lora_rank=0) keeps no frozen reference copy",
        "set actor_rollout_ref.actor.kl_loss_coef=0, or train LoRA (actor_rollout_ref.model.lora_rank=8)",
    )

    modality = arr.model.modality
    _check(
        modality in ("image", "text"),
        "actor_rollout_ref.model.modality",
        f"unknown modality {modality!r}",
        "use image (diffusion) or text (causal LM; --config-name grpo_text_trainer sets it up)",
    )
    _check(
        rollout.name != "vllm_omni",
        "actor_rollout_ref.rollout.name",
        "vllm_omni is verl-omni's diffusion server; here diffusion rolls out in-process (diffusers) in each "
        "rollout worker",
        "set actor_rollout_ref.rollout.name=transformers",
    )
    _check(
        rollout.name in ("transformers", "vllm"),
        "actor_rollout_ref.rollout.name",
        f"unknown rollout engine {rollout.name!r}",
        "use transformers (or vllm for text)",
    )
    if rollout.name == "vllm":
        _check(
            modality == "text",
            "actor_rollout_ref.rollout.name",
            "the vLLM rollout serves text models; diffusion rollouts run in the replicas",
            "set actor_rollout_ref.rollout.name=transformers (or model.modality=text)",
        )
        _check(
            arr.model.lora_rank > 0,
            "actor_rollout_ref.model.lora_rank",
            "the vLLM rollout takes weight updates as LoRA adapters; full fine-tuning is not synced into vLLM",
            "set actor_rollout_ref.model.lora_rank=8 (or rollout.name=transformers)",
        )
    if modality == "text":
        _check(rollout.response_length >= 1, "actor_rollout_ref.rollout.response_length", "must be >= 1", "e.g. 32")
        _check(rollout.temperature > 0, "actor_rollout_ref.rollout.temperature", "must be > 0", "e.g. 1.0")
        _check(
            not actor.fsdp_config.param_offload,
            "actor_rollout_ref.actor.fsdp_config.param_offload",
            "offloads a diffusion pipeline's frozen text encoder and VAE; a text policy trains its one model",
            "set it to False",
        )
    algo = rollout.algo
    _check(
        algo.sde_type in ("sde", "cps"),
        "actor_rollout_ref.rollout.algo.sde_type",
        f"unknown SDE type {algo.sde_type!r}",
        "use sde or cps",
    )
    _check(
        algo.cps_log_prob in ("flow_grpo", "gaussian"),
        "actor_rollout_ref.rollout.algo.cps_log_prob",
        f"unknown form {algo.cps_log_prob!r}",
        "use flow_grpo (the references' form) or gaussian",
    )
    _check(algo.noise_level >= 0, "actor_rollout_ref.rollout.algo.noise_level", "must be >= 0", "e.g. 0.7")
    steps = rollout.num_inference_steps
    lo, hi = (int(v) for v in algo.sde_window_range)
    _check(
        1 <= algo.sde_window_size <= steps,
        "actor_rollout_ref.rollout.algo.sde_window_size",
        f"must be within 1..num_inference_steps={steps}, got {algo.sde_window_size}",
        "pick a window no longer than the denoising schedule",
    )
    # verl-omni's / flow_grpo's meaning: the whole window lies inside [lo, hi).
    _check(
        hi - lo >= algo.sde_window_size,
        "actor_rollout_ref.rollout.algo.sde_window_range",
        f"[{lo}, {hi}) is shorter than actor_rollout_ref.rollout.algo.sde_window_size={algo.sde_window_size} "
        "(the whole window lies inside the range, as in verl-omni and flow_grpo)",
        f"widen the range to at least sde_window_size steps (e.g. [{lo},{lo + algo.sde_window_size}]) or lower "
        "sde_window_size",
    )
    _check(
        0 <= lo and hi <= steps,
        "actor_rollout_ref.rollout.algo.sde_window_range",
        f"[{lo}, {hi}) is not within the num_inference_steps={steps} denoising steps",
        f"use 0 <= lo and hi <= {steps}",
    )
    _check(rollout.agent.num_workers >= 1, "actor_rollout_ref.rollout.agent.num_workers", "must be >= 1", "set it to 1")
    _check(
        rollout.height % 16 == 0 and rollout.width % 16 == 0,
        "actor_rollout_ref.rollout.height/width",
        f"{rollout.height}x{rollout.width} is not a multiple of 16 (VAE factor 8 x patch 2)",
        "use e.g. 64x64 on CPU, 512x512 or 1024x1024 on GPUs",
    )

    _check(
        str(reward.streaming).lower() in ("auto", "true", "false"),
        "reward.streaming",
        f"unknown mode {reward.streaming!r}",
        "use auto, true or false",
    )
    _check(reward.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {reward.num_workers}", "set it to 1")
    for key in ("queue_size", "max_inflight_per_worker"):
        _check(reward[key] >= 1, f"reward.{key}", f"must be >= 1, got {reward[key]}", "use the default")
    _check(reward.max_resends >= 0, "reward.max_resends", f"must be >= 0, got {reward.max_resends}", "e.g. 2")
    _check(reward.timeout_s > 0, "reward.timeout_s", "every reward call needs a positive deadline", "e.g. 120")
    _check(
        reward.on_failure in ("mask", "raise"),
        "reward.on_failure",
        f"unknown policy {reward.on_failure!r}",
        "use mask (default) or raise",
    )
    _check(
        0.0 <= reward.max_failure_ratio <= 1.0,
        "reward.max_failure_ratio",
        f"must be in [0, 1], got {reward.max_failure_ratio}",
        "e.g. 0.25",
    )
    _check_reward_functions(reward, modality)

    rm = reward.reward_model
    if rm.enable_resource_pool:
        size = reward_pool_size(cfg)
        _check(
            size >= 1,
            "reward.reward_model.n_gpus_per_node",
            f"a dedicated reward pool of n_gpus_per_node x nnodes = {size} devices cannot host a worker",
            "give the pool devices (e.g. reward.reward_model.n_gpus_per_node=1) "
            "or set reward.reward_model.enable_resource_pool=False",
        )
        tp = rm.rollout.tensor_model_parallel_size
        _check(
            size % tp == 0,
            "reward.reward_model.rollout.tensor_model_parallel_size",
            f"TP={tp} does not divide the reward pool of {size} devices",
            "choose a divisor of the pool size",
        )
        _check(
            reward.num_workers <= size,
            "reward.num_workers",
            f"{reward.num_workers} workers do not fit a reward pool of {size} devices",
            "usually reward.num_workers = n_gpus_per_node x nnodes / tensor_model_parallel_size",
        )
    if rm.enable:
        _check(
            rm.model_path is not None,
            "reward.reward_model.model_path",
            "reward model enabled without a model",
            "set reward.reward_model.model_path (a local dir, or tiny:qwen2_vl on CPU)",
        )
    _check(
        rm.rollout.name in ("transformers", "vllm"),
        "reward.reward_model.rollout.name",
        f"unknown engine {rm.rollout.name!r}",
        "use transformers or vllm",
    )
    if rm.enable and rm.rollout.name == "vllm":
        _check(
            bool(rm.enable_resource_pool),
            "reward.reward_model.enable_resource_pool",
            "vLLM judge servers run on the dedicated reward pool",
            "set reward.reward_model.enable_resource_pool=True",
        )
        tp = rm.rollout.tensor_model_parallel_size
        _check(
            tp >= 1 and rm.n_gpus_per_node % tp == 0,
            "reward.reward_model.rollout.tensor_model_parallel_size",
            f"a TP={tp} vLLM server must fit on one node of {rm.n_gpus_per_node} reward devices",
            "choose a divisor of reward.reward_model.n_gpus_per_node",
        )
    _check(
        0.0 < rm.rollout.gpu_memory_utilization <= 1.0,
        "reward.reward_model.rollout.gpu_memory_utilization",
        f"must be in (0, 1], got {rm.rollout.gpu_memory_utilization}",
        "e.g. 0.5",
    )
    _check(
        reward.reward_manager.name in ("naive", "MultiVisualRewardManager"),
        "reward.reward_manager.name",
        f"unknown reward manager {reward.reward_manager.name!r}",
        "use naive (one reward function) or MultiVisualRewardManager (weighted reward.reward_functions)",
    )
    if reward.reward_manager.name == "MultiVisualRewardManager":
        _check(
            len(reward.reward_functions) > 0,
            "reward.reward_functions",
            "MultiVisualRewardManager combines several weighted reward functions, but none is configured",
            "add reward.reward_functions.<key>={path,name,weight} entries (or use reward_manager.name=naive)",
        )

    _check(cfg.algorithm.adv_std_eps >= 0, "algorithm.adv_std_eps", "must be >= 0", "flow_grpo uses 1e-4")
    _check(
        cfg.algorithm.adv_estimator == "grpo",
        "algorithm.adv_estimator",
        f"{cfg.algorithm.adv_estimator!r} is not supported by FlowGRPO",
        "use grpo",
    )
    _check_rollout_correction(cfg)
    a = cfg.async_reward
    if a.one_step_off_policy or a.update_pipeline:
        key = "async_reward.one_step_off_policy" if a.one_step_off_policy else "async_reward.update_pipeline"
        _check(
            bool(cfg.algorithm.rollout_correction.bypass_mode),
            "algorithm.rollout_correction.bypass_mode",
            f"{key}=true trains with weights newer than the ones the batch was (partly) scored for, so pi_old "
            "must be the rollout's log-probs",
            "set algorithm.rollout_correction.bypass_mode=true",
        )
    if a.update_pipeline:
        _check(
            not cfg.algorithm.global_std,
            "algorithm.global_std",
            "the mini-batch pipeline computes advantages per group as groups complete; a batch-wide std "
            "would need the whole batch first",
            "set algorithm.global_std=false (or async_reward.update_pipeline=false)",
        )
        _check(
            streaming_enabled(cfg),
            "async_reward.update_pipeline",
            "needs streamed rewards (groups complete one by one); with reward.streaming=false the whole batch "
            "is scored at once",
            "set reward.streaming=auto (or true)",
        )
    _check_fully_async(cfg)
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
    _check_layout(cfg)
    _check_mini_batch_feeds_ranks(cfg)
    _check_weight_sync(cfg)
    if layout(cfg) != "disaggregated":
        _check(
            rollout.agent.num_workers <= cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes,
            "actor_rollout_ref.rollout.agent.num_workers",
            f"{rollout.agent.num_workers} rollout replicas do not fit "
            f"{cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes} actor/rollout devices",
            "lower it or raise trainer.n_gpus_per_node",
        )
    _check_long_tail(cfg)
    return cfg


def _check_rollout_correction(cfg: DictConfig) -> None:
    """verl's ``algorithm.rollout_correction`` keys, in its decoupled mode (the only one where they change the loss
    here: in bypass mode pi_old is the rollout's log-prob and the ratio they are computed on is 1)."""
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
    if rc.rollout_is is None and rc.rollout_rs is None:
        return
    on = f"{key}.rollout_is" if rc.rollout_is is not None else f"{key}.rollout_rs"
    _check(
        not rc.bypass_mode,
        on,
        "corrects between pi_old recomputed by the trainer and the rollout's log-probs "
        "(verl's decoupled mode); with bypass_mode=true pi_old is the rollout's log-prob and every weight is 1",
        f"set {key}.bypass_mode=false (pi_old recomputed: one more forward per batch), or drop {on}",
    )
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


def _check_fully_async(cfg: DictConfig) -> None:
    """``async_reward.fully_async`` and verl's ``async_training.*`` / verl v1's ``trainer.v1.sampler.*`` keys."""
    a, at, sampler = cfg.async_reward, cfg.async_training, cfg.trainer.v1.sampler
    threshold = sampler.max_off_policy_threshold
    _check(
        sampler.max_off_policy_strategy in ("drop", "wait"),
        "trainer.v1.sampler.max_off_policy_strategy",
        f"unknown strategy {sampler.max_off_policy_strategy!r}",
        "use drop or wait (verl v1's values)",
    )
    if not a.fully_async:
        _check(
            threshold is None,
            "trainer.v1.sampler.max_off_policy_threshold",
            "bounds the versions a sample may span in fully async training, which is off",
            "set async_reward.fully_async=true (or trainer.v1.trainer_mode=separate_async), or drop the key",
        )
        return
    key = "async_reward.fully_async"
    for other in ("one_step_off_policy", "update_pipeline"):
        _check(
            not a[other],
            key,
            f"fully async training is its own mode; async_reward.{other}=true is another "
            "(fully async already trains each update as soon as its groups are scored)",
            f"set async_reward.{other}=false",
        )
    _check(
        layout(cfg) != "hybrid",
        key,
        "the rollouter generates while the trainer updates, so the rollout needs devices (or a copy of the "
        "weights) of its own; in the hybrid layout one process per device does both",
        "add a rollout pool: actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=N "
        "(agent.num_workers=N), or actor_rollout_ref.hybrid_engine=false",
    )
    _check(
        streaming_enabled(cfg),
        "reward.streaming",
        "fully async training scores each sample as it is generated",
        "set reward.streaming=auto (or true)",
    )
    rc = cfg.algorithm.rollout_correction
    _check(
        bool(rc.bypass_mode) or rc.rollout_is is not None,
        "algorithm.rollout_correction.bypass_mode",
        f"{key}=true trains on samples of older weights: pi_old must be the rollout's log-probs (verl's "
        "use_rollout_log_probs), or, recomputed (decoupled mode), corrected by importance weights to the rollout's",
        "set algorithm.rollout_correction.bypass_mode=true, or keep it false and set "
        "algorithm.rollout_correction.rollout_is=token (or sequence)",
    )
    _check(
        not cfg.algorithm.global_std,
        "algorithm.global_std",
        "fully async training takes groups as they complete; a batch-wide std would mix updates",
        "set it false",
    )
    _check(
        at.staleness_threshold >= 0,
        "async_training.staleness_threshold",
        f"must be >= 0, got {at.staleness_threshold}",
        "0 (synchronous), or e.g. 0.5 / 1",
    )
    _check(
        at.require_batches >= 1,
        "async_training.require_batches",
        f"must be >= 1, got {at.require_batches}",
        "verl's default 1",
    )
    k = at.trigger_parameter_sync_step
    _check(
        k is None or k >= 1,
        "async_training.trigger_parameter_sync_step",
        f"must be >= 1, got {k}",
        "e.g. 1 (a sync after every update), or null",
    )
    _check(
        cfg.rollout.total_rollout_steps is None or cfg.rollout.total_rollout_steps >= groups_per_update(cfg),
        "rollout.total_rollout_steps",
        f"{cfg.rollout.total_rollout_steps} prompts is less than one update of "
        f"require_batches x ppo_mini_batch_size = {groups_per_update(cfg)}",
        "raise it (verl counts prompts)",
    )
    if threshold is not None:
        _check(
            threshold >= sync_period_steps(cfg),
            "trainer.v1.sampler.max_off_policy_threshold",
            f"{threshold} versions is less than the {sync_period_steps(cfg)} updates between two weight syncs, "
            "which all train on the same version",
            f"set it >= {sync_period_steps(cfg)} "
            "(async_training.trigger_parameter_sync_step), or lower the sync period",
        )
    _check(
        not (interrupts_at_sync(cfg) and cfg.actor_rollout_ref.rollout.name == "vllm"),
        "async_training.partial_rollout",
        "continuing a text response across a weight sync is implemented for the transformers rollout only (a vLLM "
        "server's requests would have to be aborted and resubmitted with their tokens)",
        "set async_training.partial_rollout=false (a response in flight then finishes under the weights that started "
        "it), or actor_rollout_ref.rollout.name=transformers",
    )


# ---- the layout and its upstream spellings ----------------------------------------------------------------------
def layout(cfg: DictConfig) -> str:
    """``disaggregated`` (a rollout pool: ``actor_rollout_ref.rollout.nnodes`` > 0), else ``hybrid``
    (``hybrid_engine=True``, the default) or ``split``."""
    if int(cfg.actor_rollout_ref.rollout.nnodes) > 0:
        return "disaggregated"
    return "hybrid" if cfg.actor_rollout_ref.hybrid_engine else "split"


def sync_period_steps(cfg: DictConfig) -> int:
    """Steps between two weight syncs to the rollout pool: ``async_training.trigger_parameter_sync_step`` local
    updates of ``ppo_mini_batch_size`` prompts each (verl's meaning), counted in steps of ``data.train_batch_size``
    prompts; ``null`` = 1 (every step). Call after :func:`validate` (it checks the division)."""
    k = cfg.async_training.trigger_parameter_sync_step
    if k is None:
        return 1
    if cfg.async_reward.fully_async:  # a fully async step is one local update (of require_batches mini-batches)
        return int(k)
    return int(k) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) // int(cfg.data.train_batch_size)


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
    t = cfg.trainer
    mode = t.v1.trainer_mode
    if mode is None:
        return
    _check(
        t.use_v1 is not False,
        "trainer.v1.trainer_mode",
        f"trainer.use_v1=false selects verl's legacy trainer, which has no trainer_mode ({mode!r} given)",
        "drop trainer.v1.trainer_mode, or set trainer.use_v1=true",
    )
    _check(
        mode in ("sync", "colocate_async", "separate_async"),
        "trainer.v1.trainer_mode",
        f"unknown mode {mode!r}",
        "use sync or separate_async (or leave it null and use this project's keys)",
    )
    _check(
        mode != "colocate_async",
        "trainer.v1.trainer_mode",
        "colocate_async generates and trains on the same devices, aborting the rollouts in flight at each weight "
        "update and resuming them after; here a response is continued across versions only by fully async "
        "training on a rollout pool (separate_async, async_training.partial_rollout for text)",
        "the nearest mode: async_reward.one_step_off_policy=true on the hybrid layout (trainer.v1.trainer_mode=null)",
    )
    one_step_off = cfg.async_reward.one_step_off_policy
    if mode == "sync":
        for key in ("one_step_off_policy", "fully_async"):
            _check(
                not cfg.async_reward[key],
                "trainer.v1.trainer_mode",
                f"sync trains on-policy but async_reward.{key}=true asks for off-policy training",
                "drop one of them (separate_async is fully async training on a rollout pool)",
            )
        return
    _check(
        int(r.nnodes) > 0,
        "trainer.v1.trainer_mode",
        "separate_async runs rollout on its own devices, but there is no rollout pool (nnodes=0)",
        "set actor_rollout_ref.rollout.nnodes=1 and actor_rollout_ref.rollout.n_gpus_per_node=N",
    )
    _check(
        not one_step_off,
        "trainer.v1.trainer_mode",
        "separate_async is fully async training here (a rollouter that never stops, versions bounded by "
        "trainer.v1.sampler.max_off_policy_threshold), but async_reward.one_step_off_policy=true asks for lock-step "
        "one-step-off",
        "drop async_reward.one_step_off_policy=true (or trainer.v1.trainer_mode)",
    )
    cfg.async_reward.fully_async = True


def _check_weight_sync(cfg: DictConfig) -> None:
    """``checkpoint_engine`` and the sync period: what each layout can move, and how often."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    r, ce = arr.rollout, arr.rollout.checkpoint_engine
    lay = layout(cfg)
    _check(
        ce.backend in ("naive", "nccl"),
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        f"{ce.backend!r} is not implemented here (verl's nixl / hccl / mooncake engines)",
        "use nccl (a torch.distributed group: NCCL on CUDA, gloo on CPU) or naive",
    )
    _check(
        ce.update_weights_bucket_megabytes >= 1,
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "must be >= 1",
        "verl's default is 2048",
    )
    if lay != "disaggregated":
        _check(
            ce.backend == "naive",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            f"nccl sends weights to a rollout pool; the {lay} layout has none (rollout.nnodes=0)",
            "set actor_rollout_ref.rollout.nnodes=1 (and n_gpus_per_node), or backend=naive",
        )
    else:
        _check(
            ce.backend == "nccl" or arr.model.lora_rank > 0,
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            "naive ships weights through Ray's object store: fine for a LoRA adapter, not for a full fine-tune's "
            "weights (lora_rank=0)",
            "set actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        )
        _check(
            ce.backend == "naive" or r.name == "transformers",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            f"nccl loads weights into in-process rollout workers; rollout.name={r.name} serves from its own "
            "server (it takes LoRA adapters)",
            "set actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        )
    k = cfg.async_training.trigger_parameter_sync_step
    if k is None or cfg.async_reward.fully_async:  # fully async: any count of updates (_check_fully_async)
        return
    key = "async_training.trigger_parameter_sync_step"
    mb, tbs = int(arr.actor.ppo_mini_batch_size), int(data.train_batch_size)
    _check(
        k >= 1 and (k * mb) % tbs == 0,
        key,
        f"{k} local updates of ppo_mini_batch_size={mb} prompts is not a whole number of steps of "
        f"data.train_batch_size={tbs} prompts (weights move between steps)",
        f"use a multiple of {tbs // mb} (= train_batch_size / ppo_mini_batch_size: every step), or null",
    )
    if k * mb // tbs > 1:
        _check(
            lay == "disaggregated",
            key,
            f"a sync period of {k * mb // tbs} steps needs a rollout pool that keeps "
            f"older weights; in the {lay} layout the rollout reads the trained weights",
            "set actor_rollout_ref.rollout.nnodes=1, or leave the key null (every step)",
        )
        _check(
            bool(cfg.algorithm.rollout_correction.bypass_mode),
            "algorithm.rollout_correction.bypass_mode",
            f"{key}={k} trains on samples of older weights, so pi_old must be the rollout's log-probs",
            "set algorithm.rollout_correction.bypass_mode=true",
        )


def _check_long_tail(cfg: DictConfig) -> None:
    r = cfg.actor_rollout_ref.rollout
    alpha = r.response_length_pareto_alpha
    if alpha is None:
        return
    _check(
        cfg.actor_rollout_ref.model.modality == "text" and r.name == "transformers",
        "actor_rollout_ref.rollout.response_length_pareto_alpha",
        "a per-response length budget is a text-rollout setting of the in-process (transformers) policy",
        "set it to null",
    )
    _check(
        alpha > 0,
        "actor_rollout_ref.rollout.response_length_pareto_alpha",
        f"must be > 0, got {alpha}",
        "e.g. 1.2 (or null: no budget)",
    )


def _check_mini_batch_feeds_ranks(cfg: DictConfig) -> None:
    """Every actor rank trains on every mini-batch. A rank takes whole ``uid`` groups (``trainer.data_parallel``), so
    a mini-batch of fewer groups than ranks leaves ranks with a zero-weight padding row in every update: devices
    held and idle. verl keeps the same meaning of the key (prompts; x ``rollout.n`` samples per mini-batch) and
    requires those samples to divide over the ranks; here the unit that divides is the group."""
    ranks, mb, batch = actor_ranks(cfg), cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    fits = [m for m in range(ranks, batch + 1, ranks) if batch % m == 0]
    fix = (
        f"set actor_rollout_ref.actor.ppo_mini_batch_size={fits[0]} (a multiple of the {ranks} ranks that "
        f"divides data.train_batch_size={batch})"
        if fits
        else f"raise data.train_batch_size to a multiple of {ranks} and set ppo_mini_batch_size to a multiple of "
        f"{ranks} that divides it"
    )
    _check(
        mb >= ranks,
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        f"{mb} prompts per mini-batch = {mb} groups for {ranks} actor ranks (trainer.n_gpus_per_node x nnodes); "
        f"groups are never split, so {ranks - mb} rank(s) would train on padding rows in every update",
        f"{fix}, or use fewer actor ranks",
    )


def _check_layout(cfg: DictConfig) -> None:
    """The hybrid layout (one process per device trains and generates) and the disaggregated one (a rollout pool)
    have their own rules."""
    arr, a = cfg.actor_rollout_ref, cfg.async_reward
    r = arr.rollout
    _check(
        r.nnodes >= 0,
        "actor_rollout_ref.rollout.nnodes",
        f"must be >= 0, got {r.nnodes}",
        "0 (no rollout pool) or the rollout pool's node count",
    )
    if layout(cfg) == "disaggregated":
        _check(
            r.n_gpus_per_node is None or r.n_gpus_per_node >= 1,
            "actor_rollout_ref.rollout.n_gpus_per_node",
            f"a rollout pool needs devices, got {r.n_gpus_per_node}",
            "e.g. 1",
        )
        devices = rollout_pool_size(cfg)
        _check(
            r.agent.num_workers == devices,
            "actor_rollout_ref.rollout.agent.num_workers",
            f"the disaggregated layout has one rollout worker per rollout device ({devices}), got "
            f"{r.agent.num_workers}",
            f"set it to {devices} (actor_rollout_ref.rollout.n_gpus_per_node x nnodes)",
        )
        return
    if not arr.hybrid_engine:
        return
    devices = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    workers = arr.rollout.agent.num_workers
    _check(
        workers == devices,
        "actor_rollout_ref.rollout.agent.num_workers",
        f"the hybrid layout has one rollout worker per actor device ({devices}), got {workers}",
        f"set it to {devices} (trainer.n_gpus_per_node x nnodes), or actor_rollout_ref.hybrid_engine=False for "
        "rollout replicas separate from the actor",
    )
    _check(
        arr.rollout.name == "transformers",
        "actor_rollout_ref.hybrid_engine",
        f"rollout.name={arr.rollout.name} generates in its own server process, not in the actor",
        "set actor_rollout_ref.hybrid_engine=False",
    )
    if (a.one_step_off_policy or a.update_pipeline) and arr.model.lora_rank == 0:
        key = "async_reward.one_step_off_policy" if a.one_step_off_policy else "async_reward.update_pipeline"
        _check(
            False,
            "actor_rollout_ref.hybrid_engine",
            f"{key}=true runs updates while the rollout generates; with a full fine-tune (lora_rank=0) in the "
            "hybrid layout the rollout would read weights the update is changing in place (wrong pi_old), and "
            "only a LoRA adapter is cheap to snapshot on the device",
            "set actor_rollout_ref.hybrid_engine=False (rollout replicas on their own copy), a rollout pool "
            "(actor_rollout_ref.rollout.nnodes=1), or lora_rank > 0",
        )


def _check_verl_keys(cfg: DictConfig) -> None:
    """verl / verl-omni keys that this project implements only in some values: anything else is refused here,
    naming the key and what this project uses instead (no key is accepted and then ignored)."""
    arr, data, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    rollout, actor, judge = arr.rollout, arr.actor, cfg.reward.reward_model.rollout
    algorithm = {"image": "flow_grpo", "text": "grpo"}[arr.model.modality]
    _check(
        arr.model.algorithm == algorithm,
        "actor_rollout_ref.model.algorithm",
        f"{arr.model.algorithm!r} is not implemented for model.modality={arr.model.modality}",
        f"use {algorithm} (verl-omni's other diffusion algorithms are not part of this project)",
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
    _check(
        not (rollout.layered_summon and arr.model.lora_rank == 0),
        "actor_rollout_ref.rollout.layered_summon",
        "a full fine-tune's weight sync sends the transformer's state in one piece; layer-by-layer gathering is "
        "not implemented (with LoRA a sync moves only the adapter, which is what layered summon saves)",
        "set actor_rollout_ref.rollout.layered_summon=False, or train LoRA (model.lora_rank > 0)",
    )
    ref_mb = arr.ref.log_prob_micro_batch_size_per_gpu
    actor_mb = actor.ppo_micro_batch_size_per_gpu or actor.ppo_mini_batch_size * rollout.n
    _check(
        ref_mb is None or ref_mb >= actor_mb,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        f"the reference (adapter-off) forward runs inside each actor micro-batch of {actor_mb} samples, so its "
        f"batch cannot be limited to {ref_mb}",
        "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (it bounds both), or set this key >= it (or null)",
    )
    _check(
        not judge.free_cache_engine,
        "reward.reward_model.rollout.free_cache_engine",
        "the vLLM judge servers own the reward pool's devices, nothing else runs there between steps, so their "
        "KV cache stays resident (vLLM sleep mode is not used)",
        "set it to False",
    )
    _check_validation(cfg)
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
    steps = v.pipeline.num_inference_steps or rollout.num_inference_steps
    _check(steps >= 1, "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps", "must be >= 1", "e.g. 50")
    h, w = v.pipeline.height or rollout.height, v.pipeline.width or rollout.width
    _check(
        h % 16 == 0 and w % 16 == 0,
        "actor_rollout_ref.rollout.val_kwargs.pipeline.height/width",
        f"{h}x{w} is not a multiple of 16",
        "use e.g. 64x64 or 512x512",
    )
    _check(v.algo.noise_level >= 0, "actor_rollout_ref.rollout.val_kwargs.algo.noise_level", "must be >= 0", "0.0")
    if v.algo.noise_level > 0:
        size, hi = rollout.algo.sde_window_size, int(rollout.algo.sde_window_range[1])
        _check(
            hi <= steps,
            "actor_rollout_ref.rollout.val_kwargs.algo.noise_level",
            f"validation SDE noise runs on a window of algo.sde_window_size={size} steps within "
            f"algo.sde_window_range, which passes the {steps} validation steps",
            "raise val_kwargs.pipeline.num_inference_steps, or set val_kwargs.algo.noise_level=0.0 (ODE)",
        )
