"""The main job's GPU figures, read from a run directory: GPU-seconds per trained image, peak device memory per
phase and the step's time split, per step (issue 49 / 50; ``scripts/gpu_kit.sh run recipe`` writes one).

    python bench/gpu_product.py RUN_DIR [--out bench/results/gpu_product_<device>.json] [--label recipe]

GPU-s per trained image = step wall × the run's devices ÷ images trained in the step = 1 / ``perf/throughput``
(verl-omni's images per second per device of all pools). Reward workers on CPU (``NUM_GPUS_REWARD=0``) hold no
device, so OCR's time counts only where the step waits for it (``timing_s/reward_wait``). Peaks are the actor
worker's ``perf/max_memory_allocated_gb/<phase>`` (``trainer.device_memory``: generation, the pi_old recompute, the
update), GiB. The first step includes compilation and allocator warm-up: the summary also gives the later steps'
mean. Only the standard library and torch (for the device name) are needed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PHASES = ("gen", "old_log_prob", "update")
SPLIT = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/reward_wait",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/weight_sync",
)


def step_row(m: dict) -> dict:
    images = m.get("perf/total_num_images")
    throughput = m.get("perf/throughput")
    return {
        "step": m["step"],
        "images": images,
        "gpu_s_per_image": 1.0 / throughput if throughput else None,
        "peak_gib": {p: m.get(f"perf/max_memory_allocated_gb/{p}") for p in PHASES},
        "reserved_gib": m.get("perf/max_memory_reserved_gb"),
        "time_s": {k.split("/", 1)[1]: m[k] for k in SPLIT if k in m},
        "reward_mean": m.get("critic/rewards/mean"),
        "val_ocr": m.get("val-core/ocr/reward/mean@4", m.get("val-core/ocr/reward/mean@1")),
    }


def summarize(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the run wrote no step (see its log)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [step_row(m) for m in rows if "perf/throughput" in m]
    later = [s["gpu_s_per_image"] for s in steps[1:] if s["gpu_s_per_image"]]
    rewards = [s["reward_mean"] for s in steps if s["reward_mean"] is not None]
    return {
        # the main job's learning test (issue 49): the rollout's OCR reward, last 3 steps against the first 3
        "reward_first3": sum(rewards[:3]) / 3 if len(rewards) >= 6 else None,
        "reward_last3": sum(rewards[-3:]) / 3 if len(rewards) >= 6 else None,
        "validation": [(m["step"], m["val-core/ocr/reward/mean@4"]) for m in rows if "val-core/ocr/reward/mean@4" in m],
        "steps": steps,
        "gpu_s_per_image_after_first": sum(later) / len(later) if later else None,
        "peak_gib": {p: max((s["peak_gib"][p] or 0.0) for s in steps) if steps else None for p in PHASES},
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="recipe")
    ap.add_argument("--device", default=None, help="the device's name, for a run dir copied off its machine")
    ap.add_argument("--torch", default=None, help="the torch version there, likewise")
    args = ap.parse_args(argv)
    import platform

    import torch

    cuda = torch.cuda.is_available()
    device = args.device or (torch.cuda.get_device_name(0) if cuda else "cpu")
    report = {
        "device": device,
        "torch": args.torch or torch.__version__,
        "python": None if args.device else platform.python_version(),
        "label": args.label,
        "run_dir": str(args.run_dir),
        **summarize(args.run_dir),
    }
    config = args.run_dir / "config.yaml"
    if config.is_file():  # the resolved recipe, for the record (model, sizes, batch)
        keep = re.compile(
            r"^\s*(path|height|width|num_inference_steps|true_cfg_scale|lora_rank|train_batch_size|n|"
            r"ppo_micro_batch_size_per_gpu|model_dtype|total_training_steps):"
        )
        report["config_lines"] = [line.strip() for line in config.read_text().splitlines() if keep.match(line)]
    out = args.out or Path("bench/results") / f"gpu_product_{re.sub(r'[^a-z0-9]+', '_', device.lower())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"wrote {out}: GPU-s/image after the first step {report['gpu_s_per_image_after_first']}, "
        f"peaks {report['peak_gib']}"
    )
    return report


if __name__ == "__main__":
    main()
