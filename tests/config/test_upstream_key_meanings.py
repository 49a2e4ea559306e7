"""What the verl / verl-omni keys this project builds mean here: the rollout seeds, max_samples, use_kl_loss, AdamW's
arguments, verl's output directories, the judge servers' flags, verl v1's separate_async backlog, verl-recipe's
reward queue (keys and metric names), verl v1's off-policy metric names, and model paths checked before Ray starts."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from omni_async.agent_loop.draws import Draws
from omni_async.config.model_paths import path_problem, pipeline_class
from omni_async.config_error import ConfigErrors
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.vllm_server import server_command
from omni_async.sample import RewardOutcome
from omni_async.trainer.config import ConfigError, check_at_start, compose, validate
from omni_async.trainer.dataset import first_rows
from omni_async.trainer.loop import RLTrainer
from omni_async.trainer.metrics import discard_metrics
from omni_async.trainer.mode import mode_of

BASE = ["data.train_files=x.jsonl"]


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
    lora = "actor_rollout_ref.model.lora_rank=8"  # the reference is the adapter-off model
    on = validate(
        compose([*BASE, lora, "actor_rollout_ref.actor.kl_loss_coef=0.04", "actor_rollout_ref.actor.use_kl_loss=True"])
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
# LoRA pinned: a full fine-tune (the default rank 0) ships weights to a rollout pool only with checkpoint_engine nccl
POOL = [
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.model.lora_rank=8",
]
SEPARATE = [*BASE, "trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async", *POOL]


def test_separate_async_without_its_keys_takes_verl_omnis_defaults():
    """verl-omni's ``trainer.v1`` defaults (``diffusion_trainer.yaml``): a sync every 4 updates, a backlog of 1 train
    batch (staleness 1/4 here), trajectories spanning at most 8 versions, groups past that dropped."""
    cfg = validate(compose(SEPARATE))
    at, sampler = cfg.async_training, cfg.trainer.v1.sampler
    assert (at.trigger_parameter_sync_step, cfg.trainer.v1.separate_async.num_warmup_batches) == (4, 1)
    assert at.staleness_threshold == 0.25
    assert (sampler.max_off_policy_threshold, sampler.max_off_policy_strategy) == (8, "drop")
    m = mode_of(cfg)
    assert m.sync_period == 4 and not m.wait_for_stale
    # n = 2 groups per update: cap floor(1.25 x 4 x 2) = 10, lag bound ceil(10 / 2) - 1 = 4 (< 8 - 1)
    assert (m.cap, m.bound) == (10, 4)
    assert validate(cfg) == cfg  # idempotent
    raw = compose(SEPARATE)  # validation returns the resolved config and leaves the one it was given as given
    before = OmegaConf.to_container(raw)
    assert validate(raw) == cfg and OmegaConf.to_container(raw) == before and raw != cfg
    given = [
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0.5",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        "trainer.v1.sampler.max_off_policy_strategy=wait",
    ]
    own = validate(compose([*SEPARATE, *given]))
    assert own.async_training.trigger_parameter_sync_step == 2 and own.async_training.staleness_threshold == 0.5
    assert own.trainer.v1.separate_async.num_warmup_batches is None
    assert (own.trainer.v1.sampler.max_off_policy_threshold, mode_of(own).wait_for_stale) == (3, True)
    # this project's own fully async spelling keeps its defaults: sync every update, no span limit, dropless
    fa = validate(compose([*BASE, *POOL, "async_reward.fully_async=true"]))
    assert fa.async_training.trigger_parameter_sync_step is None and fa.async_training.staleness_threshold == 0.1
    assert (fa.trainer.v1.sampler.max_off_policy_threshold, fa.trainer.v1.sampler.max_off_policy_strategy) == (
        None,
        "wait",
    )


def test_num_warmup_batches_is_the_backlog_fractional_included():
    one = "trainer.v1.separate_async.parameter_sync_step=1"
    cfg = validate(compose([*SEPARATE, "trainer.v1.separate_async.num_warmup_batches=0.5", one]))
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
        self.score_many = SimpleNamespace(remote=self._score_many)  # the dispatcher's call: a turn's records at once

    @staticmethod
    async def _score_many(records):
        return [RewardOutcome("ok", score=1.0) for _ in records]


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
    # cumulative dropped samples, sum of their lags (step - version), dropped groups
    counts = iter([(0, 0, 0), (3, 6, 1), (3, 6, 1), (5, 13, 2)])

    def rollouter_metrics():
        dropped, staleness, groups = next(counts)
        return {
            "fully_async/count/dropped_stale_samples": dropped,
            "fully_async/count/dropped_staleness_sum": staleness,
            "fully_async/count/dropped_stale_groups": groups,
        }

    trainer = SimpleNamespace(
        _t_metrics=0.0,
        _idle=[],
        _dropped_before=(0.0, 0.0, 0.0),
        agent=SimpleNamespace(on_loop=lambda f: f(), take_idle_s=lambda: 0.0),
        producer=SimpleNamespace(metrics=rollouter_metrics),  # the trainer reads them through Producer.metrics
    )
    rows = [RLTrainer.producer_metrics(trainer, 1.0, 0.0) for _ in range(4)]
    assert [r["training/off_policy/dropped_samples"] for r in rows] == [0, 3, 0, 2]
    # verl v1's replay buffer: stale groups evicted this step, and the versions each spanned (lag + 1)
    assert [r["training/off_policy/evicted_samples"] for r in rows] == [0, 1, 0, 1]
    assert [r.get("training/off_policy/evicted_samples_staleness/mean") for r in rows] == [None, 3.0, None, 4.5]
    assert all("fully_async/count/dropped_staleness_sum" not in r for r in rows)
    # every dropped sample is a discarded one
    assert [discard_metrics(r)["training/discarded_samples"] for r in rows] == [0, 3, 0, 2]


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


def test_a_checkpoint_of_a_pipeline_not_trained_here_is_refused_before_ray_with_every_other_problem(
    tmp_path, monkeypatch
):
    """A pipeline class with no adapter here (SDXL) is refused at start naming its class, not by diffusers inside a
    Ray actor; a start with two problems names both at once. verl-omni's Qwen-Image-Edit (``QwenImageEditPlusPipeline``)
    starts."""
    import omni_async.trainer.loop as loop

    monkeypatch.setattr(loop, "init_ray", lambda cfg: pytest.fail("Ray started for a config that cannot run"))
    for name, cls in [
        ("edit", "QwenImageEditPlusPipeline"),
        ("sdxl", "StableDiffusionXLPipeline"),
        ("flux", "FluxPipeline"),
        ("sd3", "StableDiffusion3Pipeline"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        assert pipeline_class(str(tmp_path / name)) == cls
    assert pipeline_class("tiny:sd3") is None and pipeline_class(str(tmp_path)) is None  # built here / no index
    assert pipeline_class("Qwen/No-Such-Model-Here") is None  # not cached, hub off (tests): loading will tell

    for trained in ("edit", "flux"):  # Qwen-Image-Edit-2511 and FLUX.1 are trained here
        assert check_at_start(compose([*BASE, f"actor_rollout_ref.model.path={tmp_path}/{trained}"]))
    edit = f"actor_rollout_ref.model.path={tmp_path}/sdxl"
    with pytest.raises(
        ConfigError,
        match=r"^actor_rollout_ref\.model\.path: .* is a StableDiffusionXLPipeline; the diffusion pipelines trained "
        "here are QwenImagePipeline",
    ):
        RLTrainer(compose([*BASE, edit]))
    bad_reward = "reward.custom_reward_function.path=/no/such/reward.py"
    with pytest.raises(ConfigErrors) as err:
        RLTrainer(compose([*BASE, edit, bad_reward]))
    assert [k for k, _ in err.value.problems] == ["reward.custom_reward_function.path", "actor_rollout_ref.model.path"]
    assert str(err.value).startswith("2 problems stop this run:\n- reward.custom_reward_function.path")
    cfg = compose([*BASE, f"actor_rollout_ref.model.path={tmp_path}/sd3"])
    assert check_at_start(cfg) == validate(cfg)  # a supported pipeline starts, with the validated config
    with pytest.raises(ConfigError, match=r"^reward\.custom_reward_function\.path"):  # one problem: a plain one
        check_at_start(compose([*BASE, bad_reward]))


def test_use_kl_loss_true_without_a_coefficient_takes_verls_default():
    """verl's actor config (``verl/trainer/config/actor/actor.yaml``; verl-omni's ``diffusion_actor.yaml`` alike):
    ``use_kl_loss: false``, ``kl_loss_coef: 0.001``, so switching the term on without a coefficient trains with
    0.001. Neither key set: no KL term; the coefficient alone (``use_kl_loss`` unset): that coefficient."""
    lora = "actor_rollout_ref.model.lora_rank=8"
    for config_name in ("flowgrpo_trainer", "grpo_text_trainer"):
        on = validate(compose([*BASE, lora, "actor_rollout_ref.actor.use_kl_loss=True"], config_name=config_name))
        assert on.actor_rollout_ref.actor.kl_loss_coef == 0.001
        off = validate(compose([*BASE, lora], config_name=config_name))
        assert off.actor_rollout_ref.actor.kl_loss_coef == 0.0
        alone = validate(compose([*BASE, lora, "actor_rollout_ref.actor.kl_loss_coef=0.02"], config_name=config_name))
        assert alone.actor_rollout_ref.actor.kl_loss_coef == 0.02


def test_fsdp2_offload_policy_is_param_and_optimizer_offload():
    """verl's ``fsdp_config.offload_policy=true`` (FSDP2 keeps parameters and optimizer state on the CPU) composes
    to this project's param_offload + optimizer_offload; false changes nothing; a contradicting value is refused."""
    from omni_async.config.overrides import OverrideError
    from omni_async.trainer.config import compose

    key = "actor_rollout_ref.actor.fsdp_config"
    on = compose([f"{key}.offload_policy=true"]).actor_rollout_ref.actor.fsdp_config
    assert on.param_offload is True and on.optimizer_offload is True
    off = compose([f"{key}.offload_policy=false"]).actor_rollout_ref.actor.fsdp_config
    assert off.param_offload is False and off.optimizer_offload is False
    both = compose([f"{key}.offload_policy=true", f"{key}.param_offload=true"]).actor_rollout_ref.actor.fsdp_config
    assert both.param_offload is True and both.optimizer_offload is True
    with pytest.raises(
        OverrideError, match=r"offload_policy=true sets .*optimizer_offload=true.*optimizer_offload=false"
    ):
        compose([f"{key}.offload_policy=true", f"{key}.optimizer_offload=false"])
