"""Per-device memory plan of the real Qwen-Image, Wan 2.1 and FLUX.1-dev configs, measured on the meta device.

``python -m omni_async.tools.memory_plan [--model qwen_image|wan_1_3b|wan_14b|flux_1_dev|all] [--resolution 512 1024]
[--lora-rank 64] [--micro-batch 1] [--rollout-batch N] [--sp 2 ...]`` prints a table and writes ``bench/results/memory_plan.json``.

Method (nothing is downloaded, no weights exist; every figure below is counted or measured, none is typed in,
except the three runtime assumptions of :mod:`omni_async.tools.memory_layouts`):

* **Models.** The transformer, text encoder(s) and VAE of each pipeline are instantiated from the configs in
  :data:`MODELS` (copied from the public ``config.json`` files named there) under ``torch.device("meta")``:
  modules with shapes and dtypes but no storage. Parameter counts and bytes are summed from the instance.
* **LoRA.** peft's ``inject_adapter_in_model`` puts a rank-``r`` adapter on the named attention projections of
  the meta transformer; the adapter is cast to fp32 (trainable params and AdamW state are fp32 by design), so
  params + grads + AdamW ``exp_avg`` + ``exp_avg_sq`` = 16 bytes per counted LoRA parameter.
* **Full fine-tune.** Every transformer parameter trains (FSDP2 over the actor ranks: fp32 master, gradient and
  AdamW shards, bf16 compute). Its training micro-batch is measured like LoRA's on the meta transformer with all
  parameters requiring grad (their bf16 ``.grad`` pre-allocated, as FSDP2 holds one block's unsharded gradient at a
  time: only each op's transient gradient is counted); FSDP2's block buffers are counted from the largest block
  (two bf16 gathered blocks, the current and the prefetched one, plus one block's fp32 reduce-scatter input).
* **Activations.** The transformer forward and backward of one training micro-batch run on meta tensors under
  :class:`LiveMemory`, a ``TorchDispatchMode`` that adds the bytes of every storage an op creates and subtracts
  them when the storage is freed (``weakref.finalize``), so its running maximum is the peak of live
  intermediates (LoRA grads are pre-allocated, so the figure excludes them and the weights). Reported:
  ``held`` = bytes still live when the forward returns (what autograd keeps for backward), ``saved`` = the
  bytes ``torch.autograd.graph.saved_tensors_hooks`` sees, deduplicated by storage and excluding parameters
  (a cross-check of ``held``: the two agree within 1%), and ``peak`` = the maximum over forward + backward. Gradient
  checkpointing = each transformer block under ``torch.utils.checkpoint`` (non-reentrant, diffusers'
  ``enable_gradient_checkpointing``). CFG runs the conditional and unconditional branch as one batch of 2x.
* **Attention.** On meta, ``F.scaled_dot_product_attention`` would take the math path and keep the full
  ``S x S`` fp32 score matrix; a CUDA GPU in bf16 without a mask takes the flash kernel. :func:`flash_sdpa`
  routes SDPA to ``aten._scaled_dot_product_flash_attention`` (its meta kernel and autograd formula are
  PyTorch's), and to the memory-efficient kernel when a mask is given, so the figures are those of a GPU.
* **Ulysses sequence parallelism** (``--sp N``: ``actor.fsdp_config.ulysses_sequence_parallel_size``, LoRA only,
  ``models.sequence_parallel``). The LoRA training micro-batch is measured again as one rank of a group of ``N``
  (``train_sp``, the recipe's CFG setting, checkpointing on and off): the meta transformer runs with diffusers' own
  context-parallel hooks (its ``_cp_plan``: this rank's ``1/N`` of the image and text tokens from the first block
  to ``proj_out``, whose output is gathered) and diffusers' Ulysses attention, the collectives emulated in one
  process (:func:`emulated_ulysses`): each all-to-all a new buffer of its input's size, so attention sees
  ``[B, S, H/N, d]`` from ``[B, S/N, H, d]`` and the tracker counts the buffers a rank allocates; the output gather
  a new tensor ``N`` times the slice. Only the collectives' values are not real (none exist on meta). The no-grad
  denoising forward at the rollout's batch is measured the same way (``rollout_sp``: a hybrid group that generates
  each batch together). Weights, the LoRA state, the optimizer step, the gradient all-reduce (over all ranks), the
  text encoder's forward and the VAE decode do not change with ``N``; a full fine-tune is not planned with it (the
  trainer refuses Ulysses without LoRA).
* **Optimizer.** A steady-state ``torch.optim.AdamW`` (foreach) step on the meta LoRA params (and on fp32 copies
  of every transformer parameter for the full fine-tune; a rank steps its 1/ranks share), same tracker.
* **Gradient all-reduce.** The LoRA gradients' flat buckets (``trainer.data_parallel._buckets``, the code the
  ranks run) built from meta gradients under the tracker: the largest bucket.
* **Rollout, text encoder, VAE.** Forward under ``torch.no_grad`` with the same tracker, at the rollout's batch:
  ``actor_rollout_ref.rollout.agent.max_batch_size`` requests (the config's default unless ``--rollout-batch``;
  x2 with CFG), each text encoder at the same batch (they run one after the other: the largest counts). VAE decode is measured plain and tiled, one sample at a time
  (``rollout.pipeline.vae_slicing``); images decode plain, video tiled (the policy's default).
* **Per device.** :mod:`omni_async.tools.memory_layouts` adds the phases up per layout (hybrid LoRA and full
  fine-tune, disaggregated rollout worker and trainer rank), with the rollout snapshot adapter, weight-sync
  buckets, allocator fragmentation, the CUDA context and NCCL buffers (the last three assumed, not measured).

GB = 1e9 bytes throughout (the unit of "80 GB H100" and "141 GB H200").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from omni_async.models.published import (  # noqa: F401  (build, QWEN_TARGETS, WAN_TARGETS: re-exported)
    BF16,
    MODELS,
    QWEN_TARGETS,
    WAN_TARGETS,
    build,
)
from omni_async.tools.memory_layouts import (  # noqa: F401  (device_peak, recommend: this module's API too)
    DEVICES_GB,
    FRAGMENTATION,
    GB,
    NCCL_RESERVE_GB,
    RUNTIME_RESERVE_GB,
    device_peak,
    layout_rows,
    recommend,
    rollout_worker_peak,
)

CONFIG = Path(__file__).resolve().parents[1] / "config" / "flowgrpo_trainer.yaml"


def default_rollout_batch() -> int:
    """``actor_rollout_ref.rollout.agent.max_batch_size`` of the shipped config: the batch a rollout worker runs."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(CONFIG).actor_rollout_ref.rollout.agent.max_batch_size)


def _flat(value):
    """Tensors of an op's arguments or outputs (one level of list/tuple nesting, as aten signatures have)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from (item if isinstance(item, (list, tuple)) else (item,))
    else:
        yield value


class LiveMemory(TorchDispatchMode):
    """Bytes of live storages created by ops while active (deduplicated by storage); ``peak`` is their maximum.

    Outputs that alias an input's storage (views, in-place ops) are not allocations and are not counted, so
    weights and tensors made before the mode was entered never are."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or not any(isinstance(t, torch.Tensor) for t in _flat(out)):
            return out
        # An in-place result shares an input's storage: not a new allocation (weights are never counted).
        inputs = {t.untyped_storage()._cdata for t in _flat(args) if isinstance(t, torch.Tensor)}
        if kwargs:
            inputs.update(t.untyped_storage()._cdata for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor))
        for t in _flat(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in inputs:
                    self.live[key] = storage.nbytes()
                    self.current += self.live[key]
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


@contextlib.contextmanager
def flash_sdpa():
    """Route ``F.scaled_dot_product_attention`` to the kernels a GPU would pick (flash; mem-efficient with a mask)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if key.shape[-3] != query.shape[-3]:  # grouped-query attention: kernels see repeated k/v heads
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        if attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query,
            key,
            value,
            attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2]),
            torch.is_grad_enabled(),
            dropout_p,
            is_causal,
            scale=scale,
        )[0]

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


class _EmulatedMesh:
    """Stands in for diffusers' Ulysses device mesh of ``size`` ranks in :func:`emulated_ulysses` (no process group:
    the collectives that would use one are emulated)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self) -> None:
        return None


class _EmulatedAllGather(torch.autograd.Function):
    """``funcol.all_gather_tensor`` of ``size`` ranks along ``dim`` in one process: a new tensor ``size`` times the
    input (what the real gather allocates); backward keeps this rank's slice of the gradient, a view (diffusers'
    ``AllGatherFunction``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.size = dim, size
        return torch.cat([tensor] * size, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, ctx.dim)[0], None, None


@contextlib.contextmanager
def emulated_ulysses(module: torch.nn.Module, sp: int):
    """One rank of Ulysses of degree ``sp`` (``models.sequence_parallel``) inside, on a single process: the module's
    own ``_cp_plan`` hooks and diffusers' ``TemplatedUlyssesAttention`` run unchanged, with their collectives
    replaced by single-process stand-ins that allocate what the real ones allocate:

    * the input split (``EquipartitionSharder.shard``): this rank's ``1/sp`` chunk of the tokens, a view as in diffusers;
    * each all-to-all (``attention_dispatch._all_to_all_single``: q, k, v in, the output back, and their gradients):
      a new tensor of the input's shape (the real one returns a new buffer of the same numel; the values moved between
      ranks do not exist on meta), so q, k, v reach attention as ``[B, S, H/sp, d]`` from ``[B, S/sp, H, d]``;
    * the output gather (``EquipartitionSharder.unshard``): :class:`_EmulatedAllGather`.

    Approximation: nothing but the collectives' buffers differs from a real rank (same ops, shapes and saved tensors);
    NCCL's own buffers are outside PyTorch's allocator (:data:`NCCL_RESERVE_GB`, counted per communicator by
    :func:`device_peak`). An attention mask (none in :func:`transformer_inputs`) would need the mask all-gather,
    which is not emulated."""
    if sp == 1:
        yield
        return
    from unittest import mock

    from diffusers import ContextParallelConfig
    from diffusers.hooks import context_parallel as hooks
    from diffusers.models import attention_dispatch
    from diffusers.models._modeling_parallel import ParallelConfig

    from omni_async.models.sequence_parallel import check_supported

    check_supported(module, sp)
    cp, mesh = ContextParallelConfig(ulysses_degree=sp), _EmulatedMesh(sp)
    # what ContextParallelConfig.setup sets from a real (dp, ring=1, ulysses=sp) mesh
    cp._world_size, cp._mesh, cp._flattened_mesh, cp._ulysses_mesh = sp, mesh, mesh, mesh
    cp._ring_mesh = _EmulatedMesh(1)
    config = ParallelConfig(context_parallel_config=cp)
    processors = [m.processor for m in module.modules() if hasattr(getattr(m, "processor", None), "_parallel_config")]

    def shard(tensor: torch.Tensor, dim: int, mesh: _EmulatedMesh) -> torch.Tensor:
        return tensor.chunk(mesh.size(), dim=dim)[0]

    def unshard(tensor: torch.Tensor, dim: int, mesh: _EmulatedMesh) -> torch.Tensor:
        return _EmulatedAllGather.apply(tensor.contiguous(), dim, mesh.size())

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(hooks.EquipartitionSharder, "shard", staticmethod(shard)))
        stack.enter_context(mock.patch.object(hooks.EquipartitionSharder, "unshard", staticmethod(unshard)))
        stack.enter_context(mock.patch.object(attention_dispatch, "_all_to_all_single", lambda x, group: x.clone()))
        for p in processors:
            p._parallel_config = config
        hooks.apply_context_parallel(module, cp, module._cp_plan)
        try:
            yield
        finally:
            hooks.remove_context_parallel(module, module._cp_plan)
            for p in processors:
                p._parallel_config = None


@functools.cache
def component(model: str, part: str) -> torch.nn.Module:
    spec = MODELS[model]
    dtype = spec["vae_dtype"] if part == "vae" else BF16
    return build(*spec[part], dtype=dtype)


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def text_encoders(model: str) -> list[str]:
    """The pipeline's text encoders (FLUX: CLIP and T5; the others: one)."""
    return [part for part in TEXT_ENCODERS if part in MODELS[model]]


def nbytes(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of parameters + buffers) of a module."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(p.numel() for p in module.parameters()), sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def lora_transformer(model: str, rank: int) -> tuple[torch.nn.Module, int]:
    """A fresh meta transformer with a fp32 rank-``rank`` LoRA adapter; returns it and the LoRA parameter count.
    ``rank=0``: the full fine-tune's transformer, every (bf16) parameter trainable; returns it and its count."""
    from peft import LoraConfig, inject_adapter_in_model

    spec = MODELS[model]
    module = build(*spec["transformer"])
    if rank == 0:
        module.requires_grad_(True)
        return module, sum(p.numel() for p in module.parameters())
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=spec["lora_targets"]), module)
    lora = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in lora:
        p.data = p.data.float()
        p.requires_grad_(True)
    return module, sum(p.numel() for p in lora)


def largest_block_params(model: str) -> int:
    """Parameters of the largest transformer block (the unit FSDP2 shards and gathers: ``_no_split_modules``)."""
    module = component(model, "transformer")
    blocks = set(module._no_split_modules)
    return max(sum(p.numel() for p in m.parameters()) for m in module.modules() if type(m).__name__ in blocks)


def transformer_inputs(model: str, resolution: int, batch: int) -> dict:
    spec, lat = MODELS[model], resolution // 8

    def meta(*shape, dtype=BF16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    if model == "flux_1_dev":  # Qwen-Image's packing; CLIP's pooled vector, the guidance and the position ids
        side = lat // 2
        return {
            "hidden_states": meta(batch, side * side, 64),
            "timestep": meta(batch),
            "guidance": meta(batch),
            "pooled_projections": meta(batch, 768),
            "encoder_hidden_states": meta(batch, spec["text_tokens"], 4096),
            "txt_ids": meta(spec["text_tokens"], 3),
            "img_ids": meta(side * side, 3),
            "return_dict": False,
        }
    if model == "qwen_image":  # 2x2-packed latents: (res/16)^2 tokens of 64 channels
        side = lat // 2
        return {
            "hidden_states": meta(batch, side * side, 64),
            "timestep": meta(batch),
            "encoder_hidden_states": meta(batch, spec["text_tokens"], 3584),
            "img_shapes": [[(1, side, side)]] * batch,
            "return_dict": False,
        }
    frames = (spec["frames"] - 1) // 4 + 1
    return {
        "hidden_states": meta(batch, 16, frames, lat, lat),
        "timestep": meta(batch),
        "encoder_hidden_states": meta(batch, spec["text_tokens"], 4096),
        "return_dict": False,
    }


def measure_train(model: str, resolution: int, batch: int, checkpointing: bool, rank: int, sp: int = 1) -> dict:
    """Forward + backward of one micro-batch of ``batch`` rows with the LoRA transformer (``rank=0``: every
    parameter trained); bytes beyond weights and accumulated gradients. ``sp > 1``: one rank of a Ulysses group of
    ``sp`` (:func:`emulated_ulysses`; text tokens padded as ``models.sequence_parallel.pad_text`` pads them)."""
    from torch.utils.checkpoint import checkpoint

    from omni_async.models.sequence_parallel import pad_text

    module, _ = lora_transformer(model, rank)
    if checkpointing:
        module.enable_gradient_checkpointing(functools.partial(checkpoint, use_reentrant=False))
    else:
        module.disable_gradient_checkpointing()
    weights = {p.untyped_storage()._cdata for p in list(module.parameters()) + list(module.buffers())}
    for p in module.parameters():
        if p.requires_grad:  # gradient accumulation: .grad exists across micro-batches
            p.grad = torch.zeros_like(p)
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return t

    inputs = pad_text(transformer_inputs(model, resolution, batch), sp, type(module).__name__)
    with flash_sdpa(), emulated_ulysses(module, sp), LiveMemory() as mem:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(**inputs)[0]
        held = mem.current
        out.float().square().mean().backward()
        del out
    module.zero_grad(set_to_none=True)
    return {"held_gb": held / GB, "saved_gb": sum(saved.values()) / GB, "peak_gb": mem.peak / GB}


def measure_optimizer_step(model: str, rank: int) -> float:
    """Transient GB of a steady-state AdamW step (foreach) on the trainable params: the second step, after the first
    allocated the exp_avg / exp_avg_sq state already counted in the state line. ``rank=0``: fp32 copies of every
    transformer parameter (the full fine-tune's masters, all of them: a rank steps 1/ranks of this)."""
    module, _ = lora_transformer(model, rank)
    params = [p for p in module.parameters() if p.requires_grad]
    if rank == 0:
        params = [torch.nn.Parameter(torch.empty_like(p, dtype=torch.float32)) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    optimizer.step()
    with LiveMemory() as mem:
        optimizer.step()
    for p in params:
        p.grad = None
    return mem.peak / GB


def measure_allreduce_bucket(model: str, rank: int) -> float:
    """GB of the largest flat bucket the data-parallel LoRA gradient all-reduce builds (``dist.all_reduce`` works in
    place on it): ``trainer.data_parallel._buckets`` over meta gradients of the adapter."""
    from omni_async.trainer.data_parallel import _buckets

    module, _ = lora_transformer(model, rank)
    grads = [torch.zeros_like(p) for p in module.parameters() if p.requires_grad]
    with LiveMemory() as mem:
        for flat, _ in _buckets(grads):
            del flat
    return mem.peak / GB


def measure_no_grad(fn) -> float:
    """Peak GB of live intermediates of ``fn()`` under ``torch.no_grad`` on meta tensors."""
    with torch.no_grad(), flash_sdpa(), LiveMemory() as mem:
        fn()
    return mem.peak / GB


def measure_rollout(model: str, resolution: int, batch: int, rank: int, sp: int = 1) -> float:
    """The no-grad denoising forward of ``batch`` rows; ``sp > 1``: one rank of a Ulysses group generating the batch
    together (:func:`emulated_ulysses`, text padded as in :func:`measure_train`)."""
    from omni_async.models.sequence_parallel import pad_text

    module, _ = lora_transformer(model, rank)  # rollout runs the same LoRA model, without grad
    inputs = pad_text(transformer_inputs(model, resolution, batch), sp, type(module).__name__)
    with emulated_ulysses(module, sp):
        return measure_no_grad(lambda: module(**inputs))


def measure_text_encoder(model: str, batch: int) -> float:
    """The largest of the pipeline's text-encoder forwards, each at the tokens it reads (``encoder_tokens``: FLUX's
    CLIP its 77; else ``text_tokens`` + ``template_tokens``)."""
    return max(_measure_one_encoder(model, part, batch) for part in text_encoders(model))


def _measure_one_encoder(model: str, part: str, batch: int) -> float:
    spec, module = MODELS[model], component(model, part)
    tokens = spec.get("encoder_tokens", {}).get(part, spec["text_tokens"] + spec["template_tokens"])
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    if model == "qwen_image":  # the pipeline reads hidden_states[-1]; text-only mrope positions are 3 equal rows
        positions = torch.zeros(3, batch, tokens, dtype=torch.long, device="meta")
        return measure_no_grad(lambda: module(input_ids=ids, position_ids=positions, output_hidden_states=True))
    return measure_no_grad(lambda: module(input_ids=ids))


def measure_vae_decode(model: str, resolution: int, tiled: bool) -> float:
    spec, vae = MODELS[model], component(model, "vae")
    frames = (spec["frames"] - 1) // 4 + 1
    video = () if spec["vae"][1] == "AutoencoderKL" else (frames,)  # FLUX's image VAE decodes [B, C, H, W]
    z = torch.empty(1, 16, *video, resolution // 8, resolution // 8, device="meta", dtype=spec["vae_dtype"])
    vae.enable_tiling() if tiled else vae.disable_tiling()
    return measure_no_grad(lambda: vae.decode(z))


def plan_model(
    model: str,
    resolutions,
    lora_rank: int = 64,
    micro_batch: int = 1,
    rollout_batch: int | None = None,
    full: bool = True,
    sp: tuple[int, ...] = (),
) -> dict:
    """Everything measured for one pipeline: weights, LoRA state, training/rollout activations, encoder, VAE; with
    ``full``, the full fine-tune's training micro-batch (checkpointing on), optimizer step and FSDP2 block size; per
    Ulysses degree in ``sp`` (> 1), one rank's LoRA training micro-batch (``train_sp``, the recipe's CFG setting)."""
    rollout_batch = rollout_batch or default_rollout_batch()
    weights = {}
    for part in ("transformer", *text_encoders(model), "vae"):
        count, size = nbytes(component(model, part))
        weights[part] = {"params": count, "gb": size / GB}
    _, lora_params = lora_transformer(model, lora_rank)
    result = {
        "source": MODELS[model]["source"],
        "frames": MODELS[model]["frames"],
        "text_tokens": MODELS[model]["text_tokens"],
        "cfg": MODELS[model].get("cfg", True),  # the recipe's: FLUX.1-dev is guidance-distilled (one branch)
        "weights": weights,
        "micro_batch": micro_batch,
        "rollout_batch": rollout_batch,
        "lora": {
            "rank": lora_rank,
            "targets": MODELS[model]["lora_targets"],
            "params": lora_params,
            "gb": 16 * lora_params / GB,
        },  # fp32 param + grad + AdamW exp_avg + exp_avg_sq
        "text_encoder_forward_gb": measure_text_encoder(model, rollout_batch),
        "optimizer_step_gb": measure_optimizer_step(model, lora_rank),
        "lora_allreduce_bucket_gb": measure_allreduce_bucket(model, lora_rank),
        "resolutions": {},
    }
    if full:
        block = largest_block_params(model)
        result["full"] = {
            "params": weights["transformer"]["params"],
            "largest_block_params": block,
            # two bf16 gathered blocks (current + prefetched) + one block's fp32 reduce-scatter input
            "fsdp_buffers_gb": (2 * 2 + 4) * block / GB,
            "optimizer_step_gb": measure_optimizer_step(model, 0),
        }
    for res in resolutions:
        entry = {"train": {}, "rollout_gb": {}, "vae_decode_gb": {}, **({"train_full": {}} if full else {})}
        for cfg in (False, True):
            batch, tag = micro_batch * (2 if cfg else 1), "cfg" if cfg else "no_cfg"
            entry["rollout_gb"][tag] = measure_rollout(model, res, rollout_batch * (2 if cfg else 1), lora_rank)
            for ckpt in (False, True):
                key = f"{tag}/{'ckpt' if ckpt else 'no_ckpt'}"
                entry["train"][key] = measure_train(model, res, batch, ckpt, lora_rank)
            if full:
                entry["train_full"][f"{tag}/ckpt"] = measure_train(model, res, batch, True, 0)
            if cfg == result["cfg"]:
                for n in (n for n in sp if n > 1):
                    entry.setdefault("train_sp", {})[str(n)] = {
                        f"{tag}/{'ckpt' if ckpt else 'no_ckpt'}": measure_train(model, res, batch, ckpt, lora_rank, n)
                        for ckpt in (False, True)
                    }
                    rows = rollout_batch * (2 if cfg else 1)
                    entry.setdefault("rollout_sp", {})[str(n)] = {tag: measure_rollout(model, res, rows, lora_rank, n)}
        for tiled in (False, True):
            entry["vae_decode_gb"]["tiled" if tiled else "plain"] = measure_vae_decode(model, res, tiled)
        result["resolutions"][str(res)] = entry
    return result


def run(
    models,
    resolutions,
    lora_rank: int = 64,
    micro_batch: int = 1,
    rollout_batch: int | None = None,
    sp: tuple[int, ...] = (),
) -> dict:
    plans = {}
    for model in models:
        plan = plans[model] = plan_model(model, resolutions, lora_rank, micro_batch, rollout_batch, sp=sp)
        plan["micro_batch"] = micro_batch
        plan["recommendations"] = {
            name: {"cfg": recommend(plan, cap, True), "no_cfg": recommend(plan, cap, False)}
            for name, cap in DEVICES_GB.items()
        }
        if "full" in plan:  # the full fine-tune on 4 hybrid ranks (the README recipe's actor GPUs)
            plan["recommendations_full_x4"] = {
                name: recommend(plan, cap, plan["cfg"], full=True, ranks=4) for name, cap in DEVICES_GB.items()
            }
        plan["layouts"] = layout_rows(plan)
    return {
        "unit": "GB = 1e9 bytes",
        "runtime_reserve_gb": RUNTIME_RESERVE_GB,
        "nccl_reserve_gb": NCCL_RESERVE_GB,
        "fragmentation": FRAGMENTATION,
        "devices_gb": DEVICES_GB,
        "method": __doc__.split("Method", 1)[1].strip(),
        "models": plans,
    }


def format_table(report: dict) -> str:
    lines = []
    for model, plan in report["models"].items():
        w, lora = plan["weights"], plan["lora"]
        lines.append(
            f"\n## {model}  ({plan['source']}; micro-batch {plan['micro_batch']}, rollout batch "
            f"{plan['rollout_batch']}, {plan['text_tokens']} text tokens"
            + (f", {plan['frames']} frames)" if plan["frames"] > 1 else ")")
        )
        for part in w:
            lines.append(f"  {part:<14} {w[part]['params'] / 1e9:7.3f} B params  {w[part]['gb']:7.2f} GB")
        lines.append(
            f"  LoRA r{lora['rank']:<7} {lora['params'] / 1e6:7.1f} M params  {lora['gb']:7.2f} GB "
            "(fp32 param+grad+AdamW)"
        )
        lines.append(
            f"  text-encoder forward (no grad, batch {plan['rollout_batch']}): "
            f"{plan['text_encoder_forward_gb']:.2f} GB; AdamW step transient: {plan['optimizer_step_gb']:.2f}"
            f" GB; all-reduce bucket {plan['lora_allreduce_bucket_gb']:.3f} GB"
        )
        if "full" in plan:
            f = plan["full"]
            lines.append(
                f"  full fine-tune: largest block {f['largest_block_params'] / 1e6:.0f} M params, FSDP2 "
                f"buffers {f['fsdp_buffers_gb']:.2f} GB, AdamW step transient {f['optimizer_step_gb']:.2f}"
                " GB / ranks"
            )
        lines.append(
            "  res   CFG ckpt | train held  saved   peak | rollout | VAE plain tiled | hybrid LoRA device "
            "(encoders on GPU / offloaded in update)"
        )
        for res, entry in plan["resolutions"].items():
            for key, t in entry["train"].items():
                cfg, ckpt = key.split("/")
                peak_on = device_peak(plan, int(res), cfg == "cfg", ckpt == "ckpt", False)["peak_gb"]
                peak_off = device_peak(plan, int(res), cfg == "cfg", ckpt == "ckpt", True)["peak_gb"]
                lines.append(
                    f"  {res:>4}² {'on ' if cfg == 'cfg' else 'off'} {'on ' if ckpt == 'ckpt' else 'off'}  |"
                    f" {t['held_gb']:8.2f} {t['saved_gb']:7.2f} {t['peak_gb']:7.2f} |"
                    f" {entry['rollout_gb'][cfg]:7.2f} | {entry['vae_decode_gb']['plain']:9.2f}"
                    f" {entry['vae_decode_gb']['tiled']:5.2f} | {peak_on:6.1f} / {peak_off:6.1f}"
                )
            for n, figures in entry.get("train_sp", {}).items():
                for key, t in figures.items():
                    cfg, ckpt = key.split("/")
                    peak = device_peak(plan, int(res), cfg == "cfg", ckpt == "ckpt", False, ranks=int(n), sp=int(n))
                    lines.append(
                        f"  {res:>4}² {'on ' if cfg == 'cfg' else 'off'} {'on ' if ckpt == 'ckpt' else 'off'}  |"
                        f" {t['held_gb']:8.2f} {t['saved_gb']:7.2f} {t['peak_gb']:7.2f} | Ulysses sp{n}, one rank:"
                        f" hybrid LoRA device {peak['peak_gb']:.1f} (encoders on GPU)"
                    )
            for n, figures in entry.get("rollout_sp", {}).items():
                for cfg, gb in figures.items():
                    peak = device_peak(
                        plan, int(res), cfg == "cfg", True, False, ranks=int(n), sp=int(n), split_generation=True
                    )
                    lines.append(
                        f"  {res:>4}² {'on ' if cfg == 'cfg' else 'off'} on   | Ulysses sp{n} generating together, one"
                        f" rank's denoising forward {gb:7.2f}: hybrid LoRA device {peak['peak_gb']:.1f}"
                    )
            for key, t in entry.get("train_full", {}).items():
                lines.append(
                    f"  {res:>4}² {'on ' if key.startswith('cfg') else 'off'} on   | full FT train peak "
                    f"{t['peak_gb']:7.2f}"
                )
        lines.append(
            f"  per device, CFG {'on' if plan.get('cfg', True) else 'off'}, checkpointing on, encoders on GPU "
            "(allocated = max(rollout, update); total = allocated + fragmentation + context/NCCL):"
        )
        for name, by_res in plan["layouts"].items():
            text = "; ".join(
                f"{res}²: rollout {p['rollout_gb']:.1f} update {p['update_gb']:.1f} total {p['peak_gb']:.1f}"
                for res, p in by_res.items()
            )
            lines.append(f"    {name:<22} {text}")
        cfg, on_off = ("cfg", "on") if plan.get("cfg", True) else ("no_cfg", "off")
        for device, recs in plan["recommendations"].items():
            for res, rec in recs[cfg].items():
                text = (
                    "; ".join(
                        f"ckpt {'on' if o['gradient_checkpointing'] else 'off'} + encoders "
                        f"{'offloaded' if o['offload_encoders_during_update'] else 'on GPU'}: micro-batch <= "
                        f"{o['max_micro_batch']}"
                        for o in rec["options"]
                    )
                    or "does not fit"
                )
                lines.append(f"  {device}, {res}², CFG {on_off}, hybrid LoRA: {text}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--resolution", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument(
        "--rollout-batch",
        type=int,
        default=None,
        help="rollout requests per forward (default: the config's agent.max_batch_size)",
    )
    parser.add_argument("--frames", type=int, default=None, help="video frames for Wan (4k+1)")
    parser.add_argument(
        "--sp",
        type=int,
        nargs="+",
        default=[],
        help="Ulysses degrees (ulysses_sequence_parallel_size > 1) to measure one rank's LoRA training micro-batch at",
    )
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[2] / "bench/results/memory_plan.json"))
    args = parser.parse_args(argv)
    if args.frames:
        for spec in MODELS.values():
            if spec["frames"] > 1:
                spec["frames"] = args.frames
    models = list(MODELS) if args.model == "all" else [args.model]
    if any(n < 2 for n in args.sp):
        parser.error(f"--sp {args.sp}: Ulysses degrees are >= 2 (sp=1, no split, is always planned)")
    report = run(models, args.resolution, args.lora_rank, args.micro_batch, args.rollout_batch, tuple(args.sp))
    print(format_table(report))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()
