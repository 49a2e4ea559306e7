#!/usr/bin/env bash
# Main job: FlowGRPO LoRA training of Qwen-Image with the OCR reward.
#
# Each finished image is streamed to OCR reward-loop workers on their own Ray resource pool while the rest of
# the batch generates; when rollout returns the batch already holds rm_scores and the trainer skips its
# colocated reward phase.
#
# With no arguments, on a CPU box: LoRA-trains tiny:qwen_image_text_bimodal (a tiny Qwen-Image shipped in the repo
# that draws short strings such as Text "K4" legibly or, for the same prompt, too faint for OCR, about half each) on
# prompts in its vocabulary, with a dedicated (logical) reward device running PP-OCR, for 20 steps of 8 prompts x 8
# samples (about 3 min measured on 2 quiet CPU cores, when validation read each held-out word once); the OCR reward
# rises as the policy moves samples to the legible mode (README, "The main job on CPU": measured curves). The run
# writes plots/reward.png (reward per step, validation on the 19 held-out words x 4 seeds before training and every
# 10 steps) and sample grids, and prints the run directory.
# MODEL_PATH=tiny:qwen_image_text runs the same recipe on the previous renderer, whose reward did not rise. On GPUs,
# point it at real weights and size the pools with env
# variables (the VeRL-Omni async-reward layout: 4 actor/rollout GPUs + 1 reward GPU):
#   MODEL_PATH=/models/Qwen-Image NUM_GPUS_ACTOR_ROLLOUT=4 NUM_GPUS_REWARD=1 bash examples/run_qwen_image_ocr_async_reward.sh
# PP-OCR reads on the reward GPU when onnxruntime has CUDA (pip uninstall -y onnxruntime && pip install
# onnxruntime-gpu), else on its CPU with a warning that the GPU idles; NUM_GPUS_REWARD=0 reserves no reward GPU and
# runs NUM_REWARD_WORKERS (default 2) OCR workers on CPU.
# A real MODEL_PATH selects the GPU recipe: 512x512, 10 denoising steps, 300 steps of 16 prompts x 8 samples, LoRA
# r64 on the eight attention projections, bf16 frozen weights, gradient checkpointing, micro-batch 4 up to 512x512
# and 1 above (MICRO_BATCH; 4 cut the update by 32 % on an H200 at 65 GB peak, docs/gpu_and_memory.md),
# true CFG 4 (CFG; ALGO=diffusion_nft: verl-omni's NFT recipe instead, CFG-free, groups of 16, LoRA on the MLPs too,
# old policy delayed_linear_to_0_999 every 2 steps, reference KL 1e-4; ALGO=awm: its authors' OCR recipe, CFG-free,
# groups of 24, LoRA r32 on the attention); each is an env variable or a Hydra override. One hybrid worker per actor GPU; each optimizer
# step takes 2 prompts (groups) per actor GPU (MINI_BATCH, default 2 x NUM_GPUS_ACTOR_ROLLOUT x NNODES: a group is
# never split across GPUs, so fewer groups than GPUs would leave GPUs idle; BATCH is rounded up to a multiple).
# Also: LR, LORA_RANK, LORA_ALPHA, NOISE_LEVEL, VAL_FREQ (validation every N steps), STEPS, BATCH, GROUP; on the
# tiny renderers WINDOW_SIZE, WINDOW_RANGE, NUM_VAL (held-out words), VAL_N (validation seeds per word, 4),
# PIPELINE (the pipelined update), GLOBAL_STD (the batch's advantage std); VOCAB (scenes | tiny_text_bimodal |
# tiny_text: the prompt set examples/data/prepare_ocr_prompts.py writes into DATA_DIR when it has no train.jsonl).
# ALGO picks the loss (default flow_grpo): ALGO=diffusion_nft trains with DiffusionNFT in verl-omni's spelling (the
# old adapter samples, ODE, final images only; NFT_LR, MIX_BETA, TIMESTEP_FRACTION, OLD_DECAY_SCHEDULE,
# OLD_UPDATE_INTERVAL). On the tiny renderer its defaults are the references' settings scaled to this job (issue 51):
# every denoising step trained, the batch's advantage std (so no update pipeline), mini-batches of 4 prompts (2
# optimizer steps a step), the old policy copied for 5 steps then decayed (delayed_linear_to_0_999_x15), lr 1e-2
# from a sweep of 3e-4 / 1e-3 / 3e-3 / 1e-2 (docs/diffusion_nft.md, "Learning", with the measured curves against
# Flow-GRPO and AWM). ALGO=awm trains with advantage-weighted matching (AWM_LR). ALGO=dpo trains with Diffusion-DPO
# in verl-omni's online spelling (each group's best and worst image as a pair; DPO_LR, DPO_BETA). ALGO=dance_grpo
# trains with DanceGRPO (its SDE step on Flow-GRPO's window and loss; NOISE_LEVEL 1.2, its recipe's). Any of their keys
# also works as a plain override. The resolved config is written to $RUN_DIR/config.yaml.
# Extra Hydra overrides pass through, e.g. the colocated comparison:
#   bash examples/run_qwen_image_ocr_async_reward.sh reward.reward_model.enable_resource_pool=False
# or the sync baseline: ... reward.streaming=false
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

MODEL_PATH="${MODEL_PATH:-tiny:qwen_image_text_bimodal}"
NUM_GPUS_ACTOR_ROLLOUT="${NUM_GPUS_ACTOR_ROLLOUT:-1}"
NUM_GPUS_REWARD="${NUM_GPUS_REWARD:-1}"
NNODES="${NNODES:-1}"
RUN_DIR="${RUN_DIR:-$root/runs/qwen_image_ocr}"
NUM_STEPS="${NUM_STEPS:-10}"
ACTOR_RANKS=$((NUM_GPUS_ACTOR_ROLLOUT * NNODES))  # data-parallel actor ranks, one per actor/rollout device
if (( NUM_GPUS_REWARD > 0 )); then
  # One OCR reward worker per reward GPU; PP-OCR reads on it (onnxruntime's CUDA provider, onnxruntime-gpu).
  REWARD_POOL=(reward.reward_model.enable_resource_pool=True reward.reward_model.n_gpus_per_node="$NUM_GPUS_REWARD"
               reward.num_workers="$NUM_GPUS_REWARD")
else
  # No reward GPU: OCR workers as CPU actors beside the trainer (streaming still on), no device reserved.
  REWARD_POOL=(reward.reward_model.enable_resource_pool=False reward.num_workers="${NUM_REWARD_WORKERS:-2}")
fi
ALGO="${ALGO:-flow_grpo}"
[[ "$ALGO" == dance_grpo ]] && NOISE_LEVEL="${NOISE_LEVEL:-1.2}"  # verl-omni's DanceGRPO recipe's eta
GPU_RECIPE=()
CPU_RECIPE=()
WINDOW_KEYS=()  # Flow-GRPO's SDE window on the tiny renderers
if [[ "$MODEL_PATH" != tiny:* ]]; then
  # Real weights: the GPU recipe. Memory settings from the memory plan (README, "GPU"): bf16 frozen weights,
  # checkpointed transformer blocks, one sample per forward/backward (fits 80 GB at 512^2 with CFG and LoRA r64),
  # LoRA on all eight attention projections of the dual-stream blocks, as verl-omni's Qwen-Image recipe.
  HEIGHT="${HEIGHT:-512}"
  WIDTH="${WIDTH:-512}"
  if [[ "$ALGO" == awm ]]; then
    # The AWM authors' OCR recipe (config/dgx_awm.py, ocr_sd3_no_cfg_1node): CFG-free, groups of 24, LoRA r32 /
    # alpha 64 on the attention projections (the targets below); the batch's advantage std is the config's default.
    CFG="${CFG:-1.0}"
    GROUP="${GROUP:-24}"
    LORA_RANK="${LORA_RANK:-32}"
    LORA_ALPHA="${LORA_ALPHA:-64}"
  fi
  LORA_RANK="${LORA_RANK:-64}"
  LORA_ALPHA="${LORA_ALPHA:-128}"
  (( HEIGHT * WIDTH <= 512 * 512 )) && MICRO_BATCH="${MICRO_BATCH:-4}"
  [[ "$ALGO" == dpo ]] && MICRO_BATCH="${MICRO_BATCH:-2}"  # a (chosen, rejected) pair per micro-batch at least
  TARGETS="to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"
  if [[ "$ALGO" == diffusion_nft ]]; then
    # verl-omni's Qwen-Image DiffusionNFT recipe (examples/diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh),
    # as NVlabs train it: CFG-free (true_cfg_scale 1), groups of 16, LoRA also on the blocks' MLPs.
    CFG="${CFG:-1.0}"
    GROUP="${GROUP:-16}"
    TARGETS="$TARGETS,img_mlp.net.0.proj,img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2"
  fi
  GPU_RECIPE=(
    actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="${MICRO_BATCH:-1}"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="${MICRO_BATCH:-1}"
    "actor_rollout_ref.model.target_modules=[$TARGETS]"
    actor_rollout_ref.rollout.pipeline.true_cfg_scale="${CFG:-4.0}"
  )
  if [[ "$ALGO" == flow_grpo || "$ALGO" == dance_grpo ]]; then
    # pi_old = the rollout's own log-probs (verl's bypass mode), not a recompute: in lock-step they are the same
    # weights, and on an H200 the recompute gave them back to 1.2e-7 in bf16 while costing 10 % of the step
    # (1.74 of 16.7 s; docs/gpu_and_memory.md). BYPASS=false recomputes, as verl-omni's recipe does.
    GPU_RECIPE+=(algorithm.rollout_correction.bypass_mode="${BYPASS:-true}")
  fi
fi
HEIGHT="${HEIGHT:-64}"
WIDTH="${WIDTH:-64}"
if [[ "$MODEL_PATH" == tiny:qwen_image_text* ]]; then
  # The CPU default (and, with MODEL_PATH=tiny:qwen_image_text, its control): prompts in the tiny renderer's
  # vocabulary, all its held-out words for validation, the SDE window on the first denoising steps, where the noise
  # still decides whether the text comes out legible (README, "The main job on CPU").
  [[ "$MODEL_PATH" == tiny:qwen_image_text ]] && VOCAB="${VOCAB:-tiny_text}"
  VOCAB="${VOCAB:-tiny_text_bimodal}"
  STEPS="${STEPS:-20}"
  BATCH="${BATCH:-8}"
  # DiffusionNFT: verl-omni's NFT group size (its groups of 8 turn uniform within a few steps here; issue 51's
  # fifth pass, docs/diffusion_nft.md)
  [[ "$ALGO" == diffusion_nft ]] && GROUP="${GROUP:-16}"
  GROUP="${GROUP:-8}"
  LR="${LR:-2e-3}"
  NOISE_LEVEL="${NOISE_LEVEL:-0.7}"
  VAL_FREQ="${VAL_FREQ:-$(( STEPS / 2 ))}"  # validation before training, half-way and at the end
  NUM_VAL="${NUM_VAL:-19}"
  VAL_N="${VAL_N:-4}"  # validation samples (seeds) per held-out word: 19 x 4 reads, so a level moves in 1/76 steps
  # What follows changes the cost, not the learning (the same curves, measured: README, "The main job on CPU").
  # The update runs beside generation: a rollout replica generates the step's samples while the actor already
  # trains on the groups scored so far (split layout, pipelined update; the hybrid layout runs both on one thread),
  # so the update and generation use both cores instead of taking turns. One onnxruntime thread per OCR read (its
  # default spins a thread per core for every concurrent read, taking the CPU from generation); the VAE decodes a
  # batch at once (a 64x64 image needs no slicing); one timeline, the last step's, instead of a figure per step.
  WINDOW_KEYS=(actor_rollout_ref.rollout.algo.sde_window_size="${WINDOW_SIZE:-4}"
               "actor_rollout_ref.rollout.algo.sde_window_range=${WINDOW_RANGE:-[0,4]}")
  # Each group's own advantage std (the pipeline trains groups before the batch exists), with the pipeline or not;
  # DiffusionNFT as its references: the batch's std, so the update waits for the step's batch (no pipeline).
  if [[ "$ALGO" == diffusion_nft ]]; then PIPELINE="${PIPELINE:-false}" GLOBAL_STD="${GLOBAL_STD:-true}"; fi
  CPU_RECIPE=(trainer.val_before_train=True data.val_batch_size="$NUM_VAL"
              actor_rollout_ref.rollout.val_kwargs.n="$VAL_N"
              actor_rollout_ref.hybrid_engine="${HYBRID:-false}" async_reward.update_pipeline="${PIPELINE:-true}"
              algorithm.global_std="${GLOBAL_STD:-false}"
              +reward.custom_reward_function.reward_kwargs.intra_op_num_threads="${OCR_THREADS:-1}"
              actor_rollout_ref.rollout.pipeline.vae_slicing=false
              trainer.log_timeline_freq="${TIMELINE_FREQ:-$STEPS}")
elif [[ "$MODEL_PATH" == tiny:* ]]; then
  VOCAB="${VOCAB:-scenes}"
  STEPS="${STEPS:-4}"
  BATCH="${BATCH:-4}"
  GROUP="${GROUP:-4}"
  LR="${LR:-3e-4}"
  NOISE_LEVEL="${NOISE_LEVEL:-0.7}"
else
  VOCAB="${VOCAB:-scenes}"
  STEPS="${STEPS:-300}"
  MINI_BATCH="${MINI_BATCH:-$((2 * ACTOR_RANKS))}"
  BATCH="${BATCH:-$(( (16 + MINI_BATCH - 1) / MINI_BATCH * MINI_BATCH ))}"
  GROUP="${GROUP:-8}"
  LR="${LR:-3e-4}"
  NOISE_LEVEL="${NOISE_LEVEL:-0.7}"
fi
ALGO_RECIPE=()
case "$ALGO" in
  flow_grpo) ALGO_RECIPE=(${WINDOW_KEYS[@]+"${WINDOW_KEYS[@]}"}) ;;
  diffusion_nft)
    # verl-omni's DiffusionNFT keys (examples/diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh), values
    # tuned on the CPU main job (docs/diffusion_nft.md, "Learning"); the SDE window keys are not read.
    # On the tiny renderer the references' settings scaled to the job (docs/diffusion_nft.md, "Learning"): all 10
    # steps per sample, the batch's std (above), groups of 16 (above), 4 optimizer steps per step of 8 prompts
    # (mini-batches of 2), the old policy copied for 5 steps then decayed (delayed_linear_to_0_999 15x faster), lr
    # and beta from five sweeps (bench/results/nft_main_job_sweep.json); on real weights verl-omni's recipe.
    if [[ "$MODEL_PATH" == tiny:* ]]; then
      NFT_LR="${NFT_LR:-7e-3}"
      MINI_BATCH="${MINI_BATCH:-2}"
      MIX_BETA="${MIX_BETA:-0.2}"
      OLD_DECAY_SCHEDULE="${OLD_DECAY_SCHEDULE:-delayed_linear_to_0_999_x15}"
    fi
    LR="${NFT_LR:-$LR}"
    NFT_GPU=()
    if [[ "$MODEL_PATH" != tiny:* ]]; then
      # Real weights: the rest of verl-omni's recipe (its old-policy schedule, reference KL, clip, weight decay).
      OLD_DECAY_SCHEDULE="${OLD_DECAY_SCHEDULE:-delayed_linear_to_0_999}"
      OLD_UPDATE_INTERVAL="${OLD_UPDATE_INTERVAL:-2}"
      NFT_GPU=(actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.0001
        actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5 actor_rollout_ref.actor.diffusion_loss.adv_clip_max=5.0
        actor_rollout_ref.actor.optim.weight_decay=0.0001 algorithm.adv_mode=continuous)
    fi
    ALGO_RECIPE=(actor_rollout_ref.model.algorithm=diffusion_nft actor_rollout_ref.model.model_type=diffusion_nft_model
      'actor_rollout_ref.model.policy_state_adapters=["default","old"]'
      actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft
      actor_rollout_ref.actor.diffusion_loss.mix_beta="${MIX_BETA:-0.1}"
      actor_rollout_ref.rollout.calculate_log_probs=false actor_rollout_ref.rollout.rollout_adapter=old
      algorithm.trainer_type=direct_preference algorithm.sample_source=online
      algorithm.timestep_fraction="${TIMESTEP_FRACTION:-1.0}"
      algorithm.old_policy_decay_schedule="${OLD_DECAY_SCHEDULE:-copy}"
      algorithm.old_policy_update_interval="${OLD_UPDATE_INTERVAL:-1}" ${NFT_GPU[@]+"${NFT_GPU[@]}"})
    ;;
  awm)
    # Advantage-weighted matching with the AWM authors' recipe (config/dgx_awm.py): the live weights sample (ODE,
    # final images), ghuber weighting, an EMA anchor (the old adapter) at old_kl_coef 1; lr tuned as DiffusionNFT's.
    [[ "$MODEL_PATH" == tiny:* ]] && AWM_LR="${AWM_LR:-1e-3}"  # tuned on the tiny renderer (one try)
    LR="${AWM_LR:-$LR}"
    ALGO_RECIPE=(actor_rollout_ref.model.algorithm=awm algorithm.trainer_type=direct_preference
      'actor_rollout_ref.model.policy_state_adapters=["default","old"]'
      actor_rollout_ref.actor.diffusion_loss.old_kl_coef="${OLD_KL_COEF:-1.0}"
      actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.003 actor_rollout_ref.actor.diffusion_loss.clip_ratio=1.0
      algorithm.old_policy_decay_schedule=linear_to_0_3)  # training steps: the authors' draw (the config's default)
    ;;
  dpo)
    # Diffusion-DPO with verl-omni's online recipe keys (examples/dpo_trainer/qwen_image): the live weights sample
    # (ODE, final images), each group's best and worst image a pair against the adapter-off reference, beta 100.
    [[ "$MODEL_PATH" == tiny:* ]] && DPO_LR="${DPO_LR:-1e-3}"  # on the tiny renderer: AWM's lr, not tuned
    LR="${DPO_LR:-$LR}"
    ALGO_RECIPE=(actor_rollout_ref.model.algorithm=dpo actor_rollout_ref.model.model_type=diffusion_dpo_model
      algorithm.trainer_type=direct_preference algorithm.paired_preference=true
      actor_rollout_ref.actor.diffusion_loss.dpo_beta="${DPO_BETA:-100.0}"
      actor_rollout_ref.rollout.calculate_log_probs=false)
    ;;
  dance_grpo)
    # DanceGRPO with verl-omni's recipe keys (examples/dancegrpo_trainer/wan22): Flow-GRPO's loss, advantage and SDE
    # window, each window step drawn with DanceGRPO's SDE step (std eta sqrt(sigma - sigma_next), eta NOISE_LEVEL).
    ALGO_RECIPE=(${WINDOW_KEYS[@]+"${WINDOW_KEYS[@]}"} algorithm.adv_estimator=dance_grpo
      actor_rollout_ref.model.algorithm=dance_grpo actor_rollout_ref.actor.diffusion_loss.loss_mode=dance_grpo
      actor_rollout_ref.rollout.algo.sde_type=dance_sde)
    ;;
  *) echo "ALGO=$ALGO: use flow_grpo, dance_grpo, diffusion_nft, awm or dpo" >&2; exit 2 ;;
esac
# CPU defaults: the config's mini-batch of 2 prompts, or one prompt per actor rank when there are more ranks.
MINI_BATCH="${MINI_BATCH:-$(( ACTOR_RANKS > 2 ? ACTOR_RANKS : 2 ))}"
LORA_RANK="${LORA_RANK:-8}"
LORA_ALPHA="${LORA_ALPHA:-16}"
DATA_DIR="${DATA_DIR:-$root/data/ocr_$VOCAB}"

if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PYTHON" "$root/examples/data/prepare_ocr_prompts.py" --vocab "$VOCAB" --num-train 256 --num-val "${NUM_VAL:-8}" \
    --out-dir "$DATA_DIR"
fi

"$PYTHON" -m omni_async.trainer.main \
  data.train_files="$DATA_DIR/train.jsonl" \
  data.val_files="$DATA_DIR/val.jsonl" \
  data.train_batch_size="$BATCH" \
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.model.lora_rank="$LORA_RANK" \
  actor_rollout_ref.model.lora_alpha="$LORA_ALPHA" \
  actor_rollout_ref.actor.optim.lr="$LR" \
  actor_rollout_ref.rollout.n="$GROUP" \
  actor_rollout_ref.rollout.algo.noise_level="$NOISE_LEVEL" \
  actor_rollout_ref.rollout.pipeline.height="$HEIGHT" \
  actor_rollout_ref.rollout.pipeline.width="$WIDTH" \
  actor_rollout_ref.rollout.pipeline.num_inference_steps="$NUM_STEPS" \
  actor_rollout_ref.rollout.agent.num_workers="$ACTOR_RANKS" \
  trainer.n_gpus_per_node="$NUM_GPUS_ACTOR_ROLLOUT" \
  trainer.nnodes="$NNODES" \
  reward.streaming=auto \
  "${REWARD_POOL[@]}" \
  reward.custom_reward_function.path=pkg://omni_async.reward.scorers.ocr \
  reward.custom_reward_function.name=compute_score \
  trainer.total_training_steps="$STEPS" \
  trainer.test_freq="${VAL_FREQ:-$STEPS}" \
  trainer.run_dir="$RUN_DIR" \
  hydra.run.dir="$RUN_DIR/hydra" \
  ${GPU_RECIPE[@]+"${GPU_RECIPE[@]}"} \
  ${CPU_RECIPE[@]+"${CPU_RECIPE[@]}"} \
  ${ALGO_RECIPE[@]+"${ALGO_RECIPE[@]}"} \
  "$@"
