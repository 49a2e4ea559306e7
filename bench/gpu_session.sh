#!/usr/bin/env bash
# One prepared GPU session for issues 49 and 50, run from the repository root on a GPU machine that has only
# PyTorch, transformers and accelerate, with the kit's parts carried (.gpu_kit/py3.12, one part when packed with
# `--have requirements/cuda-image-packages.txt`):
#
#   OUT=/some/dir BUDGET_S=540 bash bench/gpu_session.sh STEP...
#
# The kit is installed into .gpu_kit/prefix first (kept between calls on a warm machine: a later call carries no
# parts). Steps, run in the order given:
#   recipe     the recipe through the entry point on random:qwen_image (scripts/gpu_kit.sh run recipe) and its
#              bench/gpu_product.py summary (GPU-s per trained image, peak GiB per phase, the time split)
#   fg16       bench/gpu_step.py (no Ray): Flow-GRPO, rollout batch 16, update micro-batch 4, clip 1e-5
#   fg8        the same at batch 8, micro-batch 8 (is the per-sample update time non-increasing from 4 to 8?)
#   nft        DiffusionNFT's step (verl-omni's recipe: all 10 steps, no CFG), micro-batch 4
#   fg16-compile / fg16-cudnn / fg16-efficient   fg16 with regional torch.compile, or diffusers' cuDNN / memory-
#              efficient SDPA backend (both take Qwen-Image's text mask): speed and the first update's ratio at 1e-5
#   tier+main  the GPU tier (pytest -m gpu) and the main job (tiny renderer, 20 steps: must learn), side by side
# Each step has its own time limit and the session its budget (BUDGET_S): a step cut short is recorded as such and
# the next one runs. Everything lands in $OUT: session.log, one JSON per step.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/.gpu_kit/session}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 GPU_KIT_PREFIX="$root/.gpu_kit/prefix" GPU_KIT_OUT="$root/.gpu_kit/out"
budget_end=$((SECONDS + ${BUDGET_S:-540}))

step() {  # step NAME LIMIT_S CMD...: run CMD with at most LIMIT_S seconds, never past the session's budget
  local name="$1" limit="$2"
  shift 2
  local left=$((budget_end - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then
    echo "[session] $name: skipped, $left s of the budget left"
    return
  fi
  echo "[session] $name: start (limit $limit s) $(date +%T)"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  echo "[session] $name: rc $? in $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [[ ! -f "$GPU_KIT_PREFIX/.omni_async_kit.json" ]]; then
  step install 90 bash scripts/gpu_kit.sh run import
  cp "$GPU_KIT_OUT/gpu_kit_run.json" "$OUT/kit_import.json" 2>/dev/null
  tail -n 20 "$GPU_KIT_OUT/gpu_kit_run.log"
fi
export PYTHONPATH="$GPU_KIT_PREFIX:$root" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

for what in "$@"; do
  case "$what" in
    recipe)
      step recipe 180 bash scripts/gpu_kit.sh run recipe
      tail -n 80 "$GPU_KIT_OUT/gpu_kit_run.log"
      python3 bench/gpu_product.py "$GPU_KIT_OUT/recipe" --out "$OUT/gpu_product.json" --label "recipe, random:qwen_image"
      ;;
    fg16) step fg16 120 python3 bench/gpu_step.py --batch 16 --micro-batch 4 --out "$OUT/gpu_step_fg_b16_mb4.json" ;;
    fg16-compile) step fg16-compile 240 python3 bench/gpu_step.py --batch 16 --micro-batch 4 --compile \
                    --out "$OUT/gpu_step_fg_b16_mb4_compile.json" ;;
    fg16-cudnn | fg16-efficient)
      backend="_native_${what#fg16-}"
      step "$what" 120 python3 bench/gpu_step.py --batch 16 --micro-batch 4 --attn-backend "$backend" \
        --out "$OUT/gpu_step_fg_b16_mb4_${what#fg16-}.json" ;;
    fg8) step fg8 90 python3 bench/gpu_step.py --batch 8 --micro-batch 8 --out "$OUT/gpu_step_fg_b8_mb8.json" ;;
    nft) step nft 80 python3 bench/gpu_step.py --loss diffusion_nft --batch 4 --micro-batch 4 \
           --out "$OUT/gpu_step_nft_b4_mb4.json" ;;
    tier+main)
      GPU_KIT_OUT="$root/.gpu_kit/out_tier" step tier 200 bash scripts/gpu_kit.sh run tier &
      tier_pid=$!
      GPU_KIT_OUT="$root/.gpu_kit/out_main" step main 200 bash scripts/gpu_kit.sh run main
      # this job only: a bare `wait` also waits for the log's tee (the exec's process substitution), which never
      # ends (the H200 session of 2026-11-27 hung there until its call's limit)
      wait "$tier_pid"
      for d in out_tier out_main; do
        cp "$root/.gpu_kit/$d/gpu_kit_run.json" "$OUT/kit_${d#out_}.json" 2>/dev/null
        tail -n 40 "$root/.gpu_kit/$d/gpu_kit_run.log"
      done
      python3 bench/gpu_product.py "$root/.gpu_kit/out_main/main" --out "$OUT/gpu_main.json" --label "main job, tiny"
      ;;
    *) echo "[session] unknown step $what (recipe, fg16, fg16-compile, fg16-cudnn, fg16-efficient, fg8, nft, tier+main)" ;;
  esac
done
echo "[session] done at $SECONDS s"
