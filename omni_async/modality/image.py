"""Images and video: a diffusion policy trained with FlowGRPO over the stored SDE window, or with DiffusionNFT or AWM
on the forward process (``actor_rollout_ref.actor.diffusion_loss.loss_mode``, ``algos.loss_modes``).

FlowGRPO's batch tensors per sample: ``window_latents`` [W+1, ...] (x before the window, then after each SDE step),
``window_start`` (the denoising step the sample's window starts at: windows differ per sample),
``old_log_probs`` [W] (the rollout's, pi_old in bypass mode), ``rm_scores`` [1] (verl's outcome-reward form) and
the prompt encodings made at rollout (``prompt_embeds`` [S, D], ..., see ``models.diffusion_policy.COND_KEYS``),
so the update and the log-prob recompute never run the text encoder.
The loss runs window step by window step with gradients accumulated, so one step's graph is alive at a time.
GRPO-Guard and Flow-DPPO (``algos.grpo_guard``, ``algos.flow_dppo``) take the same tensors plus ``old_means``
[W, ...] (fp32), each window step's Gaussian mean under pi_old: the rollout's (``ImageResult.window_means``) in bypass
mode, the recompute's (:meth:`ImageModality.log_probs`) with ``bypass_mode=false``; only these losses carry it.
DiffusionOPD's ``distill_kl`` (``algos.distill``) takes the window tensors plus ``teacher_velocity`` [W, ...] (fp32),
the frozen teacher's velocity at each window step (``RewardOutcome.teacher_velocity``, scored beside the reward).

DiffusionNFT's: ``latents_clean`` (x0, the rollout's final latents), ``rm_scores``, the prompt encodings, and what
``StepOps.build_batch`` adds: ``reward_prob`` [1] (the optimality probability), ``train_steps`` [T] (the denoising
steps the sample trains on) and ``noise_seed`` (its forward-process noise). No window, no log-probs. The loss runs
training step by training step, each with gradients accumulated (``_nft_backward``). AWM's (``algos.awm``): the same
without ``reward_prob`` (it weights by ``advantages``), plus ``old_log_probs`` [T] when the step recomputes its
matching log-likelihood at its start (``bypass_mode=false``, :meth:`ImageModality.log_probs`); ``_awm_backward``.
Diffusion-DPO's (``algos.dpo``): ``latents_clean``, the prompt encodings, ``train_u`` and ``noise_seed`` (one forward
draw per pair), the rows in adjacent (chosen, rejected) pairs (``StepOps.preference_batch``); ``_dpo_backward``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from omni_async.algos.awm import awm_loss, matching_log_prob
from omni_async.algos.diffusion_nft import forward_noised, nft_loss
from omni_async.algos.dpo import dpo_loss, train_index
from omni_async.algos.loss import BYPASS_CORRECTION_KEY, bypass_rollout_correction, correction_weights
from omni_async.algos.loss_modes import LossMode
from omni_async.algos.loss_modes import loss_mode as registered_loss_mode
from omni_async.algos.sde import kl_to_reference
from omni_async.algos.window_losses import WindowStepInputs
from omni_async.modality.base import MODEL_DTYPES, REF_TIME_KEY, Modality, rm_score, score_labels
from omni_async.models.device import device_clock
from omni_async.sample import ImageResult, Sample, is_video

GRID_COLUMNS, GRID_MAX_IMAGES, CAPTION_HEIGHT_PX = 4, 16, 14


class ImageModality(Modality):
    name = "image"

    def __init__(self, loss_mode: str = "flow_grpo", awm_weighting: str = "ghuber", awm_ghuber_power: float = 0.25):
        """``loss_mode``: ``actor_rollout_ref.actor.diffusion_loss.loss_mode`` (``algos.loss_modes``); AWM's matching
        log-likelihood (``diffusion_loss.awm_weighting``, ``awm_ghuber_power``: ``algos.awm``) is the modality's, so
        the update and the log-prob recompute, which gets no actor config, read the same one."""
        self.loss_mode = loss_mode
        self.mode: LossMode = registered_loss_mode(loss_mode)  # what the losses dispatch on (algos.loss_modes)
        self.awm_weighting = {"weighting": awm_weighting, "ghuber_power": float(awm_ghuber_power)}
        self.final_latents = self.mode.final_latents
        self.old_means = self.mode.old_means  # GRPO-Guard, Flow-DPPO: pi_old's window-step means
        # DiffusionNFT samples with any solver: ODE here, so no SDE window is drawn for its samples.
        self.uses_window = not self.final_latents

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
            guidance_scale_2=None if r.pipeline.guidance_scale_2 is None else float(r.pipeline.guidance_scale_2),
            num_frames=int(r.pipeline.num_frames),
            max_sequence_length=r.pipeline.max_sequence_length,
            vae_slicing=bool(r.pipeline.vae_slicing),
            vae_tiling=r.pipeline.vae_tiling,
            window_batch=r.pipeline.window_batch_size or window_batch_default(cfg),
            window_text_bucket=r.pipeline.window_text_bucket,
            clean_latents=self.final_latents,
            window_means=self.old_means,
            output_type=str(r.pipeline.output_type),
            # torch's name for the config's spelling (bf16 / bfloat16 ...; trainer.config refused any other)
            rollout_dtype=None if r.dtype is None else str(MODEL_DTYPES[str(r.dtype)]).removeprefix("torch."),
            reference_batch=cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
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
            "guidance_scale_2": p.guidance_scale_2,
            "max_sequence_length": p.max_sequence_length,
            "noise_level": v.algo.noise_level,
            "output_type": p.output_type,
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
        from omni_async.models.tiny import is_sim

        if is_sim(path):  # a simulated device: generation and update are timed waits (models.sim_image_policy)
            from omni_async.models.sim_image_policy import SimImagePolicy

            return SimImagePolicy(path, SamplingConfig(**sampling), **trainable)
        return DiffusionPolicy(path, SamplingConfig(**sampling), **trainable)

    def serving_client(self, model: dict[str, Any], sampling: dict[str, Any], server: dict[str, Any]):
        raise ValueError("actor_rollout_ref.rollout.name=vllm serves text models; diffusion rolls out in-process")

    def batch_tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        from omni_async.models.diffusion_policy import collate_conditioning

        results: list[ImageResult] = [s.result for s in samples]
        if self.final_latents:  # the SDE-window tensors are empty for these samples; x0 instead
            return {
                "latents_clean": torch.stack([r.latents_clean for r in results]),
                "rm_scores": torch.tensor([[rm_score(s)] for s in samples]),
                **collate_conditioning([r.conditioning for r in results]),
            }
        out = {
            "window_latents": torch.stack([r.window_latents for r in results]),
            "window_start": torch.tensor([r.window_start for r in results], dtype=torch.long),
            "old_log_probs": torch.stack([r.log_probs for r in results]),
            "rm_scores": torch.tensor([[rm_score(s)] for s in samples]),
            **collate_conditioning([r.conditioning for r in results]),
        }
        if self.old_means:
            if any(r.window_means is None for r in results):
                raise ValueError(
                    f"loss_mode={self.loss_mode} needs each window step's mean under pi_old, and a sample came "
                    "without it (its rollout ran with SamplingConfig.window_means=False)"
                )
            out["old_means"] = torch.stack([r.window_means for r in results])
        if self.mode.teacher:  # a sample whose scoring failed has none: zeros, and it is out of the loss (loss_mask)
            v = [s.outcome.teacher_velocity for s in samples]
            blank = torch.zeros_like(results[0].window_latents[1:], dtype=torch.float32)
            out["teacher_velocity"] = torch.stack([blank if t is None else t for t in v])
        return out

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

    def log_probs(self, policy, batch) -> torch.Tensor | dict[str, torch.Tensor]:
        """The stored window's log-probs [B, W] under the weights the policy holds (pi_old when not bypassed: the last
        sync's, ``trainer.actor_core.old_log_prob``); for a loss that reads pi_old's means (GRPO-Guard, Flow-DPPO)
        ``{"old_log_probs": [B, W], "old_means": [B, W, ...]}``, the means of the same forward passes (verl-omni's
        old-log-prob recompute returns them alike). AWM: its matching log-likelihood ``lp`` [B, T] at the batch's
        training steps (``algos.awm.matching_log_prob``)."""
        if self.mode.matching_log_prob:
            cond = policy.conditioning_from(batch.batch, batched=True)
            lps = [
                matching_log_prob(
                    policy.velocity(cond, f.xt, f.step, per_sample=False), f.noise - f.x0, f.sigma, **self.awm_weighting
                )
                for f in self._forward_steps(policy, batch)
            ]
            return torch.stack(lps, 1).cpu()
        cond = policy.conditioning_from(batch.batch)
        start = self.window_starts(batch)
        latents = batch.batch["window_latents"].to(policy.device)
        steps = [out for _, out in self._window_steps(policy, cond, latents, start)]
        log_probs = torch.stack([out.log_prob for out in steps], 1).cpu()
        if not self.old_means:
            return log_probs
        return {"old_log_probs": log_probs, "old_means": torch.stack([o.mean.float() for o in steps], 1).cpu()}

    def loss_units(self, batch) -> int:
        return int(batch.batch["loss_mask"].bool().sum())

    def backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float = 1.0
    ) -> dict[str, list[float]]:
        """The loss mode's gradient (the one dispatch point of the image losses): the backward its registry entry
        names (``LossMode.backward``, ``algos.loss_modes``)."""
        backward = {
            "window": self._window_backward,
            "nft": self._nft_backward,
            "awm": self._awm_backward,
            "dpo": self._dpo_backward,
        }
        return backward[self.mode.backward](policy, batch, loss_mask, actor_cfg, loss_scale)

    def _window_backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float
    ) -> dict[str, list[float]]:
        """The policy loss per SDE-window step, the registry's ``LossMode.window_loss``: FlowGRPO's (and DanceGRPO's)
        clipped ratio, GRPO-Guard's regulated ratio or Flow-DPPO's divergence mask (the latter two on the step's mean
        against pi_old's, ``old_means``). The advantages were clipped to ``diffusion_loss.adv_clip_max`` when the
        batch was built where the mode clips (``LossMode.clips_advantages``, ``StepOps``)."""
        dl = actor_cfg.diffusion_loss
        window_loss = self.mode.window_loss
        assert window_loss is not None, f"loss_mode={self.loss_mode} has no window loss (algos.loss_modes)"
        start = self.window_starts(batch)
        cond = policy.conditioning_from(batch.batch)
        latents, old_lp, adv = (
            batch.batch[k].to(policy.device) for k in ("window_latents", "old_log_probs", "advantages")
        )
        loss_mask = loss_mask.to(policy.device)
        # verl's decoupled rollout correction (StepOps.rollout_correction): a weight and a keep flag per window step;
        # a rejected step weighs 0 and stays in the step's mean over loss_mask (algos.loss.correction_weights).
        is_w, rs = (
            batch.batch[k].to(policy.device) if k in batch.batch.keys() else None
            for k in ("rollout_is_weights", "rollout_rs_mask")
        )
        # verl's bypass-mode rollout correction: per window step, between the current policy and the rollout.
        bypass = batch.meta_info.get(BYPASS_CORRECTION_KEY)
        old_means = batch.batch["old_means"].to(policy.device) if self.old_means else None
        teacher_v = batch.batch["teacher_velocity"].to(policy.device) if self.mode.teacher else None
        n_steps = latents.shape[1] - 1
        step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)  # read after the last backward, in one sync
        corr_metrics: dict[str, list[float]] = defaultdict(list)
        ref_s = 0.0
        for j, out in self._window_steps(policy, cond, latents, start):
            kl = None
            if actor_cfg.kl_loss_coef > 0:
                t0 = device_clock(policy.device)
                with torch.no_grad(), policy.reference():
                    ref = policy.step(cond, latents[:, j], start + j, prev_sample=latents[:, j + 1])
                ref_s += device_clock(policy.device) - t0
                kl = kl_to_reference(out.mean, ref.mean, out.std_dev_t)
            mask_j = loss_mask
            w_j = correction_weights(None if is_w is None else is_w[:, j], None if rs is None else rs[:, j])
            if bypass:  # the step's rejected samples weigh 0; its IS weights are reported (the ratio clips them)
                kept, m = bypass_rollout_correction(out.log_prob[:, None], old_lp[:, j, None], mask_j[:, None], bypass)
                w_j = correction_weights(w_j, kept[:, 0])
                for k, v in m.items():
                    corr_metrics[k].append(v)
            # DiffusionOPD: the teacher's step mean from its velocity at the same x_t, on the student's SDE step
            teacher_mean = None
            if teacher_v is not None:
                x_j, x_next = latents[:, j], latents[:, j + 1]
                teacher_mean = policy.step_with(teacher_v[:, j], x_j, start + j, prev_sample=x_next).mean
            step = WindowStepInputs(
                out, old_lp[:, j], adv, mask_j, old_mean=None if old_means is None else old_means[:, j], kl=kl,
                kl_coef=actor_cfg.kl_loss_coef, is_weights=w_j, teacher_mean=teacher_mean,
            )  # fmt: skip
            loss, m = window_loss(step, dl)
            (loss * loss_scale / n_steps).backward()  # the window's steps are averaged
            for k, v in m.items():
                step_metrics[k].append(v)
        return {**_read_metrics(step_metrics, ref_s), **corr_metrics}

    @staticmethod
    def _forward_steps(policy, batch):
        """A final-latent loss's training steps: for column ``j`` of ``train_steps``, x0 (the rollout's final latents)
        noised to each sample's step ``train_steps[:, j]`` with the sample's own noise (``noise_seed``: the same in
        any micro-batch, rank or recompute) (:class:`ForwardStep`)."""
        dev = policy.device
        x0 = batch.batch["latents_clean"].to(dev, torch.float32)
        steps = batch.batch["train_steps"].long()
        noise = forward_noise(batch.batch["noise_seed"], x0, steps.shape[1])
        for j in range(steps.shape[1]):
            i = steps[:, j]
            sigma = policy.sigmas[i.to(policy.sigmas.device)].to(dev)
            yield ForwardStep(j, i, sigma, x0, noise[:, j], forward_noised(x0, sigma, noise[:, j]))

    def _forward_backward(self, policy, batch, ref_kl_coef: float, loss_scale: float, step_loss) -> dict[str, list]:
        """The final-latent losses' loop: per training step (:meth:`_forward_steps`) the adapter-off v_ref (when
        ``ref_kl_coef`` > 0, timed), then ``step_loss(step, cond, v_ref) -> (loss, metrics)`` (which runs the live
        and, if it needs them, the old forwards), its gradient accumulated (one step's graph alive at a time) and
        averaged over the steps, as verl-omni's accumulation. One transformer call per micro-batch and forward, each
        sample at its own step (no log-prob to keep bitwise)."""
        cond = policy.conditioning_from(batch.batch, batched=True)
        n_steps = batch.batch["train_steps"].shape[1]
        step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        ref_s = 0.0
        for f in self._forward_steps(policy, batch):
            v_ref = None
            if ref_kl_coef > 0:
                t0 = device_clock(policy.device)
                with torch.no_grad(), policy.reference():
                    v_ref = policy.velocity(cond, f.xt, f.step, per_sample=False)
                ref_s += device_clock(policy.device) - t0
            loss, m = step_loss(f, cond, v_ref)
            (loss * loss_scale / n_steps).backward()
            for k, v in m.items():
                step_metrics[k].append(v)
        return _read_metrics(step_metrics, ref_s)

    def _nft_backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float
    ) -> dict[str, list[float]]:
        """DiffusionNFT (``algos.diffusion_nft``) on each training step's x_t: the live prediction v_theta, the old
        policy's v_old and (``ref_kl_coef`` > 0) the adapter-off v_ref (:meth:`_forward_backward`).

        v_old is the trainer's *current* old policy, whichever old version drew the sample (fully async: an older
        one); ``docs/diffusion_nft.md`` gives the argument and the bound on the difference."""
        dl = actor_cfg.diffusion_loss
        reward_prob = batch.batch["reward_prob"].reshape(-1).to(policy.device)
        loss_mask = loss_mask.to(policy.device)

        def step_loss(f: ForwardStep, cond, v_ref):
            with torch.no_grad(), policy.old_policy():
                v_old = policy.velocity(cond, f.xt, f.step, per_sample=False)
            v_theta = policy.velocity(cond, f.xt, f.step, per_sample=False)
            return nft_loss(
                v_theta, v_old, f.x0, f.xt, f.sigma, reward_prob, loss_mask, mix_beta=dl.mix_beta,
                adv_clip_max=dl.adv_clip_max, adaptive_weight_min=dl.adaptive_weight_min, v_ref=v_ref,
                ref_kl_coef=dl.ref_kl_coef,
            )  # fmt: skip

        return self._forward_backward(policy, batch, dl.ref_kl_coef, loss_scale, step_loss)

    def _awm_backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float
    ) -> dict[str, list[float]]:
        """AWM (``algos.awm``) on each training step's x_t: the live v_theta's weighted matching error against
        ``eps - x0``, weighted by the sample's advantage; ``lp_old`` the step-start recompute (``old_log_probs``) or,
        without one, the live value (ratio 1); v_ref (``ref_kl_coef`` > 0) and the EMA anchor's v_old
        (``old_kl_coef`` > 0, the ``old`` adapter as it is now) without gradient."""
        dl = actor_cfg.diffusion_loss
        dev = policy.device
        adv, loss_mask = batch.batch["advantages"].reshape(-1).to(dev), loss_mask.to(dev)
        old_lp = batch.batch["old_log_probs"].to(dev) if "old_log_probs" in batch.batch.keys() else None

        def step_loss(f: ForwardStep, cond, v_ref):
            v_old = None
            if dl.old_kl_coef > 0:
                with torch.no_grad(), policy.old_policy():
                    v_old = policy.velocity(cond, f.xt, f.step, per_sample=False)
            v_theta = policy.velocity(cond, f.xt, f.step, per_sample=False)
            return awm_loss(
                v_theta, f.x0, f.noise, f.sigma, adv, loss_mask, adv_clip_max=dl.adv_clip_max,
                clip_ratio=dl.clip_ratio, old_log_prob=None if old_lp is None else old_lp[:, f.j], v_ref=v_ref,
                ref_kl_coef=dl.ref_kl_coef, v_old=v_old, old_kl_coef=dl.old_kl_coef, **self.awm_weighting,
            )  # fmt: skip

        return self._forward_backward(policy, batch, dl.ref_kl_coef, loss_scale, step_loss)

    def _dpo_backward(
        self, policy, batch, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float
    ) -> dict[str, list[float]]:
        """Diffusion-DPO (``algos.dpo``) on the batch's adjacent (chosen, rejected) rows (``StepOps.preference_batch``;
        micro-batches of an even size keep a pair whole): each pair's x0 noised to its timestep on the scheduler's
        training grid (``train_u``) with its shared noise (``noise_seed``), the live v_theta and the adapter-off v_ref
        (timed) there, one backward. A micro-batch with no row in the loss (an FSDP2 rank's padding) runs forward and
        backward at weight 0."""
        dev = policy.device
        x0 = batch.batch["latents_clean"].to(dev, torch.float32)
        sigmas, timesteps = policy.train_grid()
        k = train_index(batch.batch["train_u"].reshape(-1), len(sigmas))
        sigma, t = sigmas[k].to(dev), timesteps[k]
        noise = forward_noise(batch.batch["noise_seed"], x0, 1)[:, 0]
        xt = forward_noised(x0, sigma, noise)
        cond = policy.conditioning_from(batch.batch, batched=True)
        v_theta = policy.velocity_at(cond, xt, t)
        if not bool(loss_mask.any()):
            (v_theta.sum() * 0.0).backward()
            return _read_metrics({}, 0.0)
        t0 = device_clock(dev)
        with torch.no_grad(), policy.reference():
            v_ref = policy.velocity_at(cond, xt, t)
        ref_s = device_clock(dev) - t0
        keep = loss_mask.to(dev).nonzero().flatten()  # FSDP2's padding rows (outside the loss) are not pairs
        loss, m = dpo_loss(v_theta[keep], v_ref[keep], x0[keep], noise[keep], beta=actor_cfg.diffusion_loss.dpo_beta)
        (loss * loss_scale).backward()
        return _read_metrics({key: [v] for key, v in m.items()}, ref_s)

    def save_samples(self, out_dir: Path, step: int, samples: list[Sample]) -> Path:
        """A PNG grid of the images (a video's first frame), each captioned with its reward."""
        frames = [s.result.pixels[0] if is_video(s.result.pixels) else s.result.pixels for s in samples]
        return save_sample_grid(Path(out_dir) / f"step_{step:04d}.png", frames, score_labels(samples))


@dataclass(frozen=True)
class ForwardStep:
    """One training step of a final-latent loss: column ``j`` of ``train_steps``, the samples' steps ``step`` [B]
    and sigmas [B], their x0, forward noise and ``xt = (1 - sigma) x0 + sigma noise`` (fp32, on the device)."""

    j: int
    step: torch.Tensor
    sigma: torch.Tensor
    x0: torch.Tensor
    noise: torch.Tensor
    xt: torch.Tensor


def window_batch_default(cfg: Any) -> int:
    """``rollout.pipeline.window_batch_size``'s null: the update's micro-batch (the mini-batch's samples when unset),
    so each micro-batch's window step is one call, at most a generation batch (``agent.max_batch_size``), so the
    rollout fills its calls."""
    arr = cfg.actor_rollout_ref
    micro = arr.actor.ppo_micro_batch_size_per_gpu or arr.actor.ppo_mini_batch_size * arr.rollout.n
    return max(1, min(int(micro), int(arr.rollout.agent.max_batch_size)))


def _read_metrics(step_metrics: dict[str, list[torch.Tensor]], ref_s: float) -> dict[str, list[float]]:
    """The per-step metric tensors read in one device sync, plus the reference forwards' seconds."""
    keys = list(step_metrics)
    values = torch.stack([torch.stack(step_metrics[k]) for k in keys]).tolist() if keys else []
    metrics: dict[str, list[float]] = dict(zip(keys, values, strict=True))
    metrics[REF_TIME_KEY] = [ref_s]
    return metrics


def forward_noise(seeds: torch.Tensor, like: torch.Tensor, steps: int) -> torch.Tensor:
    """DiffusionNFT's forward-process noise ``[B, steps, ...]``: sample ``b``'s from its own CPU generator seeded
    with ``seeds[b]``, in step order, so a sample's x_t do not depend on its micro-batch or rank."""
    out = []
    for seed in seeds.tolist():
        g = torch.Generator().manual_seed(int(seed))
        out.append(torch.stack([torch.randn(like.shape[1:], generator=g) for _ in range(steps)]))
    return torch.stack(out).to(like.device, like.dtype)


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
