"""The real model configs the memory plan and ``bench/gpu_step.py`` build on the meta device (or with random weights
on a GPU): Qwen-Image and Wan 2.1 T2V 1.3B / 14B, every number copied from the public ``config.json`` files named in
each entry's ``source`` (nothing is downloaded)."""

from __future__ import annotations

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
            {
                "vocab_size": 256384,
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
            },
        ),
        "vae": ("diffusers", "AutoencoderKLWan", _WAN_VAE),
        "vae_dtype": torch.float32,  # diffusers' Wan examples load the VAE in fp32
        "lora_targets": WAN_TARGETS,
        "text_tokens": 512,
        "template_tokens": 0,  # Wan pads every prompt to 512 UMT5 tokens
        "frames": 33,  # 4k+1; 33 frames = 9 latent frames (override with --frames; Wan's own default is 81)
    }


MODELS = {
    "qwen_image": _QWEN_IMAGE,
    "wan_1_3b": _wan(12, 8960, 30, "Wan2.1-T2V-1.3B"),
    "wan_14b": _wan(40, 13824, 40, "Wan2.1-T2V-14B"),
}
