"""verl / verl-omni keys that are not keys of this project's config, and what each means here.

Read from verl-omni's own config (``verl_omni/trainer/config/*.yaml``, ``algorithm.py``; a1139ba) for the keys its
diffusion recipes use (``tests/config/verl_omni_recipes/``). Keys that mean the same here and are keys of this
project's config (``rollout.pipeline.height``, ``rollout.seed``, ``data.val_max_samples``, ...) are not listed: they
are in ``omni_async/config/flowgrpo_trainer.yaml``. A key ending in ``.*`` covers every key under it.
:mod:`omni_async.config.overrides` applies the rules; ``docs/verl_omni_recipes.md`` is generated from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Get = Callable[[str], Any]  # a key's value on the command line, else its default here (None when it has none)
Kind = Literal["same", "no_effect", "refused", "renamed"]


@dataclass(frozen=True)
class Rule:
    """What a verl / verl-omni key means here.

    ``same``: accepted silently where ``accepts`` (means what this project does, ``why`` says how); ``no_effect``:
    accepted with one log line (it tunes an engine this project does not run, ``why`` says which); ``refused``: always
    refused; ``renamed``: this project spells it ``canonical`` (``convert`` maps the value). A value ``accepts``
    rejects is refused with ``why`` and ``fix``."""

    kind: Kind
    why: str
    fix: str = ""
    accepts: Callable[[Any, Get], bool] | None = None
    canonical: str = ""
    convert: Callable[[Any], Any] | None = None
    # an accepted value's meaning in this project's keys: {key: value} set with it (a key given otherwise is refused)
    sets: Callable[[Any], dict[str, Any]] | None = None


ARR = "actor_rollout_ref"
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float": "float32", "half": "float16"}


def _dtype(name: Any) -> Any:
    return _DTYPES.get(str(name).lower(), str(name).lower()) if name is not None else None


def _one_of(*values: Any):
    return lambda v, get: v in values


def _identity_template(v: Any, get: Get) -> bool:
    """A chat template that gives the user's message back unchanged (the SD3 recipes' one), or followed by ``</s>``
    (DanceGRPO's Wan 2.2 one): the prompt reaches the pipeline as written, which is what this project does. verl-omni
    tokenizes the template's text without special tokens, so ``</s>`` there is the end-of-sequence token that a T5 /
    UMT5 tokenizer (Wan's, SD3's third) ends a prompt with, which the diffusers pipeline's own tokenizer appends here."""
    if v is None:
        return True
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        text = "a sign that says HELLO"
        out = ImmutableSandboxedEnvironment().from_string(str(v)).render(messages=[{"role": "user", "content": text}])
    except Exception:  # noqa: BLE001 - any template that does not render is not the identity
        return False
    return out in (text, text + "</s>")


def _pipeline_tokenizers(v: Any, get: Get) -> bool:
    """verl-omni's per-encoder tokenizer map, when it names the pipeline's own tokenizer folders (what diffusers loads
    from model.path here)."""
    if v is None:
        return True
    return isinstance(v, dict) and all(
        isinstance(t, dict) and t.get("path") in ("tokenizer", "tokenizer_2", "tokenizer_3") for t in v.values()
    )


def _sd3_embed_length(v: Any, get: Get) -> bool:
    """SD3's prompt encoding is 77 CLIP tokens + pipeline.max_sequence_length T5 tokens (verl-omni's recipes: 333)."""
    seq = get(f"{ARR}.rollout.pipeline.max_sequence_length")
    return v is None or (seq is not None and int(v) == 77 + int(seq))


def _same_as(key: str, convert=lambda x: x):
    return lambda v, get: get(key) is None or convert(v) == convert(get(key))


def _equals(key: str):
    """The value ``key`` has here (given, else its default here, None included)."""
    return lambda v, get: v == get(key)


def _rollout_attn_pair(v: Any, get: Get) -> bool:
    """verl-omni's pairing of its rollout engine's attention with the training engine's (its
    ``validate_attention_consistency``): other model backends it does not pair, nor does this."""
    model = get(f"{ARR}.model.attn_backend")
    if v is None or model not in ("native", "_native_npu", "_flash_3_varlen_hub"):
        return True
    fa3 = ("FLASH_ATTN", "FLASH_ATTN_HUB", "FLASH_ATTN_3_HUB")
    return v in (fa3 if model == "_flash_3_varlen_hub" else ("TORCH_SDPA",))


def _verl_omni_adapter(v: Any, get: Get) -> bool:
    """verl-omni's own model-adapter modules (``verl_omni.pipelines.<family>_<algorithm>``), or none."""
    return v is None or str(v).startswith("verl_omni.pipelines.")


_NO_VIDEO_AUDIO = (
    "audio-video pipelines (LTX-2, MiniMax-H3) are not part of this project: its video model is Wan 2.1 / 2.2, "
    "frames set by rollout.pipeline.num_frames"
)
_MODEL_FAMILIES = "use a Qwen-Image, SD3 / SD3.5 or Wan 2.1 / 2.2 diffusers checkpoint (or a tiny: model)"
_OPD_ADDED = (
    "verl-omni's distillation term added to another loss (flow_grpo + distill_loss_coef x distill_kl) is not built "
    "here: the teacher trains the student as the one loss, diffusion_loss.loss_mode=distill_kl"
)
_PROFILED_WITH_ACTOR = (
    "the reference here is the actor's own transformer with its LoRA adapter off, and in the hybrid layout the "
    "rollout runs in the actor ranks: both are profiled with actor_rollout_ref.actor.profiler (NVTX ranges gen / "
    "old_log_prob / update); a separate rollout or reference worker is not profiled"
)
_PROFILED_WITH_ACTOR_FIX = "drop it (or set it to false); profile the actor ranks: actor_rollout_ref.actor.profiler"
# verl-omni's model.pipeline.* (the training engine's copy of rollout.pipeline.*, which it defaults to).
_MODEL_PIPELINE = ("height", "width", "num_inference_steps", "true_cfg_scale", "max_sequence_length")
# verl-omni's offline DPO dataset class, as its recipe names it (data.custom_cls.*)
_OFFLINE_DPO_DATASET = {
    "path": "pkg://verl_omni.utils.dataset.offline_dpo_dataset",
    "name": "OfflineDPODataset",
    "collate_fn": "offline_dpo_collate_fn",
}

RULES: dict[str, Rule] = {
    # ---- this project's earlier spellings -------------------------------------------------------------------------
    **{
        f"{ARR}.rollout.{k}": Rule(
            "renamed", "this project's earlier spelling of verl-omni's key", canonical=f"{ARR}.rollout.pipeline.{k}"
        )
        for k in ("height", "width", "num_inference_steps", "num_frames")
    },
    # ---- data ---------------------------------------------------------------------------------------------------------
    **{
        f"data.custom_cls.{k}": Rule(
            "same",
            "no custom dataset class is loaded here: data.train_files are jsonl / parquet rows of prompts, or with "
            "algorithm.sample_source=offline (Diffusion-DPO) parquet rows of verl-omni's OfflineDPODataset columns "
            "(trainer.offline_pairs), which its own class names select",
            "drop it (prompt rows: prompt, data_source, reward_model), or name verl-omni's OfflineDPODataset "
            f"({k}={v}) with algorithm.sample_source=offline",
            lambda val, get, v=v: val is None or (val == v and get("algorithm.sample_source") == "offline"),
        )
        for k, v in _OFFLINE_DPO_DATASET.items()
    },
    "data.truncation": Rule(
        "same",
        "a prompt longer than data.max_prompt_length is an error at start here, verl's truncation=error",
        "set data.truncation=error, or shorten the prompts (left / right / middle truncation is not implemented)",
        _one_of("error"),
    ),
    "data.trust_remote_code": Rule(
        "same",
        "no remote code is run here: prompts are read as jsonl / parquet rows",
        "drop it (or set it to False)",
        _one_of(False),
    ),
    # ---- model ----------------------------------------------------------------------------------------------------
    f"{ARR}.model.trust_remote_code": Rule(
        "same",
        "models load through the diffusers / transformers classes this project ships; remote code is never run",
        f"drop it; {_MODEL_FAMILIES} (BAGEL, which needs remote code, is not supported)",
        _one_of(False),
    ),
    f"{ARR}.model.architecture": Rule(
        "refused",
        "the architecture follows from model.path's pipeline here; verl-omni's BAGEL and MiniMax-H3 are not supported",
        _MODEL_FAMILIES,
    ),
    f"{ARR}.model.config_path": Rule(
        "same",
        "the transformer's config is read from model.path's transformer/ folder",
        "drop it, and point model.path at the diffusers checkpoint",
        _one_of(None),
    ),
    f"{ARR}.model.tokenizer_path": Rule(
        "same",
        "the pipeline's tokenizers load from model.path (its tokenizer*/ folders)",
        "drop it, and point model.path at a checkpoint holding its tokenizers",
        _one_of(None),
    ),
    f"{ARR}.model.extra_tokenizers": Rule(
        "same",
        "the diffusers pipeline loads its own tokenizers (tokenizer, tokenizer_2, tokenizer_3) from model.path; "
        "the T5 length is rollout.pipeline.max_sequence_length",
        "drop it (tokenizers from other folders are not supported)",
        _pipeline_tokenizers,
    ),
    f"{ARR}.model.custom_chat_template": Rule(
        "same",
        "prompts reach the diffusers pipeline as written, which is what a template returning the user's message does "
        "(or the message and </s>: T5's end of sequence, which the pipeline's tokenizer appends itself here)",
        "drop it (a template that changes the prompt is not applied here; rewrite the prompts in the data instead)",
        _identity_template,
    ),
    f"{ARR}.model.lora_dtype": Rule(
        "same",
        "LoRA weights (and their AdamW state) are float32 here",
        "drop it, or set it to float32",
        lambda v, get: v is None or _dtype(v) == "float32",
    ),
    f"{ARR}.model.external_lib": Rule(
        "same",
        "the module verl-omni imports to register a model adapter for (pipeline, algorithm); verl-omni's own "
        "(verl_omni.pipelines.*) are this project's built-in adapters, picked by model.path's pipeline and "
        "model.algorithm (which refuse a family or algorithm not built here)",
        "drop it (custom adapter modules are not loaded here)",
        _verl_omni_adapter,
    ),
    **{
        f"{ARR}.model.pipeline.{k}": Rule(
            "same",
            f"verl-omni's training-engine copy of rollout.pipeline.{k} (its default); the update here runs the "
            "transformer with the rollout's pipeline settings",
            f"drop it, or set {ARR}.rollout.pipeline.{k} to this value instead",
            _equals(f"{ARR}.rollout.pipeline.{k}"),
        )
        for k in _MODEL_PIPELINE
    },
    f"{ARR}.model.pipeline.guidance_scale": Rule(
        "same",
        "verl-omni's training-engine copy of rollout.pipeline.guidance_scale (its default); the update here runs "
        "the transformer with the rollout's pipeline settings, so it sets that key (offline DPO, which has no rollout, "
        "trains with its CFG: its pairs carry the negative prompt's encodings)",
        f"drop it, or set {ARR}.rollout.pipeline.guidance_scale to this value instead",
        lambda v, get: (
            v == get(f"{ARR}.rollout.pipeline.guidance_scale") or get("algorithm.sample_source") == "offline"
        ),
        sets=lambda v: {f"{ARR}.rollout.pipeline.guidance_scale": v},
    ),
    f"{ARR}.model.pipeline.num_frames": Rule(
        "same",
        "verl-omni's training-engine copy of rollout.pipeline.num_frames",
        f"drop it, or set {ARR}.rollout.pipeline.num_frames to this value instead",
        _equals(f"{ARR}.rollout.pipeline.num_frames"),
    ),
    **{
        f"{ARR}.model.pipeline.{k}": Rule("refused", _NO_VIDEO_AUDIO, "drop it")
        for k in ("frame_rate", "video_flow_shift")
    },
    f"{ARR}.model.fsdp_layer_prefixes": Rule(
        "no_effect",
        "the layers verl-omni gathers one by one for a layered LoRA summon; a LoRA weight sync here moves only the "
        "adapter",
    ),
    # ---- actor engine -------------------------------------------------------------------------------------------------
    f"{ARR}.actor.strategy": Rule(
        "same",
        "training runs on this project's engine whatever the name: LoRA gradients all-reduced over the actor ranks, "
        "a full fine-tune sharded with FSDP2 (fully_shard); VeOmni's engine is not used (the same update, its "
        "veomni_config.* settings have no effect)",
        "use fsdp2 (megatron is not supported)",
        _one_of("fsdp", "fsdp2", "veomni"),
    ),
    "diffusion/model_engine": Rule(
        "no_effect",
        "verl-omni's choice of training engine config (dp_diffusion / veomni_diffusion); the engine here is this "
        "project's (actor.strategy)",
        "drop it",
        _one_of("dp_diffusion", "veomni_diffusion"),
    ),
    f"{ARR}.actor.veomni_config.*": Rule(
        "no_effect", "a setting of the VeOmni engine, which is not used here (actor.fsdp_config.* holds the offloads)"
    ),
    f"{ARR}.ref.veomni_config.*": Rule("no_effect", "a setting of the VeOmni engine, which is not used here"),
    f"{ARR}.actor.fsdp_config.fsdp_size": Rule(
        "no_effect",
        "FSDP's sharding-group size; a full fine-tune here shards over all actor ranks, LoRA is replicated",
    ),
    f"{ARR}.actor.fsdp_config.reshard_after_forward": Rule(
        "no_effect",
        "an FSDP memory / speed trade-off; full fine-tunes here reshard after forward (FSDP2's default), which "
        "gives the same gradients",
    ),
    f"{ARR}.actor.fsdp_config.wrap_policy.*": Rule(
        "no_effect",
        "FSDP's wrap policy; a full fine-tune here shards each transformer block of the diffusers model",
    ),
    f"{ARR}.actor.fsdp_config.offload_policy": Rule(
        "same",
        "FSDP2's CPU offload policy (verl: parameters and optimizer state on the CPU) is this project's "
        "param_offload + optimizer_offload: true sets both (the frozen text encoder / VAE and the AdamW state off the "
        "device while they are not used)",
        "give offload_policy=true without param_offload / optimizer_offload=false, or drop it",
        lambda v, get: isinstance(v, bool),
        sets=lambda v: (
            {f"{ARR}.actor.fsdp_config.param_offload": True, f"{ARR}.actor.fsdp_config.optimizer_offload": True}
            if v
            else {}
        ),
    ),
    **{
        key: Rule(
            "same",
            f"verl's copy of {ARR}.actor.use_torch_compile ({why}); here one switch compiles the transformer's blocks "
            "for every forward",
            f"drop it, or set {ARR}.actor.use_torch_compile to this value instead",
            _equals(f"{ARR}.actor.use_torch_compile"),
        )
        for key, why in (
            (f"{ARR}.ref.use_torch_compile", "the reference here is the same transformer with its LoRA adapter off"),
            (f"{ARR}.actor.fsdp_config.use_torch_compile", "verl's engine setting"),
        )
    },
    f"{ARR}.actor.optim.lr_warmup_steps_ratio": Rule(
        "same",
        "the learning rate is constant here (verl's ratio 0.0)",
        "set it to 0.0 (learning-rate warm-up is not implemented)",
        lambda v, get: float(v) == 0.0,
    ),
    f"{ARR}.actor.optim.clip_grad": Rule(
        "renamed", "verl-omni's spelling of the gradient-norm clip", canonical=f"{ARR}.actor.grad_clip"
    ),
    # ---- rollout engine -------------------------------------------------------------------------------------------
    f"{ARR}.rollout.mode": Rule(
        "same",
        "rollout here is always asynchronous (an asyncio agent loop), verl-omni's only mode",
        "set it to async",
        _one_of("async"),
    ),
    f"{ARR}.rollout.engine_kwargs.*": Rule(
        "no_effect",
        "a vLLM-Omni engine argument; rollout here runs diffusers (request batching: rollout.agent.max_batch_size)",
    ),
    f"{ARR}.rollout.step_execution": Rule(
        "no_effect", "vLLM-Omni's step-level scheduling; rollout here batches whole requests (rollout.agent.*)"
    ),
    f"{ARR}.rollout.rollout_attn_backend": Rule(
        "same",
        "vLLM-Omni's attention backend, which verl-omni pairs with model.attn_backend (TORCH_SDPA with native / "
        "_native_npu, FLASH_ATTN / FLASH_ATTN_HUB / FLASH_ATTN_3_HUB with _flash_3_varlen_hub); rollout here runs the "
        "update's diffusers transformer, so with model.attn_backend itself",
        f"drop it, or give the pair of {ARR}.model.attn_backend (native <-> TORCH_SDPA)",
        _rollout_attn_pair,
    ),
    f"{ARR}.rollout.layered_summon": Rule(
        "no_effect",
        "verl's layer-by-layer gathering of FSDP-sharded LoRA weights for a weight sync, a memory saving; verl and "
        "verl-omni read it only when collecting LoRA weights (a full fine-tune's sync ignores it there too). Here a "
        "LoRA sync moves only the adapter, and a full fine-tune's its transformer state, whatever the value",
    ),
    f"{ARR}.rollout.data_parallel_size": Rule(
        "same",
        "each rollout worker is one replica on one device",
        "set it to 1 and scale with actor_rollout_ref.rollout.agent.num_workers",
        _one_of(1),
    ),
    f"{ARR}.rollout.max_num_seqs": Rule(
        "renamed",
        "the most requests one rollout worker generates in one batch",
        canonical=f"{ARR}.rollout.agent.max_batch_size",
    ),
    f"{ARR}.rollout.dtype": Rule(
        "same",
        "text: the rollout generates with the weights it trains, in actor.fsdp_config.model_dtype (the diffusion "
        "trainer's rollout.dtype, a key of its config, samples in a wider dtype: verl-omni's DRM recipe's fp32)",
        f"drop it, or set {ARR}.actor.fsdp_config.model_dtype to the same dtype",
        _same_as(f"{ARR}.actor.fsdp_config.model_dtype", _dtype),
    ),
    f"{ARR}.rollout.prompt_length": Rule(
        "same",
        "verl-omni's copy of data.max_prompt_length",
        "drop it, or give data.max_prompt_length the same value",
        _same_as("data.max_prompt_length"),
    ),
    f"{ARR}.rollout.max_prompt_embed_length": Rule(
        "same",
        "prompt encodings keep the pipeline's own length here: SD3's is 77 CLIP + rollout.pipeline."
        "max_sequence_length T5 tokens (verl-omni's 333 for 256)",
        "drop it, or set it to 77 + rollout.pipeline.max_sequence_length (padding to another length is not "
        "implemented)",
        _sd3_embed_length,
    ),
    f"{ARR}.rollout.algo.sde_contiguous": Rule(
        "same",
        "the SDE steps here are one consecutive window of sde_window_size steps",
        "set it to True (scattered SDE steps are not implemented)",
        _one_of(True),
    ),
    f"{ARR}.rollout.agent.default_agent_loop": Rule(
        "same",
        "one agent loop per modality here (verl-omni's diffusion_single_turn_agent)",
        f"drop it; {_NO_VIDEO_AUDIO}",
        _one_of("diffusion_single_turn_agent"),
    ),
    f"{ARR}.rollout.val_kwargs.pipeline.num_frames": Rule(
        "same",
        "validation generates rollout.pipeline.num_frames frames, as training",
        "drop it, or give it rollout.pipeline.num_frames' value",
        _same_as(f"{ARR}.rollout.pipeline.num_frames"),
    ),
    **{
        f"{ARR}.rollout.{val}pipeline.{k}": Rule("refused", _NO_VIDEO_AUDIO, "drop it")
        for val in ("", "val_kwargs.")
        for k in ("frame_rate", "video_flow_shift", "aspect_ratio")
    },
    # ---- DiffusionOPD (distillation), DPO ---------------------------------------------------------------------------
    f"{ARR}.actor.use_distill_loss": Rule(
        "same",
        _OPD_ADDED,
        f"drop it (or set it to false) and set {ARR}.actor.diffusion_loss.loss_mode=distill_kl",
        _one_of(False),
    ),
    **{
        f"{ARR}.actor.{k}": Rule(
            "same", f"read only with use_distill_loss=true ({_OPD_ADDED})", "drop it", _one_of(default)
        )
        for k, default in (("distill_loss_mode", "distill_kl"), ("distill_loss_coef", 1.0))
    },
    # ---- trainer device ---------------------------------------------------------------------------------------------
    "trainer.device": Rule(
        "same",
        "workers run on the CUDA GPU Ray assigns them (the CPU on a machine without one), verl's cuda; Ascend NPUs "
        "are not supported",
        "drop it, or set it to cuda",
        _one_of("cuda", "gpu"),
    ),
    # ---- profilers (global_profiler.{tool,steps,...} and actor.profiler.{enable,ranks,...}: trainer.profiling) ----
    **{
        f"{ARR}.{role}.profiler.enable": Rule("same", _PROFILED_WITH_ACTOR, _PROFILED_WITH_ACTOR_FIX, _one_of(False))
        for role in ("ref", "rollout")
    },
    **{
        f"{ARR}.{role}.profiler.*": Rule("no_effect", "a profiler setting of a role that is not profiled here")
        for role in ("ref", "rollout")
    },
    **{
        key: Rule(
            "no_effect",
            "nsys writes its reports where Ray's nsight plugin puts them (<Ray session>/logs/nsight) and the "
            "controller's in the working directory; verl reads save_path only to move them (relocate_results)",
        )
        for key in ("global_profiler.save_path", f"{ARR}.actor.profiler.save_path")
    },
    **{
        key: Rule(
            "same",
            "the reports stay where nsys writes them (moving them, verl's relocate_results, is not built here)",
            "drop it, or set it to false",
            _one_of(False),
        )
        for key in ("global_profiler.relocate_results", f"{ARR}.actor.profiler.relocate_results")
    },
    **{
        key: Rule(
            "same",
            "no command is run after profiling here (verl's finish hook)",
            "drop it (run the command after the job)",
            _one_of(None),
        )
        for key in ("global_profiler.finish_hook_cmd", f"{ARR}.actor.profiler.finish_hook_cmd")
    },
    **{
        key: Rule("no_effect", "read only with finish_hook_cmd, which is not built here")
        for key in (
            "global_profiler.finish_hook_all_ranks",
            "global_profiler.finish_hook_ranks",
            f"{ARR}.actor.profiler.finish_hook_all_ranks",
            f"{ARR}.actor.profiler.finish_hook_ranks",
        )
    },
    f"{ARR}.actor.profiler.tool_config.nsys.discrete": Rule(
        "same",
        "verl's per-role copy of global_profiler.global_tool_config.nsys.discrete (its default)",
        "drop it, or set global_profiler.global_tool_config.nsys.discrete to this value instead",
        _equals("global_profiler.global_tool_config.nsys.discrete"),
    ),
    f"{ARR}.actor.profiler.*": Rule("no_effect", "a setting of a profiler tool other than nsys, the only one here"),
    "global_profiler.*": Rule("no_effect", "a setting of a profiler tool other than nsys, the only one here"),
    # ---- reward -----------------------------------------------------------------------------------------------------
    "reward.aggregation": Rule(
        "same",
        "reward.reward_functions combine as a weighted sum of their scores here (verl-omni's weighted_sum)",
        "set it to weighted_sum (other aggregations are not implemented)",
        _one_of("weighted_sum"),
    ),
    "reward.reward_model.rollout.free_cache_engine": Rule(
        "no_effect",
        "verl's sleep of the reward model's vLLM servers between reward computations (KV cache dropped, weights to "
        "host), which verl does only for a reward model colocated on the actor's pool and skips for one on its own "
        "pool (standalone, vllm_async_server.sleep). Here vLLM judges always own their reward pool (verl's "
        "standalone), and the transformers judge runs on its reward worker's CPU, holding no device memory (its "
        "generate's KV cache is freed after each call): there is no device memory to free for others, whatever the "
        "value",
    ),
    "reward.reward_manager.module.path": Rule(
        "same",
        "verl-omni's module of reward managers; reward.reward_manager.name picks this project's RewardManager by "
        "verl-omni's names (naive, MultiVisualRewardManager)",
        "drop it (custom reward-manager modules are not loaded; a reward is a function: "
        "reward.custom_reward_function or reward.reward_functions)",
        _one_of("pkg://verl_omni.reward_loop.reward_manager"),
    ),
    # ---- trainer --------------------------------------------------------------------------------------------------
    "trainer.max_actor_ckpt_to_keep": Rule(
        "renamed",
        "verl's spelling (null: keep all)",
        canonical="trainer.max_ckpt_to_keep",
        convert=lambda v: -1 if v is None else v,
    ),
    "trainer.rollout_data_save_freq": Rule(
        "renamed",
        "how often training samples are written (trainer.rollout_data_dir)",
        canonical="trainer.log_image_freq",
    ),
    "trainer.video_fps": Rule(
        "no_effect", "the frame rate of saved videos; video samples are saved here as their first frame in a PNG grid"
    ),
}
