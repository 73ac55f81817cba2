"""Session-wide Valkey servers (standalone and a 3-node Cluster), always stopped.

A garbage collection after every test pins an unclosed socket on the test
that leaked it (warnings are errors), instead of on the end of the session.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from tier_servers import ValkeyClusterProcesses, ValkeyProcess


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(tmp_path_factory.mktemp("valkey")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyClusterProcesses]:
    cluster = ValkeyClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ValkeyProcess]:
    """A short-lived server of this test alone (to kill, restart or protect with a password)."""
    server = ValkeyProcess(tmp_path / "own")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _collect_after() -> Iterator[None]:
    yield
    gc.collect()
