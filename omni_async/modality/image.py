"""Images and video: a diffusion policy trained with FlowGRPO over the stored SDE window.

Batch tensors per sample: ``window_latents`` [W+1, ...] (x before the window, then after each SDE step),
``window_start`` (the denoising step the sample's window starts at: windows differ per sample),
``old_log_probs`` [W] (the rollout's, pi_old in bypass mode), ``rm_scores`` [1] (verl's outcome-reward form) and
the prompt encodings made at rollout (``prompt_embeds`` [S, D], ..., see ``models.diffusion_policy.COND_KEYS``),
so the update and the log-prob recompute never run the text encoder.
The loss runs window step by window step with gradients accumulated, so one step's graph is alive at a time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from omni_async.algos.loss import flow_grpo_loss
from omni_async.algos.sde import kl_to_reference
from omni_async.modality.base import REF_TIME_KEY, Modality, rm_score, score_labels
from omni_async.models.device import device_clock
from omni_async.sample import ImageResult, Sample, is_video

GRID_COLUMNS, GRID_MAX_IMAGES, CAPTION_HEIGHT_PX = 4, 16, 14


class ImageModality(Modality):
    name = "image"
    uses_window = True

    def sampling_config(self, cfg: Any):
        from omni_async.models.diffusion_policy import SamplingConfig

        r = cfg.actor_rollout_ref.rollout
        return SamplingConfig(
            height=r.pipeline.height,
            width=r.pipeline.width,
            num_inference_steps=r.pipeline.num_inference_steps,
            noise_level=r.algo.noise_level,
            sde_type=r.algo.sde_type,
            cps_log_prob=r.algo.cps_log_prob,
            true_cfg_scale=float(r.pipeline.true_cfg_scale),
            guidance_scale=float(r.pipeline.guidance_scale),
            num_frames=int(r.pipeline.num_frames),
            max_sequence_length=r.pipeline.max_sequence_length,
            vae_slicing=bool(r.pipeline.vae_slicing),
            vae_tiling=r.pipeline.vae_tiling,
        )

    def validation_sampling(self, cfg: Any) -> dict[str, Any]:
        """The sampling fields validation changes (``rollout.val_kwargs``; a null value keeps the training one)."""
        v = cfg.actor_rollout_ref.rollout.val_kwargs
        p = v.pipeline
        fields = {
            "num_inference_steps": p.num_inference_steps,
            "height": p.height,
            "width": p.width,
            "true_cfg_scale": p.true_cfg_scale,
            "guidance_scale": p.guidance_scale,
            "max_sequence_length": p.max_sequence_length,
            "noise_level": v.algo.noise_level,
        }
        return {k: val for k, val in fields.items() if val is not None}

    def prompt_lengths(self, model_path: str, prompts: list[str]) -> list[int]:
        """Tokens per prompt for ``data.max_prompt_length``: the pipeline's text tokenizer (``tokenizer/``) on the raw
        prompt, without the pipeline's own template."""
        from transformers import AutoTokenizer

        from omni_async.models.tiny import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(model_path), subfolder="tokenizer")
        return [len(ids) for ids in tok(list(prompts))["input_ids"]]

    def trainable_policy(self, path: str, sampling: dict[str, Any], **trainable: Any):
        from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

        return DiffusionPolicy(path, SamplingConfig(**sampling), **trainable)

    def serving_client(self, model: dict[str, Any], sampling: dict[str, Any], server: dict[str, Any]):
        raise ValueError("actor_rollout_ref.rollout.name=vllm serves text models; diffusion rolls out in-process")

    def batch_tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        from omni_async.models.diffusion_policy import collate_conditioning

        results: list[ImageResult] = [s.result for s in samples]
        return {
            "window_latents": torch.stack([r.window_latents for r in results]),
            "window_start": torch.tensor([r.window_start for r in results], dtype=torch.long),
            "old_log_probs": torch.stack([r.log_probs for r in results]),
            "rm_scores": torch.tensor([[rm_score(s)] for s in samples]),
            **collate_conditioning([r.conditioning for r in results]),
        }

    @staticmethod
    def window_starts(batch) -> torch.Tensor | int:
        """Each sample's window start (``window_start``), or one ``int`` when they all share it. A hand-built batch
        whose samples share a window may give it once as ``meta_info["window_start"]``."""
        if "window_start" not in batch.batch.keys():
            return int(batch.meta_info["window_start"])
        starts = batch.batch["window_start"].long()
        return int(starts[0]) if bool((starts == starts[0]).all()) else starts

    @staticmethod
    def _window_steps(policy, cond, latents: torch.Tensor, start: torch.Tensor | int):
        """The SDE window's transitions, scored under the current weights: one ``SDEStep`` per step (step ``j`` of
        the window is denoising step ``start + j``, per sample when the starts differ)."""
        for j in range(latents.shape[1] - 1):
            yield j, policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])

    def log_probs(self, policy, batch) -> torch.Tensor:
        cond = policy.conditioning_from(batch.batch)
        start = self.window_starts(batch)
        latents = batch.batch["window_latents"].to(policy.device)
        return torch.stack([out.log_prob for _, out in self._window_steps(policy, cond, latents, start)], 1).cpu()

    def loss_units(self, batch) -> int:
        return int(batch.batch["loss_mask"].bool().sum())

    def backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float = 1.0
    ) -> dict[str, list[float]]:
        start = self.window_starts(batch)
        cond = policy.conditioning_from(batch.batch)
        latents, old_lp, adv = (
            batch.batch[k].to(policy.device) for k in ("window_latents", "old_log_probs", "advantages")
        )
        loss_mask = loss_mask.to(policy.device)
        # verl's decoupled rollout correction (StepOps.rollout_correction): a weight and a keep flag per window step.
        is_w, rs = (
            batch.batch[k].to(policy.device) if k in batch.batch.keys() else None
            for k in ("rollout_is_weights", "rollout_rs_mask")
        )
        n_steps = latents.shape[1] - 1
        step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)  # read after the last backward, in one sync
        ref_s = 0.0
        for j, out in self._window_steps(policy, cond, latents, start):
            kl = None
            if actor_cfg.kl_loss_coef > 0:
                t0 = device_clock(policy.device)
                with torch.no_grad(), policy.reference():
                    ref = policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
                ref_s += device_clock(policy.device) - t0
                kl = kl_to_reference(out.mean, ref.mean, out.std_dev_t)
            mask_j = loss_mask if rs is None else loss_mask.bool() & rs[:, j].bool()
            loss, m = flow_grpo_loss(
                out.log_prob,
                old_lp[:, j],
                adv,
                mask_j,
                clip_ratio=actor_cfg.clip_ratio,
                kl=kl,
                kl_coef=actor_cfg.kl_loss_coef,
                is_weights=None if is_w is None else is_w[:, j],
            )
            (loss * loss_scale / n_steps).backward()  # the window's steps are averaged
            for k, v in m.items():
                step_metrics[k].append(v)
        keys = list(step_metrics)
        values = torch.stack([torch.stack(step_metrics[k]) for k in keys]).tolist() if keys else []
        metrics: dict[str, list[float]] = dict(zip(keys, values, strict=True))
        metrics[REF_TIME_KEY] = [ref_s]
        return metrics

    def save_samples(self, out_dir: Path, step: int, samples: list[Sample]) -> Path:
        """A PNG grid of the images (a video's first frame), each captioned with its reward."""
        frames = [s.result.pixels[0] if is_video(s.result.pixels) else s.result.pixels for s in samples]
        return save_sample_grid(Path(out_dir) / f"step_{step:04d}.png", frames, score_labels(samples))


def save_sample_grid(path: str | Path, images: list[np.ndarray], captions: list[str]) -> Path:
    """A PNG grid of uint8 images, each captioned (e.g. with its reward)."""
    images, captions = images[:GRID_MAX_IMAGES], captions[:GRID_MAX_IMAGES]
    h, w = images[0].shape[:2]
    rows = (len(images) + GRID_COLUMNS - 1) // GRID_COLUMNS
    grid = Image.new("RGB", (GRID_COLUMNS * w, rows * (h + CAPTION_HEIGHT_PX)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, cap) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % GRID_COLUMNS) * w, (i // GRID_COLUMNS) * (h + CAPTION_HEIGHT_PX)
        grid.paste(Image.fromarray(img), (x, y + CAPTION_HEIGHT_PX))
        draw.text((x + 2, y + 1), cap[: max(4, w // 6)], fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
