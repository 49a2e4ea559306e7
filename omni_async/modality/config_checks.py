"""The model and rollout sections' checks (``actor_rollout_ref.model.modality``, ``actor_rollout_ref.rollout.*``):
what each modality can generate with, run by ``trainer.config.validate`` at start; each error names the key and the
fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from omni_async.config_error import check as _check

if TYPE_CHECKING:
    from omni_async.algos.loss_modes import LossMode


def check_rollout(cfg: DictConfig) -> None:
    """The modality, the rollout engine, text sampling, the SDE window and the image size."""
    from omni_async.algos.sde import SDE_TYPES

    arr = cfg.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor
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
        algo.sde_type in SDE_TYPES,
        "actor_rollout_ref.rollout.algo.sde_type",
        f"unknown SDE type {algo.sde_type!r}",
        f"use one of {', '.join(SDE_TYPES)} (dance_sde: DanceGRPO's step, algos.dance_grpo)",
    )
    _check(
        algo.cps_log_prob in ("flow_grpo", "gaussian"),
        "actor_rollout_ref.rollout.algo.cps_log_prob",
        f"unknown form {algo.cps_log_prob!r}",
        "use flow_grpo (the references' form) or gaussian",
    )
    _check(algo.noise_level >= 0, "actor_rollout_ref.rollout.algo.noise_level", "must be >= 0", "e.g. 0.7")
    steps = rollout.pipeline.num_inference_steps
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
        rollout.pipeline.height % 16 == 0 and rollout.pipeline.width % 16 == 0,
        "actor_rollout_ref.rollout.pipeline.height/width",
        f"{rollout.pipeline.height}x{rollout.pipeline.width} is not a multiple of 16 (VAE factor 8 x patch 2)",
        "use e.g. 64x64 on CPU, 512x512 or 1024x1024 on GPUs",
    )
    for key in ("window_batch_size", "window_text_bucket"):
        value = rollout.pipeline[key]
        _check(value is None or value >= 1, f"actor_rollout_ref.rollout.pipeline.{key}", "must be >= 1", "e.g. 4 / 64")
    _check_long_tail(cfg)
    _check_transformer_options(cfg)


def _check_transformer_options(cfg: DictConfig) -> None:
    """verl-omni's ``model.attn_backend`` and verl's ``actor.use_torch_compile`` (``models.acceleration``): diffusion
    transformers only; a backend diffusers knows and whose package is installed; compilation not under FSDP2."""
    from omni_async.models.acceleration import NATIVE, backend_problem

    arr = cfg.actor_rollout_ref
    name, compiled = arr.model.attn_backend, arr.actor.use_torch_compile
    if arr.model.modality == "text":
        _check(
            name == NATIVE and not compiled,
            "actor_rollout_ref.model.attn_backend" if name != NATIVE else "actor_rollout_ref.actor.use_torch_compile",
            "diffusers' attention backends and the transformer's regional compilation are diffusion settings; the "
            "text policy runs transformers' own attention, uncompiled",
            f"drop it (attn_backend={NATIVE}, use_torch_compile=false)",
        )
        return
    problem = backend_problem(str(name))
    _check(problem is None, f"actor_rollout_ref.model.attn_backend={name}", *(problem or ("", "")))
    ranks = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    _check(
        not (compiled and arr.model.lora_rank == 0 and ranks > 1),
        "actor_rollout_ref.actor.use_torch_compile",
        f"a full fine-tune over {ranks} actor ranks shards each block with FSDP2, and compiled blocks under FSDP2 are "
        "not built or tested here",
        "train LoRA (actor_rollout_ref.model.lora_rank > 0), use one actor rank, or set it to false",
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


# verl-omni's values of the keys that choose the diffusion training path, per data path (algos.loss_modes).
_NFT_VALUES = {
    "actor_rollout_ref.model.model_type": "diffusion_nft_model",
    "actor_rollout_ref.model.policy_state_adapters": ["default", "old"],
    "actor_rollout_ref.rollout.rollout_adapter": "old",
    "algorithm.trainer_type": "direct_preference",
}
_WINDOW_VALUES = {
    "actor_rollout_ref.model.model_type": "diffusion_model",
    "actor_rollout_ref.model.policy_state_adapters": ["default"],
    "actor_rollout_ref.rollout.rollout_adapter": "default",
    "algorithm.trainer_type": "policy_gradient",
}
_DPO_VALUES = {
    "actor_rollout_ref.model.model_type": "diffusion_dpo_model",
    "actor_rollout_ref.model.policy_state_adapters": ["default"],
    "actor_rollout_ref.rollout.rollout_adapter": "default",
    "algorithm.trainer_type": "direct_preference",
    "algorithm.paired_preference": True,
}


def check_distillation(cfg: DictConfig, teacher_loss: bool) -> None:
    """DiffusionOPD's switches (verl-omni's ``validate_distillation_config``): ``distillation.enabled`` exactly with a
    loss that reads the teacher (``distill_kl``), and the teacher's checkpoint given (its one ``teacher_model``
    entry; another entry is an unknown key when the config is composed)."""
    d = cfg.distillation
    loss_key = "actor_rollout_ref.actor.diffusion_loss.loss_mode"
    _check(
        bool(d.enabled) or not teacher_loss,
        loss_key,
        f"{cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode} trains toward a frozen teacher, and none is configured",
        "set distillation.enabled=true and distillation.teacher_models.teacher_model.model_path=<teacher checkpoint>",
    )
    _check(
        teacher_loss or not d.enabled,
        "distillation.enabled",
        "a teacher is configured but no loss reads it",
        f"set {loss_key}=distill_kl, or distillation.enabled=false",
    )
    _check(
        not d.enabled or d.teacher_models.teacher_model.model_path is not None,
        "distillation.teacher_models.teacher_model.model_path",
        "the frozen teacher's checkpoint is not given",
        "set it to a full pipeline checkpoint of the student's family (a tiny:<name> on CPU)",
    )


def check_loss(cfg: DictConfig) -> None:
    """The diffusion loss (``actor_rollout_ref.actor.diffusion_loss.*``, verl-omni's ``DiffusionLossConfig``), the
    algorithm and the keys verl-omni pairs with it (``model.model_type``, ``policy_state_adapters``,
    ``rollout.rollout_adapter``, ``rollout.calculate_log_probs``, ``algorithm.trainer_type`` / ``sample_source``),
    and DiffusionNFT's / AWM's / Diffusion-DPO's own keys (``algos.diffusion_nft``, ``algos.awm``, ``algos.dpo``).
    Text keeps verl's ``actor.clip_ratio`` and ``algorithm.adv_clip_max``. One check per part, in this order: the
    loss mode, the keys paired with it, the values' ranges, then the loss's own keys."""
    if cfg.actor_rollout_ref.model.modality == "text":
        _check_text_loss(cfg)
        return
    mode = _check_loss_mode(cfg)
    _check_loss_pairing(cfg, mode)
    _check_loss_values(cfg, mode.name)
    if mode.name == "awm":
        _check_awm(cfg)
    if mode.final_latents:
        _check_final_latents(cfg, mode.name)


def _check_text_loss(cfg: DictConfig) -> None:
    """Text GRPO: verl's PPO clip and engine type; no distillation."""
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    _check(
        not cfg.distillation.enabled,
        "distillation.enabled",
        "DiffusionOPD distills a diffusion student (its SDE window); a causal LM has no teacher path here",
        "drop distillation.* (set distillation.enabled=false)",
    )
    _check(
        actor.clip_ratio is not None,
        "actor_rollout_ref.actor.clip_ratio",
        "text GRPO's PPO clip (verl's key) is not set",
        "set actor_rollout_ref.actor.clip_ratio=0.2 (--config-name grpo_text_trainer sets it)",
    )
    _check(
        arr.model.model_type == "language_model",
        "actor_rollout_ref.model.model_type",
        f"{arr.model.model_type!r} is a diffusion engine; a causal LM trains as language_model",
        "set actor_rollout_ref.model.model_type=language_model",
    )


def _check_loss_mode(cfg: DictConfig) -> LossMode:
    """The algorithm and the loss mode (``loss_mode`` follows ``model.algorithm``): built, of that algorithm, with
    its SDE type and teacher; the clip keys read from verl-omni's diffusion_loss section. Returns the loss mode."""
    from omni_async.algos.loss_modes import (
        DISTILL_LOSS_MODES,
        LOSS_MODES,
        PLANNED_ALGORITHMS,
        PLANNED_ISSUE,
        SAMPLING_ALGORITHMS,
        loss_algorithm,
    )

    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    actor, dl = arr.actor, arr.actor.diffusion_loss
    _check(
        actor.clip_ratio is None,
        "actor_rollout_ref.actor.clip_ratio",
        "diffusion losses read their clip from verl-omni's diffusion_loss section",
        f"set actor_rollout_ref.actor.diffusion_loss.clip_ratio={actor.clip_ratio} instead",
    )
    _check(
        algo.adv_clip_max is None,
        "algorithm.adv_clip_max",
        "diffusion losses clip advantages with verl-omni's diffusion_loss.adv_clip_max (text GRPO reads this key)",
        f"set actor_rollout_ref.actor.diffusion_loss.adv_clip_max={algo.adv_clip_max} instead",
    )
    name, algorithm = dl.loss_mode, arr.model.algorithm
    built = [m for m, v in LOSS_MODES.items() if v.built]
    algorithms = sorted({LOSS_MODES[m].algorithm for m in built} | set(SAMPLING_ALGORITHMS))
    if algorithm in PLANNED_ALGORITHMS:  # first: loss_mode follows the algorithm when not given
        instead = PLANNED_ALGORITHMS[algorithm]
        _check(
            False,
            "actor_rollout_ref.model.algorithm",
            f"{algorithm} is not built ({PLANNED_ISSUE}); {_instead_why(instead)}",
            f"set actor_rollout_ref.model.algorithm={instead} (loss_mode follows it)",
        )
    _check(
        algorithm in algorithms,
        "actor_rollout_ref.model.algorithm",
        f"{algorithm!r} is not a diffusion algorithm of this project",
        f"use one of {', '.join(algorithms)} (text GRPO: --config-name grpo_text_trainer)",
    )
    base = loss_algorithm(algorithm)
    if algorithm == "mix_grpo":
        from omni_async.algos.mix_grpo import SAMPLE_STRATEGIES

        ra = arr.rollout.algo
        _check(
            ra.sample_strategy in SAMPLE_STRATEGIES,
            "actor_rollout_ref.rollout.algo.sample_strategy",
            f"unknown MixGRPO window schedule {ra.sample_strategy!r}",
            f"use one of {', '.join(SAMPLE_STRATEGIES)}",
        )
        _check(ra.iters_per_group >= 1, "actor_rollout_ref.rollout.algo.iters_per_group", "must be >= 1", "e.g. 1")
    _check(  # loss_mode followed a sampling-only algorithm (verl-omni's interpolation): it has no loss of its own
        name not in SAMPLING_ALGORITHMS,
        "actor_rollout_ref.actor.diffusion_loss.loss_mode",
        f"{name} changes where the SDE window sits, not the loss (verl-omni's recipe pins the loss)",
        f"set actor_rollout_ref.actor.diffusion_loss.loss_mode={SAMPLING_ALGORITHMS.get(name, base)}",
    )
    _check(
        name not in DISTILL_LOSS_MODES,
        "actor_rollout_ref.actor.diffusion_loss.loss_mode",
        f"{name} trains toward a teacher's flow predictions, which no teacher here produces (verl-omni refuses it on "
        "its policy-gradient path too: its teacher returns step means)",
        "set actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl (the student's step toward the teacher's)",
    )
    _check(
        name in LOSS_MODES,
        "actor_rollout_ref.actor.diffusion_loss.loss_mode",
        f"unknown loss mode {name!r} (verl-omni's modes: {', '.join(LOSS_MODES)})",
        f"use one of {', '.join(built)}",
    )
    mode = LOSS_MODES[name]
    if not mode.built:
        _check(
            False,
            "actor_rollout_ref.actor.diffusion_loss.loss_mode",
            f"{name} is not built ({PLANNED_ISSUE}); {_instead_why(mode.instead)}",
            f"set actor_rollout_ref.actor.diffusion_loss.loss_mode={mode.instead} and "
            f"actor_rollout_ref.model.algorithm={LOSS_MODES[mode.instead].algorithm}",
        )
    _check(
        mode.algorithm == base,
        "actor_rollout_ref.actor.diffusion_loss.loss_mode",
        f"{name} runs under actor_rollout_ref.model.algorithm={mode.algorithm}, not {algorithm}",
        f"set actor_rollout_ref.model.algorithm={mode.algorithm} (loss_mode follows it when not given)",
    )
    sde_type = arr.rollout.algo.sde_type
    _check(  # GRPO-Guard's ratio scale and Flow-DPPO's KL read std_dev_t * sqrt_dt as the step's std
        not (mode.old_means and sde_type != "sde"),
        "actor_rollout_ref.rollout.algo.sde_type",
        f"{sde_type} does not fit loss_mode={name}: its scale std_dev_t * sqrt_dt is the transition's std (and the "
        "log-prob its Gaussian density) only under sde (verl-omni's recipe sets sde)",
        "set actor_rollout_ref.rollout.algo.sde_type=sde",
    )
    check_distillation(cfg, mode.teacher)
    return mode


def _check_loss_pairing(cfg: DictConfig, mode: LossMode) -> None:
    """The keys verl-omni pairs with the loss mode: the steps it trains, its adapters and trainer type, online or
    offline samples, pairs (Diffusion-DPO), and whether the rollout returns log-probs."""
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    dl = arr.actor.diffusion_loss
    name = mode.name
    final = mode.final_latents
    _check(  # DanceGRPO's own code trains a random timestep_fraction of the steps; verl-omni's trains its SDE window
        final or algo.timestep_fraction == 1.0,
        "algorithm.timestep_fraction",
        f"{algo.timestep_fraction} is DiffusionNFT's share of steps trained per sample; loss_mode={name} trains the "
        "rollout's SDE window (verl-omni's DanceGRPO too)",
        "leave it at 1.0 and set actor_rollout_ref.rollout.algo.sde_window_size (how many steps) / sde_window_range "
        "(where)",
    )
    for key, (want, why) in _paired_values(name, dl.old_kl_coef).items():
        value = OmegaConf.select(cfg, key)
        value = list(value) if OmegaConf.is_list(value) else value
        _check(
            value == want,
            key,
            f"{value!r} does not fit loss_mode={name} ({why} {want!r})",
            f"set {key}={want!r}".replace("'", '"') if isinstance(want, list) else f"set {key}={want}",
        )
    _check(
        algo.sample_source == "online" or (mode.preference_pairs and algo.sample_source == "offline"),
        "algorithm.sample_source",
        f"{algo.sample_source!r}: only Diffusion-DPO trains on offline data (pairs); {name} trains on samples it "
        "generates",
        "set algorithm.sample_source=online",
    )
    _check(
        bool(algo.paired_preference) == mode.preference_pairs,
        "algorithm.paired_preference",
        f"{algo.paired_preference} does not fit loss_mode={name}: only Diffusion-DPO (loss_mode=dpo) trains on pairs",
        f"set algorithm.paired_preference={str(mode.preference_pairs).lower()}",
    )
    if mode.preference_pairs:
        _check_dpo(cfg)
    logp = arr.rollout.calculate_log_probs
    _check(
        logp is None or bool(logp) != final,
        "actor_rollout_ref.rollout.calculate_log_probs",
        f"{name}'s rollout returns no log-probs (ODE sampling, final latents only)"
        if final
        else "FlowGRPO's rollout always returns the SDE window's log-probs (the SDE step's by-product)",
        f"set it to {str(not final).lower()}, or null (what the loss needs)",
    )


def _check_loss_values(cfg: DictConfig, name: str) -> None:
    """The diffusion loss's and DiffusionNFT's ``algorithm.*`` values in their ranges, and AWM's anchor term only
    with AWM."""
    from omni_async.algos.diffusion_nft import ADV_MODES, DECAY_SCHEDULES

    algo, dl = cfg.algorithm, cfg.actor_rollout_ref.actor.diffusion_loss
    positive = {"clip_ratio": dl.clip_ratio, "adv_clip_max": dl.adv_clip_max, "mix_beta": dl.mix_beta}
    positive |= {"adaptive_weight_min": dl.adaptive_weight_min, "dpo_beta": dl.dpo_beta}
    positive |= {"awm_ghuber_power": dl.awm_ghuber_power}
    for key, value in positive.items():
        _check(value > 0, f"actor_rollout_ref.actor.diffusion_loss.{key}", f"must be > 0, got {value}", "see README")
    nonnegative = {"ref_kl_coef": dl.ref_kl_coef, "kl_mask_threshold": dl.kl_mask_threshold}
    for key, value in (nonnegative | {"old_kl_coef": dl.old_kl_coef}).items():
        _check(value >= 0, f"actor_rollout_ref.actor.diffusion_loss.{key}", f"must be >= 0, got {value}", "e.g. 0")
    _check(
        isinstance(dl.add_kl_coefficient, bool),
        "actor_rollout_ref.actor.diffusion_loss.add_kl_coefficient",
        "must be true or false",
        "verl-omni's default is true",
    )
    _check(
        0 < algo.timestep_fraction <= 1,
        "algorithm.timestep_fraction",
        f"must be in (0, 1], got {algo.timestep_fraction}",
        "1.0 trains every rollout step (verl-omni's recipe)",
    )
    _check(
        algo.old_policy_decay_schedule in DECAY_SCHEDULES,
        "algorithm.old_policy_decay_schedule",
        f"unknown schedule {algo.old_policy_decay_schedule!r}",
        f"use one of {', '.join(DECAY_SCHEDULES)}",
    )
    _check(
        algo.old_policy_decay is None or 0 <= algo.old_policy_decay <= 1,
        "algorithm.old_policy_decay",
        f"must be in [0, 1], got {algo.old_policy_decay}",
        "e.g. 0.9, or null (the schedule's)",
    )
    _check(
        algo.old_policy_update_interval >= 1,
        "algorithm.old_policy_update_interval",
        f"must be >= 1, got {algo.old_policy_update_interval}",
        "e.g. 1 (after every step) or 2 (verl-omni's recipe)",
    )
    _check(
        algo.adv_mode in ADV_MODES,
        "algorithm.adv_mode",
        f"unknown mode {algo.adv_mode!r}",
        f"use one of {', '.join(ADV_MODES)}",
    )
    _check(
        dl.old_kl_coef == 0 or name == "awm",
        "actor_rollout_ref.actor.diffusion_loss.old_kl_coef",
        f"is AWM's pull toward its EMA anchor; loss_mode={name} has no such term",
        "set it to 0 (or loss_mode=awm)",
    )


def _check_dpo(cfg: DictConfig) -> None:
    """Diffusion-DPO's needs (``algos.dpo``): the frozen reference is the LoRA adapter switched off, and a
    micro-batch holds whole (chosen, rejected) pairs (verl-omni's rule: an even ``ppo_micro_batch_size_per_gpu``)."""
    arr = cfg.actor_rollout_ref
    _check(
        arr.model.lora_rank > 0,
        "actor_rollout_ref.model.lora_rank",
        "Diffusion-DPO's frozen reference is the model with its LoRA adapter off; a full fine-tune keeps no frozen copy",
        "train LoRA: actor_rollout_ref.model.lora_rank=32 (verl-omni's DPO recipes: 32 / 64)",
    )
    if cfg.algorithm.sample_source == "offline":  # no rollout: nothing generates beside the update
        _check(
            not cfg.async_reward.fully_async and int(arr.rollout.nnodes) == 0,
            "async_reward.fully_async" if cfg.async_reward.fully_async else "actor_rollout_ref.rollout.nnodes",
            "offline DPO has no rollout: no rollout pool, and nothing to train asynchronously with",
            "drop it (offline DPO trains on the actor ranks, step by step)",
        )
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    _check(
        micro is None or (int(micro) >= 2 and int(micro) % 2 == 0),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        f"{micro} would split a (chosen, rejected) pair across micro-batches",
        "give an even number >= 2 (or null: the whole mini-batch)",
    )


def _paired_values(name: str, old_kl_coef: float) -> dict[str, tuple[Any, str]]:
    """The keys that choose the training path -> (the value loss mode ``name`` takes, why) (``check_loss``)."""
    if name == "diffusion_nft":
        return {k: (v, "verl-omni pairs it with") for k, v in _NFT_VALUES.items()}
    if name == "dpo":
        return {k: (v, "verl-omni pairs it with") for k, v in _DPO_VALUES.items()}
    pairs = {k: (v, "verl-omni pairs it with") for k, v in _WINDOW_VALUES.items()}
    if name == "awm":  # verl-omni lists AWM among its direct-preference algorithms; it has no AWM engine
        anchored = old_kl_coef > 0
        adapters = ["default", "old"] if anchored else ["default"]
        pairs["algorithm.trainer_type"] = ("direct_preference", "verl-omni's trainer type of AWM is")
        pairs["actor_rollout_ref.model.policy_state_adapters"] = (
            adapters,
            f"diffusion_loss.old_kl_coef={old_kl_coef} {'needs the EMA anchor' if anchored else 'uses no anchor'}:",
        )
        pairs["actor_rollout_ref.rollout.rollout_adapter"] = ("default", "AWM samples with the current policy:")
    return pairs


def _instead_why(instead: str) -> str:
    """Why the built loss mode ``instead`` stands in for one not built (``LossMode.instead``)."""
    from omni_async.algos.loss_modes import LOSS_MODES, SDE_WINDOW

    if LOSS_MODES[instead].data_path == SDE_WINDOW:
        return f"verl-omni trains it with the {instead} loss (its clipped ratio on the SDE window)"
    return f"{instead} trains on the same final latents and group advantages"


def _check_awm(cfg: DictConfig) -> None:
    """AWM's own keys (``algos.awm``), and DiffusionNFT's keys that would change nothing under it."""
    from omni_async.algos.awm import WEIGHTINGS

    dl, algo = cfg.actor_rollout_ref.actor.diffusion_loss, cfg.algorithm
    _check(
        dl.awm_weighting in WEIGHTINGS,
        "actor_rollout_ref.actor.diffusion_loss.awm_weighting",
        f"unknown weighting {dl.awm_weighting!r}",
        f"use one of {', '.join(WEIGHTINGS)} (ghuber: the AWM recipes')",
    )
    _check(
        algo.adv_mode == "continuous",
        "algorithm.adv_mode",
        f"{algo.adv_mode!r} reshapes DiffusionNFT's optimality probability; AWM weights by the clipped advantage "
        "itself",
        "set algorithm.adv_mode=continuous",
    )
    # the training steps: the authors' stratified draw (algos.awm.stratified_train_steps)
    _check(
        algo.timestep_fraction == 1.0,
        "algorithm.timestep_fraction",
        f"{algo.timestep_fraction} is DiffusionNFT's share of steps trained per sample; AWM trains its authors' "
        "stratified steps",
        "leave it at 1.0 and set actor_rollout_ref.actor.diffusion_loss.awm_train_timesteps (how many, the authors' "
        "6) / awm_timestep_fraction (the strata's top, the authors' 0.9)",
    )
    _check(
        dl.awm_train_timesteps >= 1,
        "actor_rollout_ref.actor.diffusion_loss.awm_train_timesteps",
        f"must be >= 1, got {dl.awm_train_timesteps}",
        "e.g. 6 (the AWM authors')",
    )
    steps = int(cfg.actor_rollout_ref.rollout.pipeline.num_inference_steps)
    _check(
        0 < dl.awm_timestep_fraction <= 1 and steps >= 2 and int(steps * dl.awm_timestep_fraction) >= 1,
        "actor_rollout_ref.actor.diffusion_loss.awm_timestep_fraction",
        f"{dl.awm_timestep_fraction} of {steps} rollout steps leaves no step to draw from (AWM trains steps 1 .. "
        "int(num_inference_steps x awm_timestep_fraction), never step 0)",
        "a fraction in (0, 1] with int(num_inference_steps x fraction) >= 1 and num_inference_steps >= 2 (the "
        "authors' 0.9)",
    )


def _check_final_latents(cfg: DictConfig, name: str) -> None:
    """What a final-latent loss (DiffusionNFT, AWM) cannot take: the keys of the log-prob losses, and a sharded full
    fine-tune's old copy."""
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    rc, nft = algo.rollout_correction, name == "diffusion_nft"
    for key in ("rollout_is", "rollout_rs"):
        _check(
            rc[key] is None,
            f"algorithm.rollout_correction.{key}",
            f"corrects between recomputed and rollout log-probs; the {name} rollout has none (ODE sampling, final "
            "latents only)",
            f"drop algorithm.rollout_correction.{key}",
        )
    _check(
        arr.actor.kl_loss_coef == 0,
        "actor_rollout_ref.actor.kl_loss_coef",
        f"is FlowGRPO's KL on the SDE step's mean; {name} regularises toward the reference in prediction space",
        f"set actor_rollout_ref.actor.diffusion_loss.ref_kl_coef={arr.actor.kl_loss_coef} and kl_loss_coef=0",
    )
    _check(
        not (arr.actor.diffusion_loss.ref_kl_coef > 0 and arr.model.lora_rank == 0),
        "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef",
        "needs a reference policy, the model with its LoRA adapter off; a full fine-tune keeps no frozen copy",
        "set it to 0, or train LoRA (actor_rollout_ref.model.lora_rank=8)",
    )
    _check(
        not (nft and algo.drop_zero_adv_samples),
        "algorithm.drop_zero_adv_samples",
        "is flow_grpo's filter of zero-gradient samples; a DiffusionNFT sample with advantage 0 has r = 1/2 and "
        "still trains (both implicit branches)",
        "set algorithm.drop_zero_adv_samples=false",
    )
    ranks = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    old = nft or arr.actor.diffusion_loss.old_kl_coef > 0
    _check(
        not (old and arr.model.lora_rank == 0 and ranks > 1),
        "actor_rollout_ref.model.lora_rank",
        f"a full fine-tune on {ranks} actor ranks is sharded (FSDP2); {name}'s old copy of sharded weights is "
        "not implemented",
        "train LoRA (lora_rank > 0; verl-omni's recipe uses 64), or one actor rank",
    )
