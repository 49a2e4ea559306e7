"""The latency benchmark runs and writes the JSON its README table is made from (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # two short training runs (the disaggregated layout x two modes), each on a fresh cluster
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
        "disaggregated",  # the layout with the most parts; the layouts' training is tests/trainer's
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    # One layout: its report at the top. On two devices: one rollout device + one trainer rank.
    assert "layouts" not in report and report["config"]["layout"] == "disaggregated"
    assert report["devices"] == {"actor_ranks": 1, "rollout_devices": 1}
    check_layout(report)
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


@pytest.mark.timeout(600)  # one Ray cluster, two stand-in rollout workers, the product's reward worker
def test_driver_cost_bench_smoke(tmp_path):
    out = tmp_path / "driver_cost.json"
    group = 4
    cmd = [
        sys.executable,
        str(ROOT / "bench/driver_cost.py"),
        *("--workers", "2", "--in-flight", "16", "--group", str(group), "--groups-per-step", "2"),
        *("--samples", "32", "--warmup", "16", "--profile-samples", "16", "--profile-top", "5"),
        *("--gen-mean", "0.05", "--reward-latency", "0.005", "--reward-workers", "1", "--idle-window", "1"),
        *("--variants", "product"),
        *("--out", str(out)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    assert (
        report["config"]["workers"] == 2 and report["config"]["in_flight"] == 16 and report["config"]["group"] == group
    )
    assert set(report["variants"]) == {"product"}
    for name, v in report["variants"].items():
        cpu = v["cpu_ms_per_sample"]
        assert cpu["total"] > 0 and cpu["marginal"] <= cpu["total"] and isinstance(v["goal_met"], bool), name
        assert v["in_flight_idle"]["driver_cores"] >= 0 and v["in_flight_idle"]["seconds"] > 0
        assert {"agent loop thread", "trainer thread: build_batch", "Ray's threads"} <= set(cpu["by_part"])
        assert cpu["by_part"]["agent loop thread"] > 0 and cpu["by_part"]["trainer thread: build_batch"] > 0
        assert v["samples_measured"] >= 32 and v["samples_per_s"] > 0 and v["wall_s"] > 0
        assert v["box_cores_busy_by_role"]["driver"] > 0 and v["gc"]["cpu_ms_per_sample"] >= 0
        assert 0 < v["live_samples_mean"] <= 16
        profile = v["profile"]
        assert profile["samples"] >= 16 and len(profile["loop_thread_top_own_time"]) == 5
        assert abs(sum(profile["loop_thread_own_time_share_by_package"].values()) - 1.0) < 1e-6
    # Coalesced per worker and turn: the groups a take frees start together, 2 workers share each group's members.
    calls = report["variants"]["product"]["ray_calls_per_sample"]
    assert set(calls) == {"generate", "score"} and 0 < calls["generate"] < 1 and 0 < calls["score"] <= 1, calls
    assert report["variants"]["product"]["gc"]["threshold"][0] >= 20_000  # cluster.tune_driver_gc, as trainer.main
    assert report["unit_cost_ms"]["Ray actor call made and awaited (driver, idle stand-ins)"] > 0
    assert "driver CPU" in proc.stdout and "[product]" in proc.stdout
