"""bench/gpu_step.py (the hybrid worker's Ray-free core: generate a batch, one update) runs where Ray, verl, Hydra
and OmegaConf cannot be imported, as on a bare GPU machine, and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Any import of these fails (None in sys.modules), before the bench is run as __main__.
WITHOUT_RAY = (
    "import runpy, sys\n"
    "for m in ('ray', 'verl', 'hydra', 'omegaconf'): sys.modules[m] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_gpu_step_runs_without_ray_and_writes_its_report(tmp_path):
    out = tmp_path / "gpu_step.json"
    cmd = [
        sys.executable,
        "-c",
        WITHOUT_RAY,
        str(ROOT / "bench/gpu_step.py"),
        "--model",
        "tiny:qwen_image",
        "--height",
        "64",
        "--width",
        "64",
        "--batch",
        "2",
        "--steps",
        "2",
        "--window",
        "1",
        "--iters",
        "1",
        "--lora-rank",
        "4",
        "--true-cfg-scale",
        "4",
        "--dtype",
        "bf16",
        "--param-offload",
        "--optimizer-offload",
        "--attn-backend",
        "_native_math",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu") and report["peak_memory_gb"]["update"] is None  # no CUDA here
    assert report["rollout_s_per_image"] > 0 and report["update_s_per_sample"] > 0
    assert report["config"]["gradient_checkpointing"] and report["config"]["param_offload"]
    assert report["config"]["attn_backend"] == "_native_math" and report["config"]["use_torch_compile"] is False
    assert report["params"]["lora"] > 0 and report["params"]["text_encoder"] > 0
    (it,) = report["iterations"]
    # bf16 with CFG, rollout batch 2 in SDE-window calls of 2 as the update's: the first update scores the rollout's
    # own samples with the rollout's log-probs as pi_old and sees exactly them (clip 1e-5: nothing clipped), and
    # pi_old's recompute at the update's micro-batch gives the rollout's log-probs back.
    assert it["skipped_step"] == 0.0 and it["ratio_mean"] == 1.0 and it["pg_clipfrac"] == 0.0
    assert report["config"]["clip_ratio"] == 1e-5
    assert report["step1"] == {
        "ratio_mean": 1.0,
        "ratio_std": 0.0,
        "pg_clipfrac": 0.0,
        "recompute_max_abs_log_prob_diff": 0.0,
    }


def test_gpu_step_runs_diffusion_nfts_step(tmp_path):
    """``--loss diffusion_nft``: the old adapter samples (ODE, no CFG), the update trains on every denoising step,
    and the old policy's EMA refresh moves it toward the updated weights."""
    out = tmp_path / "gpu_step_nft.json"
    args = "--model tiny:qwen_image --height 64 --width 64 --batch 2 --steps 2 --iters 1 --lora-rank 4 --dtype bf16"
    cmd = [sys.executable, "-c", WITHOUT_RAY, str(ROOT / "bench/gpu_step.py"), *args.split(), "--loss", "diffusion_nft"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["loss"] == "diffusion_nft" and report["config"]["true_cfg_scale"] == 1.0
    assert report["config"]["sde_window"] is None and report["refresh_old_s"] > 0
    (it,) = report["iterations"]
    assert it["skipped_step"] == 0.0 and it["grad_norm"] > 0  # the update moved the live adapter ...
    assert report["step1"]["old_moved_l2"] > 0  # ... and the refresh moved old toward it (decay 0.5)
    assert report["step1"]["total_loss"] == it["total_loss"] and it["total_loss"] > 0
