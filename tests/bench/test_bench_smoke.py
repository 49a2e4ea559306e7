"""The latency benchmark runs and writes the JSON its README table is made from (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # four short training runs (two layouts x two modes), each on a fresh Ray cluster
def test_async_reward_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/async_reward.py"),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--batch",
        "2",
        "--group",
        "2",
        "--mini-batch",
        "2",
        "--denoise-steps",
        "3",
        "--size",
        "32",
        "--latency-scale",
        "0.005",
        "--modes",
        "sync,stream+one_step_off",
        "--layout",
        "hybrid,disaggregated",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    # Both layouts on the same two devices: hybrid with two ranks, disaggregated with one rollout + one trainer.
    assert set(report["layouts"]) == {"hybrid", "disaggregated"}
    assert report["layouts"]["hybrid"]["devices"] == {"actor_ranks": 2, "rollout_devices": 0}
    assert report["layouts"]["disaggregated"]["devices"] == {"actor_ranks": 1, "rollout_devices": 1}
    for layout in report["layouts"].values():
        check_layout(layout)
    assert "hidden" in proc.stdout and "layout disaggregated" in proc.stdout  # the printed tables
    bad = subprocess.run([*cmd[:-6], "--modes", "stream"], capture_output=True, text=True)
    assert bad.returncode != 0 and "must include sync" in bad.stderr


def check_layout(report: dict) -> None:
    assert set(report["modes"]) == {"sync", "stream+one_step_off"}
    for mode in report["modes"].values():
        assert len(mode["step_s"]) == 1 and mode["bound_s"] > 0 and "timing_s/gen" in mode["timing"]
        # One mini-batch per step: step 1 scores the rollout's samples before any optimizer step with the rollout's
        # log-probs as pi_old (bypass mode), so its ratio is 1 and nothing is clipped below.
        assert abs(mode["step1"]["actor/ratio_mean"] - 1.0) <= 1e-5 and mode["step1"]["actor/pg_clipfrac_lower"] == 0.0
        # Where the rollout pool idled: its idle gaps and its busy time make up the measured window; the run's own
        # processes are accounted for by role.
        assert mode["rollout_idle"]["idle_s"] + mode["rollout_busy_s"] == pytest.approx(mode["wall_s"])
        assert 0 < mode["own_bound_s"] and sum(mode["rollout_batch_sizes"].values()) > 0
        assert mode["cpu_s_per_step"]["driver (agent loop, trainer loop)"] > 0
    assert set(report["hidden_fraction"]) == {"stream+one_step_off"}
