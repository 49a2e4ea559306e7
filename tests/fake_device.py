"""A pretend accelerator for CPU tests: the model lives on device ``fakegpu`` and mixing it with CPU tensors raises.

CI has no GPU, and a tensor left on the CPU next to a model on CUDA (a CPU ``torch.Generator`` for sampling on the
device, a CPU mask concatenated to a device mask, a driver's CPU batch fed to the device model) only fails on a
GPU. This module gives the CPU suite a second device with CUDA's placement rules, so the real code path (the
policies' ``generate``, the modality's backward and log-prob recompute in ``trainer.actor_core``) runs with the
model on a device other than the one the driver's tensors live on:

* ``fakegpu`` is PyTorch's ``privateuseone`` backend renamed and set up from Python
  (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``), so autograd has a device guard
  for it. (A tensor that claims ``cuda`` aborts the process in backward on a CPU-only build: no CUDA device guard.)
* Its tensors are :class:`FakeDeviceTensor`, wrapper subclasses whose values are an ordinary CPU tensor
  (``.inner``): ops compute for real, so sampling, ``.item()`` and data-dependent loops run as on a GPU.
* :class:`FakeDevice` (a ``TorchDispatchMode``) sees every aten op while it is active. It creates ``fakegpu``
  tensors (``.to(device)``, factories with ``device=``), and raises :class:`DeviceMixError` where CUDA raises
  (CPU ops included, so a ``fakegpu`` generator drawing CPU noise is caught too):
  an op whose tensors are on different devices (a 0-dim CPU tensor is allowed, as CUDA allows CPU scalars), an
  op given a generator of another device than its own (``torch.multinomial(device_probs, generator=cpu_gen)``).
  ``copy_`` / ``_to_copy`` (moves) and CPU index tensors (``x[cpu_idx]``) are allowed, as on CUDA.
* ``torch.Generator(device="fakegpu")`` gives a CPU generator that reports the device (CPU-only builds have no
  other), and ``torch.fakegpu.synchronize()`` counts its calls, so a timer's device sync can be checked.

Why not the others: ``FakeTensorMode`` and the ``meta`` device hold no values, so the sampling loop (``.all()``,
``.tolist()``) and the loss metrics (``.item()``) raise ``DataDependentOutputException`` instead of running; a
wrapper tensor that reports ``cuda`` aborts the process in backward (autograd asks for the CUDA device guard, which a
CPU-only build lacks). Usage: ``with FakeDevice() as device: policy = build_policy(..., device=NAME)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

NAME = "fakegpu"
CPU = torch.device("cpu")
_REAL_GENERATOR = torch.Generator
GENERATOR_TAG = 1 << 62  # set in the seed of a fakegpu generator (FakeDeviceGenerator)
aten = torch.ops.aten

# Moves between devices (what ``.to(device)`` and ``dst.copy_(src)`` are made of): any mix is fine.
_MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
# Advanced indexing: CUDA moves CPU index tensors to the indexed tensor's device itself.
_INDEXING = {
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}


class DeviceMixError(RuntimeError):
    """An op mixed devices where CUDA would refuse it."""


class FakeDeviceTensor(torch.Tensor):
    """A tensor on ``fakegpu`` whose values are the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> FakeDeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=DEVICE,
            requires_grad=inner.requires_grad,
        )
        out.inner = inner
        return out

    def tolist(self) -> Any:  # a device tensor's tolist() copies to the host (the C++ one refuses subclasses)
        return self.inner.tolist()

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FakeDeviceTensor({self.inner!r}, device='{NAME}')"

    __torch_function__ = torch._C._disabled_torch_function_impl  # no Python overhead above autograd

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs)

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FakeDeviceTensor(inner_tensors["inner"])


class FakeDeviceGenerator(_REAL_GENERATOR):
    """``torch.Generator`` while :class:`FakeDevice` is active. ``device="fakegpu"`` gives a CPU generator whose seed
    carries :data:`GENERATOR_TAG`: PyTorch hands ``__torch_dispatch__`` a fresh ``Generator`` object for the same
    C++ generator, so the seed is what tells an op which device its generator is for."""

    def __new__(cls, device: Any = "cpu"):
        kind = torch.device(device).type
        if kind not in ("cpu", NAME):
            raise RuntimeError(f"no {kind} generator on this CPU-only build")
        gen = super().__new__(cls, device="cpu")
        gen._fake = kind == NAME
        if gen._fake:
            gen.manual_seed(_REAL_GENERATOR().initial_seed())
        return gen

    @property
    def device(self) -> torch.device:
        return DEVICE if self._fake else CPU

    def manual_seed(self, seed: int) -> FakeDeviceGenerator:
        super().manual_seed(int(seed) | GENERATOR_TAG if self._fake else int(seed))
        return self

    def seed(self) -> int:
        return self.manual_seed(_REAL_GENERATOR().seed()).initial_seed()


def _device_of(x: Any) -> torch.device:
    """A tensor's or a generator's device."""
    if isinstance(x, FakeDeviceTensor):
        return DEVICE
    if isinstance(x, torch.Tensor):
        return x.device
    return DEVICE if x.initial_seed() & GENERATOR_TAG else x.device  # a generator


def _canon(device: Any) -> torch.device | None:
    if device is None:
        return None
    d = torch.device(device)
    return DEVICE if d.type == NAME else d


def _kind(func) -> str:
    """How :func:`_check` treats ``func``: "move", "indexing" or "op" (cached per op)."""
    kind = _KINDS.get(func)
    if kind is None:
        name = func._schema.name.split("::")[-1]
        kind = (
            "move"
            if func in _MOVES or name.endswith("_like") or name.startswith("new_")  # shape from input
            else "indexing"
            if func in _INDEXING
            else "op"
        )
        _KINDS[func] = kind
    return kind


_KINDS: dict[Any, str] = {}


def _check(func, args, kwargs) -> torch.device:
    """The op's device, after refusing what CUDA refuses; raises :class:`DeviceMixError`."""
    target = _canon(kwargs.get("device"))
    kind = _kind(func)
    if kind == "move":
        return target if target is not None else _device_of(args[0])
    tensors = [args[0], *_tensors(args[2:])] if kind == "indexing" else list(_tensors(args))  # CPU indices are fine
    tensors += _tensors(kwargs.values())
    devices = set() if target is None else {target}
    for t in tensors:
        if isinstance(t, FakeDeviceTensor):
            devices.add(DEVICE)
        elif t.dim() or t.device != CPU:  # a 0-dim CPU tensor is a scalar to CUDA kernels
            devices.add(t.device)
    if len(devices) > 1:
        raise DeviceMixError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{' and '.join(sorted(map(str, devices)))}! ({func})"
        )
    device = next(iter(devices)) if devices else (_device_of(tensors[0]) if tensors else CPU)
    gen = kwargs.get("generator")
    if gen is not None and _device_of(gen).type != device.type:
        raise DeviceMixError(
            f"Expected a '{device.type}' device type for generator but found '{_device_of(gen).type}' ({func})"
        )
    return device


def _run(func, args, kwargs):
    """Run an op on the values, after :func:`_check`; a ``fakegpu`` op's tensor results are ``fakegpu`` tensors."""
    kwargs = dict(kwargs or {})
    device = _check(func, args, kwargs)
    if _canon(kwargs.get("device")) == DEVICE:
        kwargs["device"] = CPU
    out = func(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(kwargs.values()), strict=True)))
    if device != DEVICE:
        return out
    out = FakeDeviceTensor(out) if type(out) is torch.Tensor else _wrapped(out)
    return return_and_correct_aliasing(func, args, kwargs, out) if _aliases(func) else out


def _aliases(func) -> bool:
    """Whether ``func`` returns a view or mutates an input: then the wrappers must alias as the values do."""
    flag = _ALIASES.get(func)
    if flag is None:
        schema = func._schema
        flag = _ALIASES[func] = any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
    return flag


_ALIASES: dict[Any, bool] = {}


def _unwrapped(values) -> list:
    """The values with each ``fakegpu`` tensor replaced by its CPU values, in (nested) lists / tuples too."""
    return [
        v.inner if isinstance(v, FakeDeviceTensor) else type(v)(_unwrapped(v)) if isinstance(v, (list, tuple)) else v
        for v in values
    ]


def _wrapped(out: Any) -> Any:
    """An op's CPU results as ``fakegpu`` tensors (a tensor, or a tuple / list of them)."""
    if isinstance(out, (list, tuple)):
        return type(out)(_wrapped(v) for v in out)
    return FakeDeviceTensor(out) if type(out) is torch.Tensor else out


def _tensors(values) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _plain(args, kwargs) -> bool:
    """No ``fakegpu`` tensor, device or generator in sight: a CPU op (the fast path)."""
    if kwargs and (kwargs.get("generator") is not None or _canon(kwargs.get("device")) == DEVICE):
        return False
    for a in args:
        if isinstance(a, FakeDeviceTensor) or (
            isinstance(a, (list, tuple)) and any(isinstance(t, FakeDeviceTensor) for t in a)
        ):
            return False
    return not any(isinstance(v, FakeDeviceTensor) for v in (kwargs or {}).values())


class FakeDevice(TorchDispatchMode):
    """While active: CUDA's device rules on every op (CPU ops included: a ``fakegpu`` generator on a CPU op raises),
    ``torch.Generator(device="fakegpu")`` works, ``synchronize`` calls are counted (:attr:`synchronized`)."""

    def __enter__(self):
        torch.Generator = FakeDeviceGenerator
        _BACKEND.synchronized = 0
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = _REAL_GENERATOR
        return super().__exit__(*exc)

    @property
    def synchronized(self) -> int:
        """``torch.fakegpu.synchronize()`` calls since the mode was entered."""
        return _BACKEND.synchronized

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _plain(args, kwargs):
            return func(*args, **(kwargs or {}))
        return _run(func, args, kwargs)


class _Backend:
    """``torch.fakegpu``: what PyTorch asks of a device module, plus a counted ``synchronize``."""

    synchronized = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def synchronize(self, device: Any = None) -> None:
        self.synchronized += 1


_BACKEND = _Backend()


def setup_backend() -> None:
    """Rename ``privateuseone`` to ``fakegpu`` once per process (PyTorch allows one rename)."""
    if torch._C._get_privateuse1_backend_name() == NAME:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=_BACKEND)
    # The backend's allocations (``torch.tensor(data, device=...)``, ``.to(device)`` outside the mode) are CPU
    # tensors wrapped as ``fakegpu`` ones.
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")
    _LIB.impl("empty.memory_format", _empty, "PrivateUse1")
    _LIB.impl("empty_strided", _empty_strided, "PrivateUse1")
    _LIB.impl("_copy_from", _copy_from, "PrivateUse1")


_LIB: torch.library.Library | None = None


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return FakeDeviceTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _copy_from(src, dst, non_blocking=False):
    dst.inner.copy_(src.inner if isinstance(src, FakeDeviceTensor) else src)
    return dst


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return FakeDeviceTensor(torch.empty_strided(size, stride, dtype=dtype))


setup_backend()
DEVICE = torch.device(NAME, 0)


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the pretend accelerator (a result that should have come back to the CPU, if so)."""
    return isinstance(t, FakeDeviceTensor)
