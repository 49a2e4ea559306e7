"""Tiny random-weight models built offline from config, cached on disk.

No model hub is reachable on CI or on the developer box, so tests and the default example use these.
``resolve_model_path("tiny:<name>")`` builds the model once (seeded, deterministic), saves it with the
library's own ``save_pretrained`` and returns the directory; every later call is a cache hit.
``random:<family>`` (a published architecture with random weights, :mod:`omni_async.models.random_models`)
resolves the same way to a directory of its tokenizers. Anything else is a local path or hub id and is
returned unchanged, so real checkpoints work through the same config key.

Cache root: ``$OMNI_ASYNC_CACHE`` (default ``~/.cache/omni_async``). Builds go to a temporary directory
and are renamed into place, so several Ray actors resolving the same name at once never see a half-written
model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

TINY_PREFIX = "tiny:"
# Bump when a builder changes so stale caches are not reused.
_BUILD_VERSION = "v2"
_SEED = 1234


def cache_root() -> Path:
    return Path(os.environ.get("OMNI_ASYNC_CACHE", Path.home() / ".cache" / "omni_async"))


# --------------------------------------------------------------------------------------------------------
# Tokenizers, built in memory (no vocab files to download).
# --------------------------------------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (so any UTF-8 text tokenizes)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2_tokenizer():
    """A Qwen2 byte-level BPE tokenizer over single bytes plus Qwen's chat/vision special tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(_byte_level_alphabet())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS[1:]})
    tok.add_tokens(["<|endoftext|>"], special_tokens=True)
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    return tok


def build_clip_tokenizer():
    """A CLIP BPE tokenizer: every byte char, with and without CLIP's end-of-word suffix."""
    from transformers import CLIPTokenizer

    alphabet = _byte_level_alphabet()
    tokens = ["<|startoftext|>", "<|endoftext|>", *alphabet, *(c + "</w>" for c in alphabet)]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_t5_tokenizer():
    """A T5 (Unigram) tokenizer over printable ASCII, with and without the word-start marker."""
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(33, 127)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=128)


# --------------------------------------------------------------------------------------------------------
# Builders. Each writes a directory loadable by its library's normal ``from_pretrained``.
# --------------------------------------------------------------------------------------------------------


def _flow_scheduler(shift: float = 3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


# The sizes the tiny models share, one place each: the T5-style text encoders (SD3's T5, Wan's UMT5), the video VAE
# (Qwen-Image's and Wan's have the same architecture), the M-RoPE text stacks and vision towers of the Qwen VL models.
_T5_ENCODER = dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
_VISION_TOWER = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
_DENOISER_BLOCKS = dict(num_layers=2, num_attention_heads=2)  # every tiny transformer: two blocks of two heads


def _video_vae(z_dim: int) -> dict:
    """``AutoencoderKLQwenImage`` / ``AutoencoderKLWan`` arguments: one res block per level, unit latent stats."""
    return dict(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )


def _text_stack(vocab_size: int, hidden: int, intermediate: int, heads: int, **config) -> dict:
    """A transformers text config's sizes (the names CLIP, Qwen2 and the Qwen VL text models share): every tiny text
    model has two layers."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        **config,
    )


def _mrope_text(vocab_size: int, hidden: int, max_positions: int, eos: int | None, pad: int | None) -> dict:
    """A Qwen VL ``text_config``: two heads (one KV head), multimodal RoPE over ``head_dim = hidden / 2``, which
    splits head_dim/2 frequencies across (t, h, w)."""
    head_dim = hidden // 2
    return _text_stack(
        vocab_size,
        hidden,
        2 * hidden,
        2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        rope_scaling={"type": "mrope", "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
    )


def _tiny_qwen25_vl_text_encoder(vocab_size: int, hidden: int = 32, **vision_tokens: int):
    """``vision_tokens``: the tokenizer's ``image_token_id`` etc., for a pipeline that feeds it images (Qwen-Image-Edit)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=_mrope_text(vocab_size, hidden, 2048, eos=vocab_size - 1, pad=vocab_size - 1),
        vision_config=dict(
            **_VISION_TOWER, hidden_size=16, intermediate_size=32, out_hidden_size=hidden, fullatt_block_indexes=[0]
        ),
        **vision_tokens,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg)


def _qwen_transformer(z_dim: int, hidden: int, **config):
    """Qwen-Image's transformer at the tiny sizes: 2x2-packed latent tokens of ``z_dim`` channels, text of ``hidden``."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        **_DENOISER_BLOCKS,
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        attention_head_dim=16,
        joint_attention_dim=hidden,
        axes_dims_rope=(4, 6, 6),
        **config,
    )


def build_qwen_image(out: Path) -> None:
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    tok = build_qwen2_tokenizer()
    z_dim, hidden = 16, 32
    pipe = QwenImagePipeline(
        scheduler=_flow_scheduler(),
        vae=AutoencoderKLQwenImage(**_video_vae(z_dim)),
        text_encoder=_tiny_qwen25_vl_text_encoder(len(tok), hidden),
        tokenizer=tok,
        transformer=_qwen_transformer(z_dim, hidden),
    )
    pipe.save_pretrained(out)


def build_qwen_image_edit(out: Path) -> None:
    """Qwen-Image-Edit-2511's layout (``QwenImageEditPlusPipeline``, its transformer's ``zero_cond_t``) at
    ``build_qwen_image``'s sizes; the text encoder reads images (its vision token ids are the tokenizer's) through the
    ``processor/`` image processor, few pixels (at most 64 vision tokens) to keep it fast. The processor is saved
    as its parts (``models.qwen_image_edit.load_processor`` loads them): ``Qwen2VLProcessor`` needs torchvision.
    Its input images go through the VAE at 64x64 (``qwen_image_edit.STAND_IN_VAE_AREA``), not the pipeline's 1024x1024."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from omni_async.models.qwen_image_edit import STAND_IN_VAE_AREA, ImageQwen2VLProcessor

    tok = build_qwen2_tokenizer()
    ids = {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }
    z_dim, hidden = 16, 32
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=64 * 28 * 28)
    pipe = QwenImageEditPlusPipeline(
        scheduler=_flow_scheduler(),
        vae=AutoencoderKLQwenImage(**_video_vae(z_dim)),
        text_encoder=_tiny_qwen25_vl_text_encoder(len(tok), hidden, **ids),
        tokenizer=tok,
        processor=ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tok),
        transformer=_qwen_transformer(z_dim, hidden, zero_cond_t=True),
    )
    pipe.save_pretrained(out)
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]  # the published checkpoint's entry
    index[STAND_IN_VAE_AREA] = 64 * 64  # input images through the VAE at 64x64, not 1024x1024: 16 condition tokens
    (out / "model_index.json").write_text(json.dumps(index))


WEIGHTS_DIR = Path(__file__).parent / "weights"
# tiny:<name> -> the directory under WEIGHTS_DIR its pre-trained weights ship in
SHIPPED = {"qwen_image_text": "tiny_qwen_image_text", "qwen_image_text_bimodal": "tiny_qwen_image_text_bimodal"}


def _copy_shipped(name: str, out: Path) -> None:
    src = WEIGHTS_DIR / SHIPPED[name]
    if not (src / "model_index.json").exists():
        raise FileNotFoundError(f"{src} is missing; the script named in models/tiny.py's builder for it makes it")
    shutil.copytree(src, out, dirs_exist_ok=True)


def _shipped_digest(name: str) -> str:
    """A short hash of a shipped model's files: its cache entry follows the weights when they are re-made."""
    h = hashlib.sha256()
    src = WEIGHTS_DIR / SHIPPED[name]
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def build_qwen_image_text(out: Path) -> None:
    """Qwen-Image (same classes as ``build_qwen_image``) pre-trained to draw short strings such as ``Text "K47"``.

    Not built here: the weights ship in ``models/weights/tiny_qwen_image_text`` (made, and reproducible, by
    ``examples/pretrain/tiny_text_renderer.py``; its ``prompts.json`` lists the held-out strings). 64x64 images.
    Every sample is partially legible in the same way; FlowGRPO did not raise its OCR reward on CPU
    (``bench/results/ocr_learning_cpu.json``): kept as the control for ``tiny:qwen_image_text_bimodal``.
    """
    _copy_shipped("qwen_image_text", out)


def build_qwen_image_text_bimodal(out: Path) -> None:
    """Qwen-Image pre-trained to draw 2-character strings (``Text "K4"``) legibly or, with the same prompt, faint and
    blurred (PP-OCR reads nothing), about half each: the noise picks the mode, so the OCR reward is hit-or-miss.

    Shipped in ``models/weights/tiny_qwen_image_text_bimodal``, made by ``examples/pretrain/tiny_bimodal_renderer.py``
    (its ``prompts.json`` lists the held-out strings). 64x64 images. The main job's CPU default.
    """
    _copy_shipped("qwen_image_text_bimodal", out)


def _tiny_clip(cls: type, vocab_size: int):
    """A two-layer CLIP text model of ``cls`` (``CLIPTextModelWithProjection`` for SD3, ``CLIPTextModel`` for FLUX)
    over the byte-level CLIP tokenizer's ids."""
    from transformers import CLIPTextConfig

    return cls(
        CLIPTextConfig(
            **_text_stack(vocab_size, 32, 37, 4),
            projection_dim=32,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )


def _tiny_kl_vae(latent_channels: int):
    """SD3's and FLUX's ``AutoencoderKL`` (8x spatial compression), one res block per level, latents unscaled."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
        shift_factor=0.0,
        scaling_factor=1.0,
    )


def _tiny_t5(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, **_T5_ENCODER, decoder_start_token_id=0))


def build_sd3(out: Path) -> None:
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    latent_channels = 4  # the VAE's latents are the transformer's input and output

    def clip():
        return _tiny_clip(CLIPTextModelWithProjection, len(clip_tok))

    t5 = _tiny_t5(len(t5_tok))
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            **_DENOISER_BLOCKS,
            sample_size=8,
            patch_size=2,
            in_channels=latent_channels,
            attention_head_dim=8,
            joint_attention_dim=32,
            caption_projection_dim=16,
            pooled_projection_dim=64,
            out_channels=latent_channels,
            pos_embed_max_size=16,
        ),
        scheduler=_flow_scheduler(),
        vae=_tiny_kl_vae(latent_channels),
        text_encoder=clip(),
        tokenizer=clip_tok,
        text_encoder_2=clip(),
        tokenizer_2=build_clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
    )
    _zero_init_decoder_residuals(pipe.vae)
    pipe.save_pretrained(out)


# FLUX.1's scheduler config (black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json): the shift follows the
# image's token count (models.published.FLUX_1_DEV's), as FluxPipeline computes mu.
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def build_flux(out: Path) -> None:
    """FLUX.1-dev's layout (``FluxPipeline``): a ``FluxTransformer2DModel`` with the guidance embedding (the
    guidance-distilled dev model's), dual-stream then single-stream blocks over 2x2-packed latent tokens, CLIP's pooled
    projection and T5's sequence, the SD3-style ``AutoencoderKL``, FLUX.1's dynamically shifted schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    latent_channels = 4  # packed 2x2: 16 transformer channels
    pipe = FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * latent_channels,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),  # (text/index, row, column) rotary dims, summing to attention_head_dim
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=_tiny_kl_vae(latent_channels),
        text_encoder=_tiny_clip(CLIPTextModel, len(clip_tok)),
        tokenizer=clip_tok,
        text_encoder_2=_tiny_t5(len(t5_tok)),
        tokenizer_2=t5_tok,
    )
    _zero_init_decoder_residuals(pipe.vae)
    pipe.save_pretrained(out)


_TEACHER_SEED = 4321


def build_sd3_teacher(out: Path) -> None:
    """A distillation teacher for ``tiny:sd3`` (DiffusionOPD's stand-in): the same pipeline (text encoders, VAE,
    scheduler: the same seeded build) with its transformer drawn again from another seed, as a fine-tuned teacher
    of the student's family differs only in its transformer."""
    from diffusers import SD3Transformer2DModel

    build_sd3(out)
    config = SD3Transformer2DModel.load_config(out / "transformer")
    torch.manual_seed(_TEACHER_SEED)
    SD3Transformer2DModel.from_config(config).save_pretrained(out / "transformer")


def _zero_init_decoder_residuals(vae) -> None:
    """Zero the last layer of every residual branch of the decoder.

    A random GroupNorm decoder maps almost any latent to the same texture (the norms wash out the latent's
    scale), so no reward computed on pixels could tell a better latent from a worse one. With the residual
    branches at zero the decoder is conv-in, upsampling, conv-out: pixels follow the latent, and the JPEG
    reward of the learning test responds to what the transformer does (measured: zero latent 1.45 kB, unit
    noise 3.1 kB, vs 3.1 / 3.8 kB before).
    """
    from diffusers.models.resnet import ResnetBlock2D

    for m in vae.decoder.modules():
        if isinstance(m, ResnetBlock2D):
            torch.nn.init.zeros_(m.conv2.weight)
            torch.nn.init.zeros_(m.conv2.bias)
    for attn in vae.decoder.mid_block.attentions:
        torch.nn.init.zeros_(attn.to_out[0].weight)
        torch.nn.init.zeros_(attn.to_out[0].bias)


def build_wan(out: Path, experts: int = 1) -> None:
    """Wan 2.1 (one transformer); ``experts=2``: Wan 2.2's two-expert layout, ``transformer`` for the high-noise steps
    and ``transformer_2`` (its own random weights) for the rest, switching at ``boundary_ratio`` as A14B's 0.875."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def transformer():
        return WanTransformer3DModel(
            **_DENOISER_BLOCKS,
            patch_size=(1, 2, 2),
            attention_head_dim=12,
            in_channels=z_dim,
            out_channels=z_dim,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            rope_max_seq_len=32,
        )

    tok = build_t5_tokenizer()
    z_dim = 16
    two = {"transformer_2": transformer(), "boundary_ratio": 0.875} if experts == 2 else {}
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(tok), **_T5_ENCODER)),
        vae=AutoencoderKLWan(**_video_vae(z_dim)),
        scheduler=_flow_scheduler(),
        transformer=transformer(),
        **two,
    )
    pipe.save_pretrained(out)


def build_wan22(out: Path) -> None:
    build_wan(out, experts=2)


def build_qwen2_vl(out: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_qwen2_tokenizer()
    hidden = 32
    cfg = Qwen2VLConfig(
        text_config=_mrope_text(
            len(tok), hidden, 4096, eos=tok.convert_tokens_to_ids("<|im_end|>"), pad=tok.pad_token_id
        ),
        vision_config=dict(**_VISION_TOWER, embed_dim=16, hidden_size=hidden, mlp_ratio=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    model = Qwen2VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = cfg.text_config.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    # Few pixels keep the judge fast: a 64x64 image becomes a handful of vision tokens. The tokenizer and the
    # PIL image processor are saved side by side rather than as a Qwen2VLProcessor, whose video processor
    # needs torchvision (which must not be installed next to this torch).
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=64 * 28 * 28)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)


def build_qwen2(out: Path) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_qwen2_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = Qwen2ForCausalLM(
        Qwen2Config(
            **_text_stack(len(tok), 64, 128, 4),
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
    )
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)


TINY_BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen_image": build_qwen_image,
    "qwen_image_edit": build_qwen_image_edit,
    "qwen_image_text": build_qwen_image_text,
    "qwen_image_text_bimodal": build_qwen_image_text_bimodal,
    "sd3": build_sd3,
    "sd3_teacher": build_sd3_teacher,
    "flux": build_flux,
    "wan": build_wan,
    "wan22": build_wan22,
    "qwen2_vl": build_qwen2_vl,
    "qwen2": build_qwen2,
}


RANDOM_PREFIX = "random:"
# random:<family> (models.random_models: the published architecture, random weights) -> its tokenizers, by the
# checkpoint's subfolder: the byte-level ones above (the text encoders keep the real vocabulary sizes).
RANDOM_TOKENIZERS: dict[str, dict[str, Callable[[], object]]] = {
    "qwen_image": {"tokenizer": build_qwen2_tokenizer},
    "sd3.5_medium": {
        "tokenizer": build_clip_tokenizer,
        "tokenizer_2": build_clip_tokenizer,
        "tokenizer_3": build_t5_tokenizer,
    },
    "wan2.1_t2v_1.3b": {"tokenizer": build_t5_tokenizer},
    "wan2.2_ti2v_5b": {"tokenizer": build_t5_tokenizer},
    "flux.1_dev": {"tokenizer": build_clip_tokenizer, "tokenizer_2": build_t5_tokenizer},
}


def is_random(name_or_path: object) -> bool:
    return str(name_or_path).startswith(RANDOM_PREFIX)


def unknown_random_family(family: str) -> str:
    known = ", ".join(RANDOM_PREFIX + f for f in RANDOM_TOKENIZERS)
    return f"unknown random: family {family!r} (known: {known}); give one of those, a tiny:<name> or a model directory"


def _build_random_tokenizers(family: str, out: Path) -> None:
    """``random:<family>``'s cached directory: its byte-level tokenizers in the checkpoint's subfolders."""
    for sub, builder in RANDOM_TOKENIZERS[family].items():
        builder().save_pretrained(out / sub)


def is_tiny(name_or_path: str) -> bool:
    return str(name_or_path).startswith(TINY_PREFIX)


SIM_PREFIX = "sim:"
# sim:<name> (models.sim_policy: a simulated device, its generation and update timed waits) -> the tiny model under it.
# The name is the modality it simulates (sim:text: models.sim_policy, sim:image: models.sim_image_policy).
SIM_SOURCES = {"text": "tiny:qwen2", "image": "tiny:sd3"}
SIM_BASE = SIM_SOURCES["text"]


def is_sim(name_or_path: object) -> bool:
    return str(name_or_path).startswith(SIM_PREFIX)


def resolve_model_path(name_or_path: str) -> str:
    """Turn ``tiny:<name>`` (and ``sim:<name>``: its tiny model) into a cached local directory (building it on first
    use), and ``random:<family>`` into the cached directory of that family's tokenizers (``models.random_models``:
    its weights are built on the device by the policy, never saved); pass anything else through.

    >>> resolve_model_path("/models/Qwen-Image")
    '/models/Qwen-Image'
    """
    name_or_path = str(name_or_path)
    if is_sim(name_or_path) and name_or_path[len(SIM_PREFIX) :] in SIM_SOURCES:
        name_or_path = SIM_SOURCES[name_or_path[len(SIM_PREFIX) :]]  # its tokenizer and weights are the tiny model's
    if is_random(name_or_path):
        family = name_or_path[len(RANDOM_PREFIX) :]
        if family not in RANDOM_TOKENIZERS:
            raise ValueError(f"{name_or_path!r}: {unknown_random_family(family)}")
        target = cache_root() / "random" / f"{family}-{_BUILD_VERSION}"
        return _cached(target, name_or_path, partial(_build_random_tokenizers, family))
    if not is_tiny(name_or_path):
        return name_or_path
    name = name_or_path[len(TINY_PREFIX) :]
    if name not in TINY_BUILDERS:
        raise ValueError(
            f"unknown tiny model {name_or_path!r}; choose one of "
            f"{', '.join(TINY_PREFIX + n for n in TINY_BUILDERS)} or give a local path"
        )
    version = f"{_BUILD_VERSION}-{_shipped_digest(name)}" if name in SHIPPED else _BUILD_VERSION
    return _cached(cache_root() / "tiny" / f"{name}-{version}", name_or_path, TINY_BUILDERS[name])


def _cached(target: Path, label: str, builder: Callable[[Path], None]) -> str:
    """``target`` built once by ``builder`` (seeded), into a temporary directory renamed into place."""
    if (target / ".complete").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            builder(tmp)
        (tmp / ".complete").write_text(label)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is complete): keep theirs.
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
