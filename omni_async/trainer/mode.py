"""The training mode as one value: how the one producer (``agent_loop.rollouter``) and the update run.

Every spelling of a mode is a preset of :class:`Mode`::

    preset                 keys                                           streaming  lock-step  staleness  pipelined
    sync                   reward.streaming=false                         no         yes        0          no
    stream                 reward.streaming=true (auto: verl's rule)      yes        yes        0          no
    stream+pipeline        async_reward.update_pipeline=true              yes        yes        0          yes
    stream+one_step_off    async_reward.one_step_off_policy=true          yes        yes        1          no
    all                    both of the above                              yes        yes        1          yes
    fully_async            async_reward.fully_async=true, or verl v1's    yes        no         s          no
                           trainer.v1.trainer_mode=separate_async (a
                           rollout pool) / colocate_async (no pool)

(``reward.streaming=false`` combines with any of them: the reward is then one colocated call per trained chunk.)
verl v1's ``trainer_mode=sync`` is on-policy lock-step. A **step** is one trainer batch in every mode: the groups
trained under one weights version before the step counter (= the version counter) moves on —
``data.train_batch_size`` prompts in lock-step, ``require_batches x ppo_mini_batch_size`` in fully async — trained as
``ppo_mini_batch_size``-group mini-batches (one optimizer step each) x ``ppo_epochs``.

*Lock-step* means a step trains the oldest draw's groups, each draw made by one weights version: staleness 0 is the
on-policy pipeline (a draw starts once the previous step synced), 1 one-step-off (the next draw generates while a
step trains). *Fully async* trains any scored groups, oldest weights first, with verl's ``staleness_threshold``.
Production per sync window (``cap``): fully async ``floor((1 + s) x K x n)`` (verl's ``max_required_samples``);
lock-step ``(K + s) x n``, so at ``K = 1`` both agree and at ``K > 1`` lock-step one-step-off keeps one draw ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from omni_async.agent_loop.rollouter import ProducerSettings
from omni_async.algos.staleness import effective_bound, groups_per_window, lag_bound
from omni_async.config_error import check as _check
from omni_async.reward.wiring import streaming_enabled


@dataclass(frozen=True)
class Mode:
    streaming: bool  # each sample is scored as it is generated (else one colocated reward call per trained chunk)
    lock_step: bool  # a step trains the oldest draw's groups, each draw by one weights version
    staleness: float  # lock-step: 0 on-policy, 1 one-step-off; fully async: verl's staleness_threshold
    pipelined: bool  # an optimizer step per ppo_mini_batch_size groups as soon as they are scored
    groups_per_step: int  # GRPO groups (prompts) one step trains
    mini_batch: int  # groups per optimizer step (ppo_mini_batch_size)
    sync_period: int  # steps between two weight syncs (async_training.trigger_parameter_sync_step)
    cap: int  # groups the producer starts per sync window
    bound: int  # the largest lag (trainer step - weights version) a trained group may have
    wait_for_stale: bool  # verl v1's max_off_policy_strategy=wait
    interrupts_at_sync: bool  # a sync interrupts text responses in flight, continued under the new weights

    @property
    def name(self) -> str:
        """The preset's name (the benchmarks' and the logs'); a sync reward on an overlapped mode reads
        ``sync+...``."""
        if not self.lock_step:
            return "fully_async"
        if self.streaming and self.pipelined and self.staleness > 0:
            return "all"
        parts = ["stream" if self.streaming else "sync"]
        parts += ["pipeline"] * self.pipelined + ["one_step_off"] * (self.staleness > 0)
        return "+".join(parts)

    @property
    def overlaps_update(self) -> bool:
        """Whether generation can run while the actor trains (the hybrid layout then generates from a snapshot of the
        LoRA adapter)."""
        return self.pipelined or self.staleness > 0 or not self.lock_step

    @property
    def producer(self) -> ProducerSettings:
        return ProducerSettings(
            cap=self.cap, bound=self.bound, wait_for_stale=self.wait_for_stale, lock_step=self.lock_step
        )


def mode_of(cfg: DictConfig) -> Mode:
    """The mode of a validated config (``config.validate`` resolved every spelling into ``async_reward.*``)."""
    a, at, actor = cfg.async_reward, cfg.async_training, cfg.actor_rollout_ref.actor
    mini = int(actor.ppo_mini_batch_size)
    lock_step = not a.fully_async
    k = at.trigger_parameter_sync_step
    if lock_step:
        n = int(cfg.data.train_batch_size)
        staleness = 1.0 if a.one_step_off_policy else 0.0
        sync_period = 1 if k is None else int(k) * mini // n
        cap = (sync_period + int(staleness)) * n
        bound = lag_bound(cap, n)
        threshold = None
    else:
        n = int(at.require_batches) * mini
        staleness = float(at.staleness_threshold)
        sync_period = 1 if k is None else int(k)
        cap = groups_per_window(staleness, sync_period, at.require_batches, mini)
        threshold = cfg.trainer.v1.sampler.max_off_policy_threshold
        cap, bound = effective_bound(cap, n, threshold)
    return Mode(
        streaming=streaming_enabled(cfg),
        lock_step=lock_step,
        staleness=staleness,
        pipelined=bool(a.update_pipeline),
        groups_per_step=n,
        mini_batch=mini,
        sync_period=sync_period,
        cap=cap,
        bound=bound,
        wait_for_stale=cfg.trainer.v1.sampler.max_off_policy_strategy != "drop",  # (validate resolves null)
        interrupts_at_sync=interrupts_at_sync(cfg),
    )


def interrupts_at_sync(cfg: DictConfig) -> bool:
    """Whether a weight sync interrupts the responses being generated, which are then continued under the new
    weights: verl's ``async_training.partial_rollout`` in fully async training, for text. Images are one device
    batch each: a sample in flight at a sync finishes under the version that started it (never interrupted)."""
    return bool(
        cfg.async_reward.fully_async
        and cfg.async_training.partial_rollout
        and cfg.actor_rollout_ref.model.modality == "text"
    )


# verl-omni's ``trainer.v1`` defaults for ``trainer_mode=separate_async`` (``diffusion_trainer.yaml``, a1139ba; verl v1's
# ``ppo_trainer.yaml`` has the same), taken by the keys such a run does not give: a weight sync every 4 updates, a
# backlog of 1 train batch, a trajectory spanning at most 8 versions, and a group past that dropped.
SEPARATE_ASYNC_DEFAULTS = {
    "trainer.v1.separate_async.parameter_sync_step": 4,
    "trainer.v1.separate_async.num_warmup_batches": 1,
    "trainer.v1.sampler.max_off_policy_threshold": 8,
    "trainer.v1.sampler.max_off_policy_strategy": "drop",
}
VERL_STALENESS_DEFAULT = 0.1  # async_training.staleness_threshold's default (verl's): a run that did not give it


def resolve_trainer_mode(cfg: DictConfig) -> None:
    """verl v1's ``trainer.v1.trainer_mode`` as the preset it names, written into ``async_reward.*``: ``sync`` is
    on-policy lock-step, ``separate_async`` fully async on a rollout pool (with verl-omni's defaults for the keys it
    does not give: :data:`SEPARATE_ASYNC_DEFAULTS`), ``colocate_async`` fully async on the devices that train (the
    hybrid or split layout). A project key that asks for another mode is refused."""
    t, a = cfg.trainer, cfg.async_reward
    mode = t.v1.trainer_mode
    sa = t.v1.separate_async
    _check(
        mode in ("separate_async", "colocate_async") or (sa.num_warmup_batches is None and not sa.sync_compatible),
        "trainer.v1.separate_async.num_warmup_batches",
        f"the separate_async backlog settings are read only with trainer.v1.trainer_mode=separate_async ({mode} given)",
        "set trainer.v1.trainer_mode=separate_async, or drop num_warmup_batches / sync_compatible",
    )
    if mode == "separate_async":
        _separate_async_defaults(cfg)
    elif t.v1.sampler.max_off_policy_strategy is None:
        t.v1.sampler.max_off_policy_strategy = "wait"  # this project's own fully async: dropless
    if mode is None:
        return
    _check(
        t.use_v1 is not False,
        "trainer.v1.trainer_mode",
        f"trainer.use_v1=false selects verl's legacy trainer, which has no trainer_mode ({mode!r} given)",
        "drop trainer.v1.trainer_mode, or set trainer.use_v1=true",
    )
    _check(
        mode in ("sync", "colocate_async", "separate_async"),
        "trainer.v1.trainer_mode",
        f"unknown mode {mode!r}",
        "use sync, colocate_async or separate_async (or leave it null and use this project's keys)",
    )
    if mode == "sync":
        for key in ("one_step_off_policy", "fully_async"):
            _check(
                not a[key],
                "trainer.v1.trainer_mode",
                f"sync trains on-policy but async_reward.{key}=true asks for off-policy training",
                "drop one of them",
            )
        return
    pool = int(cfg.actor_rollout_ref.rollout.nnodes) > 0
    _check(
        pool or mode == "colocate_async",
        "trainer.v1.trainer_mode",
        "separate_async runs rollout on its own devices, but there is no rollout pool (nnodes=0)",
        "set actor_rollout_ref.rollout.nnodes=1 and actor_rollout_ref.rollout.n_gpus_per_node=N, or "
        "trainer.v1.trainer_mode=colocate_async (rollout on the devices that train)",
    )
    _check(
        not pool or mode == "separate_async",
        "trainer.v1.trainer_mode",
        "colocate_async generates on the devices that train, but a rollout pool is configured "
        "(actor_rollout_ref.rollout.nnodes > 0)",
        "use trainer.v1.trainer_mode=separate_async with a rollout pool, or drop the pool",
    )
    _resolve_warmup(cfg)
    _check(
        not a.one_step_off_policy,
        "trainer.v1.trainer_mode",
        f"{mode} is fully async training here (versions bounded by async_training.staleness_threshold / "
        "trainer.v1.sampler.max_off_policy_threshold), but async_reward.one_step_off_policy=true asks for lock-step "
        "one-step-off",
        "drop async_reward.one_step_off_policy=true (or trainer.v1.trainer_mode)",
    )
    a.fully_async = True


def _separate_async_defaults(cfg: DictConfig) -> None:
    """:data:`SEPARATE_ASYNC_DEFAULTS` for the keys not given. The sync period and the backlog also have this
    project's spellings (``async_training.trigger_parameter_sync_step``, ``async_training.staleness_threshold``):
    given there, they are given. Idempotent (``validate`` may run twice)."""
    at, sampler = cfg.async_training, cfg.trainer.v1.sampler
    d = SEPARATE_ASYNC_DEFAULTS
    if at.trigger_parameter_sync_step is None:  # (trainer.v1.separate_async.parameter_sync_step is folded into it)
        at.trigger_parameter_sync_step = d["trainer.v1.separate_async.parameter_sync_step"]
    sa = cfg.trainer.v1.separate_async
    if sa.num_warmup_batches is None and at.staleness_threshold == VERL_STALENESS_DEFAULT:
        sa.num_warmup_batches = d["trainer.v1.separate_async.num_warmup_batches"]
    if sampler.max_off_policy_threshold is None:
        sampler.max_off_policy_threshold = d["trainer.v1.sampler.max_off_policy_threshold"]
    if sampler.max_off_policy_strategy is None:
        sampler.max_off_policy_strategy = d["trainer.v1.sampler.max_off_policy_strategy"]


def _resolve_warmup(cfg: DictConfig) -> None:
    """verl v1's ``separate_async.{num_warmup_batches, sync_compatible}``: the rollout pool's backlog of train batches
    ahead of the trainer. Each sync window trains ``parameter_sync_step`` batches and the pool may start that many
    plus the backlog, which is this project's ``staleness_threshold`` of ``backlog / parameter_sync_step``."""
    sa, at = cfg.trainer.v1.separate_async, cfg.async_training
    warmup = sa.num_warmup_batches
    key = "trainer.v1.separate_async.num_warmup_batches"
    _check(
        not sa.sync_compatible or not warmup,
        "trainer.v1.separate_async.sync_compatible",
        f"pausing the rollout pool while the actor trains, with a backlog of {warmup} batches to generate, is not "
        "implemented",
        f"set {key}=0 (the pool then has nothing to generate while the actor trains), or sync_compatible=false",
    )
    if warmup is None:
        return
    _check(warmup >= 0, key, f"must be >= 0, got {warmup}", "e.g. 1 (0: on-policy)")
    staleness = float(warmup) / int(at.trigger_parameter_sync_step or 1)
    _check(
        at.staleness_threshold in (VERL_STALENESS_DEFAULT, staleness),  # verl's default, i.e. not given
        "async_training.staleness_threshold",
        f"async_training.staleness_threshold={at.staleness_threshold} and {key}={warmup} (= staleness "
        f"{staleness:g} at a sync step of {at.trigger_parameter_sync_step or 1}) are one setting given twice",
        "give only one of them (canonical: async_training.staleness_threshold)",
    )
    at.staleness_threshold = staleness


def check_mode(cfg: DictConfig) -> None:
    """The mode's own rules, on a config whose spellings are resolved: what each setting needs of the loss and the
    data, and verl's ``async_training.*`` / verl v1's ``trainer.v1.sampler.*`` ranges."""
    a, at, sampler = cfg.async_reward, cfg.async_training, cfg.trainer.v1.sampler
    _check(
        not (a.fully_async and a.one_step_off_policy),
        "async_reward.one_step_off_policy",
        "one-step-off is lock-step staleness 1; fully async sets its staleness with async_training.staleness_threshold "
        "(1 is about one-step-off)",
        "drop async_reward.one_step_off_policy=true, or async_reward.fully_async=true",
    )
    _check(
        sampler.max_off_policy_strategy in ("drop", "wait"),
        "trainer.v1.sampler.max_off_policy_strategy",
        f"unknown strategy {sampler.max_off_policy_strategy!r}",
        "use drop or wait (verl v1's values)",
    )
    threshold = sampler.max_off_policy_threshold
    _check(
        threshold is None or a.fully_async,
        "trainer.v1.sampler.max_off_policy_threshold",
        "bounds the versions a sample may span in fully async training, which is off",
        "set async_reward.fully_async=true (or trainer.v1.trainer_mode=separate_async), or drop the key",
    )
    rc = cfg.algorithm.rollout_correction
    off_policy = a.one_step_off_policy or a.update_pipeline or a.fully_async
    if off_policy:
        key = next(f"async_reward.{k}" for k in ("fully_async", "one_step_off_policy", "update_pipeline") if a[k])
        _check(
            bool(rc.bypass_mode) or (a.fully_async and rc.rollout_is is not None),
            "algorithm.rollout_correction.bypass_mode",
            f"{key}=true trains on samples of weights older than the ones being trained: pi_old must be the rollout's "
            "log-probs (verl's use_rollout_log_probs)"
            + (
                ", or, recomputed (decoupled mode), corrected by importance weights to the rollout's"
                if a.fully_async
                else ""
            ),
            "set algorithm.rollout_correction.bypass_mode=true"
            + (
                ", or keep it false and set algorithm.rollout_correction.rollout_is=token (or sequence)"
                if a.fully_async
                else ""
            ),
        )
    # Fully async trains a step's groups as one batch (update.update: one chunk), so its std is the step's batch's,
    # as verl's fully async trainer computes advantages over the batch it assembled from require_batches mini-batches.
    if a.update_pipeline:
        _check(
            not cfg.algorithm.global_std,
            "algorithm.global_std",
            "the mini-batch pipeline trains groups as they complete (advantages per group); a batch-wide std (the "
            "default, flow_grpo's and verl-omni's) would need the whole batch first",
            "set algorithm.global_std=false",
        )
    if not a.fully_async:
        return
    _check(
        at.staleness_threshold >= 0,
        "async_training.staleness_threshold",
        f"must be >= 0, got {at.staleness_threshold}",
        "0 (synchronous), or e.g. 0.5 / 1",
    )
    _check(
        at.require_batches >= 1,
        "async_training.require_batches",
        f"must be >= 1, got {at.require_batches}",
        "verl's default 1",
    )
    k = at.trigger_parameter_sync_step
    _check(
        k is None or k >= 1,
        "async_training.trigger_parameter_sync_step",
        f"must be >= 1, got {k}",
        "e.g. 1 (a sync after every update), or null",
    )
    n = int(at.require_batches) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    _check(
        cfg.rollout.total_rollout_steps is None or cfg.rollout.total_rollout_steps >= n,
        "rollout.total_rollout_steps",
        f"{cfg.rollout.total_rollout_steps} prompts is less than one update of "
        f"require_batches x ppo_mini_batch_size = {n}",
        "raise it (verl counts prompts)",
    )
    if threshold is not None:
        period = 1 if k is None else int(k)
        _check(
            threshold >= period,
            "trainer.v1.sampler.max_off_policy_threshold",
            f"{threshold} versions is less than the {period} updates between two weight syncs, which all train on the "
            "same version",
            f"set it >= {period} (async_training.trigger_parameter_sync_step), or lower the sync period",
        )
    _check(
        not (
            a.fully_async
            and at.partial_rollout
            and cfg.actor_rollout_ref.model.modality == "text"
            and cfg.actor_rollout_ref.rollout.name == "vllm"
        ),
        "async_training.partial_rollout",
        "continuing a text response across a weight sync is implemented for the transformers rollout only (a vLLM "
        "server's requests would have to be aborted and resubmitted with their tokens)",
        "set async_training.partial_rollout=false (a response in flight then finishes under the weights that started "
        "it), or actor_rollout_ref.rollout.name=transformers",
    )


def trains_off_policy(cfg: DictConfig) -> bool:
    """Whether the mode trains on samples drawn by weights older than the ones being trained, so pi_old must be the
    rollout's log-probs (or, fully async, be corrected toward them): one-step-off, the update pipeline, fully async,
    or a weight sync every more than one step (``async_training.trigger_parameter_sync_step``)."""
    a, k = cfg.async_reward, cfg.async_training.trigger_parameter_sync_step
    mb, tbs = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size), int(cfg.data.train_batch_size)
    period = k is not None and int(k) * mb // tbs > 1  # steps between two syncs (layout.check_layout's)
    return bool(a.one_step_off_policy or a.update_pipeline or a.fully_async or period)


def resolve_bypass_mode(cfg: DictConfig) -> None:
    """``algorithm.rollout_correction.bypass_mode`` null: the mode's default, as verl's configs give it. Lock-step:
    false, pi_old recomputed (verl's ``ppo_trainer.yaml``, verl-omni's ``diffusion_trainer.yaml``); the off-policy
    modes (:func:`trains_off_policy`): true, pi_old = the rollout's log-probs (verl's ``one_step_off_ppo_trainer.yaml``
    and ``fully_async_ppo_trainer.yaml``; :func:`check_mode` refuses a recompute there without IS weights). A value
    given stays. Idempotent."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode is None:
        rc.bypass_mode = trains_off_policy(cfg)


# The named presets of the benchmarks and tests, as config overrides (the pipeline needs each group's own std). The
# lock-step ones keep pi_old = the rollout's log-probs (bypass), as the off-policy ones must, so the presets compare
# the modes at the same loss (without the key, lock-step recomputes pi_old: verl's and verl-omni's default).
PIPELINE = ["async_reward.update_pipeline=true", "algorithm.global_std=false"]
LOCK_STEP_BYPASS = "algorithm.rollout_correction.bypass_mode=true"
MODE_OVERRIDES: dict[str, list[str]] = {
    "sync": ["reward.streaming=false", LOCK_STEP_BYPASS],
    "stream": ["reward.streaming=true", LOCK_STEP_BYPASS],
    "stream+pipeline": ["reward.streaming=true", *PIPELINE],
    "stream+one_step_off": ["reward.streaming=true", "async_reward.one_step_off_policy=true"],
    "all": ["reward.streaming=true", *PIPELINE, "async_reward.one_step_off_policy=true"],
}


def fully_async_overrides(staleness: float) -> list[str]:
    """The fully async preset at ``async_training.staleness_threshold=staleness``."""
    return ["reward.streaming=true", "async_reward.fully_async=true", f"async_training.staleness_threshold={staleness}"]
