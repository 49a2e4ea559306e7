"""Wan 2.2's two denoising experts (diffusers ``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``).

diffusers' rule (``WanPipeline.__call__``): with ``boundary_t = boundary_ratio * scheduler.num_train_timesteps``,

    t >= boundary_t  ->  transformer     (the high-noise expert)
    t <  boundary_t  ->  transformer_2   (the low-noise expert)

and without ``boundary_ratio`` only ``transformer`` runs (:func:`step_denoisers`, once per schedule: every transformer
call runs one timestep, and samples at different steps, per-sample SDE windows, run separate calls). :class:`ExpertPair` holds
both experts as one module with peft's adapter calls fanned out, so the policy trains LoRA on both (or fully
fine-tunes both) as one trainable module: whichever expert an SDE window's steps fall on gets the gradient.
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


def step_denoisers(pipe: Any, timesteps: list[float]) -> list[torch.nn.Module]:
    """The transformer that denoises each timestep, by diffusers' rule (host floats: no device read per step)."""
    boundary = boundary_timestep(pipe)
    return [pipe.transformer if boundary is None or t >= boundary else pipe.transformer_2 for t in timesteps]


class ExpertPair(torch.nn.Module):
    """``transformer`` and ``transformer_2`` as one trainable module: parameters, state dict, gradient checkpointing
    and peft's adapter API (``add_adapter``, ``set_adapter``, ``enable/disable_adapters``, ``peft_config``) reach
    both. Its forward is never called; each step calls its expert (:func:`step_denoisers`)."""

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
