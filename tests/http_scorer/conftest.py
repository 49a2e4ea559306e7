"""Module-scoped real scorer servers (see scorer_server_helpers.Server)."""

from __future__ import annotations

import pytest
from scorer_server_helpers import Server


@pytest.fixture(scope="module")
def server_factory():
    servers = []

    def make(*args: str) -> Server:
        servers.append(Server(*args))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()
