"""A simulated image device: a diffusion policy whose generation and update are timed waits (``sim:image``).

``actor_rollout_ref.model.path=sim:image`` (``modality=image``) builds :class:`SimImagePolicy` on every rollout
worker and trainer rank. It is ``tiny:sd3`` (its pipeline, its LoRA or full weights, the real optimizer step, weight
syncs, checkpoints) with the device's two computations replaced by waits that hold no CPU, as GPU kernels do not:

- **a device batch** (``DiffusionPolicy.rollout``'s contract: one image per (prompt, seed), the SDE window's latents
  and log-probs, the prompt encodings, the window starts): ``batch_s + image_s x images`` seconds per batch, whatever
  the steps, the window or the sizes (a batch is one run of denoising steps: its cost grows with its images). Its
  tensors are drawn from each sample's seed (latents of the pipeline's shape; pixels uniform, so the simulated scorer's
  latency and JPEG score differ per sample); the log-probs are 0; the prompt encodings are one prompt's, encoded once.
- **the update's forward**: ``update_step_s`` seconds per sample and scored denoising step (an SDE-window step, or a
  forward-process step of a final-latent loss) with gradients (forward + backward), a third of it without (a log-prob
  recompute, the reference's). Log-probs 0 and means equal to the input latents, joined to the trainable weights by a
  zero term, so the loss, its backward and the optimizer step run on the real (tiny) weights.

So everything but the device (the driver, the rollouter, the image batcher, reward workers, Ray, the switch policy,
weight syncs) runs as it ships, and the device's time is set by the workload (``bench/switch_sim.py --workload
image_batches``), not by this machine's cores. The timings are ``actor_rollout_ref.model.override_config`` keys
(:class:`SimImageTimings`; another key is refused at start). Each device records its waits (:attr:`busy`), as
``sim:text`` (:mod:`omni_async.models.sim_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from omni_async.algos.sde import SDEStep
from omni_async.models.diffusion_policy import DiffusionPolicy, Rollout, SamplingConfig, sample_generators
from omni_async.models.sim_policy import GENERATE, UPDATE, DeviceClock, sim_override_problems
from omni_async.models.tiny import SIM_SOURCES

RECOMPUTE_SHARE = 1.0 / 3.0  # a forward without gradients: a third of forward + backward (as sim:text)


@dataclass(frozen=True)
class SimImageTimings:
    """Seconds of device time (``actor_rollout_ref.model.override_config`` of ``sim:image``)."""

    # The defaults: bench/switch_sim.py's image_batches workload (a large text-to-image model on a GPU, scaled down).
    batch_s: float = 0.2  # a device batch, whatever its images (launch, VAE decode, the batch's fixed share)
    image_s: float = 0.1  # and per image in it (its denoising steps)
    update_step_s: float = 0.02  # the update's forward + backward per sample and scored step (a recompute: a third)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class SimImagePolicy(DiffusionPolicy):
    """``tiny:sd3`` with simulated device time (module docstring)."""

    def __init__(self, model_path: str, sampling: SamplingConfig, **options: Any):
        override = dict(options.pop("override_config", None) or {})
        problems = sim_override_problems(override, SimImageTimings.keys())
        if problems:
            raise ValueError(f"actor_rollout_ref.model.override_config for {model_path!r}: {'; '.join(problems)}")
        self.timings = SimImageTimings(**{k: float(v) for k, v in override.items()})
        self.busy = DeviceClock()
        super().__init__(SIM_SOURCES["image"], sampling, **options)
        # one prompt's encodings for every sample: the text encoder runs once, not per batch (it is device work)
        self._prompt_cond = {k: v for k, v in self.adapter.encode([""]).items() if v is not None}

    @torch.no_grad()
    def rollout(self, prompts: list[str], seeds: list[int], window: range | list[range] | None) -> Rollout:
        """``DiffusionPolicy.rollout``'s result after one wait for the batch (module docstring)."""
        n = len(seeds)
        windows = list(window) if isinstance(window, list) else [window if window is not None else range(0)] * n
        if len({len(w) for w in windows}) > 1:
            raise ValueError(f"the samples of one batch need SDE windows of one length, got {windows}")
        size = len(windows[0]) if windows else 0
        self.busy.wait(self.timings.batch_s + self.timings.image_s * n, GENERATE)
        x = self.adapter.init_latents(sample_generators(seeds))  # the pipeline's latent shape, from each seed
        s = self.sampling
        frames = (s.num_frames,) if s.num_frames > 1 else ()
        pixels = np.stack(
            [
                np.random.default_rng([int(seed), 0x51A6]).integers(0, 256, (*frames, s.height, s.width, 3))
                for seed in seeds
            ]
        ).astype(np.uint8)
        return Rollout(
            images=pixels,
            window_latents=x[:, None].expand(n, size + 1, *x.shape[1:]).clone() if size else torch.empty(n, 0),
            log_probs=torch.zeros(n, size) if size else torch.empty(n, 0),
            conditioning={k: v.expand(n, *v.shape[1:]).clone() for k, v in self._prompt_cond.items()},
            window_starts=[w.start for w in windows],
            final_latents=x.float() if s.clean_latents else None,
            window_means=x[:, None].expand(n, size, *x.shape[1:]).float().clone() if size and s.window_means else None,
        )

    def _device_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update's wait for ``len(x)`` samples at one step; a zero [B] on the trainable weights when gradients
        are on (so the backward and the optimizer step run)."""
        share = 1.0 if torch.is_grad_enabled() else RECOMPUTE_SHARE
        self.busy.wait(self.timings.update_step_s * len(x) * share, UPDATE)
        zero = torch.zeros(len(x), device=x.device)
        if torch.is_grad_enabled():
            zero = zero + 0.0 * sum(p.sum() for p in self.trainable_parameters())
        return zero

    def step(self, cond: Any, x: torch.Tensor, i: int | torch.Tensor, **options: Any) -> SDEStep:
        """An SDE step scored on the simulated device: log-prob 0, mean = ``x`` (what the window losses read)."""
        zero = self._device_forward(x)
        x = x.float()
        mean = x + zero.view(-1, *[1] * (x.dim() - 1))
        prev = options.get("prev_sample")
        ones = torch.ones_like(x)
        return SDEStep(prev_sample=x if prev is None else prev, log_prob=zero, mean=mean, std=ones, std_dev_t=ones)

    def velocity(self, cond: Any, x: torch.Tensor, i: int | torch.Tensor, *, per_sample: bool = True) -> torch.Tensor:
        """A final-latent loss's forward on the simulated device: a zero velocity."""
        zero = self._device_forward(x)
        return torch.zeros_like(x, dtype=torch.float32) + zero.view(-1, *[1] * (x.dim() - 1))
