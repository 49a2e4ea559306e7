"""Learning curves of fully async training at several staleness thresholds, on a learning test's workload.

    .venv/bin/python bench/fully_async_learning.py [--modality image|text] [--staleness 0,1,3] [--lock-step]
        [--switch] [--out bench/results/fully_async_learning.json]

Image: ``tests/trainer/test_learning.py``'s workload (FlowGRPO on tiny:sd3, full fine-tune, JPEG compressibility,
4 prompts x 8 samples per update, 10 updates, seeded). Text: ``tests/trainer/test_text_mode.py``'s (GRPO on
tiny:qwen2, the digits reward, 4 prompts x 8 samples, 20 updates, rollout replicas of their own, verl's partial
rollout). Each is run with ``async_reward.fully_async=true``, ``async_training.require_batches=2`` (an update = the
lock-step step's 4 prompts in 2 mini-batches) and each ``staleness_threshold``; ``--lock-step`` adds the lock-step
on-policy run of the same workload first. ``--switch`` runs each threshold on the disaggregated layout (one
rollout + one trainer device) twice instead, with the trainer device lending a hand to generation
(``trainer.v1.separate_async.hybrid_rollout.enable_switch``, keys ``s=<s> switch``) and without (``s=<s>``): they
sample the same way, so the curves should agree within their noise. Writes the per-step reward means, the first-3 /
last-3 means, the per-update maximum lag and (switch runs) the samples the trainer device made, of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests/trainer")]

from test_learning import FULLY_ASYNC_LEARN, MODES, learn  # noqa: E402
from test_text_mode import fully_async_text, learn_digits, write_arith  # noqa: E402

from omni_async.trainer.mode import fully_async_overrides  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modality", choices=["image", "text"], default="image")
    p.add_argument("--staleness", default="0,1,3")
    p.add_argument("--lock-step", action="store_true", help="also the lock-step on-policy run (key 'lock_step')")
    p.add_argument(
        "--switch",
        action="store_true",
        help="disaggregated layout, each threshold with the trainer-device switch off/on",
    )
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/fully_async_learning[_text].json")
    args = p.parse_args()
    suffix = ("" if args.modality == "image" else "_text") + ("_switch" if args.switch else "")
    out = args.out or ROOT / f"bench/results/fully_async_learning{suffix}.json"
    runs = {}
    load = {"before": os.getloadavg()}
    cases = {"lock_step": (None, [])} if args.lock_step else {}  # name -> (staleness or None, extra overrides)
    for x in args.staleness.split(","):
        if args.switch:
            cases.update({f"s={x}": (float(x), DISAGGREGATED), f"s={x} switch": (float(x), [*DISAGGREGATED, SWITCH])})
        else:
            cases[x] = (float(x), [])
    for name, case in cases.items():
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            curve, rows = run(args.modality, Path(tmp), *case)
        runs[name] = {
            "reward_mean": curve,
            "first3": float(np.mean(curve[:3])),
            "last3": float(np.mean(curve[-3:])),
            "staleness_max": [r["training/off_policy/trajectory_staleness/max"] for r in rows],
            "lent_samples": sum(r.get("separate_async/switch/lent_samples", 0.0) for r in rows),
            "wall_s": time.time() - t0,
        }
        print(
            f"{name}: {np.mean(curve[:3]):.3f} -> {np.mean(curve[-3:]):.3f} (lag max {max(runs[name]['staleness_max'])})",
            flush=True,
        )
    load["after"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"modality": args.modality, "load_average": load, "cpu_count": os.cpu_count()}
    out.write_text(json.dumps({"runs": runs, **meta}, indent=1))
    print(f"written: {out}")


# One rollout device of its own beside the trainer's (the layout whose trainer devices can lend a hand); both
# workloads fine-tune every weight, which go to the rollout pool over a process group.
DISAGGREGATED = [
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]
SWITCH = "trainer.v1.separate_async.hybrid_rollout.enable_switch=true"


def run(modality: str, tmp: Path, staleness: float | None, extra: list[str]) -> tuple[list[float], list[dict]]:
    """One learning run: lock-step on-policy when ``staleness`` is None, else fully async at that threshold;
    ``extra`` overrides after the mode's."""
    if modality == "image":
        mode = MODES["sync"] if staleness is None else [*fully_async_overrides(staleness), *FULLY_ASYNC_LEARN]
        return learn(tmp, *mode, *extra, with_rows=True)
    mode = [] if staleness is None else fully_async_text(staleness)
    return learn_digits(write_arith(tmp / "arith"), tmp, *mode, *extra, with_rows=True)


if __name__ == "__main__":
    main()
