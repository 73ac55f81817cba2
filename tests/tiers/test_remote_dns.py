"""Name resolution of the shared tier under each operation's deadline: a resolver that
hangs or fails ends start-up in one line and a runtime call as a counted failure, never
a stall; a known answer keeps serving while the resolver is down; IPs are never looked up.

The resolver is a real :class:`Resolver` over a lookup this test controls (it
answers 127.0.0.1, fails, or hangs until released); the server is a real
Valkey. Stalls show as calls that do not return within a generous bound.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from tier_helpers import STALL_S, content, finishes
from tier_helpers import remote_store as store
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload import OffloadKey, block_id_key
from kvoffload.tiers import CircuitBreaker, RemoteTier, RemoteTierError
from kvoffload.tiers.resp import Address, ConnectError, Deadline, Resolver
from tier_servers import ValkeyProcess

BLOCK = 32
KEYS = [block_id_key(i, 17) for i in range(8)]
NAME = "kv.test"


class ControlledLookup:
    """A lookup of :data:`NAME` that answers 127.0.0.1, raises, or hangs until released."""

    def __init__(self) -> None:
        self.mode = "answer"
        self.calls = 0
        self.release = threading.Event()

    def __call__(self, host: str, port: int) -> list[Address]:
        self.calls += 1
        if self.mode == "hang":
            self.release.wait(STALL_S)
        if self.mode == "fail":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert host == NAME
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", port))]


@pytest.fixture
def lookup() -> Iterator[ControlledLookup]:
    controlled = ControlledLookup()
    try:
        yield controlled
    finally:
        controlled.release.set()  # no lookup thread outlives the test


def url(server: ValkeyProcess, timeout_ms: int = 300) -> str:
    return f"redis://{NAME}:{server.port}/0?timeout_ms={timeout_ms}"


def read(tier: RemoteTier, keys: list[OffloadKey]) -> list[bool]:
    buffers = [bytearray(BLOCK) for _ in keys]
    ok: list[bool] = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=STALL_S)
    assert all(bytes(buffers[i]) == content(k, BLOCK) for i, k in enumerate(keys) if ok[i])
    return ok


def drop_connections(server: ValkeyProcess) -> None:
    """Close the tier's pooled connections from the server: its next call connects anew."""
    server.client().execute_command("CLIENT", "KILL", "TYPE", "normal")


@pytest.mark.parametrize("mode", ["hang", "fail"])
def test_a_name_without_answer_at_start_up_ends_in_one_line(
    valkey_server: ValkeyProcess, lookup: ControlledLookup, mode: str
) -> None:
    lookup.mode = mode

    def start() -> str:
        try:
            RemoteTier(url(valkey_server), fingerprint("dns"), resolver=Resolver(lookup)).close()
        except RemoteTierError as exc:
            return str(exc)
        return "started"

    message = finishes(start)
    assert isinstance(message, str) and message.startswith("remote tier redis://kv.test:")
    why = "no answer before the deadline" if mode == "hang" else "Name or service not known"
    assert f"cannot resolve host 'kv.test' ({why})" in message


def test_a_hung_resolver_mid_run_is_a_counted_failure_not_a_stall(
    valkey_server: ValkeyProcess, lookup: ControlledLookup
) -> None:
    """Without a usable earlier answer (none kept here), a call that must connect waits
    for the lookup no longer than its deadline, fails, and counts; once the resolver
    answers again the tier serves again."""
    breaker = CircuitBreaker(threshold=100)
    resolver = Resolver(lookup, ttl_s=0, stale_s=0)
    tier = RemoteTier(
        url(valkey_server), fingerprint("dns-hang"), breaker=breaker, resolver=resolver
    )
    try:
        store(tier, KEYS[:2])
        assert read(tier, KEYS[:2]) == [True, True]
        lookup.mode = "hang"
        drop_connections(valkey_server)
        finishes(lambda: store(tier, KEYS[2:4]))
        assert tier.stats.failed == 2 and tier.stats.stored_blocks == 2
        assert finishes(lambda: read(tier, KEYS[:2])) == [False, False]
        assert tier.stats.failed == 4 and tier.unavailable == 2
        lookup.mode = "answer"
        lookup.release.set()
        assert finishes(lambda: read(tier, KEYS[:2])) == [True, True]
    finally:
        lookup.release.set()
        tier.close()


def test_a_known_answer_serves_while_the_resolver_hangs(
    valkey_server: ValkeyProcess, lookup: ControlledLookup
) -> None:
    """Past its time an answer is still used while one lookup refreshes it in the
    background: a resolver outage costs a running tier nothing."""
    tier = RemoteTier(
        url(valkey_server), fingerprint("dns-stale"), resolver=Resolver(lookup, ttl_s=0)
    )
    try:
        lookup.mode = "hang"
        for keys in (KEYS[:3], KEYS[3:6]):
            drop_connections(valkey_server)
            finishes(partial(store, tier, keys))
            assert finishes(partial(read, tier, keys)) == [True] * 3
        assert tier.stats.failed == 0 and tier.unavailable == 0
        assert lookup.calls == 2  # start-up, then one refresh, still hung, for every call
    finally:
        lookup.release.set()
        tier.close()


def test_a_name_that_moved_is_looked_up_again_once_its_address_refuses(
    tmp_path: Path,
) -> None:
    """The server restarts at another address (a pod) and the name follows: the tier kept
    connecting to the old one, refused, until the answer was a minute old."""
    first = ValkeyProcess(tmp_path / "first").start()
    moved = ValkeyProcess(tmp_path / "moved").start()
    where = {"port": first.port}

    def lookup(host: str, port: int) -> list[Address]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", where["port"]))]

    tier = RemoteTier(
        f"redis://{NAME}:6379/0?timeout_ms=300",
        fingerprint("moved"),
        resolver=Resolver(lookup),
        breaker=CircuitBreaker(1, 0.05),
    )
    try:
        store(tier, KEYS[:2])
        first.stop()
        where["port"] = moved.port
        until = time.monotonic() + STALL_S
        while tier.present(KEYS[:2]) < 2:
            assert time.monotonic() < until, "the name's new address was never used"
            store(tier, KEYS[:2])
            time.sleep(0.05)
    finally:
        tier.close()
        first.stop()
        moved.stop()


def test_stores_follow_the_name_once_its_old_primary_became_a_replica(tmp_path: Path) -> None:
    """A standalone failover behind a name (a managed service's primary endpoint): the old
    primary stays up as a replica, serving reads and answering every store ``READONLY``.
    The tier's pooled connections and kept answer sent every store there (for the answer's
    minute; for good with a longer time to keep it, as here); now a store or two later
    they reach the new primary."""
    old = ValkeyProcess(tmp_path / "old").start()
    new = ValkeyProcess(tmp_path / "new").start()
    where = {"port": old.port}

    def lookup(host: str, port: int) -> list[Address]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", where["port"]))]

    tier = RemoteTier(
        f"redis://{NAME}:6379/0?timeout_ms=2000",
        fingerprint("demoted"),
        resolver=Resolver(lookup, ttl_s=3600),
    )
    try:
        store(tier, KEYS[:2])
        new.client().execute_command("REPLICAOF", "NO", "ONE")
        old.client().execute_command("REPLICAOF", "127.0.0.1", new.port)
        where["port"] = new.port
        for _ in range(10):
            store(tier, KEYS[2:4])
            if tier.stats.stored_blocks > 2:
                break
            tier.present(KEYS[:2])  # a lookup between, as an engine makes: a pooled connection
        assert new.client().exists(tier.name(KEYS[2]), tier.name(KEYS[3])) == 2
    finally:
        tier.close()
        old.stop()
        new.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_ip_addresses_are_never_looked_up(host: str, lookup: ControlledLookup) -> None:
    lookup.mode = "fail"
    (address,) = Resolver(lookup).resolve(host, 6379, Deadline(1))
    assert address[3][:2] == (host, 6379) and lookup.calls == 0


@pytest.mark.parametrize("zone", ["lo", str(socket.if_nametoindex("lo"))])
def test_an_ipv6_zone_becomes_the_address_s_scope(zone: str, lookup: ControlledLookup) -> None:
    """``[fe80::1%25eth0]`` (docs/tiers.md): Python's ``connect`` takes the scope from the
    address tuple, which said 0, so a link-local server was refused (``EINVAL``) whatever
    its zone. The address is the system's own for that text, still without a lookup; an
    interface that does not exist fails as a name that does not resolve."""
    lookup.mode = "fail"
    resolver = Resolver(lookup)
    host = f"fe80::1%{zone}"
    (address,) = resolver.resolve(host, 6379, Deadline(1))
    numeric = socket.getaddrinfo(host, 6379, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    assert address[0] == socket.AF_INET6 and address[3] == numeric[0][4] and lookup.calls == 0
    with pytest.raises(ConnectError, match="no network interface 'nosuch0'") as refused:
        resolver.resolve("fe80::1%nosuch0", 6379, Deadline(1))
    assert refused.value.kind == "resolve"


UNSUPPORTED_FAMILY = 12345
"""An address family no kernel has, as AF_INET6 is on one booted with IPv6 turned off."""


def test_an_address_of_a_family_the_kernel_lacks_is_skipped_for_the_next(
    valkey_server: ValkeyProcess,
) -> None:
    """A name with an IPv6 and an IPv4 address, on a host without IPv6: the socket of the
    first cannot be made, and start-up raised that OSError instead of trying the second."""

    def lookup(host: str, port: int) -> list[Address]:
        return [
            (UNSUPPORTED_FAMILY, socket.SOCK_STREAM, 0, ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", port)),
        ]

    tier = RemoteTier(url(valkey_server), fingerprint("dns-family"), resolver=Resolver(lookup))
    try:
        store(tier, KEYS[:2])
        assert tier.held(KEYS[:2]) == [True, True]
    finally:
        tier.close()


def test_a_failed_lookup_is_not_kept(lookup: ControlledLookup) -> None:
    resolver = Resolver(lookup)
    lookup.mode = "fail"
    with pytest.raises(ConnectError, match=r"cannot resolve host 'kv\.test'") as failed:
        resolver.resolve(NAME, 6379, Deadline(5))
    assert failed.value.kind == "resolve"
    lookup.mode = "answer"
    assert resolver.resolve(NAME, 6379, Deadline(5))[0][3] == ("127.0.0.1", 6379)
    assert resolver.resolve(NAME, 6379, Deadline(5))[0][3] == ("127.0.0.1", 6379)
    assert lookup.calls == 2  # the answer is kept, the failure was not


def test_simulate_with_a_name_that_does_not_resolve_ends_in_one_line() -> None:
    """The system resolver, for a name that can never resolve (RFC 2606's ``.invalid``):
    whether it answers at once or not at all here, one line and a non-zero exit."""
    command = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "5", "--no-bound"]
    command += ["--no-progress", "--remote", "redis://kvoffload.invalid:6379/0?timeout_ms=300"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot resolve host 'kvoffload.invalid'" in lines[0], lines
