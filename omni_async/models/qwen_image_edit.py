"""Qwen-Image-Edit's conditioning: what ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` make of a prompt's
input images before denoising, made once per sample at rollout and carried to the update.

Each input image goes two ways, as the pipelines' own ``__call__`` sends it:

- to the Qwen2.5-VL text encoder with the instruction (``pipe.encode_prompt(prompt, image)``; the pipeline's chat
  template puts ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` before the instruction, Plus), resized to
  ``CONDITION_IMAGE_SIZE`` pixels at the image's aspect ratio (Plus; the older pipeline: 1024² for both ways);
- through the VAE (``argmax`` of its posterior, normalised by ``latents_mean`` / ``latents_std``) at ``VAE_IMAGE_SIZE``
  pixels, packed into 2x2 tokens like the noise latents: ``image_latents`` [L_img, 64] per sample. Each denoising
  step concatenates them after the noisy latents along the sequence (``cat([x, image_latents], 1)``), gives the
  transformer one ``img_shapes`` entry per image after the output's, and keeps the first ``x.shape[1]`` tokens of
  the prediction. Qwen-Image-Edit-2511's transformer (``zero_cond_t``) runs the condition tokens at timestep 0.

The update runs the transformer on the carried ``image_latents`` and prompt encodings: the same conditioning as the
rollout, never the text encoder or the VAE again. The negative (true CFG) branch is the pipelines' ``" "`` with the
same images, as verl-omni's edit rows write it (``"Picture 1: <image> "``).

Every condition image of a sample must have the output's aspect ratio (verl-omni's rule): then each sample's
``image_latents`` have one length, and a batch stacks them. ``examples/data/prepare_qwen_image_edit.py`` letterboxes
images onto the output's square as verl-omni's ``prepare_data.py`` does.

A pipeline checkpoint's ``processor`` (``Qwen2VLProcessor``) is loaded as :class:`ImageQwen2VLProcessor`, the same
tokenizer and image processor without the video processor (which needs torchvision; no edit input is a video).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2VLProcessor

EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
IMAGE_LATENTS = "image_latents"  # the conditioning key of the packed condition-image latents (diffusers' name)


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for text and images only: transformers' ``Qwen2VLProcessor`` requires a video processor,
    which needs torchvision (not installed next to this torch). ``__call__(text=..., images=...)`` is the parent's."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs: Any):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        super(Qwen2VLProcessor, self).__init__(image_processor, tokenizer, chat_template=chat_template)


def load_processor(path: str | Path, tokenizer) -> ImageQwen2VLProcessor:
    """The checkpoint's ``processor/`` (its image processor's config) with the pipeline's tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), subfolder="processor")
    return ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def edit_load_kwargs(path: str) -> dict[str, Any]:
    """``DiffusionPipeline.from_pretrained``'s ``processor`` for an edit checkpoint (:class:`ImageQwen2VLProcessor`,
    module docstring); nothing for another pipeline."""
    from diffusers import DiffusionPipeline

    if DiffusionPipeline.load_config(path).get("_class_name") not in EDIT_PIPELINES:
        return {}
    from transformers import AutoTokenizer

    return {"processor": load_processor(path, AutoTokenizer.from_pretrained(path, subfolder="tokenizer"))}


def decode_image(data: bytes):
    """PNG / JPEG / ... bytes -> an RGB PIL image (``PIL.UnidentifiedImageError`` / ``OSError`` when not an image)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def _sizes(pipe) -> tuple[Any, int, int]:
    """``(calculate_dimensions, VL area, VAE area)`` of the pipeline's own module; the VAE area a tiny stand-in's
    ``model_index.json`` gives (:data:`STAND_IN_VAE_AREA`) instead."""
    own = _stand_in_vae_area(getattr(pipe.config, "_name_or_path", None))
    if type(pipe).__name__ == "QwenImageEditPlusPipeline":
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as m

        return m.calculate_dimensions, m.CONDITION_IMAGE_SIZE, own or m.VAE_IMAGE_SIZE
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as m

    return m.calculate_dimensions, 1024 * 1024, own or 1024 * 1024


# A tiny stand-in's size (``tiny:qwen_image_edit``): the pixels of each input image through the VAE, in place of the
# pipeline's 1024² (a VAE pass at 1024² takes seconds on a CPU and gives 4096 condition tokens). diffusers ignores a
# model_index.json entry starting with "_"; a published checkpoint has none.
STAND_IN_VAE_AREA = "_vae_image_size"


@functools.cache
def _stand_in_vae_area(path: str | None) -> int | None:
    if not path:
        return None
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.load_config(path).get(STAND_IN_VAE_AREA)
    except OSError:  # a hub id not in this machine's cache, hub unreachable: a published checkpoint
        return None


def condition_shapes(pipe, height: int, width: int, n_images: int) -> list[tuple[int, int, int]]:
    """The transformer's ``img_shapes`` for one sample: the output's latent grid, then each condition image's (all of
    the output's aspect ratio, :func:`encode`)."""
    dims, _, vae_area = _sizes(pipe)
    vae_w, vae_h = dims(vae_area, width / height)[:2]
    f = pipe.vae_scale_factor * 2
    return [(1, height // f, width // f)] + [(1, vae_h // f, vae_w // f)] * n_images


def encode(
    pipe, texts: Sequence[str], images: Sequence[Sequence[bytes]], height: int, width: int, negative: bool, **kw: Any
) -> list[dict[str, torch.Tensor]]:
    """The conditioning of each edit prompt (``texts[i]`` with its input ``images[i]``, encoded bytes) as the pipeline
    makes it (module docstring), one row per sample: ``prompt_embeds`` [S, D] without padding (and the negative
    branch's with ``negative``), and ``image_latents`` [L_img, C]. ``kw``: ``encode_prompt``'s
    ``max_sequence_length``."""
    dims, vl_area, vae_area = _sizes(pipe)
    plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
    rows: list[dict[str, torch.Tensor]] = []
    for text, encoded in zip(texts, images, strict=True):
        pil = [decode_image(b) for b in encoded]
        if not plus and len(pil) != 1:
            raise ValueError(f"QwenImageEditPipeline edits one input image per prompt, got {len(pil)}")
        for img in pil:
            if img.width * height != img.height * width:
                raise ValueError(
                    f"an input image of {img.width}x{img.height} for an output of {width}x{height}: Qwen-Image-Edit "
                    "training needs every input image at the output's aspect ratio (verl-omni's rule: one condition "
                    "length per batch). Fix: letterbox the images to it (examples/data/prepare_qwen_image_edit.py "
                    "does) or set actor_rollout_ref.rollout.pipeline.height/width to their aspect ratio"
                )
        vl_w, vl_h = dims(vl_area, width / height)[:2]
        vae_w, vae_h = dims(vae_area, width / height)[:2]
        vl = [pipe.image_processor.resize(img, vl_h, vl_w) for img in pil]
        vl_arg = vl if plus else vl[0]
        row: dict[str, torch.Tensor] = {}
        emb, mask = pipe.encode_prompt(prompt=[text], image=vl_arg, device=pipe.device, **kw)
        row["prompt_embeds"] = _valid(emb, mask)
        if negative:
            emb, mask = pipe.encode_prompt(prompt=[" "], image=vl_arg, device=pipe.device, **kw)
            row["negative_prompt_embeds"] = _valid(emb, mask)
        latents = []
        for img in pil:
            pixels = pipe.image_processor.preprocess(img, vae_h, vae_w).unsqueeze(2)
            lat = pipe._encode_vae_image(pixels.to(pipe.device, pipe.vae.dtype), generator=None)
            latents.append(pipe._pack_latents(lat, 1, lat.shape[1], lat.shape[3], lat.shape[4])[0])
        row[IMAGE_LATENTS] = torch.cat(latents)
        rows.append(row)
    return rows


def _valid(emb: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One prompt's embeddings [S, D] without padding (``encode_prompt`` gives ``mask=None`` when all are valid)."""
    return emb[0] if mask is None else emb[0, : int(mask[0].sum())]
