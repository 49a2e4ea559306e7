"""The model and rollout sections' checks (``actor_rollout_ref.model.modality``, ``actor_rollout_ref.rollout.*``):
what each modality can generate with, run by ``trainer.config.validate`` at start; each error names the key and the
fix."""

from __future__ import annotations

from omegaconf import DictConfig

from omni_async.config_error import check as _check


def check_rollout(cfg: DictConfig) -> None:
    """The modality, the rollout engine, text sampling, the SDE window and the image size."""
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
    _check_long_tail(cfg)


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
