"""Build the policy a modality trains (``actor_rollout_ref.model.modality``): ``image`` (diffusion, images and
video) or ``text`` (causal LM). Rollout replicas and actors both go through here, so they always agree."""

from __future__ import annotations

from typing import Any

from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig


def sampling_config(cfg) -> SamplingConfig | TextSamplingConfig:
    r = cfg.actor_rollout_ref.rollout
    if cfg.actor_rollout_ref.model.modality == "text":
        return TextSamplingConfig(response_length=int(r.response_length), temperature=float(r.temperature))
    return SamplingConfig(height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
                          noise_level=r.algo.noise_level, sde_type=r.algo.sde_type,
                          true_cfg_scale=float(r.pipeline.true_cfg_scale), guidance_scale=float(r.pipeline.guidance_scale),
                          num_frames=int(r.num_frames))


def build_policy(model: dict[str, Any], sampling: dict[str, Any], rollout_server: dict[str, Any] | None = None):
    """The trainable policy; for a text rollout replica with ``rollout_server`` (``rollout.name=vllm``), a client
    of a vLLM server instead (it samples and takes LoRA weights, it does not train)."""
    kwargs = dict(lora_rank=model["lora_rank"], lora_alpha=model["lora_alpha"],
                  target_modules=list(model["target_modules"]))
    if rollout_server is not None:
        from omni_async.models.vllm_text_policy import VLLMTextPolicy

        return VLLMTextPolicy(model["path"], TextSamplingConfig(**sampling), server=rollout_server, **kwargs)
    if model.get("modality", "image") == "text":
        return TextPolicy(model["path"], TextSamplingConfig(**sampling), **kwargs)
    return DiffusionPolicy(model["path"], SamplingConfig(**sampling), **kwargs)
