"""The ``reward`` section's checks (``trainer.config.validate`` runs them at start, before any Ray actor exists):
each error names the key and the fix."""

from __future__ import annotations

from omegaconf import DictConfig

from omni_async.cluster import reward_pool_size
from omni_async.config_error import ConfigError
from omni_async.config_error import check as _check


def check_reward(cfg: DictConfig) -> None:
    """The reward loop (streaming, workers, queue, failure policy), the reward functions (loaded here, so a wrong path
    fails at once) and the reward model's pool."""
    reward, modality = cfg.reward, cfg.actor_rollout_ref.model.modality
    _check(
        str(reward.streaming).lower() in ("auto", "true", "false"),
        "reward.streaming",
        f"unknown mode {reward.streaming!r}",
        "use auto, true or false",
    )
    _check(reward.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {reward.num_workers}", "set it to 1")
    for key in ("queue_size", "max_inflight_per_worker"):
        _check(reward[key] >= 1, f"reward.{key}", f"must be >= 1, got {reward[key]}", "use the default")
    _check(reward.max_resends >= 0, "reward.max_resends", f"must be >= 0, got {reward.max_resends}", "e.g. 2")
    _check(reward.timeout_s > 0, "reward.timeout_s", "every reward call needs a positive deadline", "e.g. 120")
    _check(
        0 <= reward.linger_ms <= 1000 * reward.timeout_s,
        "reward.linger_ms",
        f"must be in [0, reward.timeout_s * 1000], got {reward.linger_ms}",
        "use the default 200, or 0 to send each event-loop turn's chunks at once",
    )
    _check(
        reward.on_failure in ("mask", "raise"),
        "reward.on_failure",
        f"unknown policy {reward.on_failure!r}",
        "use mask (default) or raise",
    )
    _check(
        0.0 <= reward.max_failure_ratio <= 1.0,
        "reward.max_failure_ratio",
        f"must be in [0, 1], got {reward.max_failure_ratio}",
        "e.g. 0.25",
    )
    _check_reward_functions(reward, modality)

    rm = reward.reward_model
    if rm.enable_resource_pool:
        size = reward_pool_size(cfg)
        _check(
            size >= 1,
            "reward.reward_model.n_gpus_per_node",
            f"a dedicated reward pool of n_gpus_per_node x nnodes = {size} devices cannot host a worker",
            "give the pool devices (e.g. reward.reward_model.n_gpus_per_node=1) "
            "or set reward.reward_model.enable_resource_pool=False",
        )
        tp = rm.rollout.tensor_model_parallel_size
        _check(
            size % tp == 0,
            "reward.reward_model.rollout.tensor_model_parallel_size",
            f"TP={tp} does not divide the reward pool of {size} devices",
            "choose a divisor of the pool size",
        )
        _check(
            reward.num_workers <= size,
            "reward.num_workers",
            f"{reward.num_workers} workers do not fit a reward pool of {size} devices",
            "usually reward.num_workers = n_gpus_per_node x nnodes / tensor_model_parallel_size",
        )
    if rm.colocate_with_actor:
        _check_colocated_with_actor(cfg)
    if rm.enable:
        _check(
            rm.model_path is not None,
            "reward.reward_model.model_path",
            "reward model enabled without a model",
            "set reward.reward_model.model_path (a local dir, or tiny:qwen2_vl on CPU)",
        )
    _check(
        rm.rollout.name in ("transformers", "vllm"),
        "reward.reward_model.rollout.name",
        f"unknown engine {rm.rollout.name!r}",
        "use transformers or vllm",
    )
    if rm.enable and rm.rollout.name == "vllm":
        _check(
            bool(rm.enable_resource_pool),
            "reward.reward_model.enable_resource_pool",
            "vLLM judge servers run on the dedicated reward pool",
            "set reward.reward_model.enable_resource_pool=True",
        )
        tp = rm.rollout.tensor_model_parallel_size
        _check(
            tp >= 1 and rm.n_gpus_per_node % tp == 0,
            "reward.reward_model.rollout.tensor_model_parallel_size",
            f"a TP={tp} vLLM server must fit on one node of {rm.n_gpus_per_node} reward devices",
            "choose a divisor of reward.reward_model.n_gpus_per_node",
        )
    _check(
        0.0 < rm.rollout.gpu_memory_utilization <= 1.0,
        "reward.reward_model.rollout.gpu_memory_utilization",
        f"must be in (0, 1], got {rm.rollout.gpu_memory_utilization}",
        "e.g. 0.5",
    )
    _check(
        reward.reward_manager.name in ("naive", "MultiVisualRewardManager"),
        "reward.reward_manager.name",
        f"unknown reward manager {reward.reward_manager.name!r}",
        "use naive (one reward function) or MultiVisualRewardManager (weighted reward.reward_functions)",
    )
    if reward.reward_manager.name == "MultiVisualRewardManager":
        _check(
            len(reward.reward_functions) > 0,
            "reward.reward_functions",
            "MultiVisualRewardManager combines several weighted reward functions, but none is configured",
            "add reward.reward_functions.<key>={path,name,weight} entries (or use reward_manager.name=naive)",
        )


def _check_reward_functions(reward: DictConfig, modality: str) -> None:
    """Load every configured reward function here, on the driver, so a wrong path or name fails at once with the
    config key (not inside a Ray actor half a minute later). No path: dispatch by ``data_source``, as verl does."""
    from omni_async.reward.contract import check_reward_function
    from omni_async.reward.manager import check_judge_model_kwargs, reward_specs

    try:
        for spec in reward_specs(reward):
            check_judge_model_kwargs(
                spec,
                check_reward_function(
                    spec.path, spec.name, spec.config_key, spec.kwargs, modality, only_declared=spec.only_declared
                ),
            )
    except ValueError as e:  # a RewardConfigError, or a reward_functions entry without path / name
        raise ConfigError(str(e)) from e


def _check_colocated_with_actor(cfg: DictConfig) -> None:
    """``reward.reward_model.colocate_with_actor``: the reward-loop workers on the actor pool's devices, at most one
    per device (each takes its share of one; a second there would ask more than the device has)."""
    from omni_async.reward.wiring import streaming_enabled

    reward, rm, key = cfg.reward, cfg.reward.reward_model, "reward.reward_model.colocate_with_actor"
    _check(
        not rm.enable_resource_pool,
        key,
        "the reward-loop workers sit either beside the actor or on their own pool (enable_resource_pool), not both",
        "drop one of the two",
    )
    _check(
        not (rm.enable and rm.rollout.name == "vllm"),
        key,
        "vLLM judge servers run on the dedicated reward pool",
        "set reward.reward_model.enable_resource_pool=True instead",
    )
    _check(
        streaming_enabled(cfg),
        key,
        "places the reward-loop workers, and reward.streaming=false scores in the trainer's process (none are made)",
        "set reward.streaming=auto (or true), or drop colocate_with_actor",
    )
    devices = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    _check(
        reward.num_workers <= devices,
        "reward.num_workers",
        f"{reward.num_workers} workers beside the actor need as many actor devices, the actor has {devices}",
        f"set reward.num_workers={devices} (one per actor device) or fewer",
    )
