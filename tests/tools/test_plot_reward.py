"""The reward curve: drawn from a run's metrics.jsonl (the trainer's logger draws it on close), re-drawn by the CLI."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from omni_async.tools.plot_reward import main
from omni_async.trainer.metrics_logger import MetricsLogger
from omni_async.trainer.reward_plot import first_last, plot_reward, read_metrics, reward_plot_path


def write_run(run_dir, steps=6, val_every=3):
    logger = MetricsLogger(run_dir, ["jsonl"], steps)
    for s in range(1, steps + 1):
        m = {
            "critic/rewards/mean": 0.1 * s,
            "critic/rewards/std": 0.05,
            "critic/rewards/min": 0.0,
            "critic/rewards/max": 1.0,
        }
        if s % val_every == 0:
            m["val-core/ocr/reward/mean@1"] = 0.5
        logger.log(s, m)
    logger.close()  # draws plots/reward.png


def test_logger_close_draws_the_curve(tmp_path):
    write_run(tmp_path)
    png = reward_plot_path(tmp_path)
    assert png == tmp_path / "plots" / "reward.png"
    w, h = Image.open(png).size
    assert w > 300 and h > 200


def test_rows_by_step_and_first_last(tmp_path):
    write_run(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:  # a step's second row merges into it, later values win
        f.write(json.dumps({"step": 6, "critic/rewards/mean": 0.9}) + "\n")
        f.write(json.dumps({"step": 0, "val-core/ocr/reward/mean@1": 0.4}) + "\n")  # val_before_train's own row
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6] and rows[-1]["critic/rewards/mean"] == 0.9
    assert rows[-1]["val-core/ocr/reward/mean@1"] == 0.5 and rows[0] == {"step": 0, "val-core/ocr/reward/mean@1": 0.4}
    rows = rows[1:]
    first, last = first_last([r["critic/rewards/mean"] for r in rows])
    assert np.isclose(first, 0.2) and np.isclose(last, (0.4 + 0.5 + 0.9) / 3)


def test_cli_redraws_and_refuses_a_run_without_metrics(tmp_path, capsys):
    write_run(tmp_path / "run")
    out = tmp_path / "copy.png"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0 and out.exists()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert plot_reward(tmp_path / "empty") is None
