#!/usr/bin/env bash
# LLM GRPO with a slow reward, through the same pipeline as the diffusion recipe: each finished response is
# streamed to reward-loop workers while the rest of the batch generates.
#
# With no arguments, on a CPU box: trains tiny:qwen2 (random weights, built offline) on a synthetic GSM8K-format
# arithmetic set with verl's GSM8K rule reward for a few steps and prints the run directory. On GPUs / with a
# real model (a local HF causal-LM dir), e.g.:
#   MODEL_PATH=/models/Qwen2.5-3B-Instruct NUM_GPUS_ACTOR_ROLLOUT=8 STEPS=200 BATCH=64 GROUP=8 RESPONSE_LENGTH=1024 \
#     bash examples/run_text_grpo_async_reward.sh
# (MINI_BATCH, prompts per optimizer step, defaults to one per actor GPU, at least 2.)
# A reward a random tiny model can learn on CPU (the README's text curve, about 1 min):
#   STEPS=30 VAL_FREQ=5 bash examples/run_text_grpo_async_reward.sh \
#     reward.custom_reward_function.name=compute_score_digits actor_rollout_ref.actor.optim.lr=2e-3 \
#     trainer.val_before_train=True
# A slow remote judge: pass its reward function and overlap strategies through, e.g.
#   bash examples/run_text_grpo_async_reward.sh reward.custom_reward_function.path=my_judge.py \
#     async_reward.one_step_off_policy=true async_reward.update_pipeline=true
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

MODEL_PATH="${MODEL_PATH:-tiny:qwen2}"
NUM_GPUS_ACTOR_ROLLOUT="${NUM_GPUS_ACTOR_ROLLOUT:-1}"
NUM_REWARD_WORKERS="${NUM_REWARD_WORKERS:-1}"
DATA_DIR="${DATA_DIR:-$root/data/arith}"
RUN_DIR="${RUN_DIR:-$root/runs/text_grpo}"
STEPS="${STEPS:-4}"
BATCH="${BATCH:-4}"
GROUP="${GROUP:-4}"
RESPONSE_LENGTH="${RESPONSE_LENGTH:-32}"
# Prompts per optimizer step: at least one group per actor GPU (a group is never split across GPUs).
MINI_BATCH="${MINI_BATCH:-$(( NUM_GPUS_ACTOR_ROLLOUT > 2 ? NUM_GPUS_ACTOR_ROLLOUT : 2 ))}"

if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PYTHON" "$root/examples/data/prepare_arithmetic.py" --out-dir "$DATA_DIR"
fi

"$PYTHON" -m omni_async.trainer.main --config-name grpo_text_trainer \
  data.train_files="$DATA_DIR/train.jsonl" \
  data.val_files="$DATA_DIR/val.jsonl" \
  data.train_batch_size="$BATCH" \
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.rollout.n="$GROUP" \
  actor_rollout_ref.rollout.response_length="$RESPONSE_LENGTH" \
  actor_rollout_ref.rollout.agent.num_workers="$NUM_GPUS_ACTOR_ROLLOUT" \
  trainer.n_gpus_per_node="$NUM_GPUS_ACTOR_ROLLOUT" \
  reward.streaming=auto \
  reward.num_workers="$NUM_REWARD_WORKERS" \
  trainer.total_training_steps="$STEPS" \
  trainer.test_freq="${VAL_FREQ:-$STEPS}" \
  trainer.run_dir="$RUN_DIR" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "$@"
