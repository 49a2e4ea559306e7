"""The shipped config composes with documented overrides; semantic mistakes fail at start with a named key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from omni_async.trainer.config import ConfigError, check_at_start, compose, streaming_enabled, validate

BASE = ["data.train_files=x.jsonl"]


def test_defaults_compose_and_validate():
    cfg = validate(compose(BASE))
    assert cfg.actor_rollout_ref.model.path == "tiny:qwen_image"
    assert cfg.reward.custom_reward_function.path.startswith("pkg://")
    assert streaming_enabled(cfg)  # auto + no reward model -> stream (verl's rule)
    assert not streaming_enabled(compose(BASE + ["reward.streaming=false"]))


def test_documented_overrides():
    cfg = validate(
        compose(
            BASE
            + [
                "reward.reward_model.enable=True",
                "reward.reward_model.model_path=tiny:qwen2_vl",
                "reward.reward_model.enable_resource_pool=True",
                "reward.reward_model.n_gpus_per_node=2",
                "reward.num_workers=2",
                "actor_rollout_ref.rollout.n=8",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "reward.streaming=auto",
            ]
        )
    )
    assert streaming_enabled(cfg) and cfg.reward.num_workers == 2
    colocated = validate(
        compose(
            BASE
            + [
                "reward.streaming=auto",
                "reward.reward_model.enable=True",
                "reward.reward_model.model_path=tiny:qwen2_vl",
            ]
        )
    )
    assert not streaming_enabled(colocated)  # reward model sharing the actor pool -> sync
    assert not streaming_enabled(compose(BASE + ["reward.streaming=false"]))


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "actor_rollout_ref.actor.optim.lr=fast",
            "actor_rollout_ref.actor.optim.lr='fast': expected a number, got str",
        ),
        ("trainer.seed=1.5", "trainer.seed=1.5: expected a whole number, got float"),
        ("reward.timeout_s=120s", "reward.timeout_s='120s': expected a number, got str"),
        ("trainer.val_before_train=maybe", "trainer.val_before_train='maybe': expected true or false"),
        (
            "actor_rollout_ref.rollout.algo.sde_window_range=[0,x]",
            "actor_rollout_ref.rollout.algo.sde_window_range[1]='x': expected a whole number",
        ),
        ("trainer.total_training_steps=many", "trainer.total_training_steps='many': expected a whole number"),
    ],
)
def test_wrong_type_fails_at_compose_naming_key_value_and_type(override, message):
    key = override.split("=")[0]  # a list's element is named in the message, the list in the fix
    with pytest.raises(ConfigError) as err:
        compose(BASE + [override])
    assert str(err.value).startswith(message) and f"Fix: set {key} to the right type, e.g. {key}=" in str(err.value)


def test_types_admit_what_the_keys_mean():
    cfg = compose(
        BASE
        + [
            "reward.timeout_s=2.5",
            "trainer.total_training_steps=null",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "+reward.custom_reward_function.reward_kwargs.anything=[1,x]",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
            "data.train_files=[a.jsonl,b.jsonl]",
        ]
    )
    assert cfg.reward.timeout_s == 2.5 and cfg.trainer.total_training_steps is None
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-3 and list(cfg.data.train_files) == ["a.jsonl", "b.jsonl"]
    text = compose(BASE, "grpo_text_trainer")  # one schema serves both config files
    assert text.actor_rollout_ref.model.modality == "text"


def test_every_nullable_key_has_a_type():
    """A key whose default is null in every config file says its type in config.schema.NULLABLE (else any value
    would pass)."""
    from omegaconf import OmegaConf

    from omni_async.config.schema import NULLABLE
    from omni_async.trainer.config import CONFIG_NAMES, compose_untyped

    def nulls(node, prefix=""):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                yield from nulls(v, key + ".")
            elif v is None:
                yield key

    configs = [OmegaConf.create(compose_untyped([], name)) for name in CONFIG_NAMES]
    null_somewhere = {k for c in configs for k in nulls(OmegaConf.to_container(c, resolve=False))}
    # A key null in one file and set in another takes the set value's type.
    untyped = {k for k in null_somewhere if all(OmegaConf.select(c, k) is None for c in configs)} - set(NULLABLE)
    assert not untyped, f"add these keys' types to config.schema.NULLABLE: {sorted(untyped)}"


def test_mini_batch_feeds_every_actor_rank():
    """verl's rule is ppo_mini_batch_size x rollout.n samples divisible by the ranks; here a rank trains whole
    groups, so a mini-batch needs at least one group (prompt) per rank."""
    ranks = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.agent.num_workers=4", "data.train_batch_size=16"]
    for mb in (4, 8, 16):
        validate(compose(BASE + ranks + [f"actor_rollout_ref.actor.ppo_mini_batch_size={mb}"]))
    split = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.agent.num_workers=1"]
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):  # the split layout's actor has 4 ranks too
        validate(compose(BASE + ranks[::2] + split))


def test_ulysses_groups_divide_the_actor_ranks_and_count_as_one_data_parallel_rank():
    """verl's ulysses_sequence_parallel_size: groups of sp actor ranks, each trains one data-parallel share (so the
    mini-batch feeds ranks / sp) and, in the hybrid layout, is one rollout worker; LoRA on a diffusion transformer
    only; anything else refused naming the key."""
    key = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
    four = [
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.agent.num_workers=4",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.model.lora_rank=4",
    ]
    cfg = validate(compose(BASE + four + [f"{key}=2"]))  # 2 groups of 2 ranks: 2 prompts per mini-batch feed them
    assert cfg.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size == 2
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):  # sp=1: 4 data-parallel ranks for 2 groups
        validate(compose(BASE + four))
    # a rollout worker per group (it generates together) or, above, per rank (each generates alone)
    validate(compose(BASE + four + [f"{key}=2", "actor_rollout_ref.rollout.agent.num_workers=2"]))
    with pytest.raises(ConfigError, match="num_workers.*per actor device \\(4\\), or 2 \\(one per sequence-par"):
        validate(compose(BASE + four + [f"{key}=2", "actor_rollout_ref.rollout.agent.num_workers=3"]))
    for extra, why in (
        ([f"{key}=3"], "divide the 4 actor ranks"),
        ([f"{key}=2", "actor_rollout_ref.model.lora_rank=0"], "full fine-tune"),
        ([f"{key}=2", "actor_rollout_ref.model.attn_backend=_native_math"], "no context-parallel path"),
    ):
        with pytest.raises(ConfigError, match=f"{key}.*{why}"):
            validate(compose(BASE + four + extra))
    with pytest.raises(ConfigError, match=f"{key}.*text policy"):
        validate(compose([*BASE, *four, f"{key}=2"], config_name="grpo_text_trainer"))
    sd3 = [*four, f"{key}=2", "actor_rollout_ref.model.path=tiny:sd3"]  # before Ray: its transformer has no plan
    with pytest.raises(ConfigError, match=f"{key}.*StableDiffusion3Pipeline's SD3Transformer2DModel declares no"):
        check_at_start(compose(BASE + sd3))
    check_at_start(compose(BASE + four + [f"{key}=2"]))  # tiny:qwen_image's has one


def test_unknown_key_is_a_config_error_naming_the_nearest_keys():
    with pytest.raises(ConfigError, match=r"^reward\.not_a_key: not a key .*nearest keys are reward\.") as err:
        compose(BASE + ["reward.not_a_key=1"])
    assert not isinstance(err.value, (ConfigCompositionException, ConfigAttributeError))


def test_missing_train_files():
    with pytest.raises(ConfigError, match="data.train_files.*prepare_ocr_prompts"):
        validate(compose([]))


@pytest.mark.parametrize(
    "overrides,key,fix",
    [
        (
            ["reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=0"],
            "reward.reward_model.n_gpus_per_node",
            "enable_resource_pool=False",
        ),
        (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "rollout.n=4"),
        (
            ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "ppo_mini_batch_size",
            "divisor",
        ),
        (["reward.streaming=maybe"], "reward.streaming", "auto, true or false"),
        (["reward.on_failure=zero"], "reward.on_failure", "mask"),
        (["reward.max_failure_ratio=1.5"], "reward.max_failure_ratio", "0.25"),
        (["actor_rollout_ref.rollout.algo.sde_window_size=20"], "sde_window_size", "no longer"),
        (["actor_rollout_ref.rollout.algo.sde_window_range=[5,11]"], "sde_window_range", "hi <= 10"),
        (
            [
                "actor_rollout_ref.rollout.algo.sde_window_size=3",
                "actor_rollout_ref.rollout.algo.sde_window_range=[2,4]",
            ],
            "actor_rollout_ref.rollout.algo.sde_window_range",
            "sde_window_size",
        ),
        (
            ["async_reward.one_step_off_policy=true", "algorithm.rollout_correction.bypass_mode=false"],
            "algorithm.rollout_correction.bypass_mode",
            "bypass_mode=true",
        ),
        (
            ["async_reward.update_pipeline=true", "algorithm.global_std=true"],
            "algorithm.global_std",
            "global_std=false",
        ),
        (["reward.queue_size=0"], "reward.queue_size", "default"),
        (["reward.linger_ms=-1"], "reward.linger_ms", "default 200"),
        (["reward.reward_manager.name=dapo"], "reward.reward_manager.name", "naive"),
        (["reward.reward_model.rollout.gpu_memory_utilization=0"], "gpu_memory_utilization", "0.5"),
        (["reward.reward_model.enable_resource_pool=True", "reward.num_workers=3"], "reward.num_workers", "tensor"),
        (["reward.reward_model.enable=True"], "reward.reward_model.model_path", "tiny:qwen2_vl"),
        (
            ["reward.custom_reward_function.path=does/not/exist.py"],
            "reward.custom_reward_function.path",
            "does/not/exist.py",
        ),
        (
            ["reward.custom_reward_function.name=compute_scor"],
            "reward.custom_reward_function.name",
            "did you mean 'compute_score'",
        ),
        (["actor_rollout_ref.rollout.height=60"], "height/width", "64x64"),
        (
            ["actor_rollout_ref.actor.kl_loss_coef=0.04", "actor_rollout_ref.model.lora_rank=0"],
            "actor_rollout_ref.actor.kl_loss_coef",
            "lora_rank=8",
        ),
        # 4 actor ranks, 2 groups per mini-batch: groups are never split, so two ranks would train on padding rows
        (
            ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.agent.num_workers=4", "data.train_batch_size=16"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "ppo_mini_batch_size=4",
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "trainer.nnodes=2",
                "actor_rollout_ref.rollout.agent.num_workers=4",
                "data.train_batch_size=6",
                "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            ],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "data.train_batch_size to a multiple of 4",
        ),
        (["actor_rollout_ref.nccl_timeout=0"], "actor_rollout_ref.nccl_timeout", "600"),
    ],
)
def test_semantic_errors_name_key_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as exc:
        validate(compose(BASE + overrides))
    msg = str(exc.value)
    assert msg.startswith(key) or key in msg.split(":")[0], msg
    assert fix in msg, msg


def test_kl_with_full_fine_tune_is_refused_at_start_text_too():
    """The worker's reference policy is the adapter-off model (``TrainableModule.reference``), which a full fine-tune
    does not have: refused here, before any Ray actor, for both modalities; with LoRA it validates."""
    text = ["data.train_files=x.jsonl", "actor_rollout_ref.actor.kl_loss_coef=0.001"]
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.kl_loss_coef.*lora_rank=0"):
        validate(compose(text, config_name="grpo_text_trainer"))  # its default is a full fine-tune
    validate(compose(text + ["actor_rollout_ref.model.lora_rank=8"], config_name="grpo_text_trainer"))


def test_param_offload_is_refused_for_text_at_start():
    cfg = compose(
        ["data.train_files=x.jsonl", "actor_rollout_ref.actor.fsdp_config.param_offload=True"],
        config_name="grpo_text_trainer",
    )
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.fsdp_config.param_offload.*set it to False"):
        validate(cfg)
