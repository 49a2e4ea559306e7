"""A diffusers text-to-image pipeline as a FlowGRPO policy: SDE rollout with log-probs, log-prob recompute, LoRA.

The pipeline's own components do the model work (``encode_prompt``, ``prepare_latents``, the transformer, the
VAE); a small per-family adapter says how to call them, because Qwen-Image packs latents into tokens and takes a
text mask, SD3 takes pooled CLIP projections and Wan denoises 5-D video latents. The denoising loop itself is ours, since each step of the SDE
window must return its log-prob (``omni_async.algos.sde``).

Sampling is reproducible per sample: sample ``i`` draws its initial noise and every SDE noise from its own
``torch.Generator(seed_i)``, so the result does not depend on which other samples share its batch.

Inside the SDE window (the steps that have a log-prob) the transformer runs on calls of exactly
``SamplingConfig.window_batch`` samples, in the rollout, the log-prob recompute and the update alike: a short last
call is filled with copies of its last sample, whose outputs are dropped. Each call holds every sample's prompt,
then (CFG) every sample's negative prompt, as the ODE steps do. A masked text (Qwen-Image's) is right-padded with
its mask to the sample's own length bucket (its longer branch rounded up to a multiple of
``SamplingConfig.window_text_bucket`` tokens), and only samples of one bucket (one transformer, Wan 2.2's experts)
share a call. A sample's window step thus always meets the same shapes, whichever batch, micro-batch, position or
mini-batch padding it came in, and the kernels compute its rows alike: rows of one same-shaped call do not depend
on their batch-mates nor on their position (checked on CPU in bf16 and fp32; on GPU this is what cuBLAS and the
attention kernels are expected to do for a fixed shape; not yet checked on a device), so pi_old (the rollout's log-prob, bypass mode) and
the update's first forward agree bit for bit. Batching at whatever size a batch has does not give that: kernels
pick their blocking by batch size (measured on CPU in bf16: tiny SD3's log-prob moved by 6.5e-4 between a
generation batch of 4 and an update micro-batch of 1, against a clip of 1e-4). ``window_batch=1`` with
``window_text_bucket=1`` is the earlier per-sample path (one call per sample on its own text length). The rollout's
ODE steps, which score nothing, run the whole batch in one call (every prompt, then every negative prompt, padded to
one length with a mask). Branches are combined in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from omni_async.algos.sde import SDEStep, sde_step_with_logprob
from omni_async.models import SUPPORTED_PIPELINES
from omni_async.models.acceleration import accelerate
from omni_async.models.experts import boundary_timestep, low_noise_steps, trained_module
from omni_async.models.loading import pipeline_load_kwargs
from omni_async.models.lora import PolicyOptions, TrainableModule
from omni_async.models.offload import HostOffload
from omni_async.models.qwen_image_edit import EDIT_PIPELINES, IMAGE_LATENTS, condition_shapes, edit_load_kwargs
from omni_async.models.qwen_image_edit import encode as encode_edit
from omni_async.models.random_models import build_pipeline
from omni_async.models.rollout_policy import refuse_inapplicable
from omni_async.models.tiny import is_random, resolve_model_path
from omni_async.sample import OUTPUT_TYPES, PIXEL_OUTPUT_TYPES, EditPrompt, ImageResult

LATENT_OUT = tuple(t for t in OUTPUT_TYPES if t not in PIXEL_OUTPUT_TYPES)  # output types that hand the latent over


@dataclass
class SamplingConfig:
    height: int = 64  # pixels
    width: int = 64
    num_inference_steps: int = 10  # denoising steps (the SDE window is some of them)
    noise_level: float = 0.7  # SDE noise scale inside the window
    sde_type: str = "sde"  # sde | cps
    cps_log_prob: str = "flow_grpo"  # CPS log-prob form (see algos.sde)
    true_cfg_scale: float = 1.0  # Qwen-Image's CFG
    guidance_scale: float = 1.0  # SD3's and Wan's CFG
    guidance_scale_2: float | None = None  # Wan 2.2's low-noise expert's CFG (diffusers' pair); None: guidance_scale
    num_frames: int = 1  # video models (Wan): frames per sample
    max_sequence_length: int | None = None  # text-encoder tokens kept for prompt encoding; None = pipeline default
    vae_slicing: bool = True  # decode a batch one sample at a time (the same pixels, 1/B of the peak)
    vae_tiling: bool | None = None  # decode in overlapping spatial tiles; None = on for video (see vae_tiling)
    clean_latents: bool = False  # return each sample's final latents (DiffusionNFT's x0) with its image
    window_means: bool = False  # return each SDE-window step's Gaussian mean (pi_old's, GRPO-Guard / Flow-DPPO)
    # What the reward is handed (sample.OUTPUT_TYPES, verl-omni's pipeline.output_type): latent / both keep the clean
    # latents too. The pixels are decoded either way (sample pictures, validation grids).
    output_type: str = "pt"
    # verl-omni's rollout.dtype, by torch's name (float32 ...): the transformer samples in it
    # (DiffusionPolicy.sampling_dtype); None: model_dtype
    rollout_dtype: str | None = None
    # Samples per transformer call in the SDE window, in rollout, recompute and update alike (module docstring); the
    # update's micro-batch (a multiple of it) runs in whole calls. Config: rollout.pipeline.window_batch_size.
    window_batch: int = 4
    # A masked text (Qwen-Image) is padded to a multiple of this many tokens in the window's calls: one bucket holds
    # prompts of different lengths (fewer, fuller calls), at the cost of the padding's attention.
    window_text_bucket: int = 64
    # verl's ref.log_prob_micro_batch_size_per_gpu: the reference (adapter-off, KL) forward's SDE-window calls hold at
    # most this many samples (only the KL reads them, so their batch shape need not match the rollout's); None:
    # window_batch.
    reference_batch: int | None = None

    def __post_init__(self) -> None:
        for key, value in (("window_batch_size", self.window_batch), ("window_text_bucket", self.window_text_bucket)):
            if int(value) < 1:
                raise ValueError(f"actor_rollout_ref.rollout.pipeline.{key}={value} must be >= 1 (e.g. 4 / 64)")
        if self.output_type not in OUTPUT_TYPES:
            raise ValueError(
                f"actor_rollout_ref.rollout.pipeline.output_type={self.output_type!r}: use one of {', '.join(OUTPUT_TYPES)}"
            )


@dataclass
class Rollout:
    images: np.ndarray  # uint8 [B, H, W, 3], or video frames [B, T, H, W, 3]
    window_latents: torch.Tensor  # [B, W + 1, ...]: x before the window's first step, then after each step
    log_probs: torch.Tensor  # [B, W]
    conditioning: dict[str, torch.Tensor]  # the prompt encodings it was denoised with (COND_KEYS), batch-first
    window_starts: list[int]  # each sample's first SDE step (its window_latents[:, 0] is x before it)
    final_latents: torch.Tensor | None = None  # [B, ...] the denoised latents before decoding (clean_latents)
    window_means: torch.Tensor | None = None  # [B, W, ...] fp32: each window step's mean (SamplingConfig.window_means)


# The prompt encodings a denoising step takes, under the names of the diffusers pipelines' own arguments. They are
# made once per sample at rollout and carried to the update, which never runs the text encoder.
COND_KEYS = (
    "prompt_embeds",
    "prompt_embeds_mask",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_prompt_embeds_mask",
    "negative_pooled_prompt_embeds",
    IMAGE_LATENTS,  # Qwen-Image-Edit's input images, VAE-encoded and packed (models.qwen_image_edit)
)
NEGATIVE = "negative_"  # the CFG branch's keys: the positive keys with this prefix
SHARED = (IMAGE_LATENTS,)  # inputs both CFG branches take as they are


def sample_rows(cond: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Each sample's prompt encodings (views, on their device). A masked sequence (Qwen-Image) is cut to its valid
    tokens and its mask dropped, so a row holds no padding and does not depend on the prompts it shared a batch
    with. The masks are read on the host once per call (one copy per batch, not one sync per sample)."""
    masks = {k: v.cpu().bool() for k, v in cond.items() if k.endswith("_mask") and v is not None}
    rows: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for key, value in cond.items():
        if value is None or key.endswith("_mask"):
            continue
        mask = masks.get(f"{key}_mask")
        for i, row in enumerate(rows):
            v = value[i]
            if mask is not None:
                length = int(mask[i].sum())
                if not mask[i, :length].all():
                    raise ValueError(f"{key}: the text mask is not a prefix of valid tokens; cannot trim it")
                v = v[:length]
            row[key] = v
    return rows


def split_conditioning(cond: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """:func:`sample_rows` on the CPU, each tensor an own copy (a view would pickle the whole batch's storage into
    every sample); :func:`collate_conditioning` pads again and rebuilds the mask."""
    return [{k: v.detach().cpu().clone() for k, v in row.items()} for row in sample_rows(cond, n)]


def cfg_branches(row: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A sample's CFG branches (:func:`sample_rows`' row) under the positive keys: its prompt, then (when the row has
    ``negative_*`` keys) its negative prompt, each with the inputs both branches take (``SHARED``)."""
    pos = {k: v for k, v in row.items() if not k.startswith(NEGATIVE)}
    if not any(k.startswith(NEGATIVE) for k in row):
        return [pos]
    neg = {k[len(NEGATIVE) :]: v for k, v in row.items() if k.startswith(NEGATIVE)}
    return [pos, {**{k: row[k] for k in SHARED if k in row}, **neg}]


def batch_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples' CFG branches (:func:`sample_rows`) as the rows of one transformer call, under the positive keys:
    every prompt, then (when the rows have ``negative_*`` keys) every negative prompt, padded to one text length
    with a mask where lengths differ (:func:`collate_conditioning`)."""
    branches = [cfg_branches(r) for r in rows]
    return collate_conditioning([b[k] for k in range(len(branches[0])) for b in branches])


def window_rows(row: dict[str, torch.Tensor], masked: bool, bucket: int) -> dict[str, torch.Tensor]:
    """One sample's inputs to an SDE-window call (module docstring), ``[branches, ...]`` under the positive keys
    (:func:`cfg_branches`). ``masked`` (a variable-length text, Qwen-Image's): each branch's ``prompt_embeds``
    right-padded to ``L = ceil(max(branch lengths) / bucket) * bucket`` tokens with its ``prompt_embeds_mask``
    (1 = token), the mask kept even where nothing is padded, so the sample's shapes depend on its own text only."""
    branches = cfg_branches(row)
    if masked:
        longest = max(len(b["prompt_embeds"]) for b in branches)
        length = -(-longest // bucket) * bucket
        for b in branches:
            emb = b["prompt_embeds"]
            b["prompt_embeds"] = torch.nn.functional.pad(emb, (0, 0, 0, length - len(emb)))
            b["prompt_embeds_mask"] = (torch.arange(length, device=emb.device) < len(emb)).long()
    return {k: torch.stack([b[k] for b in branches]) for k in branches[0]}


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` without waiting for the device: a view for consecutive rows, else an index copied to the device
    without blocking (indexing with a list copies it there and waits for the stream)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0] : rows[0] + len(rows)]
    return x.index_select(0, torch.tensor(rows).to(x.device, non_blocking=True))


@dataclass
class StepConditioning:
    """The transformer's inputs for a batch on the policy's device in its compute dtype, made once per batch
    (:meth:`DiffusionPolicy.prepare`) and used by every denoising step: ``rows`` per sample (:func:`window_rows`, for
    the SDE window's calls), ``batched`` the whole batch (:func:`batch_rows`, for the rollout's ODE steps and the
    final-latent losses)."""

    rows: list[dict[str, torch.Tensor]]
    batched: dict[str, torch.Tensor] | None = None
    # A window call's inputs by the samples it holds: built at its first step, reused by the window's other steps.
    calls: dict[tuple[int, ...], dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Samples of one shape key may share a window call (their tensors' shapes: the text bucket, Qwen-Image-Edit's
        # input images).
        self.shapes = [tuple((k, tuple(v.shape)) for k, v in r.items()) for r in self.rows]

    def window_call(self, samples: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The call's rows: every sample's prompt, then (CFG) every sample's negative prompt."""
        if samples not in self.calls:
            rows = [self.rows[s] for s in samples]
            self.calls[samples] = {k: torch.stack([r[k] for r in rows], 1).flatten(0, 1) for k in rows[0]}
        return self.calls[samples]


def collate_conditioning(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch tensors from :func:`split_conditioning` rows. Sequences of different lengths are right-padded with
    zeros and get a ``<key>_mask`` (1 = token, 0 = padding), as ``QwenImagePipeline.encode_prompt`` pads a batch;
    sequences of one length get no mask (the pipeline's "all valid" ``None``). SD3's and Wan's encoders give
    fixed-length sequences, so only Qwen-Image's ever get a mask."""
    out: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        lengths = [v.shape[0] for v in values]
        if values[0].ndim < 2 or len(set(lengths)) == 1:
            out[key] = torch.stack(values)
            continue
        longest = max(lengths)
        out[key] = torch.stack([torch.nn.functional.pad(v, (0, 0, 0, longest - len(v))) for v in values])
        dev = values[0].device
        out[f"{key}_mask"] = (
            torch.arange(longest, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]
        ).long()
    return out


class _Adapter:
    """What the families share: the initial noise from the pipeline's own ``prepare_latents``, one transformer call
    on ``(x, t)`` with the prompt embeddings (each family adds its own inputs, :meth:`inputs`), standard CFG."""

    # Latent channels per transformer input channel: Qwen-Image packs 2x2 latent patches into one token.
    packed = 1
    # Whether the text encoder gives variable-length sequences with a mask (Qwen-Image) rather than fixed ones.
    text_masked = False

    def __init__(self, pipe, cfg: SamplingConfig):
        self.pipe, self.cfg = pipe, cfg
        # diffusers' WanPipeline refuses it too
        if cfg.guidance_scale_2 is not None and boundary_timestep(pipe) is None:
            raise ValueError(
                f"actor_rollout_ref.rollout.pipeline.guidance_scale_2={cfg.guidance_scale_2} is the CFG scale of Wan "
                f"2.2's low-noise expert, but this {type(pipe).__name__} has one transformer (no transformer_2 and "
                "boundary_ratio); drop it (guidance_scale applies to every step)"
            )

    def cfg_scale(self, low_noise: bool) -> float:
        """A step's CFG scale: ``guidance_scale``; on Wan 2.2's low-noise expert's steps ``guidance_scale_2`` when
        set (diffusers' ``WanPipeline``: ``None`` = ``guidance_scale``)."""
        if low_noise and self.cfg.guidance_scale_2 is not None:
            return float(self.cfg.guidance_scale_2)
        return float(self.cfg.guidance_scale)

    def uses_cfg(self) -> bool:
        """Whether the negative prompt runs (some step's scale > 1; verl-omni's Wan rule, either of the pair)."""
        return self.cfg.guidance_scale > 1 or (self.cfg.guidance_scale_2 or 0.0) > 1

    def latent_frames(self) -> tuple[int, ...]:
        """``prepare_latents``' frame count, for a video family; none for images."""
        return ()

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        p = self.pipe
        return p.prepare_latents(
            len(generators),
            p.transformer.config.in_channels // self.packed,
            self.cfg.height,
            self.cfg.width,
            *self.latent_frames(),
            torch.float32,
            p.device,
            generators,
        )

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def inputs(self, x: torch.Tensor, c: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The family's transformer inputs besides the latents, timestep and prompt embeddings."""
        return {}

    def forward(self, x, t, c, model):
        return model(
            hidden_states=x,
            timestep=self.timestep(t).expand(x.shape[0]),
            encoder_hidden_states=c["prompt_embeds"],
            return_dict=False,
            **self.inputs(x, c),
        )[0]

    def guide(self, pos, neg, scale: float):
        return neg + scale * (pos - neg)


def _denormalize(vae, lat: torch.Tensor) -> torch.Tensor:
    """Latents in the VAE's own scale (``latents_mean`` / ``latents_std`` per channel, Qwen-Image's and Wan's VAE),
    computed in ``lat``'s dtype."""
    zc = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, zc, 1, 1, 1).to(lat)
    std = torch.tensor(vae.config.latents_std).view(1, zc, 1, 1, 1).to(lat)
    return lat * std + mean


class _QwenImageAdapter(_Adapter):
    """QwenImagePipeline: packed 2x2 latent tokens, text embeddings with a mask, timestep / 1000, true CFG."""

    packed = 4
    text_masked = True

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        emb, mask = self.pipe.encode_prompt(prompt=prompts, device=self.pipe.device, **_seq_len(self.cfg))
        cond = {"prompt_embeds": emb, "prompt_embeds_mask": mask}
        if self.cfg.true_cfg_scale > 1:  # the one negative prompt, encoded once for the batch
            neg, neg_mask = self.pipe.encode_prompt(prompt=[" "], device=self.pipe.device, **_seq_len(self.cfg))
            cond["negative_prompt_embeds"] = neg.expand(len(prompts), *neg.shape[1:])
            cond["negative_prompt_embeds_mask"] = None if neg_mask is None else neg_mask.expand(len(prompts), -1)
        return cond

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        return t / 1000

    def inputs(self, x: torch.Tensor, c: dict[str, torch.Tensor]) -> dict[str, Any]:
        f = self.pipe.vae_scale_factor * 2
        shapes = [[(1, self.cfg.height // f, self.cfg.width // f)]] * x.shape[0]
        return {"guidance": None, "encoder_hidden_states_mask": c.get("prompt_embeds_mask"), "img_shapes": shapes}

    def cfg_scale(self, low_noise: bool) -> float:
        return float(self.cfg.true_cfg_scale)

    def guide(self, pos, neg, scale: float):
        """Qwen-Image's norm-preserving true CFG (``QwenImagePipeline.__call__``), on fp32 predictions."""
        comb = neg + scale * (pos - neg)
        return comb * (pos.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    def decode(self, x) -> torch.Tensor:
        p = self.pipe
        lat = p._unpack_latents(x, self.cfg.height, self.cfg.width, p.vae_scale_factor).to(p.vae.dtype)
        return p.vae.decode(_denormalize(p.vae, lat), return_dict=False)[0][:, :, 0]


class _QwenImageEditAdapter(_QwenImageAdapter):
    """QwenImageEditPipeline / QwenImageEditPlusPipeline: Qwen-Image conditioned on each prompt's input images
    (``models.qwen_image_edit``): the VL encoder reads them with the instruction, and their packed VAE latents follow
    the noisy latents in the transformer's sequence, whose prediction for the noisy latents is kept."""

    def encode(self, prompts: list[EditPrompt]) -> dict[str, torch.Tensor]:
        bare = [p for p in prompts if not isinstance(p, EditPrompt)]
        if bare:
            raise ValueError(
                f"{type(self.pipe).__name__} edits input images, but the prompt {bare[0]!r} has none. Fix: give the "
                "dataset rows an 'images' column (verl-omni's edit rows; trainer.dataset)"
            )
        texts, images = [p.text for p in prompts], [p.images for p in prompts]
        cfg = self.cfg
        rows = encode_edit(self.pipe, texts, images, cfg.height, cfg.width, cfg.true_cfg_scale > 1, **_seq_len(cfg))
        return collate_conditioning(rows)

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        p = self.pipe
        channels = p.transformer.config.in_channels // self.packed
        return p.prepare_latents(
            None, len(generators), channels, self.cfg.height, self.cfg.width, torch.float32, p.device, generators
        )[0]

    def inputs(self, x: torch.Tensor, c: dict[str, torch.Tensor]) -> dict[str, Any]:
        h, w = self.cfg.height, self.cfg.width
        one = condition_shapes(self.pipe, h, w, 1)
        n_images = c[IMAGE_LATENTS].shape[1] // (one[1][1] * one[1][2])
        return {**super().inputs(x, c), "img_shapes": [condition_shapes(self.pipe, h, w, n_images)] * x.shape[0]}

    def forward(self, x, t, c, model):
        return super().forward(torch.cat([x, c[IMAGE_LATENTS]], dim=1), t, c, model)[:, : x.shape[1]]


class _SD3Adapter(_Adapter):
    """StableDiffusion3Pipeline: spatial latents, CLIP+T5 embeddings with pooled projections, standard CFG."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        do_cfg = self.cfg.guidance_scale > 1
        pe, npe, ppe, nppe = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.pipe.device,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=[""] * len(prompts) if do_cfg else None,
            **_seq_len(self.cfg),
        )
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
        if do_cfg:
            cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"] = npe, nppe
        return cond

    def inputs(self, x: torch.Tensor, c: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"pooled_projections": c["pooled_prompt_embeds"]}

    def decode(self, x) -> torch.Tensor:
        vae = self.pipe.vae
        lat = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return vae.decode(lat.to(vae.dtype), return_dict=False)[0]


class _FluxAdapter(_SD3Adapter):
    """FluxPipeline (FLUX.1): 2x2-packed latent tokens with their position ids (``img_ids``; ``txt_ids`` zeros),
    CLIP's pooled projection and T5's sequence, timestep / 1000. FLUX.1-dev's guidance-distilled transformer takes
    ``guidance_scale`` as an embedding (diffusers' meaning: one forward, no negative prompt); ``true_cfg_scale`` > 1
    also runs the empty negative prompt (diffusers' true CFG, standard combination). The SDE window works on the
    packed tokens, stored by the rollout and recomputed by the update alike; packing only permutes a latent's
    elements, so the step's Gaussian log-prob is the same as on the unpacked latents."""

    packed = 4

    def __init__(self, pipe, cfg: SamplingConfig):
        super().__init__(pipe, cfg)
        self.embeds_guidance = bool(pipe.transformer.config.guidance_embeds)
        if not self.embeds_guidance and cfg.guidance_scale != 1.0:  # diffusers ignores it silently
            raise ValueError(
                f"actor_rollout_ref.rollout.pipeline.guidance_scale={cfg.guidance_scale} is FLUX.1-dev's guidance "
                "embedding, but this FluxTransformer2DModel has none (guidance_embeds=False, e.g. FLUX.1-schnell); "
                "drop it, or set pipeline.true_cfg_scale > 1 for classifier-free guidance with a negative prompt"
            )

    def cfg_scale(self, low_noise: bool) -> float:
        return float(self.cfg.true_cfg_scale)

    def uses_cfg(self) -> bool:
        return self.cfg.true_cfg_scale > 1

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        kw = dict(device=self.pipe.device, **_seq_len(self.cfg))
        pe, ppe, _ = self.pipe.encode_prompt(prompt=prompts, **kw)  # txt_ids: zeros, made per call (inputs)
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
        if self.uses_cfg():
            neg, neg_pooled, _ = self.pipe.encode_prompt(prompt=[""] * len(prompts), **kw)
            cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"] = neg, neg_pooled
        return cond

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        return super().init_latents(generators)[0]  # FluxPipeline.prepare_latents also returns the image ids

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        return t / 1000

    def inputs(self, x: torch.Tensor, c: dict[str, torch.Tensor]) -> dict[str, Any]:
        f = self.pipe.vae_scale_factor * 2  # pixels per packed token side
        guidance = torch.full((x.shape[0],), self.cfg.guidance_scale, device=x.device) if self.embeds_guidance else None
        return {
            "pooled_projections": c["pooled_prompt_embeds"],
            "guidance": guidance,
            "txt_ids": x.new_zeros(c["prompt_embeds"].shape[1], 3),
            "img_ids": self.pipe._prepare_latent_image_ids(
                None, self.cfg.height // f, self.cfg.width // f, x.device, x.dtype
            ),
        }

    def decode(self, x) -> torch.Tensor:
        return super().decode(self.pipe._unpack_latents(x, self.cfg.height, self.cfg.width, self.pipe.vae_scale_factor))


class _WanAdapter(_Adapter):
    """WanPipeline (text-to-video): 5-D latents [B, C, T', H', W'], UMT5 embeddings, standard CFG."""

    def __init__(self, pipe, cfg: SamplingConfig):
        super().__init__(pipe, cfg)
        k = pipe.vae_scale_factor_temporal
        if (cfg.num_frames - 1) % k:
            # Wan's VAE keeps the first frame and packs each k after it into one latent frame: diffusers' WanPipeline
            # and verl-omni's Wan 2.2 rollout round to k*n+1 frames the same way (its DanceGRPO recipe's 8 -> 9)
            frames = max(cfg.num_frames // k * k + 1, 1)
            logging.getLogger(__name__).warning(
                "actor_rollout_ref.rollout.pipeline.num_frames=%d does not fit Wan's temporal compression %d: "
                "generating %d frames (k*n+1, as diffusers and verl-omni round it)",
                cfg.num_frames,
                k,
                frames,
            )
            cfg.num_frames = frames

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        do_cfg = self.uses_cfg()
        emb, neg = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[""] * len(prompts) if do_cfg else None,
            do_classifier_free_guidance=do_cfg,
            device=self.pipe.device,
            **_seq_len(self.cfg),
        )
        return {"prompt_embeds": emb, "negative_prompt_embeds": neg} if do_cfg else {"prompt_embeds": emb}

    def latent_frames(self) -> tuple[int, ...]:
        return (self.cfg.num_frames,)

    def decode(self, x) -> torch.Tensor:
        vae = self.pipe.vae
        return vae.decode(_denormalize(vae, x).to(vae.dtype), return_dict=False)[0]  # [B, 3, T, H, W]


_ADAPTERS = {
    "QwenImagePipeline": _QwenImageAdapter,
    "StableDiffusion3Pipeline": _SD3Adapter,
    "WanPipeline": _WanAdapter,
    **dict.fromkeys(EDIT_PIPELINES, _QwenImageEditAdapter),
    "FluxPipeline": _FluxAdapter,
}
assert tuple(_ADAPTERS) == SUPPORTED_PIPELINES  # the start check (config.model_paths) refuses the others by name


# What a :meth:`DiffusionPolicy.with_sampling` view has of its own; everything else is the policy's.
_VIEW_STATE = ("sampling", "adapter", "sigmas", "timesteps", "sigma_max", "denoisers", "cfg_scales")


def _seq_len(cfg: SamplingConfig) -> dict[str, int]:
    """``encode_prompt``'s ``max_sequence_length`` (verl-omni's ``rollout.pipeline.max_sequence_length``)."""
    return {"max_sequence_length": int(cfg.max_sequence_length)} if cfg.max_sequence_length else {}


def sample_generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def window_noise(generators: list[torch.Generator], like: torch.Tensor, steps: int) -> torch.Tensor:
    """The SDE window's noise ``[B, steps, ...]``, drawn up front: sample ``i``'s from its own CPU generator in
    step order (the same numbers as drawing at each step, so a sample is the same in any batch) and moved to the
    device in one copy, from pinned memory without blocking on CUDA, instead of a pageable copy per step."""
    noise = torch.stack(
        [
            torch.stack([torch.randn(like.shape[1:], generator=g) for _ in range(steps)])
            if steps
            else torch.empty(0, *like.shape[1:])
            for g in generators
        ]
    )
    if like.device.type == "cuda":
        noise = noise.pin_memory()
    return noise.to(like.device, like.dtype, non_blocking=True)


class DiffusionPolicy(TrainableModule):
    """Load a pipeline, add LoRA to its transformer, sample with the SDE window, recompute log-probs."""

    continuous_batching: ClassVar[bool] = False  # a device batch is one run of denoising steps (models.rollout_policy)

    def __init__(
        self, model_path: Any, sampling: SamplingConfig, *, trainable_dtype: torch.dtype | None = None, **options: Any
    ):
        """``model_path``: a local directory, hub id, ``tiny:<name>`` or ``random:<family>`` (built with random weights
        on ``device``, its configs changed by ``override_config``: ``models.random_models``), or an already built pipeline whose weights
        are in ``dtype`` (``bench/gpu_step.py`` builds the real Qwen-Image architecture with random weights, which
        no directory holds). ``options``: :class:`~omni_async.models.lora.PolicyOptions`; its ``dtype`` is the frozen
        weights' dtype (``fsdp_config.model_dtype``), which the transformer computes in. The trainable weights (LoRA,
        or the whole transformer for a full fine-tune) compute in ``trainable_dtype`` (``None``: ``dtype``) and are
        stepped as fp32 masters (``models.lora``); latents, the SDE step, log-probs and KL are fp32, and tensors are
        cast to ``dtype`` only at the transformer's input (``step``). A directory loads straight onto ``device``
        (``models.loading``)."""
        from diffusers import DiffusionPipeline

        opts = PolicyOptions(**options)
        device, dtype = opts.device, opts.dtype
        if isinstance(model_path, DiffusionPipeline):
            self.pipe = model_path.to(device)
        elif is_random(model_path):  # the published architecture, random weights built on the device (random_models)
            self.pipe = build_pipeline(model_path, opts.override_config, device, dtype)
        else:
            if opts.override_config:
                raise ValueError(
                    f"actor_rollout_ref.model.override_config changes a random:<family> architecture; "
                    f"{model_path!r} loads as saved: drop override_config, or use random:<family>"
                )
            path = resolve_model_path(model_path)
            self.pipe = DiffusionPipeline.from_pretrained(
                path, **pipeline_load_kwargs(device, dtype), **edit_load_kwargs(path)
            )
            if self.pipe.device != torch.device(device):  # e.g. "cuda" asked, the current device given
                self.pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        family = type(self.pipe).__name__
        if family not in _ADAPTERS:
            raise ValueError(
                f"actor_rollout_ref.model.path={model_path!r} is a {family}; supported: {', '.join(_ADAPTERS)}"
            )
        self.sampling = sampling
        self._in_reference = False  # reference(): window calls of at most sampling.reference_batch samples
        self.adapter = _ADAPTERS[family](self.pipe, sampling)
        for module in (m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)):
            module.requires_grad_(False)
        self.transformer = self.pipe.transformer
        # The transformer, or Wan 2.2's two experts as one module (models.experts): LoRA / full fine-tune on both.
        self.init_trainable(
            trained_module(self.pipe),
            opts.lora_rank,
            opts.lora_alpha,
            opts.target_modules or ["to_q", "to_k", "to_v"],
            dtype=trainable_dtype or dtype,
        )
        # The transformer's input dtype: the frozen weights', LoRA or full fine-tune (fp32 only as masters).
        self.compute_dtype = dtype
        if opts.gradient_checkpointing:  # recompute each block's activations in backward instead of keeping them
            self.trainable.enable_gradient_checkpointing()
        accelerate(self.pipe, opts.attn_backend, opts.compile_blocks, device)  # model.attn_backend, use_torch_compile
        self.configure_vae()
        self.frozen_offloaded = False  # param_offload: text encoder(s) and VAE on the CPU (offload_frozen)
        self.frozen_offloaded_this_step = False  # at most one offload (so one round trip) per step (begin_step)
        self.host_offload: HostOffload | None = None  # made on the first offload
        self._set_schedule()

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def configure_vae(self) -> None:
        """diffusers' own VAE memory switches (``enable_slicing`` / ``enable_tiling``, on AutoencoderKL,
        AutoencoderKLQwenImage and AutoencoderKLWan), set from the sampling config.

        Slicing decodes a batch one sample at a time: the same pixels, the decode peak of one sample instead of B
        (the memory plan measures 3.6 GB per 1024² Qwen-Image image, 5.2 GB per 33-frame 512² Wan video). Tiling
        decodes overlapping spatial tiles (256 px for Qwen-Image / Wan) and blends their seams, so its pixels differ
        slightly from a plain decode; it is what makes video fit (20.8 GB -> 2.0 GB per 1024² Wan video), hence
        ``vae_tiling=None`` = on for video, off for images. Frames no larger than a tile decode plainly either way.
        """
        vae, cfg = self.pipe.vae, self.sampling
        tiling = cfg.num_frames > 1 if cfg.vae_tiling is None else cfg.vae_tiling
        vae.enable_slicing() if cfg.vae_slicing else vae.disable_slicing()
        vae.enable_tiling() if tiling else vae.disable_tiling()

    def conditioning_from(self, tensors, batched: bool = False) -> StepConditioning:
        """The prompt encodings a batch carries (``ImageModality.batch_tensors`` from each sample's
        ``ImageResult.conditioning``), prepared for :meth:`step` on the policy's device: the update and the log-prob
        recompute take these instead of running the text encoder again. The batch's padding (the mini-batch's
        longest prompt) is trimmed on the host before anything moves. ``batched``: also the whole batch's rows, for
        one transformer call (``velocity(..., per_sample=False)``)."""
        keys = tensors.keys()
        if "prompt_embeds" not in keys:
            raise KeyError(
                "the batch carries no prompt_embeds: image batches are built by "
                "ImageModality.batch_tensors from ImageResult.conditioning (made at rollout)"
            )
        return self.prepare({k: tensors[k] for k in COND_KEYS if k in keys}, batched=batched)

    def prepare(self, cond: dict[str, torch.Tensor] | StepConditioning, batched: bool = False) -> StepConditioning:
        """Prompt encodings (a batch, as ``encode`` or :func:`collate_conditioning` gives them) as the transformer
        inputs every denoising step uses (module docstring): trimmed per sample, then each sample's window rows
        (:func:`window_rows`: CFG branches stacked, a masked text padded to its bucket), on the device, floating
        tensors in the transformer's dtype; with ``batched`` also the whole batch's rows for one call. Already
        prepared conditioning is returned as is."""
        if isinstance(cond, StepConditioning):
            return cond
        cd, dev = self.compute_dtype, self.device

        def place(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v.to(dev, cd if v.is_floating_point() else v.dtype) for k, v in rows.items()}

        rows = sample_rows(cond, len(cond["prompt_embeds"]))
        masked, bucket = self.adapter.text_masked, self.sampling.window_text_bucket
        window = [place(window_rows(r, masked, bucket)) for r in rows]
        return StepConditioning(window, place(batch_rows(rows)) if batched else None)

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The pipeline's modules besides the transformer(s) it denoises with (Wan 2.2: both experts): text
        encoder(s) and VAE. Only generation uses them (the update takes the carried prompt encodings), so they are
        what ``param_offload`` moves."""
        denoisers = [self.transformer, *getattr(self.trainable, "experts", ())]
        return [
            m
            for m in self.pipe.components.values()
            if isinstance(m, torch.nn.Module) and not any(m is d for d in denoisers)
        ]

    def offload_frozen(self, offload: bool = True) -> None:
        """``param_offload``: move the frozen modules to the host (``offload=True``, before an update) or back to the
        transformer's device (``False``; :meth:`rollout` does it, so generation never finds them away), through
        persistent (pinned on CUDA) host buffers with non-blocking copies (``models.offload.HostOffload``).

        Moves only on a change, and offloads at most once per training step (:meth:`begin_step`): when generation
        and updates interleave on the device (one-step off-policy, the mini-batch pipeline), the frozen modules
        make one round trip per step and then stay on the device for the rest of the step's updates, instead of
        moving at every switch."""
        if offload and not self.frozen_offloaded and not self.frozen_offloaded_this_step:
            if self.host_offload is None:
                self.host_offload = HostOffload(self.frozen_modules())
            self.host_offload.to_host()
            self.frozen_offloaded = self.frozen_offloaded_this_step = True
        elif not offload and self.frozen_offloaded:
            self.host_offload.to_device(self.device)
            self.frozen_offloaded = False

    def begin_step(self) -> None:
        """A new training step (the worker's weight sync): ``param_offload`` may offload once more."""
        self.frozen_offloaded_this_step = False

    # ---- schedule -------------------------------------------------------------------------------------------
    def _set_schedule(self) -> None:
        self.sigmas, self.timesteps = self._schedule()
        # The sde step's sigma = 1 guard: read on the host once here, not once per denoising step.
        self.sigma_max = float(self.sigmas[1])
        # The transformer of each step (Wan 2.2: the expert diffusers' WanPipeline picks, models.experts) and its CFG
        # scale (Wan 2.2: guidance_scale_2 on the low-noise expert's steps), chosen on the host once, for the rollout
        # and the update alike.
        low = low_noise_steps(self.pipe, self.timesteps.tolist())
        self.denoisers = [self.pipe.transformer_2 if lo else self.pipe.transformer for lo in low]
        self.cfg_scales = [self.adapter.cfg_scale(lo) for lo in low]

    def _schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmas (N+1, ending at 0) and timesteps (N) as the pipeline's own ``__call__`` makes them.

        - QwenImagePipeline: ``set_timesteps(sigmas=linspace(1, 1/N, N), mu=calculate_shift(image_seq_len))``
          (dynamic shift; also verl-omni's Qwen-Image FlowGRPO schedule). FluxPipeline the same (its 2x2-packed
          token count, max_shift 1.15 from its scheduler config).
        - StableDiffusion3Pipeline: ``set_timesteps(N)``: the scheduler's own grid with its static ``shift``
          (``mu`` from SD3's ``calculate_shift`` only where the config uses dynamic shifting), as the SD3 pipeline,
          flow_grpo's ``train_sd3.py`` and verl-omni's SD3 adapter do.
        - WanPipeline: Wan ships UniPC (``use_flow_sigmas``, ``flow_shift``), whose own grid is
          ``shift(linspace(1, 1/1000, N+1)[:-1])`` with the first sigma nudged to ``1 - 1e-6`` (a guard of UniPC's
          multistep solver that would make the SDE's ``sigma / (1 - sigma)`` explode). The SDE step is an Euler
          step on flow sigmas, so Wan uses ``FlowMatchEuler(shift=flow_shift)`` on ``linspace(1, 1/N, N)``: the
          same shifted grid up to <0.1%, exactly 1 at the start, and verl-omni's Wan schedule.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler

        own, n, p = self.pipe.scheduler, self.sampling.num_inference_steps, self.pipe
        family = type(p).__name__
        if isinstance(own, FlowMatchEulerDiscreteScheduler):
            sched = FlowMatchEulerDiscreteScheduler.from_config(own.config)  # a copy: the pipeline's stays as is
        else:
            sched = FlowMatchEulerDiscreteScheduler(shift=own.config.get("flow_shift") or 1.0)
        c = sched.config
        kwargs: dict[str, Any] = {}
        sd3 = family == "StableDiffusion3Pipeline"
        if c.get("use_dynamic_shifting", False):
            # diffusers' SD3 and Qwen-Image pipelines share calculate_shift; they differ in the image's token count
            # (SD3 patchifies by its transformer's patch size, Qwen-Image packs 2x2) and in max_shift's default.
            from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

            patch = p.transformer.config.patch_size if sd3 else 2
            seq = (self.sampling.height // p.vae_scale_factor // patch) * (
                self.sampling.width // p.vae_scale_factor // patch
            )
            kwargs["mu"] = calculate_shift(
                seq,
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.16 if sd3 else 1.15),
            )
        if sd3:
            sched.set_timesteps(n, device=p.device, **kwargs)
        else:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device=p.device, **kwargs)
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    # ---- sampling and scoring -------------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self.adapter.encode(list(prompts))

    def encode_once(self, prompts: list[str | EditPrompt]) -> dict[str, torch.Tensor]:
        """:meth:`encode`'s batch, each distinct prompt encoded once and its rows repeated for the samples that
        share it (a GRPO group's). Only prompts' encodings are reused, never a sample's noise: its pixels are
        what :meth:`encode` of the whole list gives, to the text encoder's rounding at its batch shape."""
        first: dict[str | EditPrompt, int] = {}
        index = [first.setdefault(p, len(first)) for p in prompts]
        cond = self.encode(list(first))
        if len(first) == len(prompts):
            return cond
        return {k: None if v is None else take_rows(v, index) for k, v in cond.items()}

    def _guided(self, x: torch.Tensor, i: int, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """One transformer call at step ``i`` on ``rows`` for latents ``x`` [B, ...] (rows = B, or 2B under CFG: the
        positive branches, then the negative ones), with that step's transformer (Wan 2.2: its expert); the
        prediction in fp32, the branches combined in fp32 with that step's CFG scale."""
        return self._guided_call(x, self.timesteps[i], rows, self.denoisers[i], self.cfg_scales[i])

    def _guided_call(
        self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], model, scale: float
    ) -> torch.Tensor:
        """:meth:`_guided` at timestep ``t``: one for the batch, or ``[B]``, one per sample."""
        k = len(rows["prompt_embeds"]) // len(x)
        if t.ndim:  # per-sample timesteps: the CFG branches' rows repeat the samples
            t = t.repeat(k)
        pred = self.adapter.forward(x.repeat(k, *[1] * (x.ndim - 1)), t, rows, model).float()
        return self.adapter.guide(pred[: len(x)], pred[len(x) :], scale) if k > 1 else pred

    def _guided_steps(self, x: torch.Tensor, steps: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch in one transformer call with each sample at its own step ``steps[b]`` (diffusers' transformers
        take a ``[B]`` timestep), one call per transformer when the steps fall to different Wan 2.2 experts; ``rows``
        the batch's (:func:`batch_rows`). For DiffusionNFT's forward-process steps, which score no log-prob, so the
        bit-for-bit per-sample shapes of the SDE window (module docstring) are not needed."""
        idx = steps.tolist()
        t = self.timesteps[steps.to(self.timesteps.device)]
        return self._guided_experts(x, t, [(self.denoisers[k], self.cfg_scales[k]) for k in idx], rows)

    def _guided_experts(
        self, x: torch.Tensor, t: torch.Tensor, experts: list[tuple[Any, float]], rows: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The batch at timesteps ``t`` [B], sample ``b`` with its transformer and CFG scale ``experts[b]``: one call
        per transformer (Wan 2.2's experts), each sample's output in its row."""
        groups: dict[int, tuple[Any, float, list[int]]] = {}  # one per expert (its CFG scale goes with it)
        for r, (model, scale) in enumerate(experts):
            groups.setdefault(id(model), (model, scale, []))[2].append(r)
        if len(groups) == 1:
            return self._guided_call(x, t, rows, *experts[0])
        n, out = len(x), None
        cfg_rows = len(rows["prompt_embeds"]) // n
        for model, scale, members in groups.values():
            sel = [m + n * b for b in range(cfg_rows) for m in members]  # the members' rows in each CFG branch
            sub = {key: v[sel] for key, v in rows.items()}
            pred = self._guided_call(x[members], t[members], sub, model, scale)
            if out is None:
                out = pred.new_empty((n, *pred.shape[1:]))
            out[members] = pred
        return out

    @contextlib.contextmanager
    def reference(self):
        """The adapter-off reference (``TrainableModule.reference``), its SDE-window calls capped at
        ``sampling.reference_batch`` samples (verl's ``ref.log_prob_micro_batch_size_per_gpu``)."""
        with super().reference():
            self._in_reference = True
            try:
                yield
            finally:
                self._in_reference = False

    def velocity(
        self,
        cond: dict[str, torch.Tensor] | StepConditioning,
        x: torch.Tensor,
        i: int | torch.Tensor,
        *,
        per_sample: bool = True,
    ) -> torch.Tensor:
        """The (CFG-guided) velocity at step ``i``, fp32. ``per_sample``: each sample's velocity as the SDE window
        computes it, the same bits in any batch (module docstring: calls of ``window_batch`` samples,
        :meth:`_window_velocity`); ``False``: one call for the batch (needs ``prepare(..., batched=True)``).
        ``i``: one step for the batch, or a ``[B]`` tensor of per-sample steps (samples whose SDE windows start at
        different steps; batched, DiffusionNFT's forward-process steps: one call with per-sample timesteps,
        :meth:`_guided_steps`). The gradient flows through both CFG branches, as in flow_grpo and verl-omni.
        ``batched`` on :meth:`conditioning_from` / :meth:`prepare` makes the batched rows."""
        cond = self.prepare(cond)
        xs = x.to(self.compute_dtype)
        if not per_sample:
            if torch.is_tensor(i):
                return self._guided_steps(xs, i, cond.batched)
            return self._guided(xs, i, cond.batched)
        steps = i.tolist() if torch.is_tensor(i) else [int(i)] * len(xs)  # the batch's steps (host): one read per call
        return self._window_velocity(cond, xs, steps, list(range(len(xs))))

    def _window_velocity(
        self, cond: StepConditioning, x: torch.Tensor, steps: list[int], samples: list[int]
    ) -> torch.Tensor:
        """The SDE window's velocity (fp32) of ``x`` [B, ...], row ``b`` being ``cond``'s sample ``samples[b]`` at
        step ``steps[b]``: calls of exactly ``window_batch`` samples of one shape key and one transformer (Wan 2.2's
        experts), in the order the rows come; a short call is filled with copies of its last sample and their
        outputs dropped (module docstring). Samples at different steps share a call with per-sample timesteps."""
        w = self.sampling.window_batch
        if self._in_reference and self.sampling.reference_batch:
            w = min(w, int(self.sampling.reference_batch))
        groups: dict[tuple[Any, ...], list[int]] = {}
        for b, (k, s) in enumerate(zip(steps, samples, strict=True)):
            groups.setdefault((cond.shapes[s], id(self.denoisers[k]), self.cfg_scales[k]), []).append(b)
        preds, order = [], []
        for members in groups.values():
            for c in range(0, len(members), w):
                chunk = members[c : c + w]
                full = chunk + chunk[-1:] * (w - len(chunk))
                ks = [steps[b] for b in full]
                t = self.timesteps[ks[0]] if len(set(ks)) == 1 else take_rows(self.timesteps, ks)
                rows = cond.window_call(tuple(samples[b] for b in full))
                pred = self._guided_call(take_rows(x, full), t, rows, self.denoisers[ks[0]], self.cfg_scales[ks[0]])
                preds.append(pred[: len(chunk)])
                order += chunk
        out = torch.cat(preds) if len(preds) > 1 else preds[0]
        if order == sorted(order):
            return out
        return take_rows(out, sorted(range(len(order)), key=order.__getitem__))

    def train_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's training grid, ``num_train_timesteps`` sigmas and timesteps (descending; cached): the
        flow-matching Euler scheduler of :meth:`_schedule` as constructed, without ``set_timesteps`` (its static
        ``shift``; none where it shifts dynamically), where Diffusion-DPO draws its training timesteps, as verl-omni's
        SD3 DPO adapter (``algos.dpo``)."""
        if getattr(self, "_train_grid", None) is None:
            from diffusers import FlowMatchEulerDiscreteScheduler

            own = self.pipe.scheduler
            if isinstance(own, FlowMatchEulerDiscreteScheduler):
                sched = FlowMatchEulerDiscreteScheduler.from_config(own.config)
            else:  # Wan's UniPC: the flow-matching grid at its flow_shift, as _schedule
                sched = FlowMatchEulerDiscreteScheduler(shift=own.config.get("flow_shift") or 1.0)
            self._train_grid = (sched.sigmas.float().clone(), sched.timesteps.float().clone())
        return self._train_grid

    def velocity_at(
        self, cond: dict[str, torch.Tensor] | StepConditioning, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """The (CFG-guided) velocity, fp32, of the batch in one call at timesteps ``t`` [B] off the rollout's grid
        (Diffusion-DPO's, :meth:`train_grid`); Wan 2.2's expert by diffusers' rule on each ``t``. Needs
        ``prepare(..., batched=True)``'s rows."""
        cond = self.prepare(cond)
        boundary = boundary_timestep(self.pipe)
        low = [boundary is not None and v < boundary for v in t.tolist()]
        experts = [(self.pipe.transformer_2 if lo else self.pipe.transformer, self.adapter.cfg_scale(lo)) for lo in low]
        return self._guided_experts(x.to(self.compute_dtype), t.to(self.device), experts, cond.batched)

    def step(
        self,
        cond: dict[str, torch.Tensor] | StepConditioning,
        x: torch.Tensor,
        i: int | torch.Tensor,
        *,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        noise_level: float | None = None,
        per_sample: bool = True,
    ) -> SDEStep:
        """Denoising step ``i`` (0-based; or a ``[B]`` tensor of per-sample steps) from ``x``: scores
        ``prev_sample`` or draws with ``noise``. ``cond``: the batch's prompt encodings, or (in loops)
        :meth:`prepare`'s result, made once per batch. ``per_sample``: see :meth:`velocity`; a step whose log-prob
        is used must keep the default."""
        v = self.velocity(cond, x, i, per_sample=per_sample)
        return self.step_with(v, x, i, prev_sample=prev_sample, noise=noise, noise_level=noise_level)

    def step_with(
        self,
        velocity: torch.Tensor,
        x: torch.Tensor,
        i: int | torch.Tensor,
        *,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        noise_level: float | None = None,
    ) -> SDEStep:
        """:meth:`step` with a given velocity (DiffusionOPD: a frozen teacher's at the student's ``x``): this policy's
        SDE step on its own noise grid."""
        k = i.to(self.sigmas.device) if torch.is_tensor(i) else i
        return sde_step_with_logprob(
            velocity,
            x.float(),
            self.sigmas[k],
            self.sigmas[k + 1],
            noise_level=self.sampling.noise_level if noise_level is None else noise_level,
            sde_type=self.sampling.sde_type,
            sigma_max=self.sigma_max,
            prev_sample=prev_sample,
            noise=noise,
            cps_log_prob=self.sampling.cps_log_prob,
        )

    @torch.no_grad()
    def rollout(self, prompts: list[str], seeds: list[int], window: range | list[range] | None) -> Rollout:
        """:meth:`rollout_in_model_dtype`, with the transformer in ``SamplingConfig.rollout_dtype`` when that is set
        (:meth:`sampling_dtype`)."""
        with self.sampling_dtype():
            return self.rollout_in_model_dtype(prompts, seeds, window)

    @contextlib.contextmanager
    def sampling_dtype(self) -> Iterator[None]:
        """verl-omni's ``rollout.dtype`` (its DRM recipe samples in fp32 from a bf16-trained model): inside, the
        trained module's tensors in the weights' dtype (the frozen weights, buffers, an adapter of that dtype) are
        cast to the rollout dtype and the transformer computes in it; after, they are cast back. Only a wider rollout
        dtype is taken (``trainer.config`` refuses the rest), so the round trip is exact (bf16 -> fp32 -> bf16) and
        the update's weights are bit for bit what they were; an fp32 adapter and the fp32 masters are not touched.
        The text encoders and the VAE keep their dtype. The rollout's log-probs then come from another dtype than
        the update's: pi_old must be recomputed (``bypass_mode=false``, verl-omni's default, which the recipe runs)."""
        name = self.sampling.rollout_dtype
        dtype = getattr(torch, name) if name else self.compute_dtype
        model_dtype = self.compute_dtype
        if dtype == model_dtype:
            yield
            return
        module = self.trainable
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.dtype == model_dtype]
        for t in tensors:
            t.data = t.data.to(dtype)
        self.compute_dtype = dtype
        try:
            yield
        finally:
            for t in tensors:
                t.data = t.data.to(model_dtype)
            self.compute_dtype = model_dtype

    def rollout_in_model_dtype(
        self, prompts: list[str], seeds: list[int], window: range | list[range] | None
    ) -> Rollout:
        """Generate one image per (prompt, seed); the steps in a sample's window are SDE (stored), the rest ODE.

        ``window``: one ``range`` for every sample, or one per sample (all of one length), as verl-omni's request
        batches take per-row windows. A step inside some samples' windows runs those samples as SDE (the window's
        calls of ``window_batch`` samples, as every scored step) and the others as one batched ODE call; each sample
        draws its SDE noise from its own generator for its own window, so its result does not depend on the windows
        beside it. Each distinct prompt is encoded once (a GRPO group's samples share it, :meth:`encode_once`);
        nothing in the denoising loop reads the device.
        """
        self.offload_frozen(False)  # the text encoder and VAE are back on the device if an update offloaded them
        n = len(seeds)
        windows = list(window) if isinstance(window, list) else [window if window is not None else range(0)] * n
        if len({len(w) for w in windows}) > 1:
            raise ValueError(f"the samples of one batch need SDE windows of one length, got {windows}")
        size = len(windows[0]) if windows else 0
        gens = sample_generators(seeds)
        if not isinstance(self.adapter, _QwenImageEditAdapter) and any(isinstance(p, EditPrompt) for p in prompts):
            raise ValueError(
                f"the prompt rows carry input images (an 'images' column) but {type(self.pipe).__name__} generates "
                f"from text only. Fix: use an image-editing checkpoint ({', '.join(EDIT_PIPELINES)}) or drop the column"
            )
        cond = self.encode_once(list(prompts))
        prepared = self.prepare(cond, batched=True)
        ode_conds = {tuple(range(n)): prepared}  # the batched conditioning of each set of rows running ODE

        def ode_cond(rows: list[int]) -> StepConditioning:
            if tuple(rows) not in ode_conds:
                ode_conds[tuple(rows)] = self.prepare(
                    {k: take_rows(v, rows) for k, v in cond.items() if v is not None}, batched=True
                )
            return ode_conds[tuple(rows)]

        x = self.adapter.init_latents(gens)
        noise = window_noise(gens, x, size)
        stored = x.new_zeros((n, size + 1, *x.shape[1:])) if size else None
        log_probs = torch.zeros(n, size, device=x.device)
        # fp32 as the step computes it: the losses read mu_theta - mu_old, which a bf16 copy would swamp.
        means = (
            x.new_zeros((n, size, *x.shape[1:]), dtype=torch.float32) if size and self.sampling.window_means else None
        )
        for i in range(self.sampling.num_inference_steps):
            sde = [r for r, w in enumerate(windows) if i in w]
            ode = [r for r in range(n) if i not in windows[r]]
            if not sde:
                x = self.step(prepared, x, i, noise=torch.zeros_like(x), noise_level=0.0, per_sample=False).prev_sample
                continue
            offsets = [i - windows[r].start for r in sde]
            x_sde = take_rows(x, sde)
            v = self._window_velocity(prepared, x_sde.to(self.compute_dtype), [i] * len(sde), sde)
            noise_i = torch.stack([noise[r, j] for r, j in zip(sde, offsets, strict=True)])
            out = self.step_with(v, x_sde, i, noise=noise_i)
            x_next = out.prev_sample
            if ode:  # each row from its own step: SDE rows from the window's, the others from one ODE call
                x_ode = take_rows(x, ode)
                ode_next = self.step(
                    ode_cond(ode), x_ode, i, noise=torch.zeros_like(x_ode), noise_level=0.0, per_sample=False
                ).prev_sample
                by_row = {**dict(zip(sde, x_next, strict=True)), **dict(zip(ode, ode_next, strict=True))}
                x_next = torch.stack([by_row[r] for r in range(n)])
            for k, (r, j, lp) in enumerate(zip(sde, offsets, out.log_prob, strict=True)):
                if j == 0:
                    stored[r, 0] = x[r]
                stored[r, j + 1] = x_next[r]
                log_probs[r, j] = lp
                if means is not None:
                    means[r, j] = out.mean[k]
            x = x_next
        images = self.adapter.decode(x)
        images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        images = images.movedim(1, -1)  # channels last: [B, H, W, 3] or, for video, [B, T, H, W, 3]
        return Rollout(
            images=images.cpu().numpy(),
            window_latents=stored if stored is not None else torch.empty(n, 0),
            log_probs=log_probs if size else torch.empty(n, 0),
            conditioning={k: v for k, v in cond.items() if v is not None},
            window_starts=[w.start for w in windows],
            final_latents=x.float() if self.sampling.clean_latents or self.sampling.output_type in LATENT_OUT else None,
            window_means=means,
        )

    def with_sampling(self, **overrides: Any) -> DiffusionPolicy:
        """This policy (the same pipeline, transformer and adapter) sampling with other settings, e.g. validation's
        ``num_inference_steps`` / ``noise_level`` (``rollout.val_kwargs``): a shallow copy with its own sampling
        config, adapter view and schedule; the original is untouched."""
        if not overrides:
            return self
        view = copy.copy(self)  # its own: _VIEW_STATE; the rest (modules, device placement flags) is shared
        view.sampling = replace(self.sampling, **overrides)
        view.adapter = type(self.adapter)(self.pipe, view.sampling)
        view._set_schedule()
        return view

    def generate(
        self,
        prompts: list[str],
        seeds: list[int],
        window: range | list[range] | None = None,
        *,
        sampling: dict[str, Any] | None = None,
        resume: list[Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[ImageResult]:
        """:meth:`rollout`, split per sample (a rollout worker answers each request with its own sample). Each
        sample's tensors are its own CPU copies: a row view would carry the whole batch's storage when pickled.
        ``sampling``: :class:`SamplingConfig` fields that differ for these samples (:meth:`with_sampling`). An image
        batch is one run of denoising steps: nothing to resume or stop between tokens (``models.rollout_policy``)."""
        refuse_inapplicable("DiffusionPolicy", resume=resume, should_stop=should_stop)
        policy = self.with_sampling(**(sampling or {}))
        out = policy.rollout(prompts, seeds, window)
        if policy is not self:  # state the rollout changed on the view (e.g. where the frozen modules are) is ours
            self.__dict__.update({k: v for k, v in vars(policy).items() if k not in _VIEW_STATE})
        conds = split_conditioning(out.conditioning, len(prompts))
        return [
            ImageResult(
                pixels=out.images[i],
                window_latents=out.window_latents[i].cpu().clone(),
                log_probs=out.log_probs[i].cpu().clone(),
                conditioning=conds[i],
                window_start=out.window_starts[i],
                latents_clean=None if out.final_latents is None else out.final_latents[i].cpu().clone(),
                window_means=None if out.window_means is None else out.window_means[i].cpu().clone(),
                output_type=policy.sampling.output_type,
            )
            for i in range(len(prompts))
        ]
