"""Nsight Systems profiling with verl's keys (``trainer.profiling``): which actor ranks, which steps, the runtime env
Ray receives for a profiled rank, the controller's ``nsys profile`` command, the capture ranges and NVTX ranges a
rank opens (CUDA's calls recorded), and the start-up error without ``nsys``. verl-omni's nsys recipe trains its step
under a stand-in ``nsys`` in ``tests/config/test_verl_omni_recipe_runs.py``."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from omni_async.config.overrides import OverrideError
from omni_async.trainer import profiling
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.profiling import RankProfiler, StepWindows, controller_argv, nsys_plan, require_nsys

NSYS = "global_profiler.global_tool_config.nsys"
# verl-omni's nsys recipe's profiler keys (run_qwen_image_ocr_fsdp2_benchmark_nsys.sh), a few of its options
RECIPE = [
    "data.train_files=x.jsonl",
    "global_profiler.tool=nsys",
    "global_profiler.steps=[1,2,3]",
    "global_profiler.profile_continuous_steps=True",
    f"{NSYS}.discrete=False",
    "actor_rollout_ref.actor.profiler.tool=nsys",
    "actor_rollout_ref.actor.profiler.enable=True",
    "actor_rollout_ref.actor.profiler.all_ranks=False",
    "actor_rollout_ref.actor.profiler.ranks=[0]",
    "actor_rollout_ref.ref.profiler.enable=False",
    "actor_rollout_ref.rollout.profiler.enable=False",
    f'{NSYS}.controller_nsight_options.trace="nvtx"',
    f"+{NSYS}.controller_nsight_options.python-sampling-frequency=20",
    f'+{NSYS}.controller_nsight_options.o="controller_%h_pid%p"',
    f'{NSYS}.worker_nsight_options.trace="nvtx"',
    f'{NSYS}.worker_nsight_options.capture-range-end="repeat:1:async"',
    f'+{NSYS}.worker_nsight_options.o="actor_rank_%q{{RANK}}_%h_pid%p"',
]


def plan_of(*extra: str):
    return nsys_plan(
        validate(
            compose([*RECIPE, "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.agent.num_workers=2", *extra])
        )
    )


def test_recipe_keys_map_to_ranks_steps_and_the_runtime_env_ray_receives():
    plan = plan_of()
    assert plan.steps == (1, 2, 3) and plan.continuous and not plan.discrete
    assert plan.profiles(0) and not plan.profiles(1)
    # the recipe's options over verl's defaults (trace, cuda-memory-usage, cuda-graph-trace, capture-range, kill)
    options = {
        "trace": "nvtx",
        "cuda-memory-usage": "true",
        "cuda-graph-trace": "graph",
        "capture-range": "cudaProfilerApi",
        "capture-range-end": "repeat:1:async",
        "kill": "none",
        "o": "actor_rank_%q{RANK}_%h_pid%p",
    }
    here = os.path.dirname(sys.executable)
    assert plan.runtime_env(0) == {"nsight": options, "env_vars": {"PATH": f"{here}{os.pathsep}${{PATH}}"}}
    assert plan.runtime_env(1) is None  # rank 1 starts as any worker
    assert all(plan_of("actor_rollout_ref.actor.profiler.all_ranks=True").profiles(r) for r in (0, 1))
    # profiler.enable=false: no rank under nsys (the controller still is, as verl's TaskRunner)
    off = plan_of("actor_rollout_ref.actor.profiler.enable=False")
    assert off.runtime_env(0) is None and off.controller_options["python-sampling-frequency"] == "20"
    # verl's capture-range-end when unset: repeat-shutdown after 6 ranges per profiled step
    unset = plan_of(f"~{NSYS}.worker_nsight_options.capture-range-end")
    assert unset.worker_options["capture-range-end"] == "repeat-shutdown:18"
    assert nsys_plan(validate(compose(["data.train_files=x.jsonl"]))) is None  # defaults: nothing profiled
    assert nsys_plan(validate(compose(["data.train_files=x.jsonl", "global_profiler.tool=nsys"]))) is None


@pytest.mark.parametrize(
    "continuous, opened, closed",
    [(True, [1], [3]), (False, [1, 2, 3], [1, 2, 3])],
)
def test_step_windows_open_before_and_close_after_the_profiled_steps(continuous, opened, closed):
    plan = plan_of(f"global_profiler.profile_continuous_steps={continuous}")
    calls: list[tuple[str, int]] = []

    class Group:
        def start_profile(self):
            calls.append(("start", step))

        def stop_profile(self):
            calls.append(("stop", step))

    windows = StepWindows(plan, Group())
    for step in range(1, 6):
        windows.before(step)
        windows.after(step)
    windows.close()
    assert [s for k, s in calls if k == "start"] == opened and [s for k, s in calls if k == "stop"] == closed
    calls.clear()
    resumed = StepWindows(plan, Group())  # resumed at step 2, ended after 2: inside [1,2,3] (continuous or not)
    for step in (2,):
        resumed.before(step)
        resumed.after(step)
    resumed.close()
    assert calls == [("start", 2), ("stop", 2)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's profiler, NVTX and synchronize calls recorded, CUDA reported available."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    return calls


def run_step(rank: RankProfiler) -> None:
    with rank.phase("update"):  # before the window: not recorded
        pass
    rank.start()
    for name in ("gen", "old_log_prob", "update"):
        with rank.phase(name):
            pass
    rank.stop()


def test_a_profiled_rank_opens_the_capture_range_and_marks_its_phases(fake_cuda):
    run_step(RankProfiler.of_rank(plan_of(), rank=0))
    phases = ["push gen", "pop", "push old_log_prob", "pop", "push update", "pop"]
    assert fake_cuda == ["start", *phases, "stop"]
    fake_cuda.clear()
    run_step(
        RankProfiler.of_rank(plan_of("global_profiler.profile_continuous_steps=False", f"{NSYS}.discrete=True"), 0)
    )
    assert fake_cuda == ["start", "push gen", "pop", "stop", "start", "push old_log_prob", "pop", "stop"] + [
        "start",
        "push update",
        "pop",
        "stop",
    ]  # discrete: a capture range per phase
    fake_cuda.clear()
    run_step(RankProfiler.of_rank(plan_of(), rank=1))  # not among profiler.ranks
    assert fake_cuda == []


def test_the_driver_under_nsys_opens_its_own_capture_range_around_the_workers(fake_cuda):
    """verl-omni's controller opens a range too when its options capture on cudaProfilerApi (the recipe's do)."""
    plan = plan_of(f"+{NSYS}.controller_nsight_options.capture-range=cudaProfilerApi")

    class Group:
        def start_profile(self):
            fake_cuda.append("ranks start")

        def stop_profile(self):
            fake_cuda.append("ranks stop")

    for environ, expected in (
        ({profiling.CONTROLLER_ENV: "1"}, ["start", "ranks start", "ranks stop", "stop"]),
        ({}, ["ranks start", "ranks stop"]),  # not re-run under nsys: nothing to capture in the driver
    ):
        fake_cuda.clear()
        windows = StepWindows(plan, Group(), environ=environ)
        for step in range(1, 5):
            windows.before(step)
            windows.after(step)
        assert fake_cuda == expected


def test_without_cuda_a_profiled_rank_skips_the_capture_range_and_says_so_once(caplog):
    rank = RankProfiler.of_rank(plan_of(), rank=0)
    if rank.cuda:
        pytest.skip("CUDA is available here: the ranges are real (test above)")
    with caplog.at_level(logging.WARNING, logger=profiling.__name__):
        run_step(rank)
        run_step(rank)
    assert [r.message for r in caplog.records if "without CUDA" in r.message] and len(caplog.records) == 1


def test_the_controller_reruns_the_entry_point_under_nsys_once():
    plan = nsys_plan(validate(compose(RECIPE)))
    argv = ["/x/main.py", "data.train_files=x.jsonl", "++global_profiler.tool=nsys"]
    cmd = controller_argv(plan, argv, environ={})
    start = ["nsys", "profile", "--trace=nvtx", "--cuda-memory-usage=true", "--cuda-graph-trace=graph"]
    assert cmd[:5] == start and cmd[5:8] == ["--python-sampling-frequency=20", "-o", "controller_%h_pid%p"]
    assert cmd[8:] == [sys.executable, "-m", "omni_async.trainer.main", *argv[1:]]
    assert controller_argv(plan, argv, environ={profiling.CONTROLLER_ENV: "1"}) is None  # already under it
    assert controller_argv(None, argv, environ={}) is None  # nothing profiled


def test_without_nsys_on_path_the_run_stops_at_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    plan = nsys_plan(validate(compose(RECIPE)))
    with pytest.raises(ConfigError, match=r"nsys binary \(NVIDIA Nsight Systems\) is not on PATH.*Fix: install"):
        require_nsys(plan)
    require_nsys(None)  # not profiling: nsys is not needed
    (tmp_path / "nsys").write_text("#!/bin/sh\n")
    (tmp_path / "nsys").chmod(0o755)
    require_nsys(plan)


@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("global_profiler.tool=torch", "global_profiler.tool", "global_profiler.tool=nsys"),
        ("actor_rollout_ref.actor.profiler.ranks=[]", "actor_rollout_ref.actor.profiler.ranks", "ranks=[0]"),
        ("actor_rollout_ref.actor.profiler.ranks=[1]", "actor_rollout_ref.actor.profiler.ranks", "existing ranks"),
        (f"{NSYS}.discrete=True", "global_profiler.profile_continuous_steps", "one of them to false"),
        ("global_profiler.steps=[]", "actor_rollout_ref.actor.profiler.enable", "global_profiler.steps"),
        ("global_profiler.steps=[0]", "global_profiler.steps", "steps >= 1"),
    ],
)
def test_profiler_settings_that_cannot_run_are_refused_naming_key_and_fix(override, key, fix):
    with pytest.raises(ConfigError) as err:
        validate(compose([*RECIPE, override]))
    assert str(err.value).startswith(key) and fix in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.ref.profiler.enable=True",
        "actor_rollout_ref.rollout.profiler.enable=True",
        "global_profiler.relocate_results=True",
        "global_profiler.finish_hook_cmd=upload",
    ],
)
def test_what_is_not_built_is_refused_at_compose(override):
    with pytest.raises(OverrideError, match=override.split("=")[0] + ".*Fix: "):
        compose([*RECIPE, override])
