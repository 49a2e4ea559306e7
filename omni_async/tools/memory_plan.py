"""Per-device memory plan of the real Qwen-Image and Wan 2.1 configs, measured on the meta device.

``python -m omni_async.tools.memory_plan [--model qwen_image|wan_1_3b|wan_14b|all] [--resolution 512 1024]
[--lora-rank 64] [--micro-batch 1]`` prints a table and writes ``bench/results/memory_plan.json``.

Method (nothing is downloaded, no weights exist; every figure below is counted or measured, none is typed in):

* **Models.** The transformer, text encoder and VAE of each pipeline are instantiated from the configs in
  :data:`MODELS` (copied from the public ``config.json`` files named there) under ``torch.device("meta")``:
  modules with shapes and dtypes but no storage. Parameter counts and bytes are summed from the instance.
* **LoRA.** peft's ``inject_adapter_in_model`` puts a rank-``r`` adapter on the named attention projections of
  the meta transformer; the adapter is cast to fp32 (trainable params and AdamW state are fp32 by design), so
  params + grads + AdamW ``exp_avg`` + ``exp_avg_sq`` = 16 bytes per counted LoRA parameter.
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
* **Optimizer.** A steady-state ``torch.optim.AdamW`` (foreach) step on the meta LoRA params, same tracker.
* **Rollout, text encoder, VAE.** Forward under ``torch.no_grad`` with the same tracker: the peak of live
  intermediates is measured, not estimated from one layer. VAE decode is measured plain and tiled.
* **Not modelled:** allocator fragmentation and the CUDA context. The budget adds :data:`RUNTIME_RESERVE_GB`
  (an assumption, not a measurement) and the recommendations keep 10% of the device free on top.

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

GB = 1e9
RUNTIME_RESERVE_GB = 1.5  # assumption: CUDA context + cuBLAS/NCCL workspaces; not measured here
DEVICES_GB = {"H100 80GB": 80.0, "H200 141GB": 141.0}
HEADROOM = 0.10
BF16 = torch.bfloat16

QWEN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention (attn1, attn2) of every block

# Source of every number: the public config.json of the named checkpoint (HF hub paths given in "source").
_QWEN_IMAGE = {
    "source": "Qwen/Qwen-Image: transformer/, text_encoder/, vae/ config.json, scheduler/scheduler_config.json",
    "transformer": ("diffusers", "QwenImageTransformer2DModel", {
        "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
        "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
        "axes_dims_rope": (16, 56, 56)}),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", {  # = Qwen/Qwen2.5-VL-7B-Instruct
        "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                        "hidden_act": "silu", "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                        "rope_theta": 1000000.0, "tie_word_embeddings": False,
                        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "in_chans": 3, "hidden_act": "silu", "tokens_per_second": 2},
        "tie_word_embeddings": False}),
    "vae": ("diffusers", "AutoencoderKLQwenImage", {  # latents_mean/std left at diffusers' defaults (no memory)
        "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
        "temperal_downsample": [False, True, True], "dropout": 0.0}),
    "vae_dtype": BF16,
    # No memory of its own; bench/gpu_step.py samples with it (dynamic shift, as QwenImagePipeline).
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {
        "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
        "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
        "time_shift_type": "exponential"}),
    "lora_targets": QWEN_TARGETS,
    # The pipeline drops the 34-token chat template; prompts are padded to the longest in the batch.
    "text_tokens": 256, "template_tokens": 34, "frames": 1,
}


def _wan(heads: int, ffn: int, layers: int, name: str) -> dict:
    return {
        "source": f"Wan-AI/{name}-Diffusers: transformer/, text_encoder/ (google/umt5-xxl), vae/ config.json",
        "transformer": ("diffusers", "WanTransformer3DModel", {
            "patch_size": (1, 2, 2), "num_attention_heads": heads, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": ffn, "num_layers": layers,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}),
        "text_encoder": ("transformers", "UMT5EncoderModel", {
            "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False}),
        "vae": ("diffusers", "AutoencoderKLWan", {
            "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
            "temperal_downsample": [False, True, True], "dropout": 0.0}),
        "vae_dtype": torch.float32,  # diffusers' Wan examples load the VAE in fp32
        "lora_targets": WAN_TARGETS,
        "text_tokens": 512, "template_tokens": 0,  # Wan pads every prompt to 512 UMT5 tokens
        "frames": 33,  # 4k+1; 33 frames = 9 latent frames (override with --frames; Wan's own default is 81)
    }


MODELS = {
    "qwen_image": _QWEN_IMAGE,
    "wan_1_3b": _wan(12, 8960, 30, "Wan2.1-T2V-1.3B"),
    "wan_14b": _wan(40, 13824, 40, "Wan2.1-T2V-14B"),
}


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
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2]),
            torch.is_grad_enabled(), dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(library: str, cls_name: str, config: dict, dtype: torch.dtype = BF16,
          device: str | torch.device = "meta") -> torch.nn.Module:
    """Instantiate a diffusers / transformers class from a config dict on the meta device (no storage), or on a real
    ``device`` with the class's own random initialisation (``bench/gpu_step.py``). On a real device the weights are
    created in ``dtype`` (the default dtype meanwhile, as diffusers' ``from_pretrained`` does), so a 20 B transformer
    never exists in fp32 first."""
    real = torch.device(device).type != "meta"
    with torch.device(device), (_default_dtype(dtype) if real else contextlib.nullcontext()):
        if library == "diffusers":
            import diffusers

            module = getattr(diffusers, cls_name)(**dict(config))
        else:
            import transformers

            cls = getattr(transformers, cls_name)
            cfg_cls = transformers.AutoConfig.for_model(cls.config_class.model_type).__class__
            cfg = cfg_cls(**config)
            cfg._attn_implementation = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"  # UMT5: eager
            module = cls(cfg)
    return module.to(dtype).eval().requires_grad_(False)


@functools.cache
def component(model: str, part: str) -> torch.nn.Module:
    spec = MODELS[model]
    dtype = spec["vae_dtype"] if part == "vae" else BF16
    return build(*spec[part], dtype=dtype)


def nbytes(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of parameters + buffers) of a module."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(p.numel() for p in module.parameters()), sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def lora_transformer(model: str, rank: int) -> tuple[torch.nn.Module, int]:
    """A fresh meta transformer with a fp32 rank-``rank`` LoRA adapter; returns it and the LoRA parameter count."""
    from peft import LoraConfig, inject_adapter_in_model

    spec = MODELS[model]
    module = build(*spec["transformer"])
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=spec["lora_targets"]), module)
    lora = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in lora:
        p.data = p.data.float()
        p.requires_grad_(True)
    return module, sum(p.numel() for p in lora)


def transformer_inputs(model: str, resolution: int, batch: int) -> dict:
    spec, lat = MODELS[model], resolution // 8

    def meta(*shape, dtype=BF16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    if model == "qwen_image":  # 2x2-packed latents: (res/16)^2 tokens of 64 channels
        side = lat // 2
        return {"hidden_states": meta(batch, side * side, 64), "timestep": meta(batch),
                "encoder_hidden_states": meta(batch, spec["text_tokens"], 3584),
                "img_shapes": [[(1, side, side)]] * batch, "return_dict": False}
    frames = (spec["frames"] - 1) // 4 + 1
    return {"hidden_states": meta(batch, 16, frames, lat, lat), "timestep": meta(batch),
            "encoder_hidden_states": meta(batch, spec["text_tokens"], 4096), "return_dict": False}


def measure_train(model: str, resolution: int, batch: int, checkpointing: bool, rank: int) -> dict:
    """Forward + backward of one micro-batch of ``batch`` rows with the LoRA transformer; bytes beyond weights."""
    from torch.utils.checkpoint import checkpoint

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

    inputs = transformer_inputs(model, resolution, batch)
    with flash_sdpa(), LiveMemory() as mem:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(**inputs)[0]
        held = mem.current
        out.float().square().mean().backward()
        del out
    module.zero_grad(set_to_none=True)
    return {"held_gb": held / GB, "saved_gb": sum(saved.values()) / GB, "peak_gb": mem.peak / GB}


def measure_optimizer_step(model: str, rank: int) -> float:
    """Transient GB of a steady-state AdamW step (foreach) on the LoRA params: the second step, after the first
    allocated the exp_avg / exp_avg_sq state already counted in the LoRA line."""
    module, _ = lora_transformer(model, rank)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    optimizer.step()
    with LiveMemory() as mem:
        optimizer.step()
    module.zero_grad(set_to_none=True)
    return mem.peak / GB


def measure_no_grad(fn) -> float:
    """Peak GB of live intermediates of ``fn()`` under ``torch.no_grad`` on meta tensors."""
    with torch.no_grad(), flash_sdpa(), LiveMemory() as mem:
        fn()
    return mem.peak / GB


def measure_rollout(model: str, resolution: int, batch: int, rank: int) -> float:
    module, _ = lora_transformer(model, rank)  # rollout runs the same LoRA model, without grad
    inputs = transformer_inputs(model, resolution, batch)
    return measure_no_grad(lambda: module(**inputs))


def measure_text_encoder(model: str, batch: int) -> float:
    spec, module = MODELS[model], component(model, "text_encoder")
    tokens = spec["text_tokens"] + spec["template_tokens"]
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    if model == "qwen_image":  # the pipeline reads hidden_states[-1]; text-only mrope positions are 3 equal rows
        positions = torch.zeros(3, batch, tokens, dtype=torch.long, device="meta")
        return measure_no_grad(lambda: module(input_ids=ids, position_ids=positions, output_hidden_states=True))
    return measure_no_grad(lambda: module(input_ids=ids))


def measure_vae_decode(model: str, resolution: int, tiled: bool) -> float:
    spec, vae = MODELS[model], component(model, "vae")
    frames = (spec["frames"] - 1) // 4 + 1
    z = torch.empty(1, 16, frames, resolution // 8, resolution // 8, device="meta", dtype=spec["vae_dtype"])
    vae.enable_tiling() if tiled else vae.disable_tiling()
    return measure_no_grad(lambda: vae.decode(z))


def plan_model(model: str, resolutions, lora_rank: int = 64, micro_batch: int = 1) -> dict:
    """Everything measured for one pipeline: weights, LoRA state, training/rollout activations, encoder, VAE."""
    weights = {}
    for part in ("transformer", "text_encoder", "vae"):
        count, size = nbytes(component(model, part))
        weights[part] = {"params": count, "gb": size / GB}
    _, lora_params = lora_transformer(model, lora_rank)
    result = {
        "source": MODELS[model]["source"], "frames": MODELS[model]["frames"],
        "text_tokens": MODELS[model]["text_tokens"], "weights": weights,
        "lora": {"rank": lora_rank, "targets": MODELS[model]["lora_targets"], "params": lora_params,
                 "gb": 16 * lora_params / GB},  # fp32 param + grad + AdamW exp_avg + exp_avg_sq
        "text_encoder_forward_gb": measure_text_encoder(model, micro_batch),
        "optimizer_step_gb": measure_optimizer_step(model, lora_rank),
        "resolutions": {},
    }
    for res in resolutions:
        entry = {"train": {}, "rollout_gb": {}, "vae_decode_gb": {}}
        for cfg in (False, True):
            batch = micro_batch * (2 if cfg else 1)
            entry["rollout_gb"]["cfg" if cfg else "no_cfg"] = measure_rollout(model, res, batch, lora_rank)
            for ckpt in (False, True):
                key = f"{'cfg' if cfg else 'no_cfg'}/{'ckpt' if ckpt else 'no_ckpt'}"
                entry["train"][key] = measure_train(model, res, batch, ckpt, lora_rank)
        for tiled in (False, True):
            entry["vae_decode_gb"]["tiled" if tiled else "plain"] = measure_vae_decode(model, res, tiled)
        result["resolutions"][str(res)] = entry
    return result


def device_peak(plan: dict, res: int, cfg: bool, ckpt: bool, offload_encoders: bool, micro_scale: float = 1.0,
                vae_tiled: bool = True) -> dict:
    """Per-device peak of the hybrid worker: max(rollout phase, update phase), in GB.

    Resident in both phases: transformer (bf16) + LoRA params/grads/AdamW (fp32) + runtime reserve. Rollout adds the
    text encoder + VAE and the largest of (text-encoder forward, denoising forward, VAE decode); the update adds
    the encoders only when they are not offloaded to CPU, plus the larger of the training micro-batch peak and the
    AdamW step's transient (they do not overlap: the step runs after the last micro-batch's backward).
    ``micro_scale`` scales the measured training activations linearly (they are proportional to the batch); the
    rollout phase stays at the measured batch (``--micro-batch`` prompts, x2 with CFG)."""
    w, entry = plan["weights"], plan["resolutions"][str(res)]
    tag = "cfg" if cfg else "no_cfg"
    resident = w["transformer"]["gb"] + plan["lora"]["gb"] + RUNTIME_RESERVE_GB
    encoders = w["text_encoder"]["gb"] + w["vae"]["gb"]
    vae = entry["vae_decode_gb"]["tiled" if vae_tiled else "plain"]
    rollout = resident + encoders + max(plan["text_encoder_forward_gb"], entry["rollout_gb"][tag], vae)
    train = entry["train"][f"{tag}/{'ckpt' if ckpt else 'no_ckpt'}"]["peak_gb"] * micro_scale
    update = resident + (0.0 if offload_encoders else encoders) + max(train, plan.get("optimizer_step_gb", 0.0))
    return {"rollout_gb": rollout, "update_gb": update, "peak_gb": max(rollout, update)}


def rollout_worker_peak(plan: dict, res: int, cfg: bool, vae_tiled: bool = True) -> float:
    """Per-device peak of an inference-only rollout worker (disaggregated layout), in GB: the pipeline's frozen
    weights (transformer, text encoder, VAE) + the LoRA adapter's parameters alone (fp32, no gradients, no AdamW
    state) + runtime reserve + the largest of (text-encoder forward, denoising forward, VAE decode). No training
    activations, no optimizer step."""
    w, entry = plan["weights"], plan["resolutions"][str(res)]
    weights = w["transformer"]["gb"] + w["text_encoder"]["gb"] + w["vae"]["gb"] + 4 * plan["lora"]["params"] / GB
    vae = entry["vae_decode_gb"]["tiled" if vae_tiled else "plain"]
    rollout = entry["rollout_gb"]["cfg" if cfg else "no_cfg"]
    return weights + RUNTIME_RESERVE_GB + max(plan["text_encoder_forward_gb"], rollout, vae)


def recommend(plan: dict, capacity_gb: float, cfg: bool = True) -> dict:
    """Per resolution: every (checkpointing, encoder offload) option that leaves >= 10% of ``capacity_gb`` free,
    with its largest micro-batch (training activations scaled linearly from the measured one), and the pick: the
    first that fits in the order no-checkpointing/no-offload, no-checkpointing/offload, checkpointing/no-offload,
    checkpointing/offload (recomputing every block costs about one extra forward per update; offloading costs two
    host<->device copies of the encoders per step)."""
    out = {}
    budget = capacity_gb * (1 - HEADROOM)
    for res in plan["resolutions"]:
        options = []
        for ckpt, offload in ((False, False), (False, True), (True, False), (True, True)):
            if f"{'cfg' if cfg else 'no_cfg'}/{'ckpt' if ckpt else 'no_ckpt'}" not in plan["resolutions"][res]["train"]:
                continue  # not measured
            micro = 0
            while micro < 256 and device_peak(plan, int(res), cfg, ckpt, offload, micro + 1)["peak_gb"] <= budget:
                micro += 1
            if micro:
                peak = device_peak(plan, int(res), cfg, ckpt, offload)["peak_gb"]
                options.append({"gradient_checkpointing": ckpt, "offload_encoders_during_update": offload,
                                "max_micro_batch": micro * plan["micro_batch"],
                                f"peak_gb_at_micro_batch_{plan['micro_batch']}": round(peak, 1)})
        out[res] = {"pick": options[0] if options else None, "options": options}
    return out


def run(models, resolutions, lora_rank: int = 64, micro_batch: int = 1) -> dict:
    plans = {}
    for model in models:
        plans[model] = plan_model(model, resolutions, lora_rank, micro_batch)
        plans[model]["micro_batch"] = micro_batch
        plans[model]["recommendations"] = {
            name: {"cfg": recommend(plans[model], cap, True), "no_cfg": recommend(plans[model], cap, False)}
            for name, cap in DEVICES_GB.items()}
    return {"unit": "GB = 1e9 bytes", "runtime_reserve_gb": RUNTIME_RESERVE_GB, "headroom": HEADROOM,
            "devices_gb": DEVICES_GB, "method": __doc__.split("Method", 1)[1].strip(), "models": plans}


def format_table(report: dict) -> str:
    lines = []
    for model, plan in report["models"].items():
        w, lora = plan["weights"], plan["lora"]
        lines.append(f"\n## {model}  ({plan['source']}; micro-batch {plan['micro_batch']}, "
                     f"{plan['text_tokens']} text tokens" + (f", {plan['frames']} frames)" if plan["frames"] > 1
                                                              else ")"))
        for part in ("transformer", "text_encoder", "vae"):
            lines.append(f"  {part:<13} {w[part]['params'] / 1e9:7.3f} B params  {w[part]['gb']:7.2f} GB")
        lines.append(f"  LoRA r{lora['rank']:<7} {lora['params'] / 1e6:7.1f} M params  {lora['gb']:7.2f} GB "
                     "(fp32 param+grad+AdamW)")
        lines.append(f"  text-encoder forward (no grad): {plan['text_encoder_forward_gb']:.2f} GB; AdamW step "
                     f"transient: {plan['optimizer_step_gb']:.2f} GB")
        lines.append("  res   CFG ckpt | train held  saved   peak | rollout | VAE plain tiled | device peak "
                     "(encoders on GPU / offloaded in update) | rollout worker (disaggregated)")
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
                    f" | {rollout_worker_peak(plan, int(res), cfg == 'cfg'):6.1f}")
        for device, recs in plan["recommendations"].items():
            for res, rec in recs["cfg"].items():
                text = "; ".join(
                    f"ckpt {'on' if o['gradient_checkpointing'] else 'off'} + encoders "
                    f"{'offloaded' if o['offload_encoders_during_update'] else 'on GPU'}: micro-batch <= "
                    f"{o['max_micro_batch']}" for o in rec["options"]) or "does not fit"
                lines.append(f"  {device}, {res}², CFG on (>= 10% free): {text}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--resolution", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--frames", type=int, default=None, help="video frames for Wan (4k+1)")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[2] / "bench/results/memory_plan.json"))
    args = parser.parse_args(argv)
    if args.frames:
        for spec in MODELS.values():
            if spec["frames"] > 1:
                spec["frames"] = args.frames
    models = list(MODELS) if args.model == "all" else [args.model]
    report = run(models, args.resolution, args.lora_rank, args.micro_batch)
    print(format_table(report))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()
