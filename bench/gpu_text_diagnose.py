"""Where the text rollout's device memory and time go on a GPU (bench/gpu_text_step.py found 60 GB peak and ~80 ms per
decoding step for Qwen2.5-1.5B's architecture at 32 responses): a memory snapshot's largest live allocations by
stack at the peak, and a profiler table of a few decoding steps. Writes text files under --out-dir."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_text_step import TARGETS, build_qwen25  # noqa: E402
from omni_async.models import text_policy as tp  # noqa: E402


def stack_key(entry: dict) -> str:
    """An allocation's stack as one line (a snapshot block's or trace event's frames), torch's own frames left out
    except its modules'."""
    return " <- ".join(
        f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
        for f in entry.get("frames") or []
        if "torch/" not in f["filename"] or "nn/modules" in f["filename"]
    )[:600]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="/tmp/diag")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--checkpointing", action="store_true")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp()
    build_qwen25(Path(tmp) / "m", torch.bfloat16, "cuda")
    pol = tp.TextPolicy(
        str(Path(tmp) / "m"),
        tp.TextSamplingConfig(response_length=args.response_length),
        lora_rank=32,
        lora_alpha=32,
        target_modules=TARGETS,
        device="cuda",
        dtype=torch.bfloat16,
        gradient_checkpointing=args.checkpointing,
    )
    prompts = [f"prompt number {i}" for i in range(args.batch)]
    pol.generate(prompts[:4], list(range(4)))  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    orig = tp._DecodeBatch.step

    def step(self):
        torch.cuda.synchronize()
        t = time.perf_counter()
        orig(self)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)

    tp._DecodeBatch.step = step
    torch.cuda.memory._record_memory_history(max_entries=200000)
    t0 = time.perf_counter()
    pol.generate(prompts, list(range(args.batch)))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    lines = [
        f"checkpointing={args.checkpointing} training_mode={pol.model.training} batch={args.batch} "
        f"len={args.response_length}",
        f"allocated before {base / 1e9:.2f} GB, peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, after "
        f"{torch.cuda.memory_allocated() / 1e9:.2f} GB, generate wall {wall:.2f}s, steps {len(times)}, "
        f"step ms median {sorted(times)[len(times) // 2] * 1e3:.1f}",
    ]
    by_stack: Counter = Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                by_stack[stack_key(blk)] += blk["size"]
    lines.append("live at the end, by stack (GB):")
    lines += [f"{v / 1e9:8.3f}  {k}" for k, v in by_stack.most_common(12)]
    # The peak: replay the trace's alloc/free events and keep the allocation stacks live at the maximum.
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for trace in snap.get("device_traces", [[]])[0:1]:
        for ev in trace:
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], stack_key(ev))
                cur += ev["size"]
                if cur > best:
                    best, best_live = cur, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                cur -= live.pop(ev["addr"])[0]
    agg: Counter = Counter()
    for size, key in best_live.values():
        agg[key] += size
    lines.append(f"at the traced peak ({best / 1e9:.2f} GB above the start of the trace), by stack (GB):")
    lines += [f"{v / 1e9:8.3f}  {k}" for k, v in agg.most_common(12)]
    (out / "memory.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:30]))

    tp._DecodeBatch.step = orig
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pol.generate(prompts, list(range(args.batch)))
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (out / "profile.txt").write_text(table)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
