"""The reward curve of a run: ``{run_dir}/plots/reward.png`` from its ``metrics.jsonl``.

Per step: the mean training reward (``critic/rewards/mean``), a band of ± one standard deviation across the step's
samples (``critic/rewards/std``, clipped to the step's min / max; runs without it get the min – max band), and the
validation reward (verl's ``val-core/{data_source}/reward/mean@n``, averaged over data sources) where a step has
one. The title gives the mean of the first and of the
last three steps. The trainer draws it at the end of ``fit``; ``python -m omni_async.tools.plot_reward RUN_DIR``
re-draws it (or compares runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_async.trainer.metrics import validation_reward_mean

MEAN, STD, MIN, MAX = "critic/rewards/mean", "critic/rewards/std", "critic/rewards/min", "critic/rewards/max"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``{run_dir}/metrics.jsonl`` by step, rows of one step merged (later values win): validation
    before training (``trainer.val_before_train``) logs its own row at the starting step."""
    path = Path(run_dir) / "metrics.jsonl"
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]


def first_last(values: list[float], k: int = 3) -> tuple[float, float]:
    """Mean of the first ``k`` and of the last ``k`` values (the figure the README and the example report)."""
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


def reward_plot_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "plots" / "reward.png"


def plot_reward(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path | None:
    """Draw the run's reward curve; returns the PNG path, or None when the run logged no training step."""
    every = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []
    rows = [r for r in every if MEAN in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in rows])
    mean = np.array([r[MEAN] for r in rows])
    lo = np.array([r.get(MIN, np.nan) for r in rows])
    hi = np.array([r.get(MAX, np.nan) for r in rows])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if all(STD in r for r in rows):
        std = np.array([r[STD] for r in rows])
        ax.fill_between(
            steps,
            np.fmax(mean - std, lo),
            np.fmin(mean + std, hi),
            color="C0",
            alpha=0.2,
            linewidth=0,
            label="± std over the step's samples",
        )
    else:  # runs from before critic/rewards/std was logged
        ax.fill_between(steps, lo, hi, color="C0", alpha=0.15, linewidth=0, label="min – max over samples")
    ax.plot(steps, mean, "-", color="C0", linewidth=1.8, label="train reward mean")
    val = [(r["step"], v) for r in every if (v := validation_reward_mean(r)) is not None and np.isfinite(v)]
    if val:
        ax.plot(*zip(*val, strict=True), "s--", color="C3", markersize=5, label="validation reward mean")
    first, last = first_last(list(mean))
    k = min(3, len(mean))
    ax.set_title(title or f"{Path(run_dir).name}: first {k} steps {first:.3f} → last {k} steps {last:.3f}", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(out) if out is not None else reward_plot_path(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
