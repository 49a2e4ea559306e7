"""One step of the hybrid actor/rollout worker on one device, without Ray: generate a batch, run one update.

    python bench/gpu_step.py                       # real Qwen-Image architecture, random bf16 weights, 512², LoRA r64
    python bench/gpu_step.py --model tiny:qwen_image --height 64 --width 64 --batch 2 --steps 3   # CPU smoke run
    python bench/gpu_step.py --loss diffusion_nft  # DiffusionNFT's step, verl-omni's Qwen-Image OCR recipe settings

It runs the worker's own code paths: ``DiffusionPolicy.generate`` (SDE window, log-probs, prompt encodings kept,
VAE decode sliced) for the rollout and ``trainer.actor_core.update_minibatch`` (the modality's FlowGRPO backward in
micro-batches with gradient checkpointing, gradient clip, AdamW step, optional offloads) for the update, on a
:class:`~omni_async.trainer.actor_core.TensorBatch` instead of verl's ``DataProto``. Nothing here imports Ray, verl,
Hydra or OmegaConf, so it runs on a bare GPU machine with PyTorch, transformers, peft and a diffusers wheel.

``--model qwen_image`` builds the pipeline from the configs in ``omni_async.tools.memory_plan.MODELS`` (the memory
plan's source: Qwen/Qwen-Image's published config.json files) with each class's random initialisation, in bf16,
directly on the device: nothing is downloaded and timing does not depend on weight values. The tokenizer is the
tiny byte-level Qwen2 one (one token per byte), so prompt sequences are longer than the real tokenizer's: a
conservative bias of the text length, small next to the 1024 image tokens of a 512² image.

Writes ``bench/results/gpu_step_<device>.json``: seconds per image (rollout), seconds per sample (update), peak
device memory per phase (``torch.cuda.max_memory_allocated``; ``null`` on CPU) and the device's name. The first
iteration warms up (kernel selection, allocator); the figures are the last iteration's. ``step1`` holds
the first update's ``actor/ratio_mean``, ``ratio_std`` and ``pg_clipfrac``: it scores the rollout's own samples
before any optimizer step, with the rollout's log-probs as pi_old (bypass mode, clip ``--clip-ratio``, verl-omni's
1e-5), so any distance of the ratio from 1 is a rollout/update mismatch, not learning; and the largest gap between
the rollout's log-probs and pi_old's recompute of them (verl's decoupled mode) at the update's micro-batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from omni_async.algos.diffusion_nft import optimality_probability, train_steps  # noqa: E402
from omni_async.modality.base import model_dtype  # noqa: E402
from omni_async.modality.image import ImageModality  # noqa: E402
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig  # noqa: E402
from omni_async.sample import PromptRow, RewardOutcome, Sample  # noqa: E402
from omni_async.tools.memory_plan import QWEN_TARGETS  # noqa: E402
from omni_async.trainer.actor_core import TensorBatch, begin_step, compute_log_prob, update_minibatch  # noqa: E402

GB = 1e9
# verl-omni's DiffusionNFT Qwen-Image recipe trains LoRA on the MLPs too.
NFT_TARGETS = [*QWEN_TARGETS, "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def build_qwen_image(device: str, dtype: torch.dtype, layers: int | None = None):
    """A QwenImagePipeline of the real architecture (memory plan's configs), random weights in ``dtype`` on
    ``device``. ``layers`` shrinks the transformer, the text encoder and the (unused) vision tower to that many
    blocks: a quick check of this build path, not the real model."""
    import diffusers
    from diffusers import QwenImagePipeline

    from omni_async.models.tiny import build_qwen2_tokenizer
    from omni_async.tools.memory_plan import MODELS, build

    spec = MODELS["qwen_image"]
    tr_lib, tr_cls, tr_cfg = spec["transformer"]
    te_lib, te_cls, te_cfg = spec["text_encoder"]
    if layers:
        tr_cfg = {**tr_cfg, "num_layers": layers}
        te_cfg = {
            **te_cfg,
            "text_config": {**te_cfg["text_config"], "num_hidden_layers": layers},
            "vision_config": {**te_cfg["vision_config"], "depth": layers, "fullatt_block_indexes": [0]},
        }
    _, sched_cls, sched_cfg = spec["scheduler"]
    return QwenImagePipeline(
        scheduler=getattr(diffusers, sched_cls)(**sched_cfg),
        vae=build(*spec["vae"], dtype=spec["vae_dtype"], device=device),
        text_encoder=build(te_lib, te_cls, te_cfg, dtype=dtype, device=device),
        tokenizer=build_qwen2_tokenizer(),
        transformer=build(tr_lib, tr_cls, tr_cfg, dtype=dtype, device=device),
    )


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GB if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def write_report(report: dict, stem: str, out: str | None, summary: tuple[str, ...]) -> Path:
    """``report`` as JSON to ``out`` (default ``bench/results/<stem>_<device>.json``, the device's name as a slug, or
    ``cpu``), and its ``device`` and ``summary`` keys printed."""
    name, device = report["device"], report["device_kind"]
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") if device.startswith("cuda") else "cpu"
    path = Path(out) if out else ROOT / "bench" / "results" / f"{stem}_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("device", *summary)}, indent=2))
    print(f"wrote {path}")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="qwen_image",
        help="qwen_image (real architecture, random weights) or a model path / tiny:<name>",
    )
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="images per rollout batch = samples per update")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps")
    ap.add_argument("--window", type=int, default=2, help="SDE window steps (the update's per-sample steps)")
    ap.add_argument(
        "--true-cfg-scale", type=float, default=None, help="> 1 runs the negative prompt too (default 4; NFT 1)"
    )
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4, help="actor.ppo_micro_batch_size_per_gpu")
    ap.add_argument(
        "--window-batch",
        type=int,
        default=None,
        help="rollout.pipeline.window_batch_size: samples per SDE-window transformer call, in rollout and update "
        "alike (default: the micro-batch, at most --batch; 1 = the per-sample path measured before 2026-11-27)",
    )
    ap.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off (on by default)")
    ap.add_argument(
        "--attn-backend",
        default="native",
        help="actor_rollout_ref.model.attn_backend: diffusers' backend, e.g. native | flash_varlen | "
        "_flash_3_varlen_hub | sage_varlen (models/acceleration.py)",
    )
    ap.add_argument(
        "--compile", action="store_true", help="actor_rollout_ref.actor.use_torch_compile: regional compilation"
    )
    ap.add_argument("--param-offload", action="store_true", help="fsdp_config.param_offload")
    ap.add_argument("--optimizer-offload", action="store_true", help="fsdp_config.optimizer_offload")
    ap.add_argument("--dtype", default=None, help="frozen weights: bf16 | fp16 | fp32 (default: bf16 on CUDA)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--layers", type=int, default=None, help="qwen_image only: blocks per stack (a build check)")
    ap.add_argument("--loss", default="flow_grpo", choices=("flow_grpo", "diffusion_nft"))
    ap.add_argument("--timestep-fraction", type=float, default=1.0, help="diffusion_nft: algorithm.timestep_fraction")
    ap.add_argument(
        "--clip-ratio", type=float, default=1e-5, help="flow_grpo's clip_ratio (verl-omni's Qwen-Image recipe: 1e-5)"
    )
    ap.add_argument("--iters", type=int, default=2, help="rollout + update iterations; the first warms up")
    ap.add_argument("--out", default=None, help="default: bench/results/gpu_step_<device>.json")
    return ap.parse_args(argv)


# What the first update says. flow_grpo: the ratio of the rollout's own samples before any optimizer step (1 unless
# rollout and update disagree). diffusion_nft: its loss, and how far the old policy's EMA refresh moved it.
STEP1_KEYS = {
    "flow_grpo": ("ratio_mean", "ratio_std", "pg_clipfrac", "recompute_max_abs_log_prob_diff"),
    "diffusion_nft": ("total_loss", "old_moved_l2"),
}


def policy_targets(args: argparse.Namespace, nft: bool) -> list[str]:
    if args.model != "qwen_image":
        return ["to_q", "to_k", "to_v"]
    return NFT_TARGETS if nft else QWEN_TARGETS


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = model_dtype(args.dtype, device)
    nft = args.loss == "diffusion_nft"
    if args.true_cfg_scale is None:
        args.true_cfg_scale = 1.0 if nft else 4.0  # DiffusionNFT is CFG-free
    torch.manual_seed(0)
    sampling = SamplingConfig(
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        true_cfg_scale=args.true_cfg_scale,
        clean_latents=nft,
        window_batch=args.window_batch or min(args.micro_batch, args.batch),
    )
    print(
        f"SDE window: calls of {sampling.window_batch} samples (rollout and update), text padded to multiples of "
        f"{sampling.window_text_bucket} tokens; update micro-batch {args.micro_batch}",
        flush=True,
    )
    t0 = time.perf_counter()
    source = build_qwen_image(device, dtype, args.layers) if args.model == "qwen_image" else args.model
    policy = DiffusionPolicy(
        source,
        sampling,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_rank,
        target_modules=policy_targets(args, nft),
        device=device,
        dtype=dtype,
        gradient_checkpointing=not args.no_checkpointing,
        attn_backend=args.attn_backend,
        compile_blocks=args.compile,
    )
    sync(device)
    build_s = time.perf_counter() - t0
    weights_gb = peak_gb(device)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    if nft:
        policy.init_old_policy()  # the ``old`` adapter: it samples, and gives the loss its v_old
    modality = ImageModality(args.loss)
    actor_cfg = SimpleNamespace(
        # flow_grpo reads clip_ratio; diffusion_nft the rest (verl-omni's recipe values).
        diffusion_loss=SimpleNamespace(
            clip_ratio=args.clip_ratio, mix_beta=0.1, adv_clip_max=5.0, adaptive_weight_min=1e-5, ref_kl_coef=1e-4
        ),
        kl_loss_coef=0.0,
        grad_clip=1.0,
        ppo_micro_batch_size_per_gpu=args.micro_batch,
    )
    start = max(0, min(2, args.steps - args.window))
    window = range(start, start + args.window)
    prompts = [f'A shop sign that says "OMNI {i}"' for i in range(args.batch)]

    iterations = []
    for it in range(args.iters):
        begin_step(policy, args.param_offload)  # the worker's weight sync: one param_offload round trip per step
        seeds = [1000 * it + i for i in range(args.batch)]
        reset_peak(device)
        sync(device)
        t, cpu = time.perf_counter(), time.process_time()
        with policy.old_policy() if nft else contextlib.nullcontext():
            results = policy.generate(prompts, seeds, None if nft else window)
        sync(device)
        rollout_s, rollout_peak = time.perf_counter() - t, peak_gb(device)
        rollout_cpu_s = time.process_time() - cpu  # this process's CPU s: steadier than wall on a busy box

        samples = [
            Sample(i, f"g{i // 2}", PromptRow(p, "bench", ""), s, result=r, outcome=RewardOutcome("ok", 0.0))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        adv = torch.randn(args.batch, generator=torch.Generator().manual_seed(it))
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        tensors = {
            **modality.batch_tensors(samples),
            "advantages": adv,
            "loss_mask": torch.ones(args.batch, dtype=torch.bool),
        }
        if nft:  # what StepOps.nft_batch adds
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            tensors["reward_prob"] = optimality_probability(adv, adv_clip_max=5.0).unsqueeze(-1)
            tensors["train_steps"] = torch.stack([train_steps(args.steps, args.timestep_fraction, g) for g in gens])
            tensors["noise_seed"] = torch.tensor([s + 7 for s in seeds])
        batch = TensorBatch(tensors, {} if nft else {"window_start": window.start})
        recompute_gap = None
        if not nft and it == 0:  # pi_old's recompute (verl's decoupled mode) against the rollout's own log-probs
            t = time.perf_counter()
            again = compute_log_prob(modality, policy, batch, args.micro_batch)
            again = again["old_log_probs"] if isinstance(again, dict) else again
            recompute_gap = float((again.float().cpu() - tensors["old_log_probs"].float()).abs().max())
            sync(device)
            recompute_s = time.perf_counter() - t
        reset_peak(device)
        sync(device)
        t, cpu = time.perf_counter(), time.process_time()
        metrics = update_minibatch(
            modality,
            policy,
            optimizer,
            batch,
            actor_cfg,
            param_offload=args.param_offload,
            optimizer_offload=args.optimizer_offload,
        )
        sync(device)
        update_s, update_peak = time.perf_counter() - t, peak_gb(device)
        record = {
            "rollout_s": rollout_s,
            "update_s": update_s,
            "rollout_cpu_s": rollout_cpu_s,
            "update_cpu_s": time.process_time() - cpu,
            "rollout_peak_gb": rollout_peak,
            "update_peak_gb": update_peak,
            "grad_norm": metrics["actor/grad_norm"],
            "skipped_step": metrics["actor/skipped_steps"],
        }
        if nft:
            t = time.perf_counter()
            record["old_moved_l2"] = policy.refresh_old(0.5)
            sync(device)
            record["refresh_old_s"] = time.perf_counter() - t
            record["total_loss"] = metrics["actor/total_loss"]
        else:
            for k in ("ratio_mean", "ratio_std", "pg_clipfrac", "pg_clipfrac_lower", "pg_clipfrac_higher"):
                record[k] = metrics[f"actor/{k}"]
            if recompute_gap is not None:
                record["recompute_max_abs_log_prob_diff"] = recompute_gap
                record["recompute_s"] = recompute_s
        iterations.append(record)
        print(
            f"iter {it}: rollout {rollout_s:.2f}s ({rollout_s / args.batch:.3f} s/image), "
            f"update {update_s:.2f}s ({update_s / args.batch:.3f} s/sample)",
            flush=True,
        )

    last = iterations[-1]
    name = device_name(device)
    params = {
        "transformer": sum(p.numel() for p in policy.transformer.parameters())
        - sum(p.numel() for p in policy.trainable_parameters()),
        "text_encoder": sum(p.numel() for p in policy.pipe.text_encoder.parameters()),
        "vae": sum(p.numel() for p in policy.pipe.vae.parameters()),
        "lora": sum(p.numel() for p in policy.trainable_parameters()),
    }
    report = {
        "device": name,
        "device_kind": device,
        "torch": torch.__version__,
        "model": args.model
        if not args.layers
        else f"{args.model} (layers={args.layers}: a build check, not the model)",
        "weights": "random (class initialisation)" if args.model == "qwen_image" else "from the model path",
        "config": {
            "clip_ratio": None if nft else args.clip_ratio,
            "height": args.height,
            "width": args.width,
            "batch": args.batch,
            "denoising_steps": args.steps,
            "loss": args.loss,
            "sde_window": None if nft else args.window,
            "timestep_fraction": args.timestep_fraction if nft else None,
            "lora_targets": len(policy_targets(args, nft)),
            "true_cfg_scale": args.true_cfg_scale,
            "lora_rank": args.lora_rank,
            "micro_batch": args.micro_batch,
            "window_batch": sampling.window_batch,
            "window_text_bucket": sampling.window_text_bucket,
            "gradient_checkpointing": not args.no_checkpointing,
            "attn_backend": args.attn_backend,
            "use_torch_compile": args.compile,
            "model_dtype": str(dtype).replace("torch.", ""),
            "param_offload": args.param_offload,
            "optimizer_offload": args.optimizer_offload,
            "vae_slicing": sampling.vae_slicing,
        },
        "params": params,
        "build_s": build_s,
        "rollout_s_per_image": last["rollout_s"] / args.batch,
        "update_s_per_sample": last["update_s"] / args.batch,
        "peak_memory_gb": {"weights": weights_gb, "rollout": last["rollout_peak_gb"], "update": last["update_peak_gb"]},
        "step1": {k: iterations[0][k] for k in STEP1_KEYS[args.loss]},
        "iterations": iterations,
    }
    if nft:
        report["refresh_old_s"] = last["refresh_old_s"]
    write_report(
        report,
        "gpu_step_diffusion_nft" if nft else "gpu_step",
        args.out,
        ("rollout_s_per_image", "update_s_per_sample", "peak_memory_gb", "step1"),
    )
    return report


if __name__ == "__main__":
    main()
