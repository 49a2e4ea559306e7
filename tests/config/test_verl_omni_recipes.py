"""verl-omni's diffusion recipes here: every key they use composes, or is refused with a ConfigError naming the key
and the fix (never Hydra's ``Could not override``); whole recipes compose and validate with their models, engines and
reward files swapped for tiny ones, or are refused naming what is missing. Compose only: no training, a few seconds.

The recipes are ``verl_omni_recipes/*.txt`` (verl-omni a1139ba, ``scripts/extract_verl_omni_recipes.py``)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from verl_omni_recipe_data import OWNED_ELSEWHERE, key_of, outcome, recipes, source, stand_in

from omni_async.agent_loop.draws import Draws
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.vllm_server import server_command
from omni_async.sample import RewardOutcome
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.dataset import first_rows
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.main import checked_argv
from omni_async.trainer.model_paths import path_problem
from omni_async.trainer.overrides import OverrideError, check_overrides, known, rule_for

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
_PICKSCORE = {"reward.custom_reward_function.path"}  # no PickScore reward here
_64_RANKS = {"actor_rollout_ref.actor.ppo_mini_batch_size"}  # 16 groups per mini-batch cannot feed 64 ranks
EXPECTED_REFUSED: dict[str, set[str]] = {
    "diffusionnft_trainer.minimax_h3.run_minimax_h3_t2va_lora": _AUDIO_VIDEO
    | {
        "actor_rollout_ref.model.architecture",
        "actor_rollout_ref.model.config_path",
        "actor_rollout_ref.rollout.pipeline.aspect_ratio",
        "actor_rollout_ref.rollout.pipeline.video_flow_shift",
    },
    "diffusionnft_trainer.qwen_image.run_qwen_image_ocr_lora": {"actor_rollout_ref.model.algorithm"},  # issue 38
    "flowdppo_trainer.qwen_image.run_qwen_image_ocr_lora": set(),  # model.algorithm is left at flow_grpo (38)
    "flowgrpo_trainer.bagel.run_bagel_ocr_lora": _BAGEL,
    "flowgrpo_trainer.bagel.run_bagel_pickscore": _BAGEL | _PICKSCORE,
    "flowgrpo_trainer.bagel.run_bagel_pickscore_lora": _BAGEL | _PICKSCORE,
    "flowgrpo_trainer.ltx2.run_ltx2_3_t2av_lora": _AUDIO_VIDEO | {"actor_rollout_ref.rollout.algo.sde_contiguous"},
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_64cards": _64_RANKS,
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark_nsys": {
        "global_profiler.tool",
        "actor_rollout_ref.actor.profiler.enable",
    },
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_h200_mfu_optimized": {
        "reward.reward_model.rollout.free_cache_engine"
    },
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_async_reward": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_fsdp2_fa3": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_multi_node": {
        "actor_rollout_ref.actor.fsdp_config.offload_policy"
    },
    # bypass-mode rollout correction (rejection sampling on the training ratio) is not implemented
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_rollout_corr": {
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_rs",
    },
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_sp2": {
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
    },
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_multi_reward": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_reward_server": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni": set(),
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni_64cards": _64_RANKS,
    "flowgrpo_trainer.qwen_image_edit.run_qwen_image_edit_lora": _PICKSCORE,
    "flowgrpo_trainer.sd35.run_sd35_medium_drm_lora": {
        "actor_rollout_ref.rollout.dtype",
        "actor_rollout_ref.rollout.pipeline.output_type",
        "actor_rollout_ref.rollout.val_kwargs.pipeline.output_type",
        "reward.reward_functions.drm.path",
    },
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora": set(),
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1": set(),
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1_separate_async": set(),
    "grpoguard_trainer.qwen_image.run_qwen_image_ocr_lora": set(),  # the loss mode is issue 38's
    "mixgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_mixgrpo": {"actor_rollout_ref.model.algorithm"},  # issue 38
}


def test_the_recipes_are_verl_omnis_29_non_npu_diffusion_scripts_at_one_commit():
    assert len(RECIPES) == 29 and set(EXPECTED_REFUSED) == set(RECIPES)
    for name in RECIPES:
        assert source(name).startswith(f"verl-project/verl-omni@{UPSTREAM_COMMIT}:examples/")
        assert "npu" not in name
    assert sum(len(o) for o in RECIPES.values()) > 1800


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
    with caplog.at_level(logging.WARNING, logger="omni_async.trainer.overrides"):
        compose([*BASE, "+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=8"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "has no effect here" in lines[0] and "vLLM-Omni" in lines[0]
    validate(compose([*BASE, "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.mode=async"]))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.strategy=megatron: .*Fix: use fsdp2"):
        compose([*BASE, "actor_rollout_ref.actor.strategy=megatron"])
    with pytest.raises(ConfigError, match=r"model_dtype to the same dtype"):
        compose([*BASE, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.rollout.dtype=fp32"])
    compose([*BASE, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "actor_rollout_ref.rollout.dtype=bfloat16"])


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


# ---- meanings of the keys built here -----------------------------------------------------------------------------
def test_rollout_seed_and_window_seed_are_the_bases_of_the_sample_and_window_draws():
    sampler = SimpleNamespace()
    base = Draws.from_config(compose(BASE), sampler, True)
    seeded = Draws.from_config(compose([*BASE, "actor_rollout_ref.rollout.seed=7"]), sampler, True)
    windows = Draws.from_config(
        compose([*BASE, "actor_rollout_ref.rollout.seed=7", "actor_rollout_ref.rollout.algo.sde_window_seed=3"]),
        sampler,
        True,
    )
    assert (base.seed, base.window_seed) == (42, 42) and (seeded.seed, seeded.window_seed) == (7, 7)
    assert (windows.seed, windows.window_seed) == (7, 3)
    rows = [SimpleNamespace()]
    assert [s.seed for s in base.samples(0, rows)] != [s.seed for s in seeded.samples(0, rows)]
    assert [s.seed for s in seeded.samples(0, rows)] == [s.seed for s in windows.samples(0, rows)]


def test_max_samples_keep_the_first_rows():
    rows = list(range(10))
    assert first_rows(rows, -1) == rows and first_rows(rows, 3) == [0, 1, 2]
    assert first_rows(rows, -1, otherwise=8) == rows[:8] and first_rows(rows, 9, otherwise=8) == rows[:9]


def test_use_kl_loss_false_turns_the_kl_term_off_whatever_the_coefficient():
    kl = ["actor_rollout_ref.actor.kl_loss_coef=0.04", "actor_rollout_ref.model.lora_rank=0"]
    with pytest.raises(ConfigError, match="kl_loss_coef"):
        validate(compose([*BASE, *kl]))  # a full fine-tune keeps no reference
    cfg = validate(compose([*BASE, *kl, "actor_rollout_ref.actor.use_kl_loss=False"]))
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 0.0
    on = validate(
        compose([*BASE, "actor_rollout_ref.actor.kl_loss_coef=0.04", "actor_rollout_ref.actor.use_kl_loss=True"])
    )
    assert on.actor_rollout_ref.actor.kl_loss_coef == 0.04


def test_optimizer_keys_are_adamws_arguments():
    validate(
        compose(
            [
                *BASE,
                "actor_rollout_ref.actor.optim.betas=[0.9,0.99]",
                "+actor_rollout_ref.actor.optim.override_optimizer_config={eps: 1e-8}",
            ]
        )
    )
    with pytest.raises(ConfigError, match=r"\['momentum'\] are not arguments of torch.optim.AdamW"):
        validate(compose([*BASE, "actor_rollout_ref.actor.optim.override_optimizer_config={momentum: 0.9}"]))


def test_output_directories_default_to_the_run_dir_and_follow_verls_keys(tmp_path):
    def out(overrides, key, default):
        trainer = SimpleNamespace(cfg=compose([*BASE, *overrides]), run_dir=tmp_path)
        return RLTrainer._out_dir(trainer, key, default)

    assert out([], "default_local_dir", "checkpoints") == tmp_path / "checkpoints"
    assert out([f"trainer.default_local_dir={tmp_path}/ck"], "default_local_dir", "checkpoints") == tmp_path / "ck"
    assert out([f"trainer.rollout_data_dir={tmp_path}/r"], "rollout_data_dir", "samples") == tmp_path / "r"


def test_judge_server_length_and_batch_flags():
    rollout = {"server_python": "py", "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.9}
    cmd = server_command({**rollout, "max_model_len": 8192, "max_num_seqs": 128}, "/m", 8000)
    assert cmd[cmd.index("--max-model-len") + 1] == "8192" and cmd[cmd.index("--max-num-seqs") + 1] == "128"
    assert "--max-model-len" not in server_command(rollout, "/m", 8000)


# ---- verl v1's separate_async keys -------------------------------------------------------------------------------
SEPARATE = [
    *BASE,
    "trainer.use_v1=true",
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.hybrid_engine=False",
    "trainer.v1.sampler.max_off_policy_threshold=null",
]


def test_num_warmup_batches_is_the_backlog_fractional_included():
    cfg = validate(compose([*SEPARATE, "trainer.v1.separate_async.num_warmup_batches=0.5"]))
    assert cfg.async_reward.fully_async and cfg.async_training.staleness_threshold == 0.5
    two = ["trainer.v1.separate_async.num_warmup_batches=1", "trainer.v1.separate_async.parameter_sync_step=2"]
    assert validate(compose([*SEPARATE, *two, "data.train_batch_size=4"])).async_training.staleness_threshold == 0.5
    on_policy = ["trainer.v1.separate_async.num_warmup_batches=0", "trainer.v1.separate_async.sync_compatible=1"]
    assert validate(compose([*SEPARATE, *on_policy])).async_training.staleness_threshold == 0.0
    with pytest.raises(ConfigError, match=r"^trainer\.v1\.separate_async\.sync_compatible: .*backlog of 1"):
        validate(
            compose(
                [
                    *SEPARATE,
                    "trainer.v1.separate_async.num_warmup_batches=1",
                    "trainer.v1.separate_async.sync_compatible=true",
                ]
            )
        )
    with pytest.raises(ConfigError, match=r"^trainer\.v1\.separate_async\.num_warmup_batches: .*read only with"):
        validate(compose([*BASE, "trainer.v1.separate_async.num_warmup_batches=1"]))
    with pytest.raises(ConfigError, match=r"one setting given twice"):
        validate(
            compose(
                [*SEPARATE, "trainer.v1.separate_async.num_warmup_batches=1", "async_training.staleness_threshold=0.3"]
            )
        )


# ---- verl-recipe's reward queue and verl v1's metric names ---------------------------------------------------------
def test_reward_queue_keys_are_the_streaming_reward_queue():
    cfg = validate(compose([*BASE, "async_training.enable_reward_queue=true", "async_training.reward_queue_size=16"]))
    assert cfg.reward.streaming == "true" and cfg.reward.queue_size == 16
    assert validate(compose([*BASE, "async_training.enable_reward_queue=false"])).reward.streaming == "false"
    with pytest.raises(ConfigError, match=r"^reward\.streaming: reward\.streaming=false and .*enable_reward_queue"):
        validate(compose([*BASE, "reward.streaming=false", "async_training.enable_reward_queue=true"]))
    with pytest.raises(ConfigError, match=r"^reward\.queue_size: .*given twice"):
        validate(compose([*BASE, "reward.queue_size=8", "async_training.reward_queue_size=16"]))


class _Worker:
    """A reward-loop worker stand-in: scores every sample 1.0 (the dispatcher's own queue and counters are real)."""

    def __init__(self):
        self.score = SimpleNamespace(remote=self._score)

    @staticmethod
    async def _score(chunk):
        return RewardOutcome("ok", score=1.0)


def test_reward_queue_metrics_carry_verl_recipes_names():
    async def run():
        d = RewardDispatcher([_Worker()], queue_size=4, max_inflight_per_worker=2, timeout_s=5)
        for _ in range(3):
            await d.score(object())
        return d.metrics()

    m = asyncio.run(run())
    assert m["reward_queue/total_produced"] == m["reward_queue/total_consumed"] == 3
    assert m["static/max_reward_queue_size"] == 4 and m["monitor/queue/reward_queue_size"] == 0
    assert m["reward_queue/dropped_samples"] == 0


def test_off_policy_drops_are_counted_per_step_with_their_staleness(monkeypatch):
    counts = iter([(0, 0), (3, 6), (3, 6), (5, 13)])  # cumulative dropped samples, sum of their staleness

    def rollouter_metrics():
        dropped, staleness = next(counts)
        return {
            "fully_async/count/dropped_stale_samples": dropped,
            "fully_async/count/dropped_staleness_sum": staleness,
        }

    trainer = SimpleNamespace(
        _t_metrics=0.0,
        _idle=[],
        _dropped_before=(0.0, 0.0),
        agent=SimpleNamespace(on_loop=lambda f: f(), take_idle_s=lambda: 0.0),
        rollouter=SimpleNamespace(metrics=rollouter_metrics),
    )
    rows = [RLTrainer.producer_metrics(trainer, 1.0, 0.0) for _ in range(4)]
    assert [r["training/off_policy/dropped_samples"] for r in rows] == [0, 3, 0, 2]
    assert [r.get("training/off_policy/evicted_samples_staleness/mean") for r in rows] == [None, 2.0, None, 3.5]
    assert all("fully_async/count/dropped_staleness_sum" not in r for r in rows)


# ---- model paths, at start before Ray --------------------------------------------------------------------------
def test_a_model_path_that_does_not_resolve_is_refused_before_ray_starts(tmp_path, monkeypatch):
    import omni_async.trainer.loop as loop

    monkeypatch.setattr(loop, "init_ray", lambda cfg: pytest.fail("Ray started for a config that cannot run"))
    for path, problem in [
        ("/no/such/model", "not a local directory"),
        ("tiny:no_such", "unknown tiny model"),
        ("Qwen/No-Such-Model-Here", "not in this machine's Hugging Face cache, and the hub is off"),  # tests: offline
    ]:
        cfg = compose([*BASE, f"actor_rollout_ref.model.path={path}"])
        with pytest.raises(ConfigError, match=rf"^actor_rollout_ref\.model\.path: '{path}' does not .*{problem}"):
            RLTrainer(cfg)
    judge = ["reward.reward_model.enable=True", f"reward.reward_model.model_path={tmp_path}/judge"]
    with pytest.raises(ConfigError, match=r"^reward\.reward_model\.model_path: .*Fix: give a local model directory"):
        RLTrainer(compose([*BASE, *judge]))
    (tmp_path / "judge").mkdir()
    assert path_problem(str(tmp_path / "judge")) is None and path_problem("tiny:sd3") is None
