"""When the trainer devices lend a hand to generation (verl v1 / verl-omni's ``separate_async`` step switching,
``trainer.v1.separate_async.hybrid_rollout``): the decision, as one value per run.

In fully async training on a rollout pool (the disaggregated layout) the trainer ranks idle whenever the rollout pool
has not produced the next step's groups yet. With ``enable_switch`` the trainer ranks then generate too (the
layout's :meth:`~omni_async.trainer.layout.Disaggregated.collect` does the switching; this module decides). verl's
rule (``PPOTrainerSeparateAsync``), with this project's step in place of verl's ``train_batch_size``:

- **threshold**: ``clamp(round(ratio x n), chunk, n)`` groups the step can take (scored, within the lag bound)
  before the trainer ranks go back to training; ``n`` = groups per step, ``chunk`` = the first take of a step
  (``ppo_mini_batch_size`` with the mini-batch pipeline, else the whole step: verl's one-mini-batch floor).
- **lend** at a step's start (verl: at the previous step's end, for the next step) when ``remaining = threshold - sampleable > 0``, the
  rollouter has work waiting for a device, and the expected benefit beats the measured cost: ``benefit = remaining
  x per-group wait x (1 - rollout devices / all devices)`` (the per-group wait: the trainer's wait for groups so
  far over the groups it lacked; while no wait or no switch has been measured, it lends), ``cost`` = the mean
  switch-to-rollout + the mean switch-to-trainer time over the last ``switch_cost_window_size`` switches.
- **adaptive threshold**: after ``switch_threshold_release_steps`` consecutive steps that waited for groups (outside
  a lend) the ratio rises by ``switch_threshold_step_up`` (at most 1); after as many calm steps it falls by
  ``switch_threshold_step_down`` (at least ``chunk / n``). Once per step (verl#7665: not twice).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from omegaconf import DictConfig

from omni_async.config_error import check as _check

# A step "waited for groups" (verl: longer than its replay buffer's poll interval) when its takes outside a lend
# waited longer than this.
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class SwitchConfig:
    """``trainer.v1.separate_async.hybrid_rollout`` (verl's ``HybridRolloutSwitchConfig``, same keys and defaults)."""

    enable_switch: bool = False
    switch_threshold_ratio: float = 0.4
    adaptive_switch_threshold: bool = True
    switch_threshold_step_up: float = 0.05
    switch_threshold_step_down: float = 0.03
    switch_threshold_release_steps: int = 2
    switch_cost_window_size: int = 3

    @classmethod
    def from_config(cls, cfg: DictConfig) -> SwitchConfig:
        h = cfg.trainer.v1.separate_async.get("hybrid_rollout") or {}
        return cls(**{k: h[k] for k in cls.__dataclass_fields__ if k in h})


@dataclass
class Decision:
    lend: bool
    threshold: int  # groups the step can take before the trainer ranks go back
    metrics: dict[str, float]


class SwitchPolicy:
    """verl's decision state: the threshold ratio, the measured switch costs, the trainer's wait per missing group."""

    def __init__(self, config: SwitchConfig, groups_per_step: int, chunk: int, trainer_devices: int, rollout: int):
        self.config, self.n, self.chunk = config, int(groups_per_step), int(chunk)
        self.ratio = float(config.switch_threshold_ratio)
        # verl's scaling factor: all devices over the rollout's, so (1 - 1/scale) is the share the trainer adds.
        self.scale = (trainer_devices + rollout) / rollout
        self.to_rollout: deque[float] = deque(maxlen=config.switch_cost_window_size)
        self.to_trainer: deque[float] = deque(maxlen=config.switch_cost_window_size)
        self.wait_s = 0.0  # the run's waits for groups (outside lends), and the groups lacking at each
        self.wait_groups = 0
        self._step_wait_s, self._step_short = 0.0, 0
        self._idle_steps = self._calm_steps = 0
        self._decisions = 0

    def threshold(self) -> int:
        return min(max(round(self.ratio * self.n), self.chunk), self.n)

    def record_take(self, waited_s: float, short: int) -> None:
        """A take of the step outside a lend: it waited ``waited_s`` and lacked ``short`` groups when it began."""
        self._step_wait_s += waited_s
        self._step_short += short

    def record_costs(self, to_rollout_s: float, to_trainer_s: float) -> None:
        self.to_rollout.append(to_rollout_s)
        self.to_trainer.append(to_trainer_s)

    def cost(self) -> float | None:
        if not self.to_rollout or not self.to_trainer:
            return None
        return sum(self.to_rollout) / len(self.to_rollout) + sum(self.to_trainer) / len(self.to_trainer)

    def per_group_wait(self) -> float | None:
        return self.wait_s / self.wait_groups if self.wait_groups else None

    def _adapt(self, idle: bool) -> None:
        c = self.config
        if idle:
            self._calm_steps = 0
            self._idle_steps = min(self._idle_steps + 1, c.switch_threshold_release_steps)
            if self._idle_steps >= c.switch_threshold_release_steps:
                self.ratio = min(1.0, self.ratio + c.switch_threshold_step_up)
            return
        self._idle_steps = 0
        self._calm_steps = min(self._calm_steps + 1, c.switch_threshold_release_steps)
        if self._calm_steps >= c.switch_threshold_release_steps:
            self.ratio = max(self.chunk / self.n, self.ratio - c.switch_threshold_step_down)

    def decide(self, sampleable: int, waiting: int) -> Decision:
        """At a step's start: ``sampleable`` groups it could take now, ``waiting`` samples of the rollouter waiting
        for a device. The previous step's waits update the per-group wait and (adaptive) the ratio first."""
        ratio_used = self.ratio
        idle = self._step_wait_s > IDLE_WAIT_S
        if self._step_short > 0 and self._step_wait_s > 0:
            self.wait_s += self._step_wait_s
            self.wait_groups += self._step_short
        metrics = {
            "separate_async/switch/threshold_ratio": ratio_used,
            "separate_async/switch/sample_wait_seconds": self._step_wait_s,
            "separate_async/switch/wait_samples": float(self._step_short),
            "separate_async/switch/idle": float(idle),
        }
        if self.config.adaptive_switch_threshold and self._decisions:  # the first step has no previous one
            self._adapt(idle)
        self._decisions += 1
        self._step_wait_s, self._step_short = 0.0, 0
        threshold = self.threshold()
        remaining = max(0, threshold - sampleable)
        per_group, cost = self.per_group_wait(), self.cost()
        benefit = None if per_group is None else remaining * per_group * (1.0 - 1.0 / self.scale)
        lend = remaining > 0 and waiting > 0 and (benefit is None or cost is None or benefit > cost)
        metrics.update(
            {
                "separate_async/decision/sampleable_count": float(sampleable),
                "separate_async/decision/remaining": float(remaining),
                "separate_async/decision/threshold": float(threshold),
                "separate_async/decision/waiting_samples": float(waiting),
                "separate_async/decision/should_switch_to_rollout": float(lend),
            }
        )
        if per_group is not None:
            metrics["separate_async/decision/per_sample_time_seconds"] = per_group
        if benefit is not None:
            metrics["separate_async/decision/benefit_seconds"] = benefit
        if cost is not None:
            metrics["separate_async/decision/effective_switch_cost_seconds"] = cost
        return Decision(lend, threshold, metrics)


def check_switch(cfg: DictConfig, rollout_pool: bool, layout_name: str) -> None:
    """``trainer.v1.separate_async.hybrid_rollout``: ranges, and where the switch can run (``rollout_pool``: the
    layout has one, ``Layout.rollout_pool``; ``layout_name`` is for the message only)."""
    c = SwitchConfig.from_config(cfg)
    key = "trainer.v1.separate_async.hybrid_rollout"
    _check(
        0 < c.switch_threshold_ratio <= 1,
        f"{key}.switch_threshold_ratio",
        f"must be in (0, 1], got {c.switch_threshold_ratio}",
        "verl's default 0.4",
    )
    _check(
        c.switch_cost_window_size >= 1 and c.switch_threshold_release_steps >= 1,
        f"{key}.switch_cost_window_size",
        "switch_cost_window_size and switch_threshold_release_steps must be >= 1",
        "verl's defaults 3 and 2",
    )
    _check(
        c.switch_threshold_step_up >= 0 and c.switch_threshold_step_down >= 0,
        f"{key}.switch_threshold_step_up",
        "the adaptive steps must be >= 0",
        "verl's defaults 0.05 and 0.03",
    )
    if not c.enable_switch:
        return
    _check(
        rollout_pool,
        f"{key}.enable_switch",
        f"the trainer devices lend a hand to a rollout pool; the {layout_name} layout has none (its trainer devices "
        "generate already, or beside a replica)",
        "set actor_rollout_ref.rollout.nnodes=1 and n_gpus_per_node (trainer.v1.trainer_mode=separate_async)",
    )
    _check(
        bool(cfg.async_reward.fully_async),
        f"{key}.enable_switch",
        "switching needs fully async training (a lock-step draw is made by one weights version on the rollout pool)",
        "set trainer.v1.trainer_mode=separate_async (or async_reward.fully_async=true)",
    )
    _check(
        cfg.actor_rollout_ref.rollout.name == "transformers",
        f"{key}.enable_switch",
        f"rollout.name={cfg.actor_rollout_ref.rollout.name} generates in a server process; the trainer ranks "
        "generate in-process (transformers / diffusers)",
        "set actor_rollout_ref.rollout.name=transformers, or drop enable_switch",
    )
