"""The losses compared on the main job (issue 38 item 6): steps and wall seconds each needs to reach Flow-GRPO's level.

The runs are ``bench/ocr_learning.py`` records (the main job's command, ``ALGO=flow_grpo | diffusion_nft | awm |
dpo | dance_grpo``, Flow-GRPO's three seeds beside them) in one results file; this script reads them and adds a
``summary``:

- two bases, each with its own level:
  - ``rollout``: the mean OCR reward of the step's own samples. Flow-GRPO's are SDE samples (noise level 0.7 on its
    window), DiffusionNFT's and AWM's ODE samples, which read better before any training: this basis favours them.
  - ``validation``: the held-out words, ODE, the same seeds for every loss and step (run with ``VAL_FREQ=2``): the
    like-for-like basis.
- the **level**: Flow-GRPO's mean over its last three points (steps 18-20 for ``rollout``; validations at steps
  16, 18, 20 for ``validation``), the median over its seeds (its 20-step level);
- per run, the first step ``k`` whose trailing 3-point mean (points ``k-2..k``; fewer at the start) reaches the
  level, the training seconds to it (the sum of ``timing_s/step`` up to ``k``: generation, reward tail and update,
  what the loss changes) and the wall seconds from launch to that step's metrics row (start-up, the validations and
  pictures included: what a user waits, the same fixed costs for every loss);
- per loss, the medians over its seeds (a run that never reached the level counts as later than any that did; the
  median is ``None`` when it falls on such a run), and their ratios to Flow-GRPO's;
- ``same_seed`` (issue 51's criterion): per run, its last-3 mean after ``--within`` steps (7) against the same seed's
  Flow-GRPO last-3 mean less ``--margin`` (0.05), on both bases.

    python bench/ocr_learning.py --out bench/results/loss_learning.json --name grpo_s42 --seed 42
    python bench/ocr_learning.py --out bench/results/loss_learning.json --name nft_s42 --seed 42 --env ALGO=diffusion_nft
    python bench/loss_learning.py bench/results/loss_learning.json   # + loss_learning.png beside it

The plot: validation reward (held-out words) and the rollout's reward against step and against wall seconds, one
line per run, a colour per loss (``--by-run``: per run, for a sweep), Flow-GRPO's levels dashed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np

BASELINE = "flow_grpo"


def trailing_mean(curve: list[float], width: int = 3) -> list[float]:
    """``m[k] = mean(curve[max(0, k - width + 1) .. k])``."""
    return [float(np.mean(curve[max(0, k - width + 1) : k + 1])) for k in range(len(curve))]


def series(run: dict, basis: str) -> tuple[list[int], list[float]]:
    """The 1-based steps and values of ``run``'s curve on ``basis`` (the validation before training, step 0, left
    out: no loss has trained yet)."""
    if basis == "rollout":
        return list(range(1, len(run["curve"]) + 1)), run["curve"]
    points = sorted((int(k), v) for k, v in run["val"].items() if int(k) > 0)
    return [k for k, _ in points], [v for _, v in points]


def last3(run: dict, basis: str) -> float:
    return float(np.mean(series(run, basis)[1][-3:]))


def to_level(run: dict, level: float, basis: str) -> dict:
    """Step, training seconds and wall seconds at which ``run``'s trailing 3-point mean first reaches ``level``."""
    steps, values = series(run, basis)
    reached = [steps[i] for i, m in enumerate(trailing_mean(values)) if m >= level]
    if not reached:
        return {"step": None, "train_s": None, "wall_s": None}
    k = reached[0] - 1
    step_s = run.get("step_s")
    return {
        "step": k + 1,
        "train_s": round(sum(step_s[: k + 1]), 1) if step_s else None,
        "wall_s": run["row_times_s"][k] if run.get("row_times_s") else None,
    }


def loss_of(run: dict) -> str:
    return run.get("env", {}).get("ALGO", BASELINE)


def median_or_none(values: list) -> float | None:
    """The median with a run that never reached the level counted as later than any that did (right-censored, as
    a median over the reached ones would hide it); ``None`` when the median itself is such a run."""
    if not values:
        return None
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else round(m, 1)


def summarise(results: dict, names: list[str] | None = None, within: int = 7, margin: float = 0.05) -> dict:
    runs = selected(results, names)
    baseline = [r for r in runs.values() if loss_of(r) == BASELINE]
    if not baseline:
        raise SystemExit(f"no {BASELINE} run among {sorted(runs)}: its last-3 mean is the level")
    out = {basis: summarise_basis(runs, baseline, basis) for basis in ("validation", "rollout")}
    out["same_seed"] = same_seed(runs, within, margin)
    return out


def same_seed(runs: dict[str, dict], within: int, margin: float) -> dict:
    """Issue 51's criterion, per run and basis: the run's last-3 mean after ``within`` steps (rollout: steps
    ``within-2 .. within``; validation: the last three validations at or before ``within``, step 0 left out) against
    the same seed's Flow-GRPO last-3 mean over its whole run, less ``margin``."""
    grpo = {r["seed"]: r for r in runs.values() if loss_of(r) == BASELINE}
    out: dict = {"within": within, "margin": margin, "runs": {}}
    for name, run in sorted(runs.items()):
        base = grpo.get(run["seed"])
        if loss_of(run) == BASELINE or base is None:
            continue
        entry = {}
        for basis in ("validation", "rollout"):
            steps, values = series(run, basis)
            early = [v for k, v in zip(steps, values, strict=True) if k <= within][-3:]
            target = last3(base, basis) - margin
            entry[basis] = {
                "last3": round(float(np.mean(early)), 4),
                "target": round(target, 4),
                "met": bool(np.mean(early) >= target),
            }
        out["runs"][name] = entry
    return out


def summarise_basis(runs: dict[str, dict], baseline: list[dict], basis: str) -> dict:
    level = statistics.median(last3(r, basis) for r in baseline)
    per_loss: dict[str, dict] = {}
    for name, run in sorted(runs.items()):
        entry = per_loss.setdefault(loss_of(run), {"runs": {}})
        # the gain from the first three steps (rollout) or from the validation before training
        first = series(run, basis)[1][:3] if basis == "rollout" else [run["val"]["0"]]
        gain = round(last3(run, basis) - float(np.mean(first)), 4)
        entry["runs"][name] = {"gain": gain, "last3": round(last3(run, basis), 4), **to_level(run, level, basis)}
    for entry in per_loss.values():
        reached = list(entry["runs"].values())
        for key in ("step", "train_s", "wall_s"):
            entry[f"median_{key}"] = median_or_none([r[key] for r in reached])
        entry["median_gain"] = round(statistics.median(r["gain"] for r in reached), 4)
    base = per_loss[BASELINE]
    for entry in per_loss.values():
        for key in ("step", "train_s", "wall_s"):
            a, b = entry[f"median_{key}"], base[f"median_{key}"]
            entry[f"{key}_vs_{BASELINE}"] = None if a is None or not b else round(a / b, 3)
    return {"level": round(level, 4), "level_is": f"{BASELINE}'s last-3 mean, median over seeds", **per_loss}


COLOURS = {"flow_grpo": "tab:blue", "diffusion_nft": "tab:orange", "awm": "tab:green", "dance_grpo": "tab:red"}


def selected(results: dict, names: list[str] | None) -> dict[str, dict]:
    """The records ``--runs`` names (None: all), in the file's order: what the summary compares and the plot draws."""
    return {n: r for n, r in results["runs"].items() if names is None or n in names}


def plot(results: dict, out: Path, by_run: bool = False, names: list[str] | None = None) -> Path:
    """``by_run``: a colour and legend entry per run (a sweep of one loss) instead of per loss; ``names``: the runs
    drawn (None: all), as the summary compares them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey="row")
    for (row, basis), (col, x_axis) in (
        (rb, cx) for rb in enumerate(("validation", "rollout")) for cx in enumerate(("step", "wall s"))
    ):
        ax = axes[row][col]
        for i, (name, run) in enumerate(selected(results, names).items()):
            steps, values = series(run, basis)
            if x_axis == "step":
                xs = steps
                if basis == "validation":  # and the validation before training
                    xs, values = [0, *steps], [run["val"]["0"], *values]
            else:  # when the step's metrics row arrived, seconds since launch
                xs = [run["row_times_s"][k - 1] for k in steps]
            colour = f"C{i}" if by_run else COLOURS.get(loss_of(run), "grey")
            ax.plot(xs, values, color=colour, alpha=0.7, lw=1.2, label=name if by_run else loss_of(run))
        if "summary" in results:  # Flow-GRPO's level (a staleness comparison has none)
            ax.axhline(results["summary"][basis]["level"], color=COLOURS[BASELINE], ls="--", lw=0.8)
        ax.set_xlabel(x_axis)
        ax.set_ylabel(f"{basis} OCR reward")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    # as many legend columns as the figure's width holds for the longest name (a sweep's run names are long)
    ncol = max(1, min(len(unique), 6, 150 // (max(map(len, unique)) + 8)))
    rows = -(-len(unique) // ncol)
    fig.legend(unique.values(), unique.keys(), loc="upper center", ncol=ncol)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 * rows))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--runs", nargs="*", default=None, help="the record names to compare (default: all)")
    p.add_argument("--within", type=int, default=7, help="same_seed: the steps a run has to reach the target")
    p.add_argument("--margin", type=float, default=0.05, help="same_seed: the target is Flow-GRPO's last-3 less this")
    p.add_argument("--by-run", action="store_true", help="plot: a colour per run (a sweep) instead of per loss")
    p.add_argument(
        "--plot-only",
        type=Path,
        default=None,
        metavar="PNG",
        help="only draw the runs to this file (records without Flow-GRPO's, e.g. staleness runs: no summary)",
    )
    a = p.parse_args()
    results = json.loads(a.results.read_text())
    if a.plot_only is not None:
        print(plot(results, a.plot_only, a.by_run, a.runs))
        return
    results["summary"] = summarise(results, a.runs, a.within, a.margin)
    a.results.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["summary"], indent=1))
    print(plot(results, a.results.with_suffix(".png"), a.by_run, a.runs))


if __name__ == "__main__":
    main()
