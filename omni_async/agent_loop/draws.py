"""Draws: the prompts the producer takes from the dataset, ``data.train_batch_size`` at a time, made into samples.

Draw ``d`` is the ``d``-th batch of the prompt sampler. Each prompt becomes one GRPO group of ``rollout.n``
samples with uid ``"{d}-{p}"``; sample ``i`` of the draw is seeded by (rollout seed, ``d``, ``i``) and, for a
modality with an SDE window, gets its window from (window seed, ``d``, ``i`` or 0); the rollout seed is
``rollout.seed`` (null: ``trainer.seed``), the window seed ``rollout.algo.sde_window_seed`` (null: the rollout seed). So a sample is a pure function
of (seed, draw, index, weights version): whichever worker makes it, whenever, in whatever mode, and again after a
resume or a worker's death.

MixGRPO (``actor_rollout_ref.model.algorithm=mix_grpo``): every sample of draw ``d`` shares the window of training
step ``g = d + 1`` under ``rollout.algo.sample_strategy`` (``algos.mix_grpo.mix_grpo_window``, verl-omni's schedule;
``docs/losses.md``), whatever mode trains it and whenever.
"""

from __future__ import annotations

import numpy as np
import torch

from omni_async.algos.mix_grpo import mix_grpo_window
from omni_async.algos.sde import sde_window
from omni_async.sample import Sample

SEED_SAMPLE, SEED_WINDOW, SEED_VALIDATION = 0, 1, 2  # independent random streams
SEED_NFT_STEPS, SEED_NFT_NOISE = 3, 4  # DiffusionNFT: a sample's training steps and forward noise (its own seed's)
SEED_AWM_STEPS = 5  # AWM: a mini-batch's shared training steps (from its samples' seeds)
SEED_DPO_STEP = 6  # Diffusion-DPO: a pair's training timestep (its chosen sample's seed; noise: SEED_NFT_NOISE)


def sample_seed(base_seed: int, step: int, index: int, stream: int = SEED_SAMPLE) -> int:
    """A 31-bit seed that depends only on (base seed, stream, step, sample index)."""
    return int(np.random.SeedSequence([base_seed, stream, step, index]).generate_state(1)[0] & 0x7FFFFFFF)


class Draws:
    def __init__(
        self,
        sampler,
        *,
        seed: int,
        n: int,
        window: tuple[int, int, tuple[int, int], bool] | None,
        window_seed: int | None = None,
        mix: tuple[str, int] | None = None,
    ):
        """``sampler``: a ``trainer.dataset.PromptSampler`` (``next_batch``, ``state_dict``, ``load_state_dict``).
        ``window``: (num_inference_steps, sde_window_size, sde_window_range, per_sample) for a modality with an SDE
        window, else ``None``. ``mix``: MixGRPO's (sample_strategy, iters_per_group), or ``None`` (per_sample is then
        not read: a draw's samples share its step's window)."""
        self.sampler, self.seed, self.n, self.window_spec = sampler, int(seed), int(n), window
        self.window_seed = self.seed if window_seed is None else int(window_seed)
        self.mix = mix

    @classmethod
    def from_config(cls, cfg, sampler, uses_window: bool) -> Draws:
        r = cfg.actor_rollout_ref.rollout
        window = None
        if uses_window:
            window = (
                int(r.pipeline.num_inference_steps),
                int(r.algo.sde_window_size),
                tuple(r.algo.sde_window_range),
                bool(r.algo.sde_window_per_sample),
            )
        seed = int(cfg.trainer.seed if r.seed is None else r.seed)
        mix = None
        if uses_window and cfg.actor_rollout_ref.model.algorithm == "mix_grpo":
            mix = (str(r.algo.sample_strategy), int(r.algo.iters_per_group))
        return cls(sampler, seed=seed, n=int(r.n), window=window, window_seed=r.algo.sde_window_seed, mix=mix)

    def window(self, draw: int, index: int) -> tuple[int, int] | None:
        """The SDE window of sample ``index`` of draw ``draw``. With ``rollout.algo.sde_window_per_sample`` (default)
        each sample draws its own, as verl-omni's SD3 / Qwen-Image request batches draw one per row; false: one per
        draw, shared by all its samples (sample 0's). MixGRPO: training step ``draw + 1``'s window, for every index
        (``sde_window_seed`` null: the rollout seed, this project's meaning of the key)."""
        if self.window_spec is None:
            return None
        steps, size, span, per_sample = self.window_spec
        if self.mix is not None:
            strategy, iters = self.mix
            w = mix_grpo_window(
                draw + 1,
                num_inference_steps=steps,
                window_size=size,
                window_range=span,
                sample_strategy=strategy,
                sde_window_seed=self.window_seed,
                iters_per_group=iters,
            )
            return w.start, w.stop
        gen = torch.Generator().manual_seed(
            sample_seed(self.window_seed, draw, index if per_sample else 0, SEED_WINDOW)
        )
        w = sde_window(steps, size, span, gen)
        return w.start, w.stop

    def samples(self, draw: int, rows: list) -> list[Sample]:
        """``rows`` (one draw's prompts) as the draw's samples, ``n`` per prompt."""
        return [
            Sample(
                index=i,
                uid=f"{draw}-{p}",
                row=row,
                seed=sample_seed(self.seed, draw, i),
                window=self.window(draw, i),
            )
            for p, row in enumerate(rows)
            for i in range(p * self.n, p * self.n + self.n)
        ]

    def make(self, draw: int) -> tuple[dict, list[Sample]]:
        """Draw ``draw`` from the sampler: (its state before the draw, the draw's samples)."""
        state = self.sampler.state_dict()
        return state, self.samples(draw, self.sampler.next_batch())

    def state(self) -> dict:
        return self.sampler.state_dict()

    def load(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
