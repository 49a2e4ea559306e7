"""Learning curves of fully async training at several staleness thresholds, on the image learning test's workload.

    .venv/bin/python bench/fully_async_learning.py [--staleness 0,1,3] [--out bench/results/fully_async_learning.json]

The workload is ``tests/trainer/test_learning.py``'s (FlowGRPO on tiny:sd3, full fine-tune, JPEG compressibility,
4 prompts x 8 samples per update, 10 updates, seeded), run with ``async_reward.fully_async=true``,
``async_training.require_batches=2`` (an update = the lock-step step's 4 prompts in 2 mini-batches) and each
``staleness_threshold``. Writes the per-step reward means and the first-3 / last-3 means per threshold.
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests/trainer")]

from test_learning import FULLY_ASYNC_LEARN, learn  # noqa: E402

from omni_async.trainer.strategies import fully_async_overrides  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", default="0,1,3")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/fully_async_learning.json")
    args = p.parse_args()
    runs = {}
    load = {"before": os.getloadavg()}
    for s in [float(x) for x in args.staleness.split(",")]:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            curve, rows = learn(Path(tmp), *fully_async_overrides(s), *FULLY_ASYNC_LEARN, with_rows=True)
        runs[str(s)] = {
            "reward_mean": curve,
            "first3": float(np.mean(curve[:3])),
            "last3": float(np.mean(curve[-3:])),
            "staleness_max": [r["training/off_policy/trajectory_staleness/max"] for r in rows],
            "wall_s": time.time() - t0,
        }
        print(
            f"staleness {s}: {np.mean(curve[:3]):.3f} -> {np.mean(curve[-3:]):.3f} kB "
            f"(lag max {max(runs[str(s)]['staleness_max'])})",
            flush=True,
        )
    load["after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "load_average": load, "cpu_count": os.cpu_count()}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
