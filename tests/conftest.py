"""Shared test fixtures: offline guard and a per-session model cache."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

# Tests never reach a hub; make the libraries fail fast instead of retrying for minutes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LOOPBACK = ("127.", "::1", "localhost")


@pytest.fixture
def no_network(monkeypatch):
    """Refuse every outbound connection that is not to loopback (proves a code path is offline)."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else str(address)
        if self.family == socket.AF_UNIX or str(host).startswith(_LOOPBACK):
            return real_connect(self, address)
        raise OSError(f"network access blocked in tests: {address}")

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield


@pytest.fixture(scope="module")
def server_factory():
    """Start real scorer servers (``python -m http_scorer serve ...``) on loopback; stopped after the module."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "http_scorer"))
    from scorer_server_helpers import Server

    servers = []

    def make(*args: str):
        servers.append(Server(*args))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


# One Ray cluster for the whole run: a local cluster costs ~15-20 s to start on this 2-core box (GCS, dashboard and
# metrics agents, raylet), and the suite would start one per trainer test. It is started once per `pytest` command,
# before pytest-xdist starts its workers, so the workers (`-n 2`) and every subprocess (the main job's command,
# benchmarks) inherit RAY_ADDRESS and join it. Each test still runs as its own Ray job (init_ray joins through
# RAY_ADDRESS, shutdown_ray ends the job, and Ray then kills the job's actors and removes its placement groups), so
# tests stay isolated. Logical resources are generous: a test's own num_gpus / num_cpus are ignored when joining, and
# two tests at a time fit. OMNI_ASYNC_TEST_OWN_RAY=1 gives every test its own local cluster instead; tests that must
# own theirs use the `own_ray_cluster` fixture.
SHARED_RAY_GPUS, SHARED_RAY_CPUS = 16, 96
TOOLS_ENV = "OMNI_ASYNC_TEST_TOOLS_DIR"  # the shared cluster's directory of stand-in tools (pytest_configure)
_SHARED_CLUSTER = pytest.StashKey()


def cuda_device_count() -> int:
    """The GPUs the NVIDIA driver lists here (without importing torch: the xdist controller never does)."""
    listed = list(Path("/proc/driver/nvidia/gpus").glob("*"))
    return len(listed) or len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia") :].isdigit()])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: the GPU tier (tests/gpu): needs a CUDA device, skipped without one (scripts/gpu_kit.sh run)"
    )
    # Collection imports torch, verl, diffusers and the test modules with the cyclic collector paused, as a Ray worker
    # imports (omni_async.cluster.pause_gc_while_importing); pytest_collection_finish resumes it. (pytest-xdist's
    # controller collects nothing: its workers do.)
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        gc.disable()
    if hasattr(config, "workerinput") or config.option.collectonly:
        return  # an xdist worker joins the cluster its controller started (RAY_ADDRESS)
    if os.environ.get("OMNI_ASYNC_TEST_OWN_RAY") == "1" or os.environ.get("RAY_ADDRESS"):
        return
    from ray.cluster_utils import Cluster

    # Ray's daemons are a few percent of the run's CPU: the dashboard agent's reporter samples every worker process
    # each 5 s (a minute suffices: no test reads its metrics), and the log monitor tails every worker's log files to
    # forward them to drivers (~70 CPU-s a run; a failing test gets the worker's traceback from Ray's error anyway,
    # and the files stay in the session's log directory).
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
    # On a GPU machine the real devices, counted: 16 logical GPUs there would hand an actor an index the machine
    # does not have (CUDA_VISIBLE_DEVICES=7 on a one-GPU box), and left to Ray's detection this head node came up
    # with 0 GPUs on an H200 (the GPU tier's run of 2026-11-27) while ray.init beside it found the device.
    gpus = {"num_gpus": cuda_device_count() or SHARED_RAY_GPUS}
    # A directory on the cluster's PATH (fixed when its raylet starts) for a tool a test stands in for: Ray's nsight
    # runtime env calls `nsys` from there (test_verl_omni_recipe_runs.nsys_on_ray_path). Empty otherwise.
    tools = tempfile.mkdtemp(prefix="omni_async_test_tools_")
    os.environ[TOOLS_ENV], os.environ["PATH"] = tools, tools + os.pathsep + os.environ.get("PATH", "")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": SHARED_RAY_CPUS,
            **gpus,
            "include_dashboard": False,
            "include_log_monitor": False,
        },
    )
    os.environ["RAY_ADDRESS"] = cluster.address
    config.stash[_SHARED_CLUSTER] = cluster


def pytest_collection_finish(session):
    if gc.isenabled():
        return
    # The trainers' drivers run in this process: the main job's driver settings, applied once, before any trainer
    # exists (the modules imported so far are frozen, each trainer's objects later are not).
    from omni_async.cluster import tune_driver_gc

    tune_driver_gc()


def pytest_unconfigure(config):
    cluster = config.stash.get(_SHARED_CLUSTER, None)
    if cluster is not None:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.shutdown()
        shutil.rmtree(os.environ.pop(TOOLS_ENV, ""), ignore_errors=True)


@pytest.fixture
def own_ray_cluster(monkeypatch):
    """This test starts (and stops) a local Ray cluster of its own instead of joining the run's (it runs in a
    process of its own when the run shares one: :func:`pytest_pyfunc_call`)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield


def _runs_apart(item) -> bool:
    return "own_ray_cluster" in getattr(item, "fixturenames", ()) and os.environ.get("OMNI_ASYNC_TEST_OWN_RAY") != "1"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that owns its Ray cluster runs in a fresh pytest process: once a process has started a local cluster
    and shut it down, Ray (2.60) cannot create actors in a cluster it joins afterwards (the actor is cancelled before
    it starts), so such a test would break every later test of the process that joins the shared cluster."""
    if not _runs_apart(pyfuncitem):
        return None
    import subprocess
    import sys

    env = {**os.environ, "OMNI_ASYNC_TEST_OWN_RAY": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "--show-capture=no", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd.append(pyfuncitem.nodeid)
    proc = subprocess.run(cmd, cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    if proc.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process:\n{out}", pytrace=False)
    if " passed" not in proc.stdout.splitlines()[-1]:
        pytest.skip(f"skipped in its own process: {out[-500:]}")
    return True


def pytest_collection_modifyitems(config, items):
    """Long modules first, so with `-n 2 --dist loadscope` they start early and the short ones fill in at the end
    instead of one long module running alone. A module's weight: its slow tests, a test in a process and cluster of
    its own counting as three (they are the multi-minute multi-node runs)."""
    weight: dict[str, int] = {}
    for item in items:
        w = 3 if _runs_apart(item) else item.get_closest_marker("slow") is not None
        weight[item.location[0]] = weight.get(item.location[0], 0) + w
    items.sort(key=lambda item: -weight[item.location[0]])


@pytest.fixture
def trainers(tmp_path):
    """``helpers.Trainers`` over 8 prompts in ``tmp_path``: a test builds its trainers with it (one Ray session
    each); the last one is closed after the test."""
    from helpers import Trainers, write_prompts

    made = Trainers(write_prompts(tmp_path / "train.jsonl", 8), tmp_path)
    yield made
    made.close()
