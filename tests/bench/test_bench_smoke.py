"""The latency benchmark runs and writes the JSON its README table is made from (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]


def test_async_reward_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench/async_reward.py"), "--steps", "1", "--warmup", "0", "--batch", "2",
           "--group", "2", "--mini-batch", "1", "--denoise-steps", "3", "--size", "32", "--latency-scale", "0.005",
           "--modes", "sync,stream+one_step_off", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"sync", "stream+one_step_off"}
    for mode in report["modes"].values():
        assert len(mode["step_s"]) == 1 and mode["bound_s"] > 0 and "timing_s/gen" in mode["timing"]
    assert set(report["hidden_fraction"]) == {"stream+one_step_off"}
    assert "hidden" in proc.stdout  # the printed table
    bad = subprocess.run([*cmd[:-4], "--modes", "stream"], capture_output=True, text=True)
    assert bad.returncode != 0 and "must include sync" in bad.stderr
