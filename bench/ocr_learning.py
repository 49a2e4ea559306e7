"""Timed runs of the main job's CPU default (issue 25), each appended to ``bench/results/ocr_learning_cpu_bimodal.json``.

Runs ``examples/run_qwen_image_ocr_async_reward.sh`` (no arguments = the default) in a fresh run directory with the
given environment settings and seed, and records what the run printed and wrote: the OCR reward curve, its first-3
and last-3 step means and their difference (the issue's criterion), the validation rewards, the wall time of the
whole command, the load average before and after (this box is shared: a timing means little without it), and where
the wall time went, from the console log's arrival times and ``metrics.jsonl``'s ``timing_s/*``:

- ``to_first_row_s``: launch until the first metrics row (Python / Ray / model / OCR start-up and, with
  ``trainer.val_before_train``, the first validation);
- ``steps_s``: the sum of ``timing_s/step`` (generation with the OCR streaming beside it, the reward tail, update);
  ``gen_s`` / ``reward_wait_s`` / ``update_actor_s`` its parts;
- ``between_steps_s``: the rest of the time from the first row to the last (validation, grids, timelines,
  checkpoints, logging);
- ``after_last_row_s``: the last row until the command exits (plot, shutdown).

    flock /work/bench.lock python bench/ocr_learning.py --name default --settings "the default"
    flock /work/bench.lock python bench/ocr_learning.py --name b4_s2 --seed 2 --env BATCH=4 -- trainer.log_image_freq=5

Timings are only comparable when taken one at a time (``flock``) at a similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from omni_async.trainer.metrics import validation_reward_mean  # noqa: E402

RESULTS = ROOT / "bench/results/ocr_learning_cpu_bimodal.json"
SCRIPT = ROOT / "examples/run_qwen_image_ocr_async_reward.sh"


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def run(env_settings: dict[str, str], seed: int | None, overrides: list[str], run_dir: Path) -> tuple[float, list, int]:
    """The command, its wall time and the arrival time (seconds since launch) of each line it printed."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "RUN_DIR": str(run_dir),
        **env_settings,
    }
    # None: the command's own seeds (trainer.seed 42, data.seed 1), as a user runs it.
    seeds = [] if seed is None else [f"trainer.seed={seed}", f"data.seed={seed}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *seeds, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines = []
    for line in proc.stdout:
        lines.append((time.perf_counter() - t0, line.rstrip()))
    rc = proc.wait()
    return time.perf_counter() - t0, lines, rc


def record(
    run_dir: Path, wall: float, lines: list, settings: str, env: dict, seed: int | None, overrides: list
) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/rewards/mean" in r]
    curve = [r["critic/rewards/mean"] for r in steps]
    val = {str(r["step"]): round(v, 4) for r in rows if (v := validation_reward_mean(r)) is not None}
    # verl's console logger prints one "step:N - ..." line per metrics row: their arrival times place the rows.
    row_times = [t for t, line in lines if line.startswith("step:")]

    def total(key: str) -> float:
        return round(float(sum(r.get(key, 0.0) for r in steps)), 1)

    first3, last3 = float(np.mean(curve[:3])), float(np.mean(curve[-3:]))
    out = {
        "settings": settings,
        "env": env,
        "overrides": overrides,
        "seed": "default (trainer.seed 42, data.seed 1)" if seed is None else f"trainer.seed = data.seed = {seed}",
        "steps": len(steps),
        "first3": round(first3, 4),
        "last3": round(last3, 4),
        "gain": round(last3 - first3, 4),
        "val": val,
        "curve": [round(c, 4) for c in curve],
        # When each step's row arrived (seconds since launch): reward against wall time.
        "row_times_s": [round(t, 1) for t in row_times],
        "step_s": [round(r.get("timing_s/step", 0.0), 2) for r in steps],
        "wall_s": round(wall, 1),
        "phases_s": {
            "to_first_row": round(row_times[0], 1) if row_times else None,
            "steps": total("timing_s/step"),
            "gen": total("timing_s/gen"),
            "reward_wait": total("timing_s/reward_wait"),
            "update_actor": total("timing_s/update_actor"),
            "between_steps": round(row_times[-1] - row_times[0] - total("timing_s/step"), 1) if row_times else None,
            "after_last_row": round(wall - row_times[-1], 1) if row_times else None,
        },
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="the record's key in the results file (must be new)")
    p.add_argument("--settings", default="", help="what differs from the default, in words")
    p.add_argument(
        "--seed", type=int, default=None, help="trainer.seed and data.seed (default: the command's, 42 and 1)"
    )
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="the script's env settings")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed through the script (after --)")
    a = p.parse_args()
    results = json.loads(a.out.read_text()) if a.out.exists() else {"runs": {}}
    if a.name in results["runs"]:
        raise SystemExit(f"{a.name!r} is already in {a.out}: choose another --name (records are never replaced)")
    env = dict(kv.split("=", 1) for kv in a.env)
    with tempfile.TemporaryDirectory(prefix="ocr_learning_") as tmp:
        load_before = load_average()
        wall, lines, rc = run(env, a.seed, a.overrides, Path(tmp) / "run")
        load_after = load_average()
        if rc != 0:
            print("\n".join(line for _, line in lines[-60:]))
            raise SystemExit(f"the command failed (exit {rc})")
        rec = record(Path(tmp) / "run", wall, lines, a.settings, env, a.seed, a.overrides)
        rec["load_before_after"] = [load_before, load_after]
        keep = os.environ.get("OCR_LEARNING_KEEP")  # copy the run directory (plots, grids) here
        if keep:
            subprocess.run(["cp", "-r", str(Path(tmp) / "run"), keep], check=True)
    results = json.loads(a.out.read_text()) if a.out.exists() else {"runs": {}}  # re-read: others may append
    results["runs"][a.name] = rec
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({a.name: {k: v for k, v in rec.items() if k != "curve"}}, indent=1))


if __name__ == "__main__":
    main()
