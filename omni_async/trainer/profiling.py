"""Nsight Systems profiling with verl's keys: ``global_profiler.*`` (tool, steps, continuous steps, the nsys options of
the controller and of the workers) and ``actor_rollout_ref.actor.profiler.*`` (which actor ranks).

What verl does, and what this module does the same way:

* the profiled ranks of the actor worker group start under Nsight Systems through Ray's ``nsight`` runtime env
  (``runtime_env={"nsight": worker_nsight_options}``; Ray's plugin runs ``nsys profile <options> python ...``).
  verl puts every rank of the group under nsys and lets only ``ranks`` / ``all_ranks`` open a capture range; here
  only the selected ranks start under nsys (the others would write empty reports);
* on each of ``global_profiler.steps`` (1-based, as verl counts) a selected rank opens the CUDA profiler's capture
  range (``torch.cuda.profiler.start`` / ``stop``: nsys' ``capture-range=cudaProfilerApi``) before the step and
  closes it after; with ``profile_continuous_steps`` consecutive profiled steps share one range; with
  ``discrete`` each phase of a profiled step is a range of its own. Each phase is an NVTX range: ``gen``,
  ``old_log_prob``, ``update`` (verl's worker annotations). Without CUDA there is no capture range to open: the
  calls are skipped, logged once, and nsys records the rank's CPU side;
* the controller: verl runs its ``TaskRunner`` actor under ``controller_nsight_options``. Here the driver is the
  user's own process (``python -m omni_async.trainer.main``), so the entry point runs itself again under
  ``nsys profile <controller_nsight_options>`` (:func:`controller_argv`).

``nsys`` must be on ``PATH`` (the driver's, and every Ray node's: Ray's plugin calls it): the run stops at start
otherwise (:func:`require_nsys`), before Ray, never mid-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from omni_async.config_error import ConfigError, check

logger = logging.getLogger(__name__)

NSYS = "nsys"
# verl's defaults (verl/trainer/config/ppo_trainer.yaml, global_tool_config.nsys), under the options a user gives
CONTROLLER_DEFAULTS: dict[str, Any] = {
    "trace": "cuda,nvtx,cublas,ucx",
    "cuda-memory-usage": "true",
    "cuda-graph-trace": "graph",
}
WORKER_DEFAULTS: dict[str, Any] = {
    **CONTROLLER_DEFAULTS,
    "capture-range": "cudaProfilerApi",  # the ranges torch.cuda.profiler.start / stop open and close
    "capture-range-end": None,  # None: repeat-shutdown after RANGES_PER_STEP ranges per profiled step
    "kill": "none",  # nsys sends no signal: the worker exits by itself
}
RANGES_PER_STEP = 6  # verl's RayWorkerGroup: capture-range-end=repeat-shutdown:<6 x len(steps)> when unset
# Set in the driver's environment when the entry point re-ran itself under nsys (it does so once).
CONTROLLER_ENV = "OMNI_ASYNC_NSYS_CONTROLLER"

P = "global_profiler"
A = "actor_rollout_ref.actor.profiler"


def _option_value(value: Any) -> str:
    """An option's value as nsys reads it (``true`` / ``false``, not Python's ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def nsys_args(options: dict[str, Any]) -> list[str]:
    """``nsys profile`` arguments of ``options``, spelled as Ray's nsight plugin spells them: ``--name=value`` for a
    long option, ``-o value`` for a one-letter one."""
    out: list[str] = []
    for name, value in options.items():
        out += [f"--{name}={value}"] if len(name) > 1 else [f"-{name}", str(value)]
    return out


@dataclass(frozen=True)
class NsysPlan:
    """What ``global_profiler`` and ``actor.profiler`` ask for, decided once from the validated config."""

    steps: tuple[int, ...]  # profiled steps, 1-based (the logged step numbers)
    continuous: bool  # consecutive profiled steps share one capture range
    discrete: bool  # each phase of a profiled step is its own capture range
    ranks: frozenset[int] | None  # the actor ranks profiled; None = all of them
    worker_options: dict[str, str]  # ``nsys profile`` options of a profiled rank (verl's defaults filled in)
    controller_options: dict[str, str]  # ... of the driver

    def profiles(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def closes(self, step: int) -> bool:
        """The capture range closes after ``step``: every profiled step's, or, continuous, the last of a run of
        consecutive ones (verl's ``curr_step_profile and not next_step_profile``)."""
        return step in self.steps and not (self.continuous and step + 1 in self.steps)

    def runtime_env(self, rank: int) -> dict[str, Any] | None:
        """The runtime env a profiled actor rank starts with (None: not profiled). Ray's plugin execs ``nsys profile
        <options> python ...`` with ``python`` looked up on ``PATH``: the driver's interpreter's directory goes first,
        so the rank runs the interpreter (and packages) the run was started with, not another ``python`` on the
        node's ``PATH``."""
        if not self.profiles(rank):
            return None
        here = os.path.dirname(sys.executable)
        return {"nsight": dict(self.worker_options), "env_vars": {"PATH": f"{here}{os.pathsep}${{PATH}}"}}


def _options(given: Any, defaults: dict[str, Any], steps: int) -> dict[str, str]:
    merged = {**defaults, **(OmegaConf.to_container(given, resolve=True) if given is not None else {})}
    if "capture-range-end" in merged and merged["capture-range-end"] is None:
        merged["capture-range-end"] = f"repeat-shutdown:{RANGES_PER_STEP * steps}"
    return {k: _option_value(v) for k, v in merged.items() if v is not None}


def nsys_plan(cfg: DictConfig) -> NsysPlan | None:
    """The run's profiling plan, or None when nothing is profiled (``global_profiler.tool`` null or no steps)."""
    g = cfg.global_profiler
    if g.tool != NSYS or not g.steps:
        return None
    a = cfg.actor_rollout_ref.actor.profiler
    ranks = None if a.all_ranks else frozenset(int(r) for r in a.ranks)
    nsys = g.global_tool_config.nsys
    steps = tuple(sorted({int(s) for s in g.steps}))
    return NsysPlan(
        steps=steps,
        continuous=bool(g.profile_continuous_steps),
        discrete=bool(nsys.discrete),
        ranks=(ranks if a.enable else frozenset()),
        worker_options=_options(nsys.worker_nsight_options, WORKER_DEFAULTS, len(steps)),
        controller_options=_options(nsys.controller_nsight_options, CONTROLLER_DEFAULTS, len(steps)),
    )


def check_profiler(cfg: DictConfig, actor_ranks: int) -> None:
    """The profiler keys make sense together (config only; whether ``nsys`` is installed: :func:`require_nsys`)."""
    g, a = cfg.global_profiler, cfg.actor_rollout_ref.actor.profiler
    check(
        g.tool in (None, NSYS),
        f"{P}.tool",
        f"{g.tool!r}: only Nsight Systems (nsys) profiles here (verl's npu, torch, torch_memory and "
        "precision_debugger tools are not built)",
        f"set {P}.tool=nsys, or drop it",
    )
    check(
        a.tool in (None, g.tool),
        f"{A}.tool",
        f"{a.tool!r} differs from {P}.tool={g.tool!r}: the actor's profiler is the run's",
        f"drop {A}.tool, or give both the same value",
    )
    steps = list(g.steps or [])
    check(
        all(int(s) >= 1 for s in steps),
        f"{P}.steps",
        f"{steps}: steps are counted from 1 (the logged step numbers, verl's global_steps)",
        f"give steps >= 1, e.g. {P}.steps=[1,2]",
    )
    if a.enable:
        check(
            g.tool is not None and bool(steps),
            f"{A}.enable",
            f"true, but {P}.tool={g.tool} and {P}.steps={g.steps}: no step would be profiled",
            f"set {P}.tool=nsys and {P}.steps (e.g. [1,2]), or drop {A}.enable",
        )
        check(
            bool(a.all_ranks) or bool(a.ranks),
            f"{A}.ranks",
            "[] with all_ranks=false: profiler.enable selects no rank",
            f"set {A}.ranks=[0] (or all_ranks=true)",
        )
        bad = [r for r in a.ranks if not isinstance(r, int) or not 0 <= r < actor_ranks]
        check(
            not bad,
            f"{A}.ranks",
            f"{list(a.ranks)}: {bad} not among the run's {actor_ranks} actor rank(s), 0 to {actor_ranks - 1}",
            "name existing ranks",
        )
    check(
        not (g.profile_continuous_steps and g.global_tool_config.nsys.discrete),
        f"{P}.profile_continuous_steps",
        "true with global_tool_config.nsys.discrete=true: a range per phase cannot also span several steps "
        "(verl's rule)",
        "set one of them to false",
    )


def require_nsys(plan: NsysPlan | None) -> None:
    """Raise :class:`ConfigError` at start when the run profiles (``plan``) and ``nsys`` is not on ``PATH``."""
    if plan is not None and shutil.which(NSYS) is None:
        raise ConfigError(
            f"{P}.tool=nsys: the {NSYS} binary (NVIDIA Nsight Systems) is not on PATH, and the profiled ranks start "
            f"under it (Ray's nsight runtime env calls `{NSYS} profile`). Fix: install Nsight Systems with {NSYS} on "
            f"PATH (of every Ray node too), or drop {P}.tool to train without profiling"
        )


def controller_argv(plan: NsysPlan | None, argv: list[str], environ: dict[str, str] | None = None) -> list[str] | None:
    """The command that re-runs the entry point (``argv``: its ``sys.argv``) under ``nsys profile
    <controller_nsight_options>``, or None when the driver is not profiled or already runs under it (the re-run
    carries :data:`CONTROLLER_ENV`). verl profiles its controller, the ``TaskRunner`` Ray actor, with these options;
    here the controller is the entry point's own process."""
    if plan is None or (environ if environ is not None else os.environ).get(CONTROLLER_ENV):
        return None
    return [NSYS, "profile", *nsys_args(plan.controller_options), sys.executable, "-m", "omni_async.trainer.main"] + [
        *argv[1:]
    ]


def rerun_under_nsys(cfg: DictConfig, argv: list[str]) -> None:
    """Replace this process by :func:`controller_argv`'s command when there is one (``nsys`` checked first). The
    entry point's own reading of the profiling plan: the trainer's is ``trainer.config.plan``'s."""
    plan = nsys_plan(cfg)
    cmd = controller_argv(plan, argv)
    if cmd is None:
        return
    require_nsys(plan)
    logger.info("the controller runs under Nsight Systems: %s", " ".join(cmd))
    os.execvpe(cmd[0], cmd, {**os.environ, CONTROLLER_ENV: "1"})


class StepWindows:
    """The driver's side: opens the capture range of the profiled ranks before a profiled step when none is open
    (a run resumed inside a continuous window opens it at its first step, as verl does) and closes it where
    :meth:`NsysPlan.closes` says (``worker_group``'s ``start_profile`` / ``stop_profile``). The driver, re-run under
    nsys with ``capture-range=cudaProfilerApi`` in its options, opens its own range around the workers' (verl-omni's
    controller does the same)."""

    def __init__(self, plan: NsysPlan | None, worker_group: Any, environ: dict[str, str] | None = None) -> None:
        self.plan, self.wg, self.open = plan, worker_group, False
        under_nsys = bool((environ if environ is not None else os.environ).get(CONTROLLER_ENV))
        captures = plan is not None and plan.controller_options.get("capture-range") == "cudaProfilerApi"
        self.driver = RankProfiler(under_nsys and captures)

    def before(self, step: int) -> None:
        if self.plan is not None and step in self.plan.steps and not self.open:
            self.driver.start()
            self.wg.start_profile()
            self.open = True

    def after(self, step: int) -> None:
        if self.plan is not None and self.plan.closes(step):
            self.close()

    def close(self) -> None:
        """Close a range still open (the run ended inside a continuous window)."""
        if self.open:
            self.wg.stop_profile()
            self.driver.stop()
            self.open = False


class RankProfiler:
    """A profiled process's side (an actor rank, or the driver under nsys): the CUDA profiler's capture range and
    NVTX ranges, inside a profiled window. A rank calls it on its device thread, in call order with its model calls."""

    def __init__(self, on: bool, discrete: bool = False) -> None:
        import torch

        self.on, self.discrete = bool(on), bool(discrete)
        self.cuda = torch.cuda.is_available()
        self.window = False  # between start() and stop()
        self._told = False

    @classmethod
    def of_rank(cls, plan: NsysPlan | None, rank: int) -> RankProfiler:
        """Actor rank ``rank``'s: on when the plan profiles it."""
        return cls(plan is not None and plan.profiles(rank), bool(plan and plan.discrete))

    def start(self) -> None:
        if not self.on:
            return
        self.window = True
        if not self.cuda:
            if not self._told:
                logger.warning(
                    "profiled process without CUDA: no capture range to open (torch.cuda.profiler) and no NVTX "
                    "ranges; nsys records its CPU side only"
                )
                self._told = True
            return
        if not self.discrete:
            import torch

            torch.cuda.profiler.start()

    def stop(self) -> None:
        if not self.window:
            return
        self.window = False
        if self.cuda and not self.discrete:
            import torch

            torch.cuda.synchronize()  # the step's kernels inside the range
            torch.cuda.profiler.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``name``'s NVTX range (and, discrete, its own capture range) while a window is open."""
        if not (self.window and self.cuda):
            yield
            return
        import torch

        if self.discrete:
            torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
            if self.discrete:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
