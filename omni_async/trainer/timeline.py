"""Per-step timelines: what overlapped with what.

Every logged step writes ``{run_dir}/timeline/step_XXXX.json`` (per-sample timestamps and the trainer's phase
spans, wall clock) and draws ``step_XXXX.png`` from it: one lane per sample (waiting for the device, generate — in red
when a trainer device lent to generation made it —, queued, scoring) and the trainer's phases beneath (with
``hybrid_rollout.enable_switch``: ``switch_to_rollout``, ``switch_wait`` while the trainer devices generate,
``switch_to_trainer``). ``python -m omni_async.tools.timeline RUN_DIR --step K`` re-draws a saved step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLE_PHASES = (
    ("waiting for the device", "requested", "gen_start", "tab:purple"),
    ("generate", "gen_start", "gen_end", "tab:blue"),
    ("queued", "queued", "sent", "tab:orange"),
    ("scoring", "sent", "scored", "tab:green"),
)


def timeline_record(step: int, t0: float, samples, timer) -> dict[str, Any]:
    """A step's record: its samples' timestamps and the trainer's phase spans; ``t0`` its first request."""
    return {
        "step": step,
        "t0": t0,
        "samples": [{"index": s.index, "uid": s.uid, "lent": s.lent, **s.times.as_dict()} for s in samples],
        "trainer": [{"phase": name, "start": a, "end": b} for name, a, b in timer.spans if name != "step"],
    }


def timeline_path(run_dir: str | Path, step: int, suffix: str) -> Path:
    return Path(run_dir) / "timeline" / f"step_{step:04d}.{suffix}"


def save_timeline(run_dir: str | Path, record: dict[str, Any]) -> Path:
    path = timeline_path(run_dir, record["step"], "json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return draw_timeline(record, timeline_path(run_dir, record["step"], "png"))


def draw_timeline(record: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min([record["t0"]] + [s["gen_start"] for s in record["samples"] if "gen_start" in s])
    samples = sorted(record["samples"], key=lambda s: s["index"])
    phases = sorted({p["phase"] for p in record["trainer"]})
    rows = len(samples) + len(phases)
    fig, ax = plt.subplots(figsize=(10, 0.25 * rows + 1.5))
    labelled: set[str] = set()
    for y, s in enumerate(samples):
        for label, a, b, color in SAMPLE_PHASES:
            if a in s and b in s:
                if label == "generate" and s.get("lent"):  # made on a trainer device lent to generation
                    label, color = "generate (trainer device)", "tab:red"
                ax.barh(
                    y, s[b] - s[a], left=s[a] - t0, color=color, height=0.8, label=None if label in labelled else label
                )
                labelled.add(label)
        if "scored" in s and "sent" not in s:  # sync mode: the colocated reward scores after the batch
            ax.plot([s["scored"] - t0], [y], "k|")
    for k, phase in enumerate(phases):
        y = len(samples) + k
        for p in (p for p in record["trainer"] if p["phase"] == phase):
            ax.barh(y, p["end"] - p["start"], left=p["start"] - t0, color="tab:gray", height=0.8)
    ax.set_yticks(
        range(rows),
        [f"sample {s['index']} ({s['uid']})" for s in samples] + [f"trainer: {p}" for p in phases],
        fontsize=6,
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step's rollout started")
    ax.set_title(f"step {record['step']}")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
