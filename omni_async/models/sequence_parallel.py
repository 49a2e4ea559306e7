"""Ulysses sequence parallelism for a diffusion transformer (verl's ``actor.fsdp_config.ulysses_sequence_parallel_size``).

The actor's ``W`` ranks form ``W / sp`` data-parallel groups of ``sp`` consecutive ranks: rank ``r`` is data-parallel
rank ``r // sp`` and sequence rank ``r % sp`` (``trainer.data_parallel.DataParallel``). The batch is split by
data-parallel rank, so the ``sp`` ranks of a group hold the same samples; inside every transformer call of an update
or a log-prob recompute they share each sample's tokens, through diffusers' context parallelism (Ulysses degree
``sp``, the model's own ``_cp_plan``; diffusers >= 0.38):

- entering the first block, each rank keeps its ``1/sp`` slice of the image tokens and of the text tokens,
  ``[B, S/sp, D]`` (the RoPE frequencies are sliced the same way);
- in every attention, one all-to-all turns q, k, v from ``[B, S/sp, H, d]`` (a slice of the tokens, every head) into
  ``[B, S, H/sp, d]`` (every token, ``H/sp`` heads); attention runs over the whole sequence for those heads, and a
  second all-to-all turns the output back into ``[B, S/sp, H, d]``; the joint mask is all-gathered alike;
- ``proj_out``'s output is all-gathered into ``[B, S_img, C]`` on every rank; its backward keeps each rank's own
  slice of the gradient (every rank computes the same loss from the same gathered output).

So a parameter's gradient on a rank holds the contributions of that rank's tokens, and the sum over the ``sp`` ranks
is the sample's gradient: the data-parallel sum over all ``W`` ranks, with each micro-batch's loss weighted by its
units over the global units counted once per group (``trainer.data_parallel.loss_scales``), is one rank's step. What
it buys: activations (the per-token ``[S, D]`` tensors of every block, kept for backward) are ``1/sp`` per rank, and
attention's ``S x S`` work is split by heads.

Text tokens are padded with masked tokens up to a multiple of ``sp`` (Qwen-Image's ``encoder_hidden_states_mask``:
padded keys are masked out, their own outputs never reach the image tokens); image tokens must divide by ``sp``.

Generation is split the same way. A group is one rollout worker: its leader (sequence rank 0) takes the requests and
forms the batches, and the group's other ranks run each batch with it (``trainer.group_order`` puts every rank's
device calls in the leader's order, so the ranks always meet in the same collective); every rank gets the whole
samples (``proj_out``'s gathered output), the leader answers the requests. The text encoders and the VAE are not
split (each rank runs them whole). The hooks are attached only inside :meth:`SequenceParallel.active` (generation,
the update, the log-prob recompute), so nothing else a rank runs waits on a collective.

diffusers' ``enable_parallelism`` is not used: it builds its device from ``rank % torch.accelerator.device_count()``,
which divides by zero on a CPU machine, and it cannot be undone; the same parts (``ParallelConfig.setup``, the
processors' ``_parallel_config``, ``apply_context_parallel``) are applied here on a ``(dp, ring=1, ulysses=sp)``
device mesh over the actor's process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

KEY = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"


def check_supported(module: torch.nn.Module, size: int) -> None:
    """Raise a ``ValueError`` naming the model and the fix when ``module`` cannot run Ulysses of degree ``size``."""
    key, name = KEY, type(module).__name__
    if getattr(module, "_cp_plan", None) is None:
        raise ValueError(
            f"{key}={size}: diffusers' {name} declares no context-parallel plan (_cp_plan), so its tokens cannot be "
            f"split across ranks; use a model whose transformer does (Qwen-Image, FLUX.1, Wan), or set {key}=1"
        )
    backend = unsupported_backend(module)
    if backend is not None:
        raise ValueError(
            f"{key}={size}: {name}'s attention backend {backend!r} has no context-parallel path in diffusers (its "
            "_parallel_config would be ignored: attention over each rank's slice alone); set "
            f"actor_rollout_ref.model.attn_backend to one that has ({', '.join(context_parallel_backends())}), or {key}=1"
        )
    heads = int(getattr(module.config, "num_attention_heads", 0) or 0)
    if heads % size:
        raise ValueError(
            f"{key}={size}: {name} has {heads} attention heads; Ulysses gives each rank heads / {size} of them, so "
            f"{size} must divide {heads}: set {key} to a divisor of {heads}"
        )


def context_parallel_backends() -> list[str]:
    """diffusers' attention backends that run Ulysses (registered with ``supports_context_parallel``)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return sorted(_AttentionBackendRegistry._supports_context_parallel)


def unsupported_backend(module: torch.nn.Module) -> str | None:
    """The first attention backend among ``module``'s processors (diffusers' active one where a processor sets
    none) that has no context-parallel path, or None."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for p in _attention_processors(module):
        backend = getattr(p, "_attention_backend", None) or _AttentionBackendRegistry.get_active_backend()[0]
        name = getattr(backend, "value", backend)
        if name not in context_parallel_backends():
            return str(name)
    return None


def pipeline_problem(pipeline: str) -> str | None:
    """Why the transformer of diffusers pipeline class ``pipeline`` cannot run Ulysses (it declares no ``_cp_plan``;
    read from the pipeline's ``transformer`` argument), or None (a plan, or a class this cannot tell)."""
    import inspect
    import typing

    import diffusers

    cls = getattr(diffusers, pipeline, None)
    param = inspect.signature(cls.__init__).parameters.get("transformer") if cls is not None else None
    if param is None:
        return None
    for t in (param.annotation, *typing.get_args(param.annotation)):  # a class, or ``Class | None``
        if isinstance(t, type) and issubclass(t, torch.nn.Module):
            if getattr(t, "_cp_plan", None) is None:
                return f"{pipeline}'s {t.__name__} declares no context-parallel plan (_cp_plan) in diffusers"
            return None
    return None


def denoisers(policy: Any) -> list[torch.nn.Module]:
    """A diffusion policy's transformers, each once (Wan 2.2: both experts)."""
    out: list[torch.nn.Module] = []
    for m in (policy.transformer, *getattr(policy.trainable, "experts", ())):
        if not any(m is o for o in out):
            out.append(m)
    return out


def _attention_processors(module: torch.nn.Module) -> list[Any]:
    return [
        m.processor
        for m in module.modules()
        if hasattr(getattr(m, "processor", None), "_parallel_config")  # diffusers' attention modules' processors
    ]


class SequenceParallel:
    """Ulysses over the sequence ranks of this rank's data-parallel group, for ``modules`` (the policy's
    transformers). Built on every actor rank at the same point (the device mesh's groups are collectives); ``size``
    divides ``world`` (``trainer.data_parallel.DataParallel`` refuses it otherwise)."""

    def __init__(self, modules: Sequence[torch.nn.Module], size: int, rank: int, world: int, device: torch.device):
        from diffusers import ContextParallelConfig
        from diffusers.models._modeling_parallel import ParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        for m in modules:
            check_supported(m, size)
        self.modules, self.size = list(modules), int(size)
        mesh = init_device_mesh(device.type, (world // size, 1, size), mesh_dim_names=("dp", "ring", "ulysses"))
        self.config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=size, mesh=mesh))
        self.config.setup(rank, world, device, mesh=mesh)
        self.on = False

    def _pad_text(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, pad_text(kwargs, self.size, type(module).__name__)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside: every call of the modules splits its tokens over the group (module docstring). Re-entrant."""
        if self.on:
            yield
            return
        from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

        handles = []
        for m in self.modules:
            for p in _attention_processors(m):
                p._parallel_config = self.config
            apply_context_parallel(m, self.config.context_parallel_config, m._cp_plan)
            handles.append(m.register_forward_pre_hook(self._pad_text, with_kwargs=True))
        self.on = True
        try:
            yield
        finally:
            self.on = False
            for h in handles:
                h.remove()
            for m in self.modules:
                remove_context_parallel(m, m._cp_plan)
                for p in _attention_processors(m):
                    p._parallel_config = None


def pad_text(kwargs: dict[str, Any], size: int, model: str) -> dict[str, Any]:
    """A transformer call's keyword arguments with the text tokens padded up to a multiple of ``size``, the added ones
    masked out (``encoder_hidden_states_mask`` 0; an absent mask becomes all ones first); the image tokens must
    divide by ``size``. ``model``: the transformer's class, for the errors."""
    key = KEY
    x = kwargs.get("hidden_states")
    if x is not None and x.shape[1] % size:
        raise ValueError(
            f"{key}={size}: {model} gets {x.shape[1]} image tokens, which do not split evenly over {size} ranks; "
            "choose rollout.pipeline.height / width so they do"
        )
    text = kwargs.get("encoder_hidden_states")
    pad = -text.shape[1] % size if text is not None else 0
    if not pad:
        return kwargs
    if "encoder_hidden_states_mask" not in kwargs:
        raise ValueError(
            f"{key}={size}: {model} takes no text mask, so its {text.shape[1]} text tokens cannot be padded to a "
            f"multiple of {size}; set rollout.pipeline.max_sequence_length to one"
        )
    mask = kwargs["encoder_hidden_states_mask"]
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
    return {
        **kwargs,
        "encoder_hidden_states": torch.nn.functional.pad(text, (0, 0, 0, pad)),
        "encoder_hidden_states_mask": torch.nn.functional.pad(mask, (0, pad)),
    }
