"""verl-omni's diffusion recipes here: every key they use composes, or is refused with a ConfigError naming the key
and the fix (never Hydra's ``Could not override``); whole recipes compose and validate with their models, engines and
reward files swapped for tiny ones, or are refused naming what is missing. Compose only: no training, a few seconds.

The recipes are ``verl_omni_recipes/*.txt`` (verl-omni a1139ba, ``scripts/extract_verl_omni_recipes.py``)."""

from __future__ import annotations

import logging
import os
import re

import pytest
from verl_omni_recipe_data import (
    OWNED_ELSEWHERE,
    key_of,
    outcome,
    profiles,
    recipes,
    source,
    stand_in,
    start_refusal,
)

import omni_async.trainer.loop as loop
from omni_async.config.overrides import OverrideError, check_overrides, known, rule_for
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.main import checked_argv

BASE = ["data.train_files=x.jsonl"]
RECIPES = recipes()
UPSTREAM_COMMIT = "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30"

# What each recipe is refused with here once its models, engines and reward files are swapped for tiny stand-ins
# (verl_omni_recipe_data.STAND_INS) and the keys owned elsewhere are left out: the keys named, each with a fix.
# An empty set: the recipe composes and validates.
_AUDIO_VIDEO = {
    "actor_rollout_ref.rollout.agent.default_agent_loop",
    "actor_rollout_ref.rollout.pipeline.frame_rate",
    "actor_rollout_ref.rollout.val_kwargs.pipeline.frame_rate",
    "reward.reward_functions.clap.path",
}
_BAGEL = {
    "actor_rollout_ref.model.architecture",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.trust_remote_code",
    "data.trust_remote_code",
}
_PICKSCORE = {"reward.custom_reward_function.path"}  # verl-omni's PickScore file (the edit recipe's pkg:// is stood in)
_64_RANKS = {"actor_rollout_ref.actor.ppo_mini_batch_size"}  # 16 groups per mini-batch cannot feed 64 ranks
EXPECTED_REFUSED: dict[str, set[str]] = {
    # DanceGRPO (algos.dance_grpo, its loss, algorithm and dance_sde step built), HPSv3 stood in (its contract)
    "dancegrpo_trainer.wan22.run_wan22_5b_t2v_hpsv3_auto": set(),
    "diffusionnft_trainer.minimax_h3.run_minimax_h3_t2va_lora": _AUDIO_VIDEO
    | {
        "actor_rollout_ref.model.architecture",
        "actor_rollout_ref.model.config_path",
        "actor_rollout_ref.rollout.pipeline.aspect_ratio",
        "actor_rollout_ref.rollout.pipeline.video_flow_shift",
    },
    "diffusionnft_trainer.qwen_image.run_qwen_image_ocr_lora": set(),
    # DiffusionOPD (algos.distill, the teacher on the reward workers: reward.teacher) with a tiny teacher
    "diffusionopd_trainer.sd35.run_sd35_medium_ocr_distill": set(),
    # Diffusion-DPO (algos.dpo): online from each group's best and worst sample; offline from verl-omni's
    # OfflineDPODataset rows (trainer.offline_pairs), with the training engine's CFG scale (no rollout)
    "dpo_trainer.qwen_image.run_qwen_image_online_dpo_lora": set(),
    "dpo_trainer.sd35.run_sd35_medium_offline_dpo_lora": set(),
    "flowdppo_trainer.qwen_image.run_qwen_image_ocr_lora": set(),
    "flowgrpo_trainer.bagel.run_bagel_ocr_lora": _BAGEL,
    "flowgrpo_trainer.bagel.run_bagel_pickscore": _BAGEL | _PICKSCORE,
    "flowgrpo_trainer.bagel.run_bagel_pickscore_lora": _BAGEL | _PICKSCORE,
    "flowgrpo_trainer.ltx2.run_ltx2_3_t2av_lora": _AUDIO_VIDEO | {"actor_rollout_ref.rollout.algo.sde_contiguous"},
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_64cards": _64_RANKS,
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark": set(),
    # Nsight Systems: rank 0 under Ray's nsight runtime env, capture ranges on steps 1-3 (trainer.profiling)
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark_nsys": set(),
    # free_cache_engine: no effect (logged), as verl skips it for a judge on its own pool; the CPU judge holds no device
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_h200_mfu_optimized": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_async_reward": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_fsdp2_fa3": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_multi_node": set(),  # offload_policy: param + optimizer
    # bypass-mode rollout correction: IS weights reported, the rejection mask applied per SDE step (as verl-omni)
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_rollout_corr": set(),
    # Ulysses: one group of 2 actor ranks on CPU (ON_CPU_SEQUENCE_PARALLEL), the tokens split across it
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_sp2": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_multi_reward": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_reward_server": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni_64cards": _64_RANKS,
    "flowgrpo_trainer.qwen_image_edit.run_qwen_image_edit_lora": set(),  # tiny:qwen_image_edit, a PickScore stand-in
    # the clean latent and the prompt encodings to a DRM stand-in; fp32 sampling from bf16 weights, pi_old recomputed;
    # its reference micro-batch of 2 below the actor's 9 honoured in the SDE window's reference calls
    "flowgrpo_trainer.sd35.run_sd35_medium_drm_lora": set(),
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora": set(),
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1": set(),
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1_separate_async": set(),
    "grpoguard_trainer.qwen_image.run_qwen_image_ocr_lora": set(),
    "mixgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_mixgrpo": set(),
}


def test_the_recipes_are_verl_omnis_33_non_npu_diffusion_scripts_at_one_commit():
    assert len(RECIPES) == 33 and set(EXPECTED_REFUSED) == set(RECIPES)
    for name in RECIPES:
        assert source(name).startswith(f"verl-project/verl-omni@{UPSTREAM_COMMIT}:examples/")
        assert "npu" not in name
    assert sum(len(o) for o in RECIPES.values()) > 2000
    assert not any("qwen3_omni" in name for name in RECIPES)  # verl-omni's LLM / omni-modal DPO: not diffusion


def _first_use() -> dict[str, str]:
    first: dict[str, str] = {}
    for overrides in RECIPES.values():
        for o in overrides:
            first.setdefault(key_of(o), o)
    return first


def test_every_recipe_key_is_a_key_here_or_has_a_rule_except_those_owned_elsewhere():
    """The config test the issue asks for: the recipes' keys (verl-omni a1139ba), each known or ruled."""
    keys = _first_use()
    unruled = {k for k in keys if not known(k, "flowgrpo_trainer") and rule_for(k) is None}
    assert unruled == OWNED_ELSEWHERE & set(keys)


def test_every_upstream_key_alone_is_accepted_or_names_the_key_and_a_fix():
    """Each recipe key that is not this project's, with the recipe's first value, through the override check (the
    whole-recipe tests below compose every override)."""
    for key, override in _first_use().items():
        if known(key, "flowgrpo_trainer"):
            continue
        try:
            check_overrides([override])
        except OverrideError as err:
            assert [k for k, _ in err.problems] == [key], str(err)
            assert str(err).startswith(key) and "Fix:" in str(err), str(err)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_whole_recipe_unchanged_gives_only_config_errors_naming_keys_and_fixes(name):
    result = outcome(RECIPES[name])
    assert result.error is None
    for _, key, message in result.refused:
        assert key in message and "Fix:" in message, message


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_whole_recipe_with_tiny_stand_ins_composes_and_validates_or_names_what_is_missing(name):
    overrides = [o for o in stand_in(RECIPES[name]) if key_of(o) not in OWNED_ELSEWHERE]
    result = outcome(overrides)
    assert result.error is None
    assert result.keys() == EXPECTED_REFUSED[name], [m for *_, m in result.refused]


# What a recipe's start names besides EXPECTED_REFUSED's keys (the start check reads the model's model_index.json
# after compose and validate): none now.
START_ALSO: dict[str, set[str]] = {}
# What the issue names as missing here, as the start names it: recipe -> (key, words of its message).
MISSING = {
    "flowgrpo_trainer.bagel.run_bagel_ocr_lora": ("actor_rollout_ref.model.architecture", "BAGEL"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_starts_or_is_refused_before_ray_naming_what_is_missing(name, monkeypatch, tmp_path):
    """As ``python -m omni_async.trainer.main`` starts it (the override check and compose, then ``RLTrainer``), with
    its tiny stand-ins: a recipe EXPECTED_REFUSED leaves whole gets to Ray (``test_verl_omni_recipe_runs.py`` trains
    it); any other is refused before Ray with a ConfigError naming its keys (EXPECTED_REFUSED's, START_ALSO's), each
    with a fix. A recipe that profiles finds an ``nsys`` on PATH (without one it stops at start: test_profiling)."""
    monkeypatch.setattr(loop, "init_ray", lambda cfg: pytest.fail("Ray started"))
    if profiles(RECIPES[name]):
        (tmp_path / "nsys").write_text("#!/bin/sh\n")
        (tmp_path / "nsys").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    overrides = [o for o in stand_in(RECIPES[name]) if key_of(o) not in OWNED_ELSEWHERE]
    if not EXPECTED_REFUSED[name]:
        assert start_refusal(overrides) == []
        with pytest.raises(pytest.fail.Exception, match="Ray started"):
            loop.RLTrainer(compose(overrides))
        return
    with pytest.raises(ConfigError) as err:
        loop.RLTrainer(compose(overrides))
    problems = getattr(err.value, "problems", None) or [(re.match(r"[\w./]+", str(err.value)).group(0), str(err.value))]
    keys = {k for k, _ in problems}
    assert keys and keys <= EXPECTED_REFUSED[name] | START_ALSO.get(name, set()), str(err.value)
    assert all("Fix:" in m for _, m in problems), str(err.value)
    assert start_refusal(overrides) == problems  # what the docs table shows
    if name in MISSING:
        key, words = MISSING[name]
        assert any(k == key and words in m for k, m in problems), str(err.value)


@pytest.mark.parametrize("name", sorted(n for n, keys in EXPECTED_REFUSED.items() if keys == _64_RANKS))
def test_64_card_recipes_refusal_is_verl_omnis_own_arithmetic(name):
    """At their real 64 ranks the 64-card recipes are refused on ``ppo_mini_batch_size`` alone, and rightly: verl-omni's
    update (verl's ``train_mini_batch``) gives each of the 64 data-parallel ranks 16 prompts x n=16 / 64 = 4 samples
    per mini-batch, and verl's ``prepare_micro_batches`` stops on 4 samples in micro-batches of
    ``ppo_micro_batch_size_per_gpu=16``. Their run (``test_verl_omni_recipe_runs.py``) shrinks the world and the
    mini-batch together, to ON_CPU's one rank and 2 prompts, as every other recipe's."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl_omni_recipe_data import refused_only_at_real_world_size

    overrides = stand_in(RECIPES[name])
    assert refused_only_at_real_world_size(overrides)
    ((_, message),) = start_refusal(overrides)
    assert "verl-omni's update stops here too: 256 samples / 64 ranks = 4 per rank" in message  # users are told
    cfg = compose(overrides)
    arr = cfg.actor_rollout_ref
    ranks = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes // arr.actor.fsdp_config.ulysses_sequence_parallel_size
    assert ranks == 64 and arr.actor.ppo_mini_batch_size < ranks
    samples = arr.actor.ppo_mini_batch_size * arr.rollout.n  # verl-omni's global mini-batch, in samples
    assert samples % ranks == 0  # verl's train_mini_batch: the mini-batch divides over the ranks ...
    per_rank = TensorDict({"x": torch.zeros(samples // ranks, 1)}, batch_size=[samples // ranks])
    tu.assign_non_tensor(
        per_rank, use_dynamic_bsz=False, micro_batch_size_per_gpu=arr.actor.ppo_micro_batch_size_per_gpu
    )
    with pytest.raises(AssertionError, match="divisible"):  # ... but not into micro-batches (verl-omni sets no dyn bsz)
        prepare_micro_batches(per_rank)


def test_hpsv3_stand_in_keeps_verl_omnis_contract():
    """verl-omni's ``compute_score_hpsv3`` (a1139ba): its parameters and defaults, every ``frame_interval``-th frame
    (``extra_info``, 4) of a ``[C, F, H, W]`` video from the first, the mean of ``reward_scale`` x the raw score,
    ``{"score", "hpsv3_raw"}``; a video in another layout is refused naming its shape."""
    import inspect

    import torch
    from verl_omni_hpsv3_stand_in import compute_score_hpsv3

    params = inspect.signature(compute_score_hpsv3).parameters
    assert list(params)[:4] == ["data_source", "solution_image", "ground_truth", "extra_info"]
    assert {k: params[k].default for k in ("model_name", "reward_scale", "device")} == {
        "model_name": None,
        "reward_scale": 0.1,
        "device": None,
    }
    video = torch.zeros(3, 9, 8, 8, dtype=torch.uint8)
    video[:, 4, :, :4] = 255  # frame 4 alone has contrast: 10 x std / 255 = 5.0 (half the pixels 255)
    out = compute_score_hpsv3("dance_grpo/hpsv3", video, "a cat", {})
    assert out == pytest.approx({"score": 0.1 * 5.0 / 3, "hpsv3_raw": 5.0 / 3}, rel=1e-3)  # frames 0, 4, 8
    assert compute_score_hpsv3("x", video, "", {"frame_interval": 3})["hpsv3_raw"] == 0.0  # frames 0, 3, 6
    with pytest.raises(ValueError, match=r"\(9, 3, 8, 8\)"):
        compute_score_hpsv3("x", video.permute(1, 0, 2, 3), "", {})


def test_multi_reward_spelling_of_verl_omni_is_this_projects_weighted_rewards():
    recipe = stand_in(RECIPES["flowgrpo_trainer.qwen_image.run_qwen_image_ocr_multi_reward"])
    cfg = validate(compose([o for o in recipe if key_of(o) not in OWNED_ELSEWHERE]))
    functions = cfg.reward.reward_functions
    assert set(functions) == {"ocr", "jpeg"} and functions.ocr.weight == functions.jpeg.weight == 0.5
    assert cfg.reward.reward_manager.name == "MultiVisualRewardManager"


# ---- the override check ------------------------------------------------------------------------------------------
def test_unknown_key_is_refused_naming_the_nearest_keys():
    with pytest.raises(OverrideError) as err:
        compose([*BASE, "actor_rollout_ref.rollout.noise_level=0.5", "trainer.total_trainng_steps=3"])
    problems = dict(err.value.problems)
    assert "actor_rollout_ref.rollout.algo.noise_level" in problems["actor_rollout_ref.rollout.noise_level"]
    assert "trainer.total_training_steps" in problems["trainer.total_trainng_steps"]
    assert "Could not override" not in str(err.value) and str(err.value).startswith("2 overrides")


def test_this_projects_earlier_spelling_is_renamed_and_two_spellings_must_agree():
    cfg = compose([*BASE, "actor_rollout_ref.rollout.height=32", "actor_rollout_ref.rollout.num_inference_steps=6"])
    assert cfg.actor_rollout_ref.rollout.pipeline.height == 32
    assert cfg.actor_rollout_ref.rollout.pipeline.num_inference_steps == 6
    assert "height" not in cfg.actor_rollout_ref.rollout
    same = ["actor_rollout_ref.rollout.width=48", "actor_rollout_ref.rollout.pipeline.width=48"]
    assert compose([*BASE, *same]).actor_rollout_ref.rollout.pipeline.width == 48
    with pytest.raises(ConfigError, match=r"rollout\.pipeline\.width=48 and actor_rollout_ref\.rollout\.width=32"):
        compose([*BASE, "actor_rollout_ref.rollout.pipeline.width=48", "actor_rollout_ref.rollout.width=32"])
    assert compose([*BASE, "trainer.max_actor_ckpt_to_keep=null"]).trainer.max_ckpt_to_keep == -1
    assert compose([*BASE, "actor_rollout_ref.actor.optim.clip_grad=0.5"]).actor_rollout_ref.actor.grad_clip == 0.5


def test_no_effect_key_is_logged_once_and_refused_values_name_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger="omni_async.config.overrides"):
        compose([*BASE, "+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=8"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "has no effect here" in lines[0] and "vLLM-Omni" in lines[0]
    validate(compose([*BASE, "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.mode=async"]))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.strategy=megatron: .*Fix: use fsdp2"):
        compose([*BASE, "actor_rollout_ref.actor.strategy=megatron"])
    # rollout.dtype (verl-omni's DRM recipe samples in fp32 from bf16 weights): a wider one, pi_old recomputed
    bf16 = [*BASE, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
    validate(compose([*bf16, "actor_rollout_ref.rollout.dtype=fp32"]))
    validate(compose([*bf16, "actor_rollout_ref.rollout.dtype=bfloat16"]))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.dtype: .*exact only towards a wider"):
        validate(
            compose(
                [*BASE, "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32", "actor_rollout_ref.rollout.dtype=bf16"]
            )
        )
    with pytest.raises(ConfigError, match=r"bypass_mode=true pi_old is the rollout's log-probs.*Fix: set"):
        validate(
            compose([*bf16, "actor_rollout_ref.rollout.dtype=fp32", "algorithm.rollout_correction.bypass_mode=true"])
        )


def test_add_prefix_on_a_key_this_project_has_sets_it():
    assert compose([*BASE, "+trainer.rollout_data_dir=/tmp/r"]).trainer.rollout_data_dir == "/tmp/r"


def test_a_wrong_type_still_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.seed='x': expected a whole number"):
        compose([*BASE, "actor_rollout_ref.rollout.seed=x"])


def test_the_entry_point_checks_overrides_before_hydra():
    argv = ["main.py", "--config-name", "grpo_text_trainer", "hydra.run.dir=/tmp/h", "actor_rollout_ref.rollout.seed=3"]
    assert checked_argv(argv) == argv
    assert checked_argv(["m", "actor_rollout_ref.rollout.height=32"]) == [
        "m",
        "++actor_rollout_ref.rollout.pipeline.height=32",
    ]
    with pytest.raises(OverrideError, match="nearest keys"):
        checked_argv(["m", "trainer.sead=1"])


def test_a_ruled_key_with_a_value_of_the_wrong_type_is_refused_naming_it():
    with pytest.raises(
        ConfigError, match=r"^actor_rollout_ref\.actor\.optim\.lr_warmup_steps_ratio=abc: .*Fix: set it"
    ):
        compose([*BASE, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=abc"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.max_prompt_embed_length=x: .*77 \+"):
        compose([*BASE, "actor_rollout_ref.rollout.max_prompt_embed_length=x"])


def test_keys_of_dancegrpo_diffusionopd_and_dpo_recipes_mean_the_same_or_name_what_is_not_built():
    # verl-omni registers dance_grpo and flow_grpo to one advantage estimator; a chat template ending in T5's </s>
    # is the identity (the pipeline's tokenizer appends </s> itself); model.pipeline.* is the rollout's copy
    template = '"{% for m in messages %}{{ m[\\"content\\"] }}{% endfor %}</s>"'
    cfg = validate(
        compose(
            [
                *BASE,
                "algorithm.adv_estimator=dance_grpo",
                "trainer.device=cuda",
                "distillation.enabled=false",
                "algorithm.paired_preference=false",
                "actor_rollout_ref.model.external_lib=verl_omni.pipelines.sd3_flow_grpo",
                f"actor_rollout_ref.model.custom_chat_template={template}",
                "actor_rollout_ref.rollout.pipeline.guidance_scale=4.0",
                "actor_rollout_ref.model.pipeline.guidance_scale=4.0",
            ]
        )
    )
    assert cfg.algorithm.adv_estimator == "dance_grpo" and cfg.actor_rollout_ref.rollout.pipeline.guidance_scale == 4
    refused = {
        "trainer.device=npu": "Ascend NPUs",
        "actor_rollout_ref.actor.use_distill_loss=true": "loss_mode=distill_kl",
        "actor_rollout_ref.model.external_lib=my_pkg.adapters": "custom adapter modules are not loaded",
        "data.custom_cls.name=OfflineDPODataset": "prompt rows",
        "actor_rollout_ref.model.pipeline.guidance_scale=4.0": "rollout.pipeline.guidance_scale to this value",
        "actor_rollout_ref.model.pipeline.frame_rate=24": "audio-video",
    }
    with pytest.raises(OverrideError) as err:
        compose([*BASE, *refused])
    problems = dict(err.value.problems)
    assert set(problems) == {o.split("=")[0] for o in refused}
    for override, words in refused.items():
        assert words in problems[override.split("=")[0]] and "Fix:" in problems[override.split("=")[0]]
    for overrides, key, words in (
        (
            ["actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl"],
            "actor_rollout_ref.actor.diffusion_loss.loss_mode",
            "trains toward a frozen teacher, and none is configured",
        ),
    ):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*{words}.*Fix:"):
            validate(compose([*BASE, *overrides]))
