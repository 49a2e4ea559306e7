"""verl-omni's async-reward recipe runs here: its override list composes against our config and validates (its
training step: tests/config/test_verl_omni_recipe_runs.py); every key of it that this project implements only in
some values is refused with an error naming the key and what to use instead; the keys' meanings (validation sampling, epochs, judge model path,
wandb, prompt length, judge server flags) are tested one by one."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import SMALL_IMAGE_TRAINER, write_ocr_rows
from omegaconf import OmegaConf
from PIL import Image

from omni_async.agent_loop.batcher import GenerationBatcher
from omni_async.cluster import shutdown_ray
from omni_async.modality import get_modality
from omni_async.reward.manager import RewardManager
from omni_async.reward.scorers import vlm_judge
from omni_async.reward.vllm_server import server_command
from omni_async.trainer.config import ConfigError, compose, total_training_steps, validate
from omni_async.trainer.dataset import DatasetError, check_prompt_lengths
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.metrics_logger import MetricsLogger

# verl-omni examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_async_reward.sh: its 56 overrides in its
# order, with its shell variables replaced by the values the script gives them.
VERL_OMNI = {
    "data.train_files": "$WORKSPACE/data/ocr/qwen_image/train.parquet",
    "data.val_files": "$WORKSPACE/data/ocr/qwen_image/test.parquet",
    "data.train_batch_size": "32",
    "data.max_prompt_length": "256",
    "actor_rollout_ref.model.algorithm": "flow_grpo",
    "actor_rollout_ref.model.path": "Qwen/Qwen-Image",
    "actor_rollout_ref.model.lora_rank": "64",
    "actor_rollout_ref.model.lora_alpha": "128",
    "actor_rollout_ref.model.target_modules": "['to_q','to_k','to_v','to_out.0','add_q_proj','add_k_proj',"
    "'add_v_proj','to_add_out','img_mlp.net.0.proj','img_mlp.net.2',"
    "'txt_mlp.net.0.proj','txt_mlp.net.2']",
    "actor_rollout_ref.actor.optim.lr": "3e-4",
    "actor_rollout_ref.actor.optim.weight_decay": "0.0001",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "16",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "True",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "bfloat16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "32",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.rollout.name": "vllm_omni",
    "actor_rollout_ref.rollout.n": "16",
    "actor_rollout_ref.rollout.agent.num_workers": "4",
    "actor_rollout_ref.rollout.load_format": "safetensors",
    "actor_rollout_ref.rollout.layered_summon": "True",
    "actor_rollout_ref.rollout.pipeline.true_cfg_scale": "4.0",
    "actor_rollout_ref.rollout.pipeline.max_sequence_length": "256",
    "actor_rollout_ref.rollout.algo.noise_level": "1.2",
    "actor_rollout_ref.rollout.algo.sde_type": "sde",
    "actor_rollout_ref.rollout.algo.sde_window_size": "2",
    "actor_rollout_ref.rollout.algo.sde_window_range": "[0,5]",
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps": "50",
    "actor_rollout_ref.rollout.val_kwargs.algo.noise_level": "0.0",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "32",
    "reward.num_workers": "1",
    "reward.reward_model.enable": "True",
    "reward.reward_model.model_path": "Qwen/Qwen3-VL-8B-Instruct",
    "reward.reward_model.rollout.name": "vllm",
    "reward.reward_model.enable_resource_pool": "True",
    "reward.reward_model.nnodes": "1",
    "reward.reward_model.n_gpus_per_node": "1",
    "reward.reward_model.rollout.gpu_memory_utilization": "0.9",
    "reward.reward_model.rollout.free_cache_engine": "False",
    "reward.reward_model.rollout.tensor_model_parallel_size": "1",
    "reward.reward_model.rollout.enforce_eager": "False",
    "reward.custom_reward_function.path": "verl_omni/utils/reward_score/genrm_ocr.py",
    "reward.custom_reward_function.name": "compute_score_ocr",
    "trainer.logger": '["console", "wandb"]',
    "trainer.project_name": "flow_grpo",
    "trainer.experiment_name": "qwen_image_ocr_lora_async_reward",
    "trainer.log_val_generations": "8",
    "trainer.val_before_train": "False",
    "trainer.n_gpus_per_node": "4",
    "trainer.nnodes": "1",
    "trainer.save_freq": "30",
    "trainer.test_freq": "30",
    "trainer.total_epochs": "15",
    "trainer.total_training_steps": "300",
}

# What one CPU step on tiny models changes, and why; every other value is verl-omni's.
ON_CPU = {
    "data.train_files": ("{data}/train.jsonl", "a tiny local prompt set"),
    "data.val_files": ("{data}/val.jsonl", "a tiny local prompt set"),
    "data.train_batch_size": ("2", "2 prompts per step"),
    "actor_rollout_ref.model.path": ("tiny:qwen_image", "an offline random Qwen-Image of the same architecture"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("1", "2 mini-batches per step, as theirs (32 / 16)"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("1", "micro-batches inside the mini-batch of 2"),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": ("float32", "bf16 matmuls are slow on this CPU"),
    "actor_rollout_ref.rollout.name": ("transformers", "vllm_omni is verl-omni's engine; ours runs diffusers"),
    "actor_rollout_ref.rollout.n": ("2", "groups of 2"),
    "actor_rollout_ref.rollout.agent.num_workers": ("1", "one logical device"),
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps": ("8", "fewer steps on CPU"),
    "reward.reward_model.model_path": ("tiny:qwen2_vl", "an offline random Qwen2-VL judge"),
    "reward.reward_model.rollout.name": ("transformers", "no vLLM here: the judge runs in the reward worker"),
    "reward.custom_reward_function.path": ("pkg://omni_async.reward.scorers.vlm_judge", "our GenRM-OCR judge"),
    "reward.custom_reward_function.name": ("compute_score", "its function name"),
    "trainer.logger": ("[console,jsonl]", "wandb is not installed here (refused: see the test below)"),
    "trainer.n_gpus_per_node": ("1", "one logical device"),
    "trainer.total_training_steps": ("1", "one step"),
}
# Our own keys the CPU run needs on top (verl-omni sets height/width/steps in its pipeline defaults: 512, 10).
OURS = [
    "actor_rollout_ref.rollout.height=64",
    "actor_rollout_ref.rollout.width=64",
    "actor_rollout_ref.rollout.num_inference_steps=6",
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]


def verl_omni_overrides(data_dir, run_dir) -> list[str]:
    out = [
        f"{key}={ON_CPU[key][0].format(data=data_dir) if key in ON_CPU else value}" for key, value in VERL_OMNI.items()
    ]
    return [*out, *OURS, f"trainer.run_dir={run_dir}"]


@pytest.fixture
def data_dir(tmp_path):
    write_ocr_rows(tmp_path / "train.jsonl", 4)
    write_ocr_rows(tmp_path / "val.jsonl", 3)
    return tmp_path


def test_the_script_has_56_overrides_and_each_cpu_change_is_one_of_them():
    assert len(VERL_OMNI) == 56
    assert set(ON_CPU) <= set(VERL_OMNI)


def test_verl_omni_override_list_composes_and_validates(data_dir, tmp_path):
    """The list with its CPU changes composes to verl-omni's meanings; the recipe's training step runs in
    tests/config/test_verl_omni_recipe_runs.py (``run_qwen_image_ocr_lora_async_reward``, extracted from the script)."""
    cfg = validate(compose(verl_omni_overrides(data_dir, tmp_path / "run")))
    assert cfg.actor_rollout_ref.rollout.val_kwargs.algo.noise_level == 0.0
    assert cfg.trainer.total_epochs == 15 and cfg.data.max_prompt_length == 256
    assert (
        cfg.actor_rollout_ref.actor.fsdp_config.param_offload
        and cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload
    )
    assert cfg.reward.reward_model.enable_resource_pool  # the judge streams on its own reward pool


# ---- keys refused at start, each naming itself and what to use instead ------------------------------------------
BASE = ["data.train_files=x.jsonl"]


@pytest.mark.parametrize(
    "overrides, key, instead",
    [
        (["actor_rollout_ref.rollout.name=vllm_omni"], "actor_rollout_ref.rollout.name", "rollout.name=transformers"),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "agent.num_workers",
        ),
        (
            ["actor_rollout_ref.rollout.load_format=dummy"],
            "actor_rollout_ref.rollout.load_format",
            "load_format=safetensors",
        ),
        (["actor_rollout_ref.model.algorithm=dpo"], "actor_rollout_ref.model.model_type", "diffusion_dpo_model"),
        (
            ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0"],
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            "must be >= 1",
        ),
        (
            [
                "actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.5",
                "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=4",
            ],
            "actor_rollout_ref.rollout.val_kwargs.algo.noise_level",
            "num_inference_steps",
        ),
        (["actor_rollout_ref.rollout.val_kwargs.n=0"], "actor_rollout_ref.rollout.val_kwargs.n", "e.g. 1"),
        (["data.max_prompt_length=0"], "data.max_prompt_length", "null for no limit"),
        (["trainer.total_epochs=0"], "trainer.total_epochs", "e.g. 1"),
        (["trainer.total_training_steps=0"], "trainer.total_training_steps", "e.g. 4"),
        (["trainer.log_val_generations=-1"], "trainer.log_val_generations", "0 for none"),
        (["trainer.logger=[console,mlflow]"], "trainer.logger", "pip install mlflow"),
        (["trainer.logger=[console,jsonl2]"], "trainer.logger", "use verl's: wandb, mlflow"),
        (
            [
                "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.vlm_judge",
                "+reward.custom_reward_function.reward_kwargs.model_path=tiny:qwen2_vl",
            ],
            "reward.custom_reward_function.reward_kwargs.model_path",
            "reward.reward_model.model_path=tiny:qwen2_vl",
        ),
        (
            [
                "+reward.reward_functions.judge.path=pkg://omni_async.reward.scorers.vlm_judge",
                "+reward.reward_functions.judge.name=compute_score",
                "+reward.reward_functions.judge.judge_model_path=/m",
            ],
            "reward.reward_functions.judge.judge_model_path",
            "reward.reward_model.model_path=/m",
        ),
    ],
)
def test_refused_key_names_itself_and_the_alternative(overrides, key, instead):
    with pytest.raises(ConfigError) as err:
        validate(compose(BASE + overrides))
    assert str(err.value).startswith(key) and instead in str(err.value), str(err.value)


def test_wandb_without_wandb_installed_is_refused_at_start(monkeypatch):
    """The dev extras install wandb, so its absence is simulated where the check looks for it."""
    cfg = compose(BASE + ['trainer.logger=["console", "wandb"]'])
    validate(cfg)  # installed: accepted
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^trainer\.logger: wandb is listed but not installed.*pip install wandb"):
        validate(cfg)


def test_no_op_equivalent_values_are_accepted():
    for rank in (0, 8):  # layered_summon: no effect here, with a full fine-tune or LoRA (verl / verl-omni read it
        # only when collecting LoRA weights; a full fine-tune's sync ignores it there too)
        validate(
            compose(
                BASE + ["actor_rollout_ref.rollout.layered_summon=True", f"actor_rollout_ref.model.lora_rank={rank}"]
            )
        )
    validate(
        compose(
            BASE
            + [
                "actor_rollout_ref.rollout.layered_summon=True",
                "actor_rollout_ref.rollout.load_format=hf",
                "reward.reward_model.rollout.free_cache_engine=True",  # verl skips it for a standalone judge, too
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            ]
        )
    )
    text = validate(compose(BASE, config_name="grpo_text_trainer"))
    assert text.actor_rollout_ref.model.algorithm == "grpo"


# ---- meanings -------------------------------------------------------------------------------------------------------
def test_total_epochs_count_steps_when_total_training_steps_is_null():
    cfg = compose(BASE + ["trainer.total_training_steps=null", "trainer.total_epochs=3", "data.train_batch_size=4"])
    assert total_training_steps(validate(cfg), 10) == 3 * 2  # 2 full batches of 4 per pass (verl drops the last)
    assert total_training_steps(compose(BASE + ["trainer.total_epochs=3"]), 10) == 4  # set steps win


def test_validation_settings_change_the_denoising_steps_and_batch_apart():
    """The request path: GenerationBatcher -> policy.generate(sampling=...). Requests with other settings never
    share a device batch; the transformer runs val_kwargs' number of steps for them, the policy's own otherwise."""
    cfg = compose(BASE + SMALL_IMAGE_TRAINER + ["actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=7"])
    image = get_modality("image")
    policy = image.build_policy(
        {"path": "tiny:sd3", "lora_rank": 2, "lora_alpha": 4, "target_modules": ["to_q"]},
        vars(image.sampling_config(cfg)),
    )
    calls = []
    policy.transformer.register_forward_hook(lambda *a: calls.append(1))
    sampling = image.validation_sampling(cfg)
    assert sampling == {"num_inference_steps": 7, "noise_level": 0.0}

    async def run():
        batcher = GenerationBatcher(policy.generate, lambda: 0, ThreadPoolExecutor(1), 4, 20)
        val = batcher.submit("a", 1, (0, 0), sampling=sampling)
        train = batcher.submit("b", 2, (0, 2))
        return await asyncio.gather(val, train), batcher.batch_sizes

    (val, train), sizes = asyncio.run(run())
    assert sizes == [1, 1] and len(calls) == 7 + 4
    assert val.result.log_probs.numel() == 0 and train.result.log_probs.shape == (2,)
    assert policy.sampling.num_inference_steps == 4 and len(policy.timesteps) == 4  # the policy is unchanged


@pytest.mark.slow  # a training run: not in the fast tier (pytest -m 'not slow')
def test_validation_runs_val_kwargs_before_training_logs_n_samples_and_epochs_set_steps(tmp_path):
    write_ocr_rows(tmp_path / "train.jsonl", 2)
    write_ocr_rows(tmp_path / "val.jsonl", 3)
    cfg = compose(
        [
            f"data.train_files={tmp_path}/train.jsonl",
            f"data.val_files={tmp_path}/val.jsonl",
            f"trainer.run_dir={tmp_path}/run",
            *SMALL_IMAGE_TRAINER,
            "trainer.total_training_steps=null",
            "trainer.total_epochs=1",  # 2 rows / batch 2: one step
            "trainer.val_before_train=True",
            "trainer.log_val_generations=5",
            "trainer.log_image_freq=-1",
            "actor_rollout_ref.rollout.val_kwargs.n=2",  # 3 prompts x 2 = 6 validation samples, 5 logged
            "actor_rollout_ref.rollout.val_kwargs.pipeline.height=48",
            "actor_rollout_ref.rollout.val_kwargs.pipeline.width=48",
            "actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.5",
        ]
    )  # SDE in validation, window [0,3)
    shutdown_ray()
    try:
        trainer = RLTrainer(cfg)
        assert trainer.total_steps == 1
        run_dir = trainer.fit()
    finally:
        shutdown_ray()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (
        [r["step"] for r in rows] == [0, 1]
        and any(k.startswith("val-core/") for k in rows[0])
        and "actor/pg_loss" in rows[1]
    )
    grid = Image.open(run_dir / "validation/step_0000.png")
    assert grid.size == (4 * 48, 2 * (48 + 14))  # 5 samples at the validation size (the training size is 32)


def test_judge_model_path_has_one_key(monkeypatch):
    """reward.reward_model.model_path reaches the judge as judge_model_path; without it the transformers judge
    fails the sample naming that key (no silent default model)."""
    seen = []

    class FakeJudge:
        def transcribe(self, image):
            return "HELLO"

    monkeypatch.setattr(vlm_judge, "transformers_judge", lambda path, *a: seen.append(path) or FakeJudge())
    base = {
        "timeout_s": 30,
        "max_inflight_per_worker": 2,
        "reward_functions": {},
        "custom_reward_function": {
            "path": "pkg://omni_async.reward.scorers.vlm_judge",
            "name": "compute_score",
            "reward_kwargs": {},
        },
    }
    sample = {
        "prompt": "p",
        "data_source": "ocr",
        "ground_truth": "HELLO",
        "extra_info": {},
        "uid": "0",
        "solution_image": np.zeros((16, 16, 3), np.uint8),
    }
    ok = RewardManager(OmegaConf.create({**base, "reward_model": {"model_path": "/models/judge"}})).score_batch(
        [sample]
    )
    assert seen == ["/models/judge"] and ok[0].ok and ok[0].score == 1.0
    failed = RewardManager(OmegaConf.create({**base, "reward_model": {"model_path": None}})).score_batch([sample])
    assert not failed[0].ok and "reward.reward_model.model_path" in failed[0].error


def test_metrics_logger_sends_rows_to_wandb_through_verl_tracking(tmp_path, monkeypatch):
    """trainer.logger=[wandb] goes through verl's Tracking (project / experiment names as in verl); wandb's files land
    in the run directory unless WANDB_DIR says otherwise, and the variable is not left set."""
    calls = []
    monkeypatch.delenv("WANDB_DIR", raising=False)
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["project"], kw["name"], os.environ.get("WANDB_DIR")))
    fake.log = lambda data, step: calls.append(("log", step, dict(data)))
    fake.finish = lambda exit_code=0: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(
        tmp_path, ["wandb"], 2, label="exp", project="flow_grpo", config={"trainer": {"project_name": "flow_grpo"}}
    )
    logger.log(0, {"val-core/ocr/reward/mean@1": 0.5}, advance=False)
    logger.log(1, {"actor/pg_loss": 0.1})
    logger.close()
    assert calls == [
        ("init", "flow_grpo", "exp", str(tmp_path)),
        ("log", 0, {"val-core/ocr/reward/mean@1": 0.5}),
        ("log", 1, {"actor/pg_loss": 0.1}),
        ("finish",),
    ]
    assert "WANDB_DIR" not in os.environ
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_max_prompt_length_counts_tokens_per_modality():
    long = "a very long prompt " * 20
    for modality, path in (("image", "tiny:qwen_image"), ("text", "tiny:qwen2")):
        count = get_modality(modality).prompt_lengths
        short_n, long_n = count(path, ["hi", long])  # text counts the chat template's tokens too
        assert long_n > short_n + 50
        limit = short_n + 10
        check_prompt_lengths([_row("hi")], limit, lambda p, c=count, m=path: c(m, p))
        with pytest.raises(
            DatasetError,
            match=rf"^data\.max_prompt_length={limit}: 1 prompt\(s\) are longer, the "
            rf"longest {long_n} tokens",
        ):
            check_prompt_lengths([_row("hi"), _row(long)], limit, lambda p, c=count, m=path: c(m, p))


def _row(prompt):
    from omni_async.sample import PromptRow

    return PromptRow(prompt=prompt, data_source="x", ground_truth="", extra_info={})


def test_pipeline_max_sequence_length_truncates_the_prompt_encoding():
    image = get_modality("image")
    cfg = compose(BASE + ["actor_rollout_ref.rollout.pipeline.max_sequence_length=3"])
    sampling = vars(image.sampling_config(cfg))
    assert sampling["max_sequence_length"] == 3
    policy = image.build_policy(
        {"path": "tiny:qwen_image", "lora_rank": 2, "lora_alpha": 4, "target_modules": ["to_q"]},
        {**sampling, "max_sequence_length": None},
    )
    prompt = ["a sign that says many different words in a row"]
    full = policy.encode(prompt)["prompt_embeds"].shape[1]
    assert full > 3 and policy.with_sampling(max_sequence_length=3).encode(prompt)["prompt_embeds"].shape[1] == 3


def test_judge_server_launch_flags():
    rollout = {
        "server_python": "py",
        "tensor_model_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "enforce_eager": True,
        "server_args": [],
    }
    assert "--enforce-eager" in server_command(rollout, "/m", 8000)
    assert "--enforce-eager" not in server_command({**rollout, "enforce_eager": False}, "/m", 8000)
    cmd = server_command(rollout, "/m", 8000)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"
