"""Shared test fixtures: offline guard and a per-session model cache."""

from __future__ import annotations

import os
import socket

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


# One Ray cluster for the whole session: a local cluster costs ~15-20 s to start on this 2-core box (GCS, dashboard
# and metrics agents, raylet), and the suite starts one per trainer test. Each test still runs as its own Ray job
# (init_ray joins through RAY_ADDRESS, shutdown_ray ends the job, and Ray then kills the job's actors and removes its
# placement groups), so tests stay isolated; subprocesses (the main job's command, benchmarks) inherit RAY_ADDRESS
# and join too. Logical resources are generous: a test's own num_gpus / num_cpus are ignored when joining.
# OMNI_ASYNC_TEST_OWN_RAY=1 gives every test its own local cluster, as before; tests that must own their cluster
# use the `own_ray_cluster` fixture.
SHARED_RAY_GPUS, SHARED_RAY_CPUS = 16, 96


@pytest.fixture(scope="session", autouse=True)
def shared_ray_cluster():
    if os.environ.get("OMNI_ASYNC_TEST_OWN_RAY") == "1" or os.environ.get("RAY_ADDRESS"):
        yield None
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": SHARED_RAY_CPUS, "num_gpus": SHARED_RAY_GPUS, "include_dashboard": False},
    )
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.shutdown()


@pytest.fixture
def own_ray_cluster(monkeypatch):
    """This test starts (and stops) a local Ray cluster of its own instead of joining the session's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests that own their Ray cluster run after all the others: once a process has started a local cluster and shut
    it down, Ray (2.60) cannot create actors in a cluster it joins afterwards (the actor is cancelled before it
    starts), while joining first and starting a local cluster later works."""
    items.sort(key=lambda item: "own_ray_cluster" in getattr(item, "fixturenames", ()))
