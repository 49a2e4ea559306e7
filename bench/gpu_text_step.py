"""One step of the text modality's worker on one device, without Ray: generate a batch of responses, run one update.

    python bench/gpu_text_step.py                      # Qwen2.5-1.5B's architecture, random bf16 weights, LoRA r32
    python bench/gpu_text_step.py --model tiny --batch 4 --response-length 16   # CPU smoke run

The text counterpart of ``bench/gpu_step.py``: it runs the worker's own code paths, ``TextPolicy.generate`` (continuous
batching with a KV cache, per-sample generators on the model's device, per-token log-probs) for the rollout and
``trainer.actor_core.update_minibatch`` (``TextModality.backward``: verl's GRPO token loss in micro-batches, gradient
clip, AdamW) for the update, on a :class:`~omni_async.trainer.actor_core.TensorBatch`. Nothing here imports Ray,
verl, Hydra or OmegaConf.

``--model qwen2.5-1.5b`` builds ``Qwen2ForCausalLM`` from Qwen/Qwen2.5-1.5B-Instruct's published config.json (28
layers, hidden 1536, 12 query / 2 key-value heads, MLP 8960, rope theta 1e6) with the class's random initialisation
in bf16 and saves it with the tiny byte-level Qwen2 tokenizer (nothing is downloaded), so the embedding has the
tokenizer's vocabulary, not 151,936 rows: 1.31 B parameters instead of 1.54 B. ``TextPolicy`` loads it from that
directory as it loads a checkpoint. Random weights rarely emit EOS, so every response runs to ``--response-length``:
the longest case.

The update is verl's GRPO token loss (``algos.loss.grpo_token_loss`` calls ``verl.trainer.ppo.core_algos``), and verl
cannot be imported without Ray, which a bare GPU machine lacks (and whose wheel is over what can be carried there).
Where verl is missing the update runs :func:`surrogate_update` instead and the JSON says so (``update_path``): the same
forward and backward over the batch (``TextPolicy.log_probs`` with gradients, in the same micro-batches), gradient
clip and AdamW step, with a plain ``-ratio * advantage`` token mean as the loss: the same device work, not verl's
clipping and metrics. Before any update the rollout's log-probs are compared with a recompute under the same weights
(``logprob_diff``): the rollout/update agreement in bf16 that the clip ratio depends on.

Writes ``bench/results/gpu_text_step_<device>.json``: seconds per response and tokens/s (rollout), seconds per sample
(update), peak device memory per phase and ``step1`` (the first update's ``actor/ratio_mean``: the rollout's own
samples scored before any optimizer step, so any distance from 1 is a rollout/update mismatch in log-probs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_step import device_name, peak_gb, reset_peak, sync, write_report  # noqa: E402
from omni_async.modality.base import model_dtype  # noqa: E402
from omni_async.modality.text import TextModality  # noqa: E402
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig  # noqa: E402
from omni_async.sample import PromptRow, RewardOutcome, Sample  # noqa: E402
from omni_async.trainer.actor_core import TensorBatch, begin_step, update_minibatch  # noqa: E402

# Qwen/Qwen2.5-1.5B-Instruct config.json (the vocabulary is the tokenizer's: module docstring).
QWEN25_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_qwen25(out: Path, dtype: torch.dtype, device: str) -> None:
    """Qwen2.5-1.5B's architecture with random weights in ``dtype``, saved to ``out`` with the tiny tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from omni_async.models.tiny import build_qwen2_tokenizer

    tok = build_qwen2_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(**QWEN25_1_5B, vocab_size=len(tok), eos_token_id=eos, pad_token_id=tok.pad_token_id)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights are created in bf16: no fp32 copy of the model exists first
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model


def surrogate_update(policy, optimizer, batch: TensorBatch, micro_batch: int, grad_clip: float) -> dict[str, float]:
    """Forward + backward + AdamW over ``batch`` in micro-batches with ``-ratio * advantage`` averaged over response
    tokens (module docstring: where verl, whose loss the product uses, cannot be imported)."""
    device = policy.device
    tokens = float(batch.batch["response_mask"].sum())
    ratios = []
    optimizer.zero_grad(set_to_none=True)
    for mb in batch.split(micro_batch):
        b = {k: v.to(device) for k, v in mb.batch.items()}
        lp = policy.log_probs(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
        mask = b["response_mask"].float()
        ratio = torch.exp(lp.float() - b["old_log_probs"].float())
        loss = -(ratio * b["advantages"][:, None].float() * mask).sum() / tokens
        loss.backward()
        ratios.append(float((ratio * mask).sum() / mask.sum()))
    norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grad_clip)
    optimizer.step()
    return {"actor/grad_norm": float(norm), "actor/ratio_mean": sum(ratios) / len(ratios)}


def verl_importable() -> bool:
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b", help="qwen2.5-1.5b (random weights), tiny, or a model path")
    ap.add_argument("--batch", type=int, default=32, help="responses per rollout batch = samples per update")
    ap.add_argument("--response-length", type=int, default=512)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8, help="actor.ppo_micro_batch_size_per_gpu")
    ap.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off (on by default)")
    ap.add_argument("--dtype", default=None, help="frozen weights: bf16 | fp16 | fp32 (default: bf16 on CUDA)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--iters", type=int, default=2, help="rollout + update iterations; the first warms up")
    ap.add_argument("--out", default=None, help="default: bench/results/gpu_text_step_<device>.json")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = model_dtype(args.dtype, device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if args.model == "qwen2.5-1.5b":
            path = str(Path(tmp) / "qwen25")
            build_qwen25(Path(path), dtype, device)
        elif args.model == "tiny":
            path = "tiny:qwen2"
        policy = TextPolicy(
            path,
            TextSamplingConfig(response_length=args.response_length, temperature=1.0),
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_rank,
            target_modules=TARGETS,
            device=device,
            dtype=dtype,
            gradient_checkpointing=not args.no_checkpointing,
        )
    sync(device)
    build_s = time.perf_counter() - t0
    weights_gb = peak_gb(device)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    modality = TextModality()
    actor_cfg = SimpleNamespace(
        clip_ratio=0.2, kl_loss_coef=0.0, grad_clip=1.0, ppo_micro_batch_size_per_gpu=args.micro_batch
    )
    prompts = [f"Count the letters in the word number {i} and answer with one integer." for i in range(args.batch)]

    update_path = "verl" if verl_importable() else "surrogate (verl not importable: module docstring)"
    logprob_diff = float("nan")
    iterations = []
    for it in range(args.iters):
        begin_step(policy, False)
        seeds = [1000 * it + i for i in range(args.batch)]
        reset_peak(device)
        sync(device)
        t = time.perf_counter()
        results = policy.generate(prompts, seeds)
        sync(device)
        rollout_s, rollout_peak = time.perf_counter() - t, peak_gb(device)
        for r in results:
            r.stamp_version(0)
        tokens = sum(len(r.response_ids) for r in results)

        samples = [
            Sample(i, f"g{i // 4}", PromptRow(p, "bench", ""), s, result=r, outcome=RewardOutcome("ok", 0.0))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        adv = torch.randn(args.batch, generator=torch.Generator().manual_seed(it))
        batch = TensorBatch(
            {
                **modality.batch_tensors(samples),
                "advantages": (adv - adv.mean()) / (adv.std() + 1e-6),
                "loss_mask": torch.ones(args.batch, dtype=torch.bool),
            }
        )
        if it == 0:  # the rollout's log-probs against a recompute under the same weights, before any update
            with torch.no_grad():  # (without it the recompute's graph stayed alive: 57 GB in the first GPU run)
                recomputed = modality.log_probs(policy, batch)
            mask = batch.batch["response_mask"].bool()
            logprob_diff = float((recomputed - batch.batch["old_log_probs"]).abs()[mask].max())
            del recomputed
        reset_peak(device)
        sync(device)
        t = time.perf_counter()
        if update_path == "verl":
            metrics = update_minibatch(modality, policy, optimizer, batch, actor_cfg)
        else:
            metrics = surrogate_update(policy, optimizer, batch, args.micro_batch, actor_cfg.grad_clip)
        sync(device)
        update_s, update_peak = time.perf_counter() - t, peak_gb(device)
        iterations.append(
            {
                "rollout_s": rollout_s,
                "response_tokens": tokens,
                "update_s": update_s,
                "rollout_peak_gb": rollout_peak,
                "update_peak_gb": update_peak,
                "grad_norm": metrics["actor/grad_norm"],
                "ratio_mean": metrics["actor/ratio_mean"],
                "pg_clipfrac": metrics.get("actor/pg_clipfrac"),  # verl's path only
            }
        )
        print(
            f"iter {it}: rollout {rollout_s:.2f}s ({tokens / rollout_s:.0f} tokens/s), "
            f"update {update_s:.2f}s ({update_s / args.batch:.3f} s/sample)",
            flush=True,
        )

    last = iterations[-1]
    name = device_name(device)
    report = {
        "device": name,
        "device_kind": device,
        "torch": torch.__version__,
        "model": args.model,
        "weights": "random (class initialisation)" if args.model == "qwen2.5-1.5b" else "from the model path",
        "config": {
            "batch": args.batch,
            "response_length": args.response_length,
            "lora_rank": args.lora_rank,
            "target_modules": TARGETS,
            "micro_batch": args.micro_batch,
            "gradient_checkpointing": not args.no_checkpointing,
            "model_dtype": str(dtype).replace("torch.", ""),
        },
        "params": {
            "model": sum(p.numel() for p in policy.model.parameters())
            - sum(p.numel() for p in policy.trainable_parameters()),
            "lora": sum(p.numel() for p in policy.trainable_parameters()),
        },
        "update_path": update_path,
        "build_s": build_s,
        "logprob_diff": {"max_abs_rollout_vs_recompute": logprob_diff},
        "rollout_s_per_response": last["rollout_s"] / args.batch,
        "rollout_tokens_per_s": last["response_tokens"] / last["rollout_s"],
        "update_s_per_sample": last["update_s"] / args.batch,
        "peak_memory_gb": {"weights": weights_gb, "rollout": last["rollout_peak_gb"], "update": last["update_peak_gb"]},
        "step1": {"actor/ratio_mean": iterations[0]["ratio_mean"], "actor/pg_clipfrac": iterations[0]["pg_clipfrac"]},
        "iterations": iterations,
    }
    write_report(
        report,
        "gpu_text_step",
        args.out,
        ("update_path", "rollout_tokens_per_s", "update_s_per_sample", "peak_memory_gb", "logprob_diff"),
    )
    return report


if __name__ == "__main__":
    main()
