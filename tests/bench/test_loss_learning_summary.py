"""bench/loss_learning.py's comparison: the level is Flow-GRPO's last-3 mean (median over seeds), a run reaches it at
the first step whose trailing 3-point mean does, and a run that never does makes its loss's median None (not a
median over the runs that did)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Loaded by path: putting bench/ on sys.path would let bench/http_scorer.py shadow the http_scorer package for
# every later test in this worker.
_spec = importlib.util.spec_from_file_location("bench_loss_learning", ROOT / "bench/loss_learning.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
summarise = _module.summarise


def record(algo: str | None, curve: list[float], val: dict[int, float], seed: str = "default") -> dict:
    n = len(curve)
    return {
        "seed": seed,  # as bench/ocr_learning.py records it: the same-seed comparison pairs runs by it
        "env": {"ALGO": algo} if algo else {},
        "curve": curve,
        "val": {str(k): v for k, v in val.items()},
        "step_s": [2.0] * n,
        "row_times_s": [10.0 + 3.0 * k for k in range(n)],
        "last3": sum(curve[-3:]) / 3,
        "gain": 0.0,
    }


def test_steps_and_seconds_to_flow_grpos_level():
    grpo = [0.1 * k for k in range(1, 7)]  # 0.1 .. 0.6: last-3 mean 0.5
    runs = {
        "grpo_a": record(None, grpo, {0: 0.2, 2: 0.3, 4: 0.4, 6: 0.5}),
        "grpo_b": record("flow_grpo", grpo, {0: 0.2, 2: 0.3, 4: 0.4, 6: 0.5}),
        "nft_a": record("diffusion_nft", [0.4, 0.5, 0.6, 0.6, 0.6, 0.6], {0: 0.2, 2: 0.5, 4: 0.5, 6: 0.5}),
        "nft_b": record("diffusion_nft", [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], {0: 0.2, 2: 0.4, 4: 0.4, 6: 0.4}),
    }
    out = summarise({"runs": runs})
    roll = out["rollout"]
    assert abs(roll["level"] - 0.5) < 1e-9
    # grpo: trailing means 0.1, .15, .2, .3, .4, .5 -> step 6; nft_a: .4, .45, .5 -> step 3; nft_b: 0.5 at step 1
    assert roll["flow_grpo"]["runs"]["grpo_a"]["step"] == 6
    assert roll["diffusion_nft"]["runs"]["nft_a"] == {
        "gain": 0.1,
        "last3": 0.6,
        "step": 3,
        "train_s": 6.0,
        "wall_s": 16.0,
    }
    assert roll["diffusion_nft"]["runs"]["nft_b"]["step"] == 1
    assert roll["diffusion_nft"]["median_step"] == 2.0 and roll["diffusion_nft"]["step_vs_flow_grpo"] == round(2 / 6, 3)
    val = out["validation"]
    # level: grpo's validations at 2, 4, 6 -> 0.4; nft_a's trailing means 0.5 at step 2; nft_b's 0.4 at step 2
    assert abs(val["level"] - 0.4) < 1e-9 and val["diffusion_nft"]["runs"]["nft_a"]["step"] == 2
    assert val["flow_grpo"]["median_step"] == 6 and val["diffusion_nft"]["runs"]["nft_a"]["gain"] == 0.3


def test_a_run_that_never_reaches_the_level_is_not_hidden():
    runs = {
        "grpo": record(None, [0.1, 0.5, 0.9], {0: 0.1, 1: 0.5, 2: 0.9, 3: 0.9}),
        "awm_ok": record("awm", [0.9, 0.9, 0.9], {0: 0.1, 1: 0.9, 2: 0.9, 3: 0.9}),
        "awm_stuck": record("awm", [0.1, 0.1, 0.1], {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}),
    }
    out = summarise({"runs": runs})["rollout"]["awm"]
    assert out["runs"]["awm_stuck"]["step"] is None and out["runs"]["awm_ok"]["step"] == 1
    assert out["median_step"] is None and out["step_vs_flow_grpo"] is None  # the median falls on the stuck run
    # With a third run that got there, the stuck one counts as the latest: the median is the later of the two others.
    runs["awm_late"] = record("awm", [0.1, 0.9, 0.9], {0: 0.1, 1: 0.1, 2: 0.9, 3: 0.9})
    out = summarise({"runs": runs})["rollout"]["awm"]
    assert out["runs"]["awm_late"]["step"] == 2 and out["median_step"] == 2  # trailing means 0.1, 0.5 >= 0.5
