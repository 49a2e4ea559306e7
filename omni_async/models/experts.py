"""Wan 2.2's two denoising experts (diffusers ``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``).

diffusers' rule (``WanPipeline.__call__``): with ``boundary_t = boundary_ratio * scheduler.num_train_timesteps``,

    t >= boundary_t  ->  transformer     (the high-noise expert), CFG scale guidance_scale
    t <  boundary_t  ->  transformer_2   (the low-noise expert),  CFG scale guidance_scale_2 (None: guidance_scale)

and without ``boundary_ratio`` only ``transformer`` runs. ``t`` is the timestep diffusers' pipeline denoises that step
at, which :func:`switch_timesteps` gives: Wan ships UniPC, whose timesteps are integers (``int64``), and the policy
samples on the same grid up to < 0.1 % with float timesteps (``DiffusionPolicy._schedule``), so the decision reads
UniPC's own timestep of each step. At flow_shift 3 and boundary_ratio 0.875, step 3 of 10 (12 of 40) is sigma 0.875:
UniPC says t = 875 (high-noise expert), the float grid 874.99994 (which would pick the low-noise one).

:func:`low_noise_steps` decides once per schedule (every transformer call runs one timestep, and samples at different
steps, per-sample SDE windows, run separate calls), for rollout and update alike. :class:`ExpertPair` holds both
experts as one module with peft's adapter calls fanned out, so the policy trains LoRA on both (or fully fine-tunes
both) as one trainable module: whichever expert an SDE window's steps fall on gets the gradient.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def boundary_timestep(pipe: Any) -> float | None:
    """diffusers' switch point ``boundary_ratio * num_train_timesteps``, or ``None`` for a one-expert pipeline."""
    ratio = getattr(pipe.config, "boundary_ratio", None)
    if ratio is None or getattr(pipe, "transformer_2", None) is None:
        return None
    return float(ratio) * float(pipe.scheduler.config.num_train_timesteps)


def switch_timesteps(pipe: Any, timesteps: list[float]) -> list[float]:
    """The timestep diffusers' ``WanPipeline`` denoises each of the ``N = len(timesteps)`` steps at, which its expert
    switch compares with :func:`boundary_timestep`: the pipeline's own scheduler's ``set_timesteps(N)`` (on a copy)
    where that is not the flow-matching Euler scheduler the policy samples with (Wan's UniPC: integer timesteps on
    the policy's grid up to < 0.1 %); with a ``FlowMatchEulerDiscreteScheduler`` pipeline, ``timesteps`` itself (the
    same scheduler's, on verl-omni's sigmas)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    own = pipe.scheduler
    if isinstance(own, FlowMatchEulerDiscreteScheduler):
        return list(timesteps)
    sched = type(own).from_config(own.config)
    sched.set_timesteps(len(timesteps), device="cpu")
    theirs = [float(t) for t in sched.timesteps]
    if len(theirs) != len(timesteps):  # a multistep scheduler that repeats steps: no step-for-step counterpart
        raise ValueError(
            f"{type(own).__name__} gives {len(theirs)} timesteps for {len(timesteps)} steps; Wan 2.2's expert switch "
            "needs one per denoising step"
        )
    return theirs


def low_noise_steps(pipe: Any, timesteps: list[float]) -> list[bool]:
    """Per step (host floats: no device read per step): whether diffusers' rule gives it the low-noise expert
    ``transformer_2`` (all ``False`` for a one-expert pipeline)."""
    boundary = boundary_timestep(pipe)
    if boundary is None:
        return [False] * len(timesteps)
    return [t < boundary for t in switch_timesteps(pipe, timesteps)]


class ExpertPair(torch.nn.Module):
    """``transformer`` and ``transformer_2`` as one trainable module: parameters, state dict, gradient checkpointing
    and peft's adapter API (``add_adapter``, ``set_adapter``, ``enable/disable_adapters``, ``peft_config``) reach
    both. Its forward is never called; each step calls its expert (:func:`low_noise_steps`)."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        # FSDP2 shards each of these blocks (trainer.data_parallel.shard_module reads it).
        self._no_split_modules = sorted(
            {
                *(getattr(transformer, "_no_split_modules", None) or []),
                *(getattr(transformer_2, "_no_split_modules", None) or []),
            }
        )

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    @property
    def peft_config(self) -> dict:
        return self.transformer.peft_config

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        for expert in self.experts:
            expert.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)

    def set_adapter(self, adapter_name: str) -> None:
        for expert in self.experts:
            expert.set_adapter(adapter_name)

    def disable_adapters(self) -> None:
        for expert in self.experts:
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.experts:
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertPair is a container; each step calls its expert (models.experts.step_denoisers)")


def trained_module(pipe: Any) -> torch.nn.Module:
    """What the policy trains: both experts of a two-expert Wan 2.2 pipeline, else the pipeline's transformer."""
    if boundary_timestep(pipe) is not None:
        return ExpertPair(pipe.transformer, pipe.transformer_2)
    return pipe.transformer
