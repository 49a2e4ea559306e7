"""The transformer's two speed options, applied once where the policy's transformer is built: diffusers' attention
backend (verl-omni's ``actor_rollout_ref.model.attn_backend``) and regional compilation (verl's
``actor_rollout_ref.actor.use_torch_compile``).

Both change the module itself, not a call site, so the rollout, the log-prob recompute and the update (one module in
a hybrid worker; the same build in a rollout replica) run one attention kernel and one compiled block, and pi_old
and the update's first forward keep agreeing (the window's same-shaped calls, ``models.diffusion_policy``).

* **Attention backend.** A value of diffusers' ``AttentionBackendName`` (``native``: torch SDPA, the default;
  ``_native_math``, ``flex``; on CUDA ``_native_efficient``, ``_native_cudnn``, ``flash`` / ``flash_varlen``
  (``flash-attn``), ``_flash_3`` / ``_flash_varlen_3`` (FA3), ``_flash_3_varlen_hub`` (verl-omni's default, the
  ``kernels`` package), ``sage`` / ``sage_varlen`` (``sageattention``), ``xformers``, ...). The start refuses an
  unknown name (listing the valid ones) and one whose package is not installed (naming it: diffusers' own check);
  the policy's build refuses what its device or model family cannot run (:func:`set_attention_backend`).
* **Regional compilation.** ``torch.compile`` on each repeated block of the transformer (diffusers'
  ``compile_repeated_blocks``, the classes its ``_repeated_blocks`` names; a model without them, SD3, compiles each
  module of its ``*blocks`` lists): the blocks hold nearly all of the compute and share one compiled graph per
  block class (diffusers' reason for it: a fraction of a whole-model compile's time), and LoRA (peft's layers inside
  them) and gradient checkpointing (which calls each block) work as they do eagerly. Inductor rounds as eager does (:func:`compile_repeated_blocks`), which keeps the first
  update's ratio at 1.
"""

from __future__ import annotations

from typing import Any

import torch

NATIVE = "native"
# Backends that run on a CPU device (the others are CUDA / NPU / XLA kernels). Tested on CPU: native, _native_math
# (tests/models/test_acceleration.py); flex runs there unfused (torch warns), slowly.
CPU_BACKENDS = (NATIVE, "_native_math", "flex")
# Backends whose diffusers implementation (diffusers 0.42, attention_dispatch) refuses an attention mask, and the
# varlen form that takes one where there is one. Qwen-Image masks its text wherever prompts of different lengths (a
# batch, or a sample's two CFG branches) share a transformer call.
MASKLESS: dict[str, str | None] = {
    "flash": "flash_varlen",
    "flash_hub": "flash_varlen_hub",
    "_flash_3": "_flash_varlen_3",
    "_flash_3_hub": "_flash_3_varlen_hub",
    "sage": "sage_varlen",
    **dict.fromkeys(
        (
            "flash_4_hub",
            "aiter_fa2_hub",
            "_native_flash",
            "_native_xla",
            "sage_hub",
            "sage_blackwell_hub",
            "_sage_qk_int8_pv_fp8_cuda",
            "_sage_qk_int8_pv_fp8_cuda_sm90",
            "_sage_qk_int8_pv_fp16_cuda",
            "_sage_qk_int8_pv_fp16_triton",
        )
    ),
}
MASKED_TEXT_TRANSFORMERS = ("QwenImageTransformer2DModel",)  # Qwen-Image and Qwen-Image-Edit
KEY = "actor_rollout_ref.model.attn_backend"


def backend_names() -> list[str]:
    """diffusers' attention backends (the installed version's ``AttentionBackendName`` values)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName]


def backend_problem(name: str) -> tuple[str, str] | None:
    """Why ``name`` cannot be used in this environment, and the fix, or ``None``: an unknown name, or a known one
    whose package is missing (diffusers' own requirement check, which names the package and its install)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    names = backend_names()
    if name not in names:
        return f"unknown attention backend {name!r}", f"use one of diffusers' backends: {', '.join(names)}"
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as err:  # diffusers raises RuntimeError naming the package and how to install it
        return str(err).rstrip("."), f"install it on every worker, or use {NATIVE} (torch SDPA)"
    return None


def set_attention_backend(modules: list[torch.nn.Module], name: str, device: torch.device | str) -> None:
    """Give every attention processor of ``modules`` (the pipeline's transformers) the backend ``name``. Raises
    ``ValueError`` naming the key and the fix when the device or the model cannot run it: a CUDA kernel on a CPU
    device; a mask-less kernel on Qwen-Image's masked text; a non-native backend on a model whose attention
    processors call torch SDPA themselves (SD3's ``JointAttnProcessor2_0``), where diffusers' backends never
    reach."""
    problem = backend_problem(name)
    if problem is not None:
        raise ValueError(f"{KEY}={name}: {problem[0]}. Fix: {problem[1]}")
    if torch.device(device).type == "cpu" and name not in CPU_BACKENDS:
        raise ValueError(
            f"{KEY}={name}: a CUDA kernel, and this worker runs on the CPU. Fix: use one of {', '.join(CPU_BACKENDS)} "
            "on CPU (or run on GPUs)"
        )
    for module in modules:
        family = type(module).__name__
        if name in MASKLESS and family in MASKED_TEXT_TRANSFORMERS:
            varlen = MASKLESS[name]
            raise ValueError(
                f"{KEY}={name}: {family} masks its text where prompts of different lengths share a call (a batch, "
                f"or CFG's two branches), and diffusers' {name} takes no mask. Fix: use "
                f"{varlen + ' (its varlen form) or ' if varlen else ''}{NATIVE}"
            )
        module.set_attention_backend(name)
        if name != NATIVE and not _dispatching(module):
            raise ValueError(
                f"{KEY}={name}: {family}'s attention processors call torch SDPA themselves, so diffusers' backends do "
                f"not reach them. Fix: use {NATIVE} for this model (Qwen-Image, FLUX.1 and Wan take the backends)"
            )


def _dispatching(module: torch.nn.Module) -> bool:
    """Whether any attention processor of ``module`` calls diffusers' ``dispatch_attention_fn`` (has a backend)."""
    return any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in module.modules())


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks regional compilation compiles: the modules whose class the model's ``_repeated_blocks`` names
    (diffusers' convention), else each module of its ``*blocks`` lists (SD3's ``transformer_blocks``)."""
    names = getattr(model, "_repeated_blocks", None)
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    return [
        block
        for child_name, child in model.named_children()
        if isinstance(child, torch.nn.ModuleList) and child_name.endswith("blocks")
        for block in child
    ]


def compile_repeated_blocks(modules: list[torch.nn.Module], **compile_kwargs: Any) -> int:
    """``torch.compile`` each repeated block of ``modules`` in place (``nn.Module.compile``: the module and its
    parameters stay the same objects, so optimizers, LoRA adapters and weight syncs are untouched); returns how
    many. Raises ``ValueError`` naming the key when a module has no blocks to compile.

    Inductor is told to round every low-precision intermediate as eager does (``emulate_precision_casts``): without
    it, it keeps a fused chain's bf16 intermediates in fp32, differently in the rollout's no-grad graph and the
    update's autograd graph, and tiny Qwen-Image's first-update log-prob moved by 2.1e-4 between the two on CPU
    (|ratio - 1| 2.1e-4, clipped at 1e-5); with it the two equal each other and the eager log-prob bit for bit."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True  # process-wide: this worker's compiled modules are these blocks
    count = 0
    for module in modules:
        blocks = repeated_blocks(module)
        if not blocks:
            raise ValueError(
                f"actor_rollout_ref.actor.use_torch_compile: {type(module).__name__} has no repeated blocks "
                "(_repeated_blocks, or *blocks lists) to compile. Fix: set it to false for this model"
            )
        for block in blocks:
            block.compile(**compile_kwargs)
        count += len(blocks)
    return count


def denoisers(pipe: Any) -> list[torch.nn.Module]:
    """The pipeline's transformers: ``transformer``, and Wan 2.2's low-noise expert ``transformer_2`` where it has
    one."""
    return [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]


def accelerate(pipe: Any, attn_backend: str, compile_blocks: bool, device: torch.device | str) -> None:
    """Both options on ``pipe``'s transformers, after LoRA and gradient checkpointing are in place (the compiled
    blocks trace the peft layers and are what checkpointing calls)."""
    set_attention_backend(denoisers(pipe), attn_backend, device)
    if compile_blocks:
        compile_repeated_blocks(denoisers(pipe))
