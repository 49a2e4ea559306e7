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
