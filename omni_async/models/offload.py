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

The frozen modules' moves (:class:`HostOffload`) go through persistent host buffers, allocated on the first offload
and reused by every later one, page-locked (pinned) when the device is a CUDA GPU so both directions are
asynchronous DMA copies (``non_blocking``) instead of staged pageable copies; a policy moves them at most once
each way per training step (``DiffusionPolicy.offload_frozen``), however generation and updates interleave.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch

OFFLOAD_DEVICE = torch.device("cpu")


def pinned_host_memory(device: torch.device | str) -> bool:
    """Whether host buffers for tensors of ``device`` are page-locked: only for a CUDA device (pinning needs the
    CUDA driver, and only a device DMA benefits from it)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _set_param(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Point a parameter at ``value``, keeping the ``Parameter`` object (so tied weights stay tied): ``.data`` where
    the tensor types allow it (``nn.Module._apply``'s test), else a swap of the two tensors' contents."""
    if torch._has_compatible_shallow_copy_type(p, value):
        p.data = value
    else:
        torch.utils.swap_tensors(p, torch.nn.Parameter(value, requires_grad=p.requires_grad))


class HostOffload:
    """Moves a fixed set of modules' parameters and buffers between the device and persistent host buffers.

    :meth:`to_host` copies each tensor into its host buffer (made on the first call, pinned when
    :func:`pinned_host_memory`, then reused by every later call) and points the module at the buffer, which frees
    the device memory; :meth:`to_device` copies the buffers into fresh device tensors. Both copies are
    ``non_blocking``: they are ordered on the current stream before any kernel that later uses the memory, and the
    host side never reads the buffers. Parameters keep their ``Parameter`` objects (:func:`_set_param`), so hooks
    and tied weights see no change. (With the CPU as the device the buffers simply become the modules' storage.)
    """

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.modules = list(modules)
        self.host: dict[tuple, torch.Tensor] = {}  # a parameter's or a buffer slot's key -> its host buffer
        self.buffers_allocated = 0  # host buffers made so far: fixed after the first offload
        self.moves = {"to_host": 0, "to_device": 0}

    def _slots(self) -> list[tuple[tuple, torch.Tensor, Callable[[torch.Tensor], None]]]:
        """(key, tensor, setter) of every parameter (once, tied ones included) and buffer of the modules."""
        slots, seen = [], set()
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    slots.append((("param", id(p)), p.data, partial(_set_param, p)))
            for owner in module.modules():
                for name, b in owner._buffers.items():
                    if b is not None:
                        slots.append((("buffer", id(owner), name), b, partial(owner._buffers.__setitem__, name)))
        return slots

    def to_host(self) -> None:
        for key, t, put in self._slots():
            buf = self.host.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned_host_memory(t.device))
                self.host[key] = buf
                self.buffers_allocated += 1
            if buf.data_ptr() != t.data_ptr():
                buf.copy_(t, non_blocking=True)
            put(buf)
        self.moves["to_host"] += 1

    def to_device(self, device: torch.device | str) -> None:
        for _, t, put in self._slots():
            put(t.to(device, non_blocking=True))
        self.moves["to_device"] += 1


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
