"""A diffusers text-to-image pipeline as a FlowGRPO policy: SDE rollout with log-probs, log-prob recompute, LoRA.

The pipeline's own components do the model work (``encode_prompt``, ``prepare_latents``, the transformer, the
VAE); a small per-family adapter says how to call them, because Qwen-Image packs latents into tokens and takes a
text mask, SD3 takes pooled CLIP projections and Wan denoises 5-D video latents. The denoising loop itself is ours, since each step of the SDE
window must return its log-prob (``omni_async.algos.sde``).

Sampling is reproducible per sample: sample ``i`` draws its initial noise and every SDE noise from its own
``torch.Generator(seed_i)``, so the result does not depend on which other samples share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_async.algos.sde import SDEStep, sde_step_with_logprob
from omni_async.models.lora import TrainableModule
from omni_async.models.tiny import resolve_model_path
from omni_async.sample import ImageResult


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
    num_frames: int = 1  # video models (Wan): frames per sample


@dataclass
class Rollout:
    images: np.ndarray  # uint8 [B, H, W, 3], or video frames [B, T, H, W, 3]
    window_latents: torch.Tensor  # [B, W + 1, ...]: x before the window's first step, then after each step
    log_probs: torch.Tensor  # [B, W]


class _QwenImageAdapter:
    """QwenImagePipeline: packed 2x2 latent tokens, text embeddings with a mask, timestep / 1000, true CFG."""

    def __init__(self, pipe, cfg: SamplingConfig):
        self.pipe, self.cfg = pipe, cfg

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        emb, mask = self.pipe.encode_prompt(prompt=prompts, device=self.pipe.device)
        cond = {"emb": emb, "mask": mask}
        if self.cfg.true_cfg_scale > 1:
            cond["neg_emb"], cond["neg_mask"] = self.pipe.encode_prompt(prompt=[" "] * len(prompts),
                                                                        device=self.pipe.device)
        return cond

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        p = self.pipe
        return p.prepare_latents(len(generators), p.transformer.config.in_channels // 4, self.cfg.height,
                                 self.cfg.width, torch.float32, p.device, generators)

    def _forward(self, x, t, emb, mask):
        f = self.pipe.vae_scale_factor * 2
        shapes = [[(1, self.cfg.height // f, self.cfg.width // f)]] * x.shape[0]
        return self.pipe.transformer(hidden_states=x, timestep=(t / 1000).expand(x.shape[0]), guidance=None,
                                     encoder_hidden_states=emb, encoder_hidden_states_mask=mask,
                                     img_shapes=shapes, return_dict=False)[0]

    def velocity(self, x, t, cond):
        v = self._forward(x, t, cond["emb"], cond["mask"])
        if "neg_emb" in cond:  # Qwen-Image's norm-preserving true CFG
            neg = self._forward(x, t, cond["neg_emb"], cond["neg_mask"])
            comb = neg + self.cfg.true_cfg_scale * (v - neg)
            v = comb * (v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        return v

    def decode(self, x) -> torch.Tensor:
        p = self.pipe
        lat = p._unpack_latents(x, self.cfg.height, self.cfg.width, p.vae_scale_factor).to(p.vae.dtype)
        zc = p.vae.config.z_dim
        mean = torch.tensor(p.vae.config.latents_mean).view(1, zc, 1, 1, 1).to(lat)
        std = torch.tensor(p.vae.config.latents_std).view(1, zc, 1, 1, 1).to(lat)
        return p.vae.decode(lat * std + mean, return_dict=False)[0][:, :, 0]


class _SD3Adapter:
    """StableDiffusion3Pipeline: spatial latents, CLIP+T5 embeddings with pooled projections, standard CFG."""

    def __init__(self, pipe, cfg: SamplingConfig):
        self.pipe, self.cfg = pipe, cfg

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        do_cfg = self.cfg.guidance_scale > 1
        pe, npe, ppe, nppe = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                     device=self.pipe.device, do_classifier_free_guidance=do_cfg,
                                                     negative_prompt=[""] * len(prompts) if do_cfg else None)
        cond = {"emb": pe, "pooled": ppe}
        if do_cfg:
            cond["neg_emb"], cond["neg_pooled"] = npe, nppe
        return cond

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        p = self.pipe
        return p.prepare_latents(len(generators), p.transformer.config.in_channels, self.cfg.height,
                                 self.cfg.width, torch.float32, p.device, generators)

    def _forward(self, x, t, emb, pooled):
        return self.pipe.transformer(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=emb,
                                     pooled_projections=pooled, return_dict=False)[0]

    def velocity(self, x, t, cond):
        v = self._forward(x, t, cond["emb"], cond["pooled"])
        if "neg_emb" in cond:
            neg = self._forward(x, t, cond["neg_emb"], cond["neg_pooled"])
            v = neg + self.cfg.guidance_scale * (v - neg)
        return v

    def decode(self, x) -> torch.Tensor:
        vae = self.pipe.vae
        lat = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return vae.decode(lat.to(vae.dtype), return_dict=False)[0]


class _WanAdapter:
    """WanPipeline (text-to-video): 5-D latents [B, C, T', H', W'], UMT5 embeddings, standard CFG."""

    def __init__(self, pipe, cfg: SamplingConfig):
        self.pipe, self.cfg = pipe, cfg
        k = pipe.vae_scale_factor_temporal
        if (cfg.num_frames - 1) % k:
            raise ValueError(f"actor_rollout_ref.rollout.num_frames={cfg.num_frames} does not fit Wan's temporal "
                             f"compression {k}; use {k}*n+1 frames, e.g. {k + 1} or {4 * k + 1}")

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        do_cfg = self.cfg.guidance_scale > 1
        emb, neg = self.pipe.encode_prompt(prompt=prompts, negative_prompt=[""] * len(prompts) if do_cfg else None,
                                           do_classifier_free_guidance=do_cfg, device=self.pipe.device)
        return {"emb": emb, "neg_emb": neg} if do_cfg else {"emb": emb}

    def init_latents(self, generators: list[torch.Generator]) -> torch.Tensor:
        p = self.pipe
        return p.prepare_latents(len(generators), p.transformer.config.in_channels, self.cfg.height, self.cfg.width,
                                 self.cfg.num_frames, torch.float32, p.device, generators)

    def _forward(self, x, t, emb):
        return self.pipe.transformer(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=emb,
                                     return_dict=False)[0]

    def velocity(self, x, t, cond):
        v = self._forward(x, t, cond["emb"])
        if "neg_emb" in cond:
            neg = self._forward(x, t, cond["neg_emb"])
            v = neg + self.cfg.guidance_scale * (v - neg)
        return v

    def decode(self, x) -> torch.Tensor:
        vae = self.pipe.vae
        zc = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, zc, 1, 1, 1).to(x)
        std = torch.tensor(vae.config.latents_std).view(1, zc, 1, 1, 1).to(x)
        return vae.decode((x * std + mean).to(vae.dtype), return_dict=False)[0]  # [B, 3, T, H, W]


_ADAPTERS = {"QwenImagePipeline": _QwenImageAdapter, "StableDiffusion3Pipeline": _SD3Adapter,
             "WanPipeline": _WanAdapter}


def sample_generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


class DiffusionPolicy(TrainableModule):
    """Load a pipeline, add LoRA to its transformer, sample with the SDE window, recompute log-probs."""

    def __init__(self, model_path: str, sampling: SamplingConfig, *, lora_rank: int = 8, lora_alpha: int = 16,
                 target_modules: list[str] | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 gradient_checkpointing: bool = False):
        """``dtype``: the frozen weights' dtype (``fsdp_config.model_dtype``). Trainable weights are fp32 (LoRA, or
        the whole transformer for a full fine-tune); latents, the SDE step, log-probs and KL are fp32 too, and
        tensors are cast to the transformer's dtype only at its input (``step``)."""
        from diffusers import DiffusionPipeline

        self.pipe = DiffusionPipeline.from_pretrained(resolve_model_path(model_path), dtype=dtype)
        self.pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        family = type(self.pipe).__name__
        if family not in _ADAPTERS:
            raise ValueError(f"actor_rollout_ref.model.path={model_path!r} is a {family}; supported: "
                             f"{', '.join(_ADAPTERS)}")
        self.sampling = sampling
        self.adapter = _ADAPTERS[family](self.pipe, sampling)
        for module in (m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)):
            module.requires_grad_(False)
        self.transformer = self.pipe.transformer
        self.init_trainable(self.transformer, lora_rank, lora_alpha, target_modules or ["to_q", "to_k", "to_v"])
        # The transformer's input dtype: the frozen weights' (LoRA casts its fp32 branch itself), fp32 when all train.
        self.compute_dtype = dtype if lora_rank > 0 else torch.float32
        if gradient_checkpointing:  # recompute each block's activations in backward instead of keeping them
            self.transformer.enable_gradient_checkpointing()
        self.sigmas, self.timesteps = self._schedule()

    # ---- schedule -------------------------------------------------------------------------------------------
    def _schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmas (N+1, ending at 0) and timesteps (N) as the pipeline's own ``__call__`` makes them.

        - QwenImagePipeline: ``set_timesteps(sigmas=linspace(1, 1/N, N), mu=calculate_shift(image_seq_len))``
          (dynamic shift; also verl-omni's Qwen-Image FlowGRPO schedule).
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
        if family == "StableDiffusion3Pipeline":
            if c.get("use_dynamic_shifting", False):
                from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

                patch = p.transformer.config.patch_size
                seq = (self.sampling.height // p.vae_scale_factor // patch) * (
                    self.sampling.width // p.vae_scale_factor // patch)
                kwargs["mu"] = calculate_shift(seq, c.get("base_image_seq_len", 256),
                                               c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                               c.get("max_shift", 1.16))
            sched.set_timesteps(n, device=p.device, **kwargs)
        else:
            if c.get("use_dynamic_shifting", False):
                from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

                seq = (self.sampling.height // p.vae_scale_factor // 2) * (
                    self.sampling.width // p.vae_scale_factor // 2)
                kwargs["mu"] = calculate_shift(seq, c.get("base_image_seq_len", 256),
                                               c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                               c.get("max_shift", 1.15))
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device=p.device, **kwargs)
        return sched.sigmas.float().clone(), sched.timesteps.float().clone()

    # ---- sampling and scoring -------------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self.adapter.encode(list(prompts))

    def step(self, cond: dict[str, torch.Tensor], x: torch.Tensor, i: int, *, prev_sample: torch.Tensor | None = None,
             noise: torch.Tensor | None = None, noise_level: float | None = None) -> SDEStep:
        """Denoising step ``i`` (0-based) from ``x``: scores ``prev_sample`` or draws with ``noise``."""
        cd = self.compute_dtype
        cond = {k: v.to(cd) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in cond.items()}
        v = self.adapter.velocity(x.to(cd), self.timesteps[i], cond).float()
        x = x.float()
        return sde_step_with_logprob(
            v, x, self.sigmas[i], self.sigmas[i + 1],
            noise_level=self.sampling.noise_level if noise_level is None else noise_level,
            sde_type=self.sampling.sde_type, sigma_max=float(self.sigmas[1]), prev_sample=prev_sample, noise=noise,
            cps_log_prob=self.sampling.cps_log_prob,
        )

    @torch.no_grad()
    def rollout(self, prompts: list[str], seeds: list[int], window: range | None) -> Rollout:
        """Generate one image per (prompt, seed); steps in ``window`` are SDE (stored), the rest ODE."""
        gens = sample_generators(seeds)
        cond = self.adapter.encode(list(prompts))
        x = self.adapter.init_latents(gens)
        window = window if window is not None else range(0)
        stored, log_probs = [], []
        for i in range(self.sampling.num_inference_steps):
            if i in window:
                stored.append(x)
                noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(x)
                out = self.step(cond, x, i, noise=noise)
                log_probs.append(out.log_prob)
                if i == window.stop - 1:
                    stored.append(out.prev_sample)
            else:
                out = self.step(cond, x, i, noise=torch.zeros_like(x), noise_level=0.0)
            x = out.prev_sample
        images = self.adapter.decode(x)
        images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        images = images.movedim(1, -1)  # channels last: [B, H, W, 3] or, for video, [B, T, H, W, 3]
        return Rollout(images=images.cpu().numpy(),
                       window_latents=torch.stack(stored, 1) if stored else torch.empty(len(seeds), 0),
                       log_probs=torch.stack(log_probs, 1) if log_probs else torch.empty(len(seeds), 0))

    def generate(self, prompts: list[str], seeds: list[int], window: range | None = None) -> list[ImageResult]:
        """:meth:`rollout`, split per sample (a rollout worker answers each request with its own sample)."""
        out = self.rollout(prompts, seeds, window)
        return [ImageResult(pixels=out.images[i], window_latents=out.window_latents[i], log_probs=out.log_probs[i])
                for i in range(len(prompts))]
