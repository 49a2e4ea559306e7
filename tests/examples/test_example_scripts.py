"""The example scripts compose and validate as documented, on this CPU box (``PYTHON`` points at a stand-in that
validates the trainer's config instead of training; see ``validate_main.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, tmp_path: Path, **env: str) -> dict:
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/examples/validate_main.py" "$@"\n')
    shim.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": str(shim), "DATA_DIR": str(tmp_path / "data"),
                              "RUN_DIR": str(tmp_path / "run"), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_gpu_recipe_composes_and_validates(tmp_path):
    """The README's GPU command: 4 actor/rollout GPUs (hybrid: one worker each), 1 reward GPU, real weights."""
    cfg = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path, MODEL_PATH="/models/Qwen-Image",
                      NUM_GPUS_ACTOR_ROLLOUT="4", NUM_GPUS_REWARD="1")
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"] == "/models/Qwen-Image" and arr["hybrid_engine"] is True
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and arr["rollout"]["agent"]["num_workers"] == 4
    assert cfg["reward"]["reward_model"]["enable_resource_pool"] is True
    assert cfg["reward"]["reward_model"]["n_gpus_per_node"] == 1
    assert (arr["rollout"]["height"], arr["rollout"]["width"]) == (512, 512)
    assert arr["model"]["lora_rank"] == 64
    # Memory settings the README's GPU section explains.
    assert arr["actor"]["fsdp_config"]["model_dtype"] == "bfloat16"
    assert arr["model"]["enable_gradient_checkpointing"] is True
    assert arr["actor"]["ppo_micro_batch_size_per_gpu"] >= 1


@pytest.mark.parametrize("script", ["run_qwen_image_ocr_async_reward.sh", "run_text_grpo_async_reward.sh"])
def test_cpu_defaults_compose_and_validate(script, tmp_path):
    cfg = run_example(script, tmp_path)
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["actor_rollout_ref"]["model"]["path"].startswith("tiny:")
