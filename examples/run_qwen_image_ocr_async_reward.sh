#!/usr/bin/env bash
# Main job: FlowGRPO LoRA training of Qwen-Image with the OCR reward.
#
# Each finished image is streamed to OCR reward-loop workers on their own Ray resource pool while the rest of
# the batch generates; when rollout returns the batch already holds rm_scores and the trainer skips its
# colocated reward phase.
#
# With no arguments, on a CPU box: trains tiny:qwen_image (random weights, built offline) for a few steps with a
# dedicated (logical) reward device and prints the run directory. On GPUs, point it at real weights and size the
# pools with env variables (the VeRL-Omni async-reward layout: 4 actor/rollout GPUs + 1 reward GPU):
#   MODEL_PATH=/models/Qwen-Image NUM_GPUS_ACTOR_ROLLOUT=4 NUM_GPUS_REWARD=1 HEIGHT=512 WIDTH=512 NUM_STEPS=10 \
#     STEPS=300 BATCH=16 GROUP=8 bash examples/run_qwen_image_ocr_async_reward.sh
# Extra Hydra overrides pass through, e.g. the colocated comparison:
#   bash examples/run_qwen_image_ocr_async_reward.sh reward.reward_model.enable_resource_pool=False
# or the sync baseline: ... reward.streaming=false
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

MODEL_PATH="${MODEL_PATH:-tiny:qwen_image}"
NUM_GPUS_ACTOR_ROLLOUT="${NUM_GPUS_ACTOR_ROLLOUT:-1}"
NUM_GPUS_REWARD="${NUM_GPUS_REWARD:-1}"
NNODES="${NNODES:-1}"
DATA_DIR="${DATA_DIR:-$root/data/ocr}"
RUN_DIR="${RUN_DIR:-$root/runs/qwen_image_ocr}"
STEPS="${STEPS:-4}"
HEIGHT="${HEIGHT:-64}"
WIDTH="${WIDTH:-64}"
NUM_STEPS="${NUM_STEPS:-10}"
BATCH="${BATCH:-4}"
GROUP="${GROUP:-4}"

if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PYTHON" "$root/examples/data/prepare_ocr_prompts.py" --out-dir "$DATA_DIR"
fi

"$PYTHON" -m omni_async.trainer.main \
  data.train_files="$DATA_DIR/train.jsonl" \
  data.val_files="$DATA_DIR/val.jsonl" \
  data.train_batch_size="$BATCH" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.rollout.n="$GROUP" \
  actor_rollout_ref.rollout.height="$HEIGHT" \
  actor_rollout_ref.rollout.width="$WIDTH" \
  actor_rollout_ref.rollout.num_inference_steps="$NUM_STEPS" \
  actor_rollout_ref.rollout.agent.num_workers="$NUM_GPUS_ACTOR_ROLLOUT" \
  trainer.n_gpus_per_node="$NUM_GPUS_ACTOR_ROLLOUT" \
  trainer.nnodes="$NNODES" \
  reward.streaming=auto \
  reward.reward_model.enable_resource_pool=True \
  reward.reward_model.n_gpus_per_node="$NUM_GPUS_REWARD" \
  reward.num_workers="$NUM_GPUS_REWARD" \
  reward.custom_reward_function.path=pkg://omni_async.reward.scorers.ocr \
  reward.custom_reward_function.name=compute_score \
  trainer.total_training_steps="$STEPS" \
  trainer.test_freq="$STEPS" \
  trainer.run_dir="$RUN_DIR" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "$@"
