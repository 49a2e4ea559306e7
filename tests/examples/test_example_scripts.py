"""The example scripts compose and validate as documented, on this CPU box: ``PYTHON`` points at a stand-in that
records the trainer's command line instead of training (anything else, the data preparation, runs for real), and
the test composes and validates that command's config in this process (one import of the trainer for all)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from omni_async.trainer.config import compose, validate

ROOT = Path(__file__).resolve().parents[2]


def trainer_config(argv: list[str]) -> dict:
    """``python -m omni_async.trainer.main <argv>``'s config, composed and validated as the entry point does."""
    config_name, overrides = "flowgrpo_trainer", []
    args = iter(argv)
    for arg in args:
        if arg == "--config-name":
            config_name = next(args)
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif not arg.startswith("hydra."):
            overrides.append(arg)
    return OmegaConf.to_container(validate(compose(overrides, config_name=config_name)), resolve=True)


def run_example(script: str, tmp_path: Path, **env: str) -> dict:
    shim, argv = tmp_path / "python", tmp_path / "trainer_argv"
    shim.write_text(
        '#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "omni_async.trainer.main" ]; then\n'
        f'  shift 2; for a in "$@"; do printf "%s\\n" "$a"; done > "{argv}"; exit 0\nfi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    shim.chmod(0o755)
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHON": str(shim),
            "DATA_DIR": str(tmp_path / "data"),
            "RUN_DIR": str(tmp_path / "run"),
            **env,
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return trainer_config(argv.read_text().splitlines())


@pytest.mark.parametrize(("gpus", "nodes"), [(4, 1), (8, 2)])
def test_gpu_recipe_composes_and_validates(gpus, nodes, tmp_path):
    """The README's GPU command: 4 actor/rollout GPUs (hybrid: one worker each), 1 reward GPU, real weights; and
    the same on two nodes of 8 GPUs each."""
    cfg = run_example(
        "run_qwen_image_ocr_async_reward.sh",
        tmp_path,
        MODEL_PATH="/models/Qwen-Image",
        NUM_GPUS_ACTOR_ROLLOUT=str(gpus),
        NUM_GPUS_REWARD="1",
        NNODES=str(nodes),
    )
    arr = cfg["actor_rollout_ref"]
    ranks = gpus * nodes
    assert arr["model"]["path"] == "/models/Qwen-Image" and arr["hybrid_engine"] is True
    assert cfg["trainer"]["n_gpus_per_node"] == gpus and cfg["trainer"]["nnodes"] == nodes
    assert arr["rollout"]["agent"]["num_workers"] == ranks  # hybrid: one rollout worker per actor device
    assert cfg["reward"]["reward_model"]["enable_resource_pool"] is True
    assert cfg["reward"]["reward_model"]["n_gpus_per_node"] == 1
    assert (arr["rollout"]["pipeline"]["height"], arr["rollout"]["pipeline"]["width"]) == (512, 512)
    assert arr["model"]["lora_rank"] == 64
    # Every actor rank trains whole groups in every mini-batch: no rank pads (ppo_mini_batch_size counts prompts).
    mini, batch = arr["actor"]["ppo_mini_batch_size"], cfg["data"]["train_batch_size"]
    assert mini % ranks == 0 and batch % mini == 0 and batch >= 16
    # Memory settings the README's GPU section explains.
    assert arr["actor"]["fsdp_config"]["model_dtype"] == "bfloat16"
    assert arr["model"]["enable_gradient_checkpointing"] is True
    # Micro-batch 4 at 512² (bench/results/gpu_step_nvidia_h200_mb4.json: -32 % update time, 65 GB peak).
    assert arr["actor"]["ppo_micro_batch_size_per_gpu"] == 4 == arr["rollout"]["log_prob_micro_batch_size_per_gpu"]
    # pi_old is the rollout's log-probs (the H200 recompute gave them back to 1.2e-7 at 10 % of the step)
    assert cfg["algorithm"]["rollout_correction"]["bypass_mode"] is True


def test_gpu_recipe_nft_is_verl_omnis_nft_recipe(tmp_path):
    """``ALGO=diffusion_nft`` with real weights composes verl-omni's Qwen-Image DiffusionNFT recipe
    (examples/diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh): CFG-free, its old-policy schedule and
    interval, reference KL, clip, group size, lr, weight decay and LoRA targets; Flow-GRPO keeps CFG 4."""
    cfg = run_example(
        "run_qwen_image_ocr_async_reward.sh", tmp_path, MODEL_PATH="/models/Qwen-Image", ALGO="diffusion_nft"
    )
    arr, algo = cfg["actor_rollout_ref"], cfg["algorithm"]
    loss = arr["actor"]["diffusion_loss"]
    assert arr["rollout"]["pipeline"]["true_cfg_scale"] == 1.0
    assert (algo["old_policy_decay_schedule"], algo["old_policy_update_interval"]) == ("delayed_linear_to_0_999", 2)
    assert (loss["ref_kl_coef"], loss["clip_ratio"], loss["adv_clip_max"], loss["mix_beta"]) == (1e-4, 1e-5, 5.0, 0.1)
    assert arr["rollout"]["n"] == 16 and algo["timestep_fraction"] == 1.0 and algo["adv_mode"] == "continuous"
    assert arr["actor"]["optim"]["lr"] == 3e-4 and arr["actor"]["optim"]["weight_decay"] == 1e-4
    assert (arr["model"]["lora_rank"], arr["model"]["lora_alpha"]) == (64, 128)
    assert set(arr["model"]["target_modules"]) == {
        *("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        *("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    }
    (tmp_path / "grpo").mkdir()
    grpo = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "grpo", MODEL_PATH="/models/Qwen-Image")
    assert grpo["actor_rollout_ref"]["rollout"]["pipeline"]["true_cfg_scale"] == 4.0


def test_gpu_recipe_awm_is_its_authors_ocr_recipe(tmp_path):
    """``ALGO=awm`` with real weights composes the AWM authors' OCR recipe (config/dgx_awm.py,
    ocr_sd3_no_cfg_1node): CFG-free, groups of 24, LoRA r32 / alpha 64 on the eight attention projections, lr 3e-4,
    the batch's advantage std, reference KL 0.003, clip 1, the EMA anchor decayed linearly to 0.3."""
    cfg = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path, MODEL_PATH="/models/Qwen-Image", ALGO="awm")
    arr, algo = cfg["actor_rollout_ref"], cfg["algorithm"]
    loss = arr["actor"]["diffusion_loss"]
    assert arr["model"]["algorithm"] == "awm" and arr["rollout"]["pipeline"]["true_cfg_scale"] == 1.0
    assert arr["rollout"]["n"] == 24 and (arr["model"]["lora_rank"], arr["model"]["lora_alpha"]) == (32, 64)
    assert set(arr["model"]["target_modules"]) == {
        *("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    }
    assert arr["actor"]["optim"]["lr"] == 3e-4 and algo["global_std"] is True
    assert (loss["ref_kl_coef"], loss["clip_ratio"], loss["old_kl_coef"]) == (0.003, 1.0, 1.0)
    assert loss["adv_clip_max"] == 5.0  # with their advantage_max 1: advantages scaled to [-1, 1]
    assert algo["old_policy_decay_schedule"] == "linear_to_0_3"


def test_gpu_recipe_without_a_reward_gpu_scores_ocr_on_cpu_actors(tmp_path):
    """NUM_GPUS_REWARD=0: no reward pool (no device reserved for a CPU scorer); OCR workers are CPU actors."""
    cfg = run_example(
        "run_qwen_image_ocr_async_reward.sh",
        tmp_path,
        MODEL_PATH="/models/Qwen-Image",
        NUM_GPUS_ACTOR_ROLLOUT="4",
        NUM_GPUS_REWARD="0",
    )
    assert cfg["reward"]["reward_model"]["enable_resource_pool"] is False and cfg["reward"]["num_workers"] == 2


def test_text_gpu_command_composes_and_validates(tmp_path):
    """The text example's header command for 8 GPUs."""
    cfg = run_example(
        "run_text_grpo_async_reward.sh",
        tmp_path,
        MODEL_PATH="/models/Qwen2.5-3B-Instruct",
        NUM_GPUS_ACTOR_ROLLOUT="8",
        STEPS="200",
        BATCH="64",
        GROUP="8",
        RESPONSE_LENGTH="1024",
    )
    mini = cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]
    assert cfg["trainer"]["n_gpus_per_node"] == 8 and mini % 8 == 0 and 64 % mini == 0


@pytest.mark.parametrize("script", ["run_qwen_image_ocr_async_reward.sh", "run_text_grpo_async_reward.sh"])
def test_cpu_defaults_compose_and_validate(script, tmp_path):
    cfg = run_example(script, tmp_path)
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["actor_rollout_ref"]["model"]["path"].startswith("tiny:")


def test_algo_picks_the_loss_with_verl_omnis_keys(tmp_path):
    """``ALGO=diffusion_nft``: the main job with DiffusionNFT in verl-omni's spelling and its tuned settings (no SDE
    window keys: the loss does not read them); the default stays Flow-GRPO with its window; an unknown ALGO stops
    the script naming the choices."""
    (tmp_path / "grpo").mkdir()
    (tmp_path / "nft").mkdir()
    default = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "grpo")
    assert default["actor_rollout_ref"]["actor"]["diffusion_loss"]["loss_mode"] == "flow_grpo"
    assert default["actor_rollout_ref"]["rollout"]["algo"]["sde_window_range"] == [0, 4]
    cfg = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "nft", ALGO="diffusion_nft")
    arr = cfg["actor_rollout_ref"]
    assert (
        arr["model"]["algorithm"] == "diffusion_nft" and arr["actor"]["diffusion_loss"]["loss_mode"] == "diffusion_nft"
    )
    assert arr["rollout"]["rollout_adapter"] == "old" and arr["model"]["policy_state_adapters"] == ["default", "old"]
    assert arr["actor"]["optim"]["lr"] == 7e-3 and cfg["algorithm"]["trainer_type"] == "direct_preference"  # swept
    assert arr["actor"]["diffusion_loss"]["mix_beta"] == 0.2
    # the references' settings scaled to the CPU job: every step trained, the batch's std (so no update pipeline),
    # verl-omni's groups of 16, 4 optimizer steps per step of 8 prompts, the delayed ramp compressed to the job's
    # length; 4 seeds per held-out word
    assert cfg["algorithm"]["timestep_fraction"] == 1.0 and cfg["algorithm"]["global_std"] is True
    assert (
        arr["rollout"]["n"] == 16
        and cfg["data"]["train_batch_size"] == 8
        and default["actor_rollout_ref"]["rollout"]["n"] == 8
    )
    assert cfg["async_reward"]["update_pipeline"] is False and arr["actor"]["ppo_mini_batch_size"] == 2
    assert cfg["algorithm"]["old_policy_decay_schedule"] == "delayed_linear_to_0_999_x15"
    assert arr["rollout"]["val_kwargs"]["n"] == 4 and cfg["data"]["val_batch_size"] == 19
    # Flow-GRPO keeps the pipelined update with each group's std
    assert default["algorithm"]["global_std"] is False and default["async_reward"]["update_pipeline"] is True
    assert arr["rollout"]["algo"]["sde_window_range"] != [0, 4]  # the window keys are Flow-GRPO's only
    (tmp_path / "awm").mkdir()
    awm = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "awm", ALGO="awm")
    assert awm["actor_rollout_ref"]["actor"]["diffusion_loss"]["loss_mode"] == "awm"
    assert awm["actor_rollout_ref"]["actor"]["diffusion_loss"]["old_kl_coef"] == 1.0
    assert awm["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-3
    assert awm["actor_rollout_ref"]["rollout"]["rollout_adapter"] == "default"  # the live weights sample
    (tmp_path / "dpo").mkdir()
    dpo = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "dpo", ALGO="dpo")
    assert dpo["actor_rollout_ref"]["actor"]["diffusion_loss"]["loss_mode"] == "dpo"
    assert dpo["algorithm"]["paired_preference"] is True and dpo["actor_rollout_ref"]["model"]["lora_rank"] > 0
    assert dpo["actor_rollout_ref"]["actor"]["diffusion_loss"]["dpo_beta"] == 100.0  # verl-omni's recipes'
    (tmp_path / "dance").mkdir()
    dance = run_example("run_qwen_image_ocr_async_reward.sh", tmp_path / "dance", ALGO="dance_grpo")
    algo = dance["actor_rollout_ref"]["rollout"]["algo"]
    assert dance["actor_rollout_ref"]["actor"]["diffusion_loss"]["loss_mode"] == "dance_grpo"
    assert algo["sde_type"] == "dance_sde" and algo["noise_level"] == 1.2  # verl-omni's recipe's
    assert algo["sde_window_range"] == [0, 4] and dance["algorithm"]["adv_estimator"] == "dance_grpo"  # the job's
    bad = subprocess.run(
        ["bash", str(ROOT / "examples/run_qwen_image_ocr_async_reward.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "ALGO": "ppo", "PYTHON": "/bin/false", "DATA_DIR": str(tmp_path / "data")},
    )
    assert bad.returncode == 2 and "ALGO=ppo: use flow_grpo, dance_grpo, diffusion_nft, awm or dpo" in bad.stderr
