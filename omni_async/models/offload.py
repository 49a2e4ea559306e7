"""Offload between phases of a step: verl-omni's ``actor.fsdp_config.param_offload`` and ``optimizer_offload``.

A device holds, besides the transformer the update trains, parts that only one phase uses:

* ``param_offload``: the frozen text encoder(s) and VAE. Generation needs them (prompt encoding, decoding); the
  update does not, since the prompt encodings made at rollout travel with the batch. Qwen-Image's text encoder
  alone is 16.6 GB in bf16, a fifth of an 80 GB device, so while the update runs they live on the CPU
  (:meth:`DiffusionPolicy.offload_frozen`) and come back before the next generation.
* ``optimizer_offload``: AdamW's ``exp_avg`` / ``exp_avg_sq`` (2x the trainable parameters, fp32) are needed only
  inside ``optimizer.step()``: they live on the CPU between steps and visit the device for the step.

Both trade PCIe transfers for device memory (verl-omni's guidance: try ``optimizer_offload`` first, it costs no
forward time). Results are unchanged: the same tensors, moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

OFFLOAD_DEVICE = torch.device("cpu")


def place(modules: Iterable[torch.nn.Module], device: torch.device | str) -> None:
    """Move whole modules (parameters and buffers) to ``device``; ``Module.to`` leaves those already there."""
    for module in modules:
        module.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str | None) -> None:
    """Move each parameter's optimizer state to ``device`` (``None``: to the parameter's own device).

    ``step`` counters stay where the optimizer made them: a non-capturable AdamW keeps them on the CPU.
    """
    for param, state in optimizer.state.items():
        target = param.device if device is None else torch.device(device)
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value) and value.device != target:
                state[key] = value.to(target)


@contextlib.contextmanager
def optimizer_state_on_device(optimizer: torch.optim.Optimizer, enabled: bool = True) -> Iterator[None]:
    """``optimizer_offload``: the state is on its parameters' device inside the block (the step) and on the CPU
    after it. The first step creates the state on the device; it leaves for the CPU when the block ends."""
    if not enabled:
        yield
        return
    move_optimizer_state(optimizer, None)
    try:
        yield
    finally:
        move_optimizer_state(optimizer, OFFLOAD_DEVICE)
