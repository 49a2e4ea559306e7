"""The sync trainer end to end through `python -m omni_async.trainer.main` (real Ray, verl worker group)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_LORA
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
# Deterministic comparisons: one sample per device batch, so batching order cannot perturb a float.
COMMON = [
    "actor_rollout_ref.model.path=tiny:sd3",
    *SMALL_LORA,  # LoRA r8 / alpha 16, as these runs were written (the config's default is a full fine-tune)
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.rollout.num_inference_steps=6",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.rollout.agent.max_batch_size=1",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio=0.2",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.jpeg",
    "trainer.logger=[jsonl]",
    "reward.streaming=false",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/data/prepare_ocr_prompts.py"),
            "--out-dir",
            str(out),
            "--num-train",
            "8",
            "--num-val",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    return out


def run_trainer(run_dir: Path, data_dir: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "omni_async.trainer.main",
        f"data.train_files={data_dir}/train.jsonl",
        f"trainer.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra",
        *COMMON,
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(m: dict) -> dict:
    """The metrics a resumed run must reproduce: not times, throughput, validation, or the producer's counters and
    idle shares (fully_async/*: counted since the process started)."""
    return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "val-", "fully_async/"))}


def val_reward(row: dict) -> float | None:
    from omni_async.trainer.metrics import validation_reward_mean

    return validation_reward_mean(row)


@pytest.mark.slow
def test_sync_run_then_kill_and_resume_gives_same_next_step(tmp_path, data_dir):
    full = run_trainer(
        tmp_path / "full",
        data_dir,
        "trainer.total_training_steps=3",
        f"data.val_files={data_dir}/val.jsonl",
        "trainer.test_freq=3",
        "trainer.logger=[console,file]",
        "trainer.save_freq=1",  # step 2's checkpoint is the "killed" run's last one below
    )
    assert [m["step"] for m in full] == [1, 2, 3]
    for key in (
        "critic/rewards/mean",
        "critic/rewards/std_mean",
        "critic/rewards/zero_std_ratio",
        "actor/pg_loss",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
        "actor/ratio_mean",
        "actor/grad_norm",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/old_log_prob",
        "timing_s/ref",
        "timing_s/adv",
        "timing_s/update_actor",
        "timing_s/step",
        "perf/throughput",
        "timing_s/reward_compute/p95",
        "critic/advantages/mean",
        "perf/samples_per_s",
        "perf/total_num_images",
    ):
        assert key in full[0], key
    # verl's meanings: images per second per device (one actor device here), advantages of the trained samples.
    assert full[0]["perf/throughput"] == pytest.approx(8 / full[0]["timing_s/step"])
    assert full[0]["critic/advantages/min"] < 0 < full[0]["critic/advantages/max"]
    # The same rows went through verl's Tracking: its `file` backend ({"step", "data"} per log call).
    tracked = [json.loads(x) for x in (tmp_path / "full/tracking.jsonl").read_text().splitlines()]
    assert [r["step"] for r in tracked] == [1, 2, 3]
    assert tracked[2]["data"] == pytest.approx({k: v for k, v in full[2].items() if k != "step"})
    assert full[0]["reward/failed"] == 0 and full[0]["critic/rewards/mean"] < 0  # JPEG compressibility = -kB
    assert "val-core/ocr/reward/mean@1" in full[2] and val_reward(full[1]) is None  # verl's key, test_freq=3
    # Weights pushed after every update: step k's samples come from policy version k-1.
    assert [m["rollout/policy_version"] for m in full] == [0.0, 1.0, 2.0]
    assert (tmp_path / "full/samples/step_0001.png").stat().st_size > 0
    assert (tmp_path / "full/tensorboard").exists() is False  # logger=[jsonl] only
    # Timeline: saved each step, re-drawn by the tool; a step never saved gets a clear message.
    timeline = json.loads((tmp_path / "full/timeline/step_0002.json").read_text())
    assert len(timeline["samples"]) == 8 and {"update_actor", "reward"} <= {p["phase"] for p in timeline["trainer"]}
    redraw = tmp_path / "redrawn.png"
    tool = [sys.executable, "-m", "omni_async.tools.timeline", str(tmp_path / "full")]
    done = subprocess.run([*tool, "--step", "2", "--out", str(redraw)], capture_output=True, text=True)
    assert done.returncode == 0 and redraw.stat().st_size > 0, done.stderr
    missing = subprocess.run([*tool, "--step", "9"], capture_output=True, text=True)
    assert missing.returncode == 2 and "step_0001" in missing.stderr

    # "Killed" right after step 2's checkpoint: the full run's directory as it was then (no step 3 checkpoint, two
    # metric rows), resumed with resume_mode=auto.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part, ignore=shutil.ignore_patterns("step_000003", "tracking.jsonl"))
    rows = (part / "metrics.jsonl").read_text().splitlines(keepends=True)
    (part / "metrics.jsonl").write_text("".join(rows[:2]))
    resumed = run_trainer(part, data_dir, "trainer.total_training_steps=3")
    assert [m["step"] for m in resumed] == [1, 2, 3]  # nothing repeated, nothing lost
    assert deterministic(resumed[2]) == pytest.approx(deterministic(full[2]), rel=1e-5, abs=1e-9)


def test_qwen_image_ocr_smoke(tmp_path, data_dir):
    metrics = run_trainer(
        tmp_path / "qi",
        data_dir,
        "actor_rollout_ref.model.path=tiny:qwen_image",
        "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.ocr",
        "trainer.total_training_steps=1",
    )
    assert metrics[0]["reward/failed"] == 0
    assert 0.0 <= metrics[0]["critic/rewards/mean"] <= 1.0
    # The resolved config is on record beside the curves: the command line's values, interpolations resolved.
    cfg = OmegaConf.load(tmp_path / "qi" / "config.yaml")
    assert cfg.actor_rollout_ref.model.path == "tiny:qwen_image" and cfg.trainer.total_training_steps == 1
    assert cfg.reward.custom_reward_function.path == "pkg://omni_async.reward.scorers.ocr"
    assert "${" not in (tmp_path / "qi" / "config.yaml").read_text()
