"""The published model configs the memory plan (``omni_async.tools.memory_plan``), ``bench/gpu_step.py`` and the
``random:<family>`` model sources (``omni_async.models.random_models``) build, on the meta device or with random
weights on a device: Qwen-Image, SD3.5 Medium, Wan 2.1 T2V 1.3B / 14B and Wan 2.2 TI2V 5B, every number copied from
the public ``config.json`` files named in each entry's ``source`` (nothing is downloaded). :func:`build` instantiates
one component from its entry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BF16 = torch.bfloat16

QWEN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention (attn1, attn2) of every block

# Source of every number: the public config.json of the named checkpoint (HF hub paths given in "source").

# Qwen-Image's VAE is Wan 2.1's (the same architecture and sizes in both vae/config.json; read-only here).
_WAN_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}

# The T5-XXL encoder's sizes, shared by Wan's UMT5 (google/umt5-xxl) and SD3's third text encoder (t5-v1_1-xxl);
# the two differ in their vocabularies.
_T5_XXL = {
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False,
}

_QWEN_IMAGE = {
    "source": "Qwen/Qwen-Image: transformer/, text_encoder/, vae/ config.json, scheduler/scheduler_config.json",
    "transformer": (
        "diffusers",
        "QwenImageTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 60,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 3584,
            "guidance_embeds": False,
            "axes_dims_rope": (16, 56, 56),
        },
    ),
    "text_encoder": (
        "transformers",
        "Qwen2_5_VLForConditionalGeneration",
        {  # = Qwen/Qwen2.5-VL-7B-Instruct
            "text_config": {
                "vocab_size": 152064,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "hidden_act": "silu",
                "max_position_embeddings": 128000,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "tie_word_embeddings": False,
                "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            },
            "vision_config": {
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "out_hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "in_chans": 3,
                "hidden_act": "silu",
                "tokens_per_second": 2,
            },
            "tie_word_embeddings": False,
        },
    ),
    # latents_mean/std left at diffusers' defaults (no memory)
    "vae": ("diffusers", "AutoencoderKLQwenImage", _WAN_VAE),
    "vae_dtype": BF16,
    # No memory of its own; bench/gpu_step.py samples with it (dynamic shift, as QwenImagePipeline).
    "scheduler": (
        "diffusers",
        "FlowMatchEulerDiscreteScheduler",
        {
            "num_train_timesteps": 1000,
            "shift": 1.0,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
            "shift_terminal": 0.02,
            "time_shift_type": "exponential",
        },
    ),
    "lora_targets": QWEN_TARGETS,
    # The pipeline drops the 34-token chat template; prompts are padded to the longest in the batch.
    "text_tokens": 256,
    "template_tokens": 34,
    "frames": 1,
}


def _wan(heads: int, ffn: int, layers: int, name: str) -> dict:
    return {
        "source": f"Wan-AI/{name}-Diffusers: transformer/, text_encoder/ (google/umt5-xxl), vae/ config.json",
        "transformer": (
            "diffusers",
            "WanTransformer3DModel",
            {
                "patch_size": (1, 2, 2),
                "num_attention_heads": heads,
                "attention_head_dim": 128,
                "in_channels": 16,
                "out_channels": 16,
                "text_dim": 4096,
                "freq_dim": 256,
                "ffn_dim": ffn,
                "num_layers": layers,
                "cross_attn_norm": True,
                "qk_norm": "rms_norm_across_heads",
                "eps": 1e-6,
                "rope_max_seq_len": 1024,
            },
        ),
        "text_encoder": (
            "transformers",
            "UMT5EncoderModel",
            {"vocab_size": 256384, **_T5_XXL},
        ),
        "vae": ("diffusers", "AutoencoderKLWan", dict(_WAN_VAE)),
        "vae_dtype": torch.float32,
        "scheduler": _wan_scheduler(3.0),  # diffusers' Wan examples load the VAE in fp32
        "lora_targets": WAN_TARGETS,
        "text_tokens": 512,
        "template_tokens": 0,  # Wan pads every prompt to 512 UMT5 tokens
        "frames": 33,  # 4k+1; 33 frames = 9 latent frames (override with --frames; Wan's own default is 81)
    }


# The CLIP token ids are the byte-level tokenizer's (random:), not sizes.
_CLIP_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "max_position_embeddings": 77}
# openai/clip-vit-large-patch14's text model: SD3's first text encoder (with its projection) and FLUX.1's (pooled).
_CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
    **_CLIP_IDS,
}
# The SD3 VAE's architecture (16 latent channels, 8x), which FLUX.1's shares; each has its own latent scale and shift.
_SD3_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# stabilityai/stable-diffusion-3.5-medium: MMDiT-X (dual attention in the first 13 blocks), CLIP-L + OpenCLIP bigG +
# T5-XXL (the SD3 text encoders), the SD3 VAE.
SD35_MEDIUM = {
    "source": "stabilityai/stable-diffusion-3.5-medium: transformer/, text_encoder{,_2,_3}/, vae/, scheduler/",
    "transformer": (
        "diffusers",
        "SD3Transformer2DModel",
        {
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)),
            "qk_norm": "rms_norm",
        },
    ),
    "text_encoder": (  # openai/clip-vit-large-patch14
        "transformers",
        "CLIPTextModelWithProjection",
        _CLIP_L,
    ),
    "text_encoder_2": (  # laion/CLIP-ViT-bigG-14
        "transformers",
        "CLIPTextModelWithProjection",
        {
            "vocab_size": 49408,
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 20,
            "projection_dim": 1280,
            "hidden_act": "gelu",
            **_CLIP_IDS,
        },
    ),
    "text_encoder_3": (  # google/t5-v1_1-xxl's encoder
        "transformers",
        "T5EncoderModel",
        {"vocab_size": 32128, **_T5_XXL, "decoder_start_token_id": 0},
    ),
    "vae": ("diffusers", "AutoencoderKL", {**_SD3_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 1000, "shift": 3.0}),
}


# black-forest-labs/FLUX.1-dev: the guidance-distilled 12 B transformer (19 dual-stream + 38 single-stream blocks over
# 2x2-packed latent tokens, a guidance embedding), CLIP-L (pooled) + T5-XXL (512 tokens), a 16-channel AutoencoderKL.
FLUX_1_DEV = {
    "source": "black-forest-labs/FLUX.1-dev: transformer/, text_encoder{,_2}/, vae/, scheduler/ config.json",
    "transformer": (
        "diffusers",
        "FluxTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": (16, 56, 56),
        },
    ),
    "text_encoder": (  # openai/clip-vit-large-patch14's text model: FluxPipeline reads its pooled output
        "transformers",
        "CLIPTextModel",
        _CLIP_L,
    ),
    "text_encoder_2": ("transformers", "T5EncoderModel", {"vocab_size": 32128, **_T5_XXL, "decoder_start_token_id": 0}),
    "vae": ("diffusers", "AutoencoderKL", {**_SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}),
    "vae_dtype": BF16,
    "scheduler": (
        "diffusers",
        "FlowMatchEulerDiscreteScheduler",
        {
            "num_train_timesteps": 1000,
            "shift": 3.0,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
    ),
    # the attention projections (the single-stream blocks have only to_q / to_k / to_v of these)
    "lora_targets": QWEN_TARGETS,
    "text_tokens": 512,  # T5 pads every prompt to max_sequence_length (FluxPipeline's default 512)
    "template_tokens": 0,
    "encoder_tokens": {"text_encoder": 77},  # CLIP reads its 77 positions; the others read text_tokens
    "frames": 1,
    "cfg": False,  # guidance-distilled: the guidance is an embedding, one branch (true CFG only when asked)
}


def _wan_scheduler(flow_shift: float) -> tuple[str, str, dict]:
    """Wan's shipped scheduler (UniPC on flow sigmas); the policy samples with FlowMatchEuler at its ``flow_shift``."""
    return (
        "diffusers",
        "UniPCMultistepScheduler",
        {
            "num_train_timesteps": 1000,
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": flow_shift,
        },
    )


def _wan22_ti2v_5b() -> dict:
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers: a 3072-wide transformer on the 48-channel Wan 2.2 VAE (16x spatial, 4x
    temporal, 2x2 patchified pixels); one transformer, ``expand_timesteps`` (per-token timesteps, the same for every
    token in text-to-video)."""
    spec = _wan(24, 14336, 30, "Wan2.2-TI2V-5B")
    spec["transformer"][2].update({"in_channels": 48, "out_channels": 48})
    spec["vae"] = (
        "diffusers",
        "AutoencoderKLWan",
        {
            **_WAN_VAE,
            "base_dim": 160,
            "decoder_base_dim": 256,
            "z_dim": 48,
            "is_residual": True,
            "in_channels": 12,
            "out_channels": 12,
            "patch_size": 2,
            "scale_factor_spatial": 16,
            "scale_factor_temporal": 4,
            # per-channel latent statistics: no memory or time, so unit ones stand in for the published 48 values
            "latents_mean": [0.0] * 48,
            "latents_std": [1.0] * 48,
        },
    )
    spec["pipeline_kwargs"] = {"expand_timesteps": True}
    spec["scheduler"] = _wan_scheduler(5.0)
    return spec


MODELS = {
    "qwen_image": _QWEN_IMAGE,
    "wan_1_3b": _wan(12, 8960, 30, "Wan2.1-T2V-1.3B"),
    "wan_14b": _wan(40, 13824, 40, "Wan2.1-T2V-14B"),
    "flux_1_dev": FLUX_1_DEV,
}


# The random:<family> sources (models.random_models): the published architecture, by the checkpoint's own name.
PUBLISHED = {
    "qwen_image": MODELS["qwen_image"],
    "sd3.5_medium": SD35_MEDIUM,
    "wan2.1_t2v_1.3b": MODELS["wan_1_3b"],
    "wan2.2_ti2v_5b": _wan22_ti2v_5b(),
    "flux.1_dev": FLUX_1_DEV,
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def config_class(library: str, cls_name: str) -> type | None:
    """A transformers model class's config class (``None`` for a diffusers class, configured by its arguments)."""
    if library == "diffusers":
        return None
    import transformers

    cls = getattr(transformers, cls_name)
    return transformers.AutoConfig.for_model(cls.config_class.model_type).__class__


def build(
    library: str, cls_name: str, config: dict, dtype: torch.dtype = BF16, device: str | torch.device = "meta"
) -> torch.nn.Module:
    """Instantiate a diffusers / transformers class from a config dict on the meta device (no storage), or on a real
    ``device`` with the class's own random initialisation (``random:`` sources, ``bench/gpu_step.py``). On a real
    device each weight is created there, once, in ``dtype`` (the default dtype meanwhile, as diffusers'
    ``from_pretrained`` does), so a 20 B transformer never exists in fp32 or in host memory first."""
    real = torch.device(device).type != "meta"
    with torch.device(device), _default_dtype(dtype) if real else contextlib.nullcontext():
        if library == "diffusers":
            import diffusers

            module = getattr(diffusers, cls_name)(**dict(config))
        else:
            import transformers

            cls = getattr(transformers, cls_name)
            cfg = config_class(library, cls_name)(**config)
            cfg._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"  # UMT5: eager
            module = cls(cfg)
    return module.to(dtype).eval().requires_grad_(False)
