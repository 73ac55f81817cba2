"""The shared tier against servers and links that misbehave: it never stalls, every bad
block is counted once, and one dead Cluster node fails only its own slots.

A stall shows as a future or a thread that does not finish within a generous
bound (a loaded CI machine), never as a timing assert; the servers are
stopped, or resumed, before the tier is closed, so a failing test ends too.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
from tier_helpers import STALL_S, content, finishes
from tier_helpers import remote_read as read
from tier_helpers import remote_store as store
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload import OffloadKey, block_id_key
from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.tiers import CircuitBreaker, RemoteTier, RemoteTierError
from kvoffload.tiers.format import (
    encode_trailed_block,
    encode_trailed_header,
    encode_trailer,
    payload_digest,
    payload_hasher,
)
from kvoffload.tiers.resp import Address, Resolver
from tier_servers import (
    FakeValkey,
    FakeValkeyCluster,
    ValkeyClusterProcesses,
    ValkeyProcess,
    _cluster_ok,
    free_port,
)

BLOCK = 32
KEYS = [block_id_key(i, 5) for i in range(12)]
HELD_DESCRIPTORS = 1100
"""Open descriptors that push every socket opened next past ``select``'s 1024."""


CLI = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "5", "--no-bound"]
CLI += ["--no-progress"]


@pytest.fixture
def fake() -> Iterator[FakeValkey]:
    server = FakeValkey()
    try:
        yield server
    finally:
        server.stop()


class SippingValkey(FakeValkey):
    """A :class:`FakeValkey` with one more ``mode``, ``sip``: a SET is answered only once its
    value has come in at a byte per ``interval_s`` (the path from the client congested for
    large requests), while lookups and reads, small on the way in, are answered at once."""

    def _answer(self, connection: socket.socket, args: list[bytes]) -> None:
        sipped = self.mode == "sip" and args[0] == b"SET"
        if sipped and self._stopping.wait(self.interval_s * len(args[2])):
            return
        super()._answer(connection, args)


@pytest.fixture
def sipping() -> Iterator[SippingValkey]:
    server = SippingValkey(interval_s=1.0)  # a SET value takes minutes to come in
    try:
        yield server
    finally:
        server.stop()


def test_a_reply_that_trickles_at_start_up_ends_in_one_line(tmp_path: Path) -> None:
    server = FakeValkey("trickle")
    try:
        done = subprocess.run(
            [*CLI, "--remote", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.stop()
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert "not reachable: no full answer before the deadline" in line


def test_start_up_against_seeds_that_never_answer_ends_within_one_deadline() -> None:
    """Three seed nodes that accept (the kernel does) and never answer: one deadline for
    the whole start-up, not one per seed."""
    seeds = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    hosts = ",".join(f"127.0.0.1:{seed.getsockname()[1]}" for seed in seeds)
    timeout_s = 1.0
    started = time.monotonic()
    try:
        with pytest.raises(RemoteTierError, match="no full answer before the deadline"):
            RemoteTier(f"redis://{hosts}?timeout_ms={timeout_s * 1000:.0f}", fingerprint("seeds"))
    finally:
        for seed in seeds:
            seed.close()
    assert time.monotonic() - started < 2 * timeout_s  # a deadline per seed took 3


def simulate_error(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``simulate --remote url`` fails with (no traceback)."""
    argv = ["simulate", "--requests", "5", "--no-bound", "--no-progress", "--remote", url]
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_reply_nested_thousands_deep_at_start_up_ends_in_one_line(
    fake: FakeValkey, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parsing recurses once per array: a hostile server must not choose how deep. The server
    answered, in RESP, with no sane reply: the line says so, with no hint about TLS (it read
    "not reachable ... (if that port speaks TLS, use rediss://)")."""
    fake.mode = "nested"
    line = simulate_error(fake.url, capsys)
    unexpected = "the server answered with something unexpected (arrays nested more than 8 deep"
    assert unexpected in line
    assert "not reachable" not in line and "rediss://" not in line


class AlertingValkey(FakeValkey):
    """A :class:`FakeValkey` that answers as a TLS port answers a plain client: an alert
    record, then the connection closed."""

    def _answer(self, connection: socket.socket, args: list[bytes]) -> None:
        connection.sendall(b"\x15\x03\x03\x00\x02\x02\x46")
        connection.shutdown(socket.SHUT_RDWR)


def test_a_port_that_answers_as_tls_does_at_start_up_keeps_the_tls_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bytes cut off before a whole line are no answer: the hint about TLS stays."""
    server = AlertingValkey()
    try:
        line = simulate_error(server.url, capsys)
    finally:
        server.stop()
    assert line.endswith(
        "is not reachable: the server closed the connection (if that port speaks TLS, use rediss://)"
    )


def one_range(node: bytes, low: int = 0, high: int = 16383) -> bytes:
    """A CLUSTER SLOTS reply: slots ``low`` to ``high`` on ``node`` (its RESP)."""
    return b"*1\r\n*3\r\n:%d\r\n:%d\r\n%b" % (low, high, node)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (one_range(b"*2\r\n$4\r\n\xff\xfe\xfd\xfc\r\n:7000\r\n"), "not ASCII"),
        (one_range(b"*0\r\n"), "unknown shape"),
        (one_range(b"*2\r\n$9\r\n127.0.0.1\r\n$4\r\n7000\r\n"), "unknown shape"),
        (one_range(b"*2\r\n:1\r\n:7000\r\n"), "unknown shape"),
        (one_range(b"*2\r\n$9\r\n127.0.0.1\r\n:0\r\n"), "at port 0"),
        (one_range(b"*2\r\n$0\r\n\r\n:7000\r\n", 20000, 30000), "no slot from 0 to 16383"),
        (b"*1\r\n" * 5000 + b":1\r\n", "arrays nested more than 8 deep"),
    ],
)
def test_a_malformed_cluster_slots_reply_ends_start_up_in_one_line(
    slots: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    server = FakeValkey(cluster_slots=slots)
    try:
        line = simulate_error(server.url, capsys)
    finally:
        server.stop()
    assert f"remote tier redis://127.0.0.1:{server.port}/0: " in line and message in line


def test_a_value_that_drips_mid_run_is_a_counted_failure_and_opens_the_breaker(
    fake: FakeValkey,
) -> None:
    breaker = CircuitBreaker(threshold=1, cooldown_s=0.2)
    tier = RemoteTier(fake.url, fingerprint("drip"), breaker=breaker)
    try:
        store(tier, KEYS[:4])
        fake.mode = "drip"  # each byte comes well within a socket timeout, the value never
        assert read(tier, KEYS[:4]) == [False] * 4
        assert tier.stats.failed == 4 and breaker.is_open and tier.unavailable == 1
        assert finishes(lambda: tier.present(KEYS[:4])) == 0  # refused by the open breaker
        fake.mode = "normal"
        threading.Event().wait(0.25)  # the cooldown
        assert read(tier, KEYS[:4]) == [True] * 4 and not breaker.is_open
    finally:
        fake.stop()
        tier.close()


def test_reads_that_keep_dripping_are_rested_while_lookups_and_stores_go_on(
    fake: FakeValkey,
) -> None:
    """The server drips every value but answers lookups and stores in time (its path to
    the client congested for large replies): each read fails at its deadline, and the
    successes between them kept the node's breaker closed, so every read waited out its
    deadline, for ever. The reads' own breaker opens after ``threshold`` failed reads and
    refuses the next unsent; lookups and stores go on; a trial read lets reads back in."""
    tier = RemoteTier(fake.url, fingerprint("drip-reads"), breaker=CircuitBreaker(2, 60))
    try:
        store(tier, KEYS[:4])
        fake.mode = "drip"
        for _ in range(2):
            assert finishes(lambda: tier.present(KEYS[:4])) == 4
            assert read(tier, KEYS[:4]) == [False] * 4
            store(tier, KEYS[4:6])
        sent = fake.commands
        assert read(tier, KEYS[:4]) == [False] * 4
        assert fake.commands == sent  # refused at once: no GET went out
        assert tier.stats.failed == 12 and tier.unavailable == 3
        reads = tier.read_breakers[f"127.0.0.1:{fake.port}"]
        assert reads.is_open and not tier.breaker.is_open
        assert finishes(lambda: tier.present(KEYS[:6])) == 6
        store(tier, KEYS[6:8])
        assert tier.stats.stored_blocks == 4 + 2 * 2 + 2 and not tier.breaker.is_open
        fake.mode = "normal"
        reads.cooldown_s = 0.0  # the cool-down is over: the next read is the trial
        assert read(tier, KEYS[:8]) == [True] * 8 and not reads.is_open
    finally:
        fake.stop()
        tier.close()


def test_a_read_refused_by_the_node_s_breaker_hands_back_its_read_trial(
    fake: FakeValkey,
) -> None:
    """Reads pass both breakers: a read whose read breaker let it through as the trial,
    and whose node's breaker then refused it, leaves the trial to the next read (else no
    read would ever be let through again)."""
    tier = RemoteTier(fake.url, fingerprint("two-breakers"), breaker=CircuitBreaker(1, 60))
    try:
        reads = tier.read_breakers[f"127.0.0.1:{fake.port}"]
        store(tier, KEYS[:4])
        fake.mode = "drip"
        assert read(tier, KEYS[:4]) == [False] * 4
        assert reads.is_open and tier.breaker.is_open
        fake.mode = "normal"
        reads.cooldown_s = 0.0
        assert read(tier, KEYS[:4]) == [False] * 4  # the node's breaker still cools down
        tier.breaker.cooldown_s = 0.0
        assert read(tier, KEYS[:4]) == [True] * 4
        assert not reads.is_open and not tier.breaker.is_open
    finally:
        fake.stop()
        tier.close()


def test_writes_that_keep_failing_are_rested_while_lookups_and_reads_go_on(
    sipping: SippingValkey,
) -> None:
    """The server takes in SET values slowly but answers lookups and reads in time (its
    path from the client congested for large requests): each write pipeline fails at its
    deadline, and the successes between them kept the node's breaker closed, so every
    write was sent and waited out its deadline on an I/O thread, for ever. The writes' own
    breaker opens after ``threshold`` failed writes and refuses the next unsent; lookups
    and reads go on; a trial write lets writes back in."""
    tier = RemoteTier(sipping.url, fingerprint("sip-writes"), breaker=CircuitBreaker(2, 60))
    try:
        store(tier, KEYS[:4])
        sipping.mode = "sip"
        for _ in range(2):
            assert finishes(lambda: tier.present(KEYS[:4])) == 4
            store(tier, KEYS[4:6])
            assert read(tier, KEYS[:4]) == [True] * 4
        sent = sipping.commands
        store(tier, KEYS[4:6])
        assert sipping.commands == sent  # refused at once: no SET went out
        assert tier.stats.stored_blocks == 4 and tier.stats.failed == 6
        assert tier.unavailable == 3 and tier.skipped_full == 0
        writes = tier.write_breakers[f"127.0.0.1:{sipping.port}"]
        assert writes.is_open and not tier.breaker.is_open
        assert finishes(lambda: tier.present(KEYS[:4])) == 4
        assert read(tier, KEYS[:4]) == [True] * 4 and not tier.breaker.is_open
        sipping.mode = "normal"
        writes.cooldown_s = 0.0  # the cool-down is over: the next write is the trial
        store(tier, KEYS[4:8])
        assert tier.stats.stored_blocks == 8 and not writes.is_open
        assert read(tier, KEYS[:8]) == [True] * 8
    finally:
        sipping.stop()
        tier.close()


def test_a_write_refused_by_the_node_s_breaker_hands_back_its_write_trial(
    sipping: SippingValkey,
) -> None:
    """Writes pass both breakers: a write whose write breaker let it through as the trial,
    and whose node's breaker then refused it, leaves the trial to the next write (else no
    write would ever be let through again)."""
    tier = RemoteTier(sipping.url, fingerprint("two-write-breakers"), breaker=CircuitBreaker(1, 60))
    try:
        writes = tier.write_breakers[f"127.0.0.1:{sipping.port}"]
        sipping.mode = "sip"
        store(tier, KEYS[:4])
        assert writes.is_open and tier.breaker.is_open
        sipping.mode = "normal"
        writes.cooldown_s = 0.0
        store(tier, KEYS[:4])  # the node's breaker still cools down
        assert tier.stats.stored_blocks == 0 and tier.stats.failed == 8
        tier.breaker.cooldown_s = 0.0
        store(tier, KEYS[:4])
        assert tier.stats.stored_blocks == 4 and read(tier, KEYS[:4]) == [True] * 4
        assert not writes.is_open and not tier.breaker.is_open
    finally:
        sipping.stop()
        tier.close()


class HoldingValkey(FakeValkey):
    """A :class:`FakeValkey` with one more ``mode``, ``hold``: a SET is answered only once
    :attr:`released` is set (a healthy server slower than the write-back, its answers
    still within the tier's deadline), while lookups and reads are answered at once."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def _answer(self, connection: socket.socket, args: list[bytes]) -> None:
        if self.mode == "hold" and args[0] == b"SET":
            self.released.wait(STALL_S)
        super()._answer(connection, args)


def test_writes_offered_while_the_backlog_is_full_are_dropped_unsent_and_counted() -> None:
    """A server that stores, but slower than the write-back offers, had every write
    pipeline queued with its payload, without end (the manager never waits on them). A
    write offered while ``max_pending_write_bytes`` are queued or under way is dropped at
    once, counted, and its blocks are not on the server; once the writes under way are
    done, writes are taken again."""
    server = HoldingValkey()
    url = f"redis://127.0.0.1:{server.port}/0?timeout_ms=20000"  # held SETs stay in time
    tier = RemoteTier(url, fingerprint("backlog"), max_pending_write_bytes=2 * BLOCK)
    try:
        server.mode = "hold"
        for key in KEYS[:6]:
            tier.write([key], [content(key, BLOCK)])
            tier.poll(wait=False)
        assert tier.pending_write_bytes == 2 * BLOCK
        assert tier.skipped_backlog == 4 and tier.stats.failed == 4
        assert tier.unavailable == 0 and tier.skipped_full == 0
        server.released.set()
        tier.poll(wait=True)
        assert tier.pending_write_bytes == 0 and tier.stats.stored_blocks == 2
        assert read(tier, KEYS[:6]) == [True] * 2 + [False] * 4
        assert tier.held(KEYS[2:6]) == [False] * 4
        store(tier, KEYS[2:6])  # one batch past the bound, into an empty backlog: taken
        assert tier.stats.stored_blocks == 6 and tier.skipped_backlog == 4
        assert read(tier, KEYS[:6]) == [True] * 6
    finally:
        server.released.set()
        server.stop()
        tier.close()


def test_the_write_backlog_bound_is_two_pipelines_per_thread_and_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="max_pending_write_bytes"):
        RemoteTier("redis://127.0.0.1:1", fingerprint("bound"), max_pending_write_bytes=0)
    server = FakeValkey()
    tier = RemoteTier(server.url, fingerprint("bound"), io_threads=3, chunk_bytes=1000)
    try:
        assert tier.max_pending_write_bytes == 2 * 3 * 1000
    finally:
        server.stop()
        tier.close()


@pytest.mark.parametrize("address", [b"127.0.0.1:0", b"127.0.0.1:70000", b"127.0.0.1:-1"])
def test_a_redirection_to_no_tcp_port_is_an_error_not_a_node(
    fake: FakeValkey, address: bytes
) -> None:
    tier = RemoteTier(fake.url, fingerprint("no-port"))
    try:
        store(tier, KEYS[:2])
        fake.redirect = address
        assert read(tier, KEYS[:2]) == [False, False]
        assert tier.stats.failed == 2
        assert list(tier.breakers) == [f"127.0.0.1:{fake.port}"]  # no node of port 0 or 70000
    finally:
        tier.close()


def test_a_server_that_redirects_to_itself_has_each_key_asked_past_its_hops_no_more(
    fake: FakeValkey,
) -> None:
    """Every GET and SET answered with a ``MOVED`` to the server itself (a confused node):
    each key is sent once and then once per redirection it may follow, then fails, counted,
    reads and stores alike; no operation loops."""
    from kvoffload.tiers.remote import MAX_HOPS

    tier = RemoteTier(fake.url, fingerprint("self-redirect"))
    try:
        store(tier, KEYS[:2])
        fake.redirect = b"127.0.0.1:%d" % fake.port
        sent = fake.commands
        assert read(tier, KEYS[:2]) == [False, False]
        assert fake.commands - sent == 2 * (1 + MAX_HOPS) and tier.stats.failed == 2
        sent = fake.commands
        store(tier, KEYS[2:4])
        assert fake.commands - sent == 2 * (1 + MAX_HOPS) and tier.stats.failed == 4
        assert tier.stats.stored_blocks == 2
    finally:
        tier.close()


def test_redirections_never_grow_the_known_nodes_past_the_cap(
    fake: FakeValkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read is sent to a new made-up node; past MAX_NODES none is made (each would keep
    a breaker and, for a host name, a lookup thread) and the read fails after its hops."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAX_NODES", 3)
    tier = RemoteTier(fake.url, fingerprint("cap"))
    try:
        store(tier, KEYS[:1])
        for _ in range(6):
            fake.redirect = b"127.0.0.1:%d" % free_port()  # nothing listens there
            assert read(tier, KEYS[:1]) == [False]
        assert len(tier.breakers) == 3
        assert tier.stats.failed == 6
    finally:
        tier.close()


def test_slot_map_refreshes_never_grow_the_known_nodes_past_the_cap(
    fake: FakeValkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cluster node that fails has the slot map asked again; a hostile node that names
    new (dead) owners each time: each map's nodes take the last's place (forgotten), and a
    map naming more than MAX_NODES nodes is not taken."""
    from kvoffload.tiers import remote

    def slots_at(*ports: int) -> bytes:
        step = 16384 // len(ports)
        entries = [
            b"*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n"
            % (i * step, 16383 if i == len(ports) - 1 else (i + 1) * step - 1, port)
            for i, port in enumerate(ports)
        ]
        return b"*%d\r\n" % len(ports) + b"".join(entries)

    monkeypatch.setattr(remote, "MAX_NODES", 3)
    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    fake.cluster_slots = slots_at(fake.port)
    tier = RemoteTier(fake.url, fingerprint("map-cap"))
    try:
        for round in range(7):
            ports = [free_port() for _ in range(1 if round < 6 else 4)]  # nothing listens
            fake.cluster_slots = slots_at(*ports)
            fake.redirect = b"127.0.0.1:%d" % ports[0] if round == 0 else None
            assert read(tier, KEYS[:1]) == [False]
            time.sleep(0.2)  # the refresh runs on a thread of its own
        assert len(tier.breakers) <= 3
        assert not {f"127.0.0.1:{port}" for port in ports} & set(tier.breakers)
    finally:
        tier.close()


def test_the_names_of_nodes_a_map_left_are_not_kept(
    fake: FakeValkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each slot map names its one node by a new host name (a hostile Cluster's made up, or
    a long run's): the nodes the maps left are forgotten, and their names' answers with
    them, so the resolver keeps no more names than the tier knows nodes."""
    from kvoffload.tiers import remote

    def every_slot_at(host: bytes) -> bytes:
        return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$%d\r\n%b\r\n:6379\r\n" % (len(host), host)

    dead = free_port()  # every name points there, where nothing listens
    looked_up: set[str] = set()

    def lookup(host: str, port: int) -> list[Address]:
        looked_up.add(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", dead))]

    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    resolver = Resolver(lookup)
    fake.cluster_slots = every_slot_at(b"node-0.test")
    tier = RemoteTier(fake.url, fingerprint("names"), resolver=resolver)
    try:
        until = time.monotonic() + STALL_S
        for round in range(1, 9):
            fake.cluster_slots = every_slot_at(b"node-%d.test" % round)
            while tier.node_address(tier.name(KEYS[0]))[0] != f"node-{round}.test":
                assert time.monotonic() < until, f"map {round} was never learnt"
                assert read(tier, KEYS[:1]) == [False]
                time.sleep(0.05)
        assert len(looked_up) == 8
        assert len(resolver._answers) <= 2
    finally:
        tier.close()


def test_a_lookup_that_outlasts_close_leaves_no_connection_open(fake: FakeValkey) -> None:
    """A lookup runs on the scheduler's thread and may still wait on the server when the
    tier closes: its connection, handed back after, is closed, not kept by a closed node."""
    tier = RemoteTier(fake.url, fingerprint("close-race"))
    store(tier, KEYS[:1])
    fake.delay_s = 0.2
    lookup = threading.Thread(target=tier.present, args=(KEYS[:1],))
    lookup.start()
    time.sleep(0.05)  # the lookup waits for its answer
    tier.close()
    lookup.join(STALL_S)
    assert not lookup.is_alive()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tier
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_lookup_redirected_to_a_new_node_after_close_leaves_no_connection_open(
    fake: FakeValkey,
) -> None:
    """The lookup's answer, after close, is a MOVED to a node the tier did not know: the
    node made then is closed as the others were, so its connection is not kept."""
    other = FakeValkey()
    try:
        tier = RemoteTier(fake.url, fingerprint("close-moved"))
        fake.delay_s = 0.2
        fake.redirect = b"127.0.0.1:%d" % other.port
        lookup = threading.Thread(target=tier.present, args=(KEYS[:1],))
        lookup.start()
        time.sleep(0.05)  # the lookup waits for its answer
        tier.close()
        lookup.join(STALL_S)
        assert not lookup.is_alive()
        assert other.commands > 0  # the redirection was followed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del tier
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        other.stop()


def test_a_value_announced_at_512_mb_is_refused_unread_counted_and_deleted(
    fake: FakeValkey,
) -> None:
    tier = RemoteTier(fake.url, fingerprint("huge"))
    try:
        store(tier, KEYS[:3])
        fake.mode = "huge"
        assert read(tier, KEYS[:3]) == [False] * 3
        assert tier.stats.corrupt == 3 and tier.stats.failed == 0
        deleted = [name for name in fake.deleted if not name.endswith(b":probe")]  # start-up
        assert sorted(deleted) == sorted(tier.name(key) for key in KEYS[:3])
    finally:
        fake.stop()
        tier.close()


def test_simulate_goes_on_when_the_server_starts_dripping_mid_run(
    tmp_path: Path, fake: FakeValkey
) -> None:
    """The first run stores its blocks; in the second the server drips every value it
    is asked for: the promotions fail within their deadlines, the run ends normally."""
    argv = [sys.executable, "-m", "kvoffload", "simulate", "--mix", "oneshot=1"]
    argv += ["--requests", "30", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    argv += ["--layout", "tiny", "--no-bound", "--no-progress", "--remote", fake.url]
    runs = []
    for i in range(2):
        if i == 1:
            fake.mode = "drip"
        path = tmp_path / f"run{i}.json"
        done = subprocess.run(
            [*argv, "--json", str(path)], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(path.read_text())["tiers"]["remote"])
    assert runs[0]["stored_blocks"] > 0 and runs[0]["failed"] == 0
    assert runs[1]["hit_blocks"] == 0 and runs[1]["failed"] > 0


def test_a_real_server_paused_with_sigstop_never_stalls_the_tier(
    own_server: ValkeyProcess,
) -> None:
    """Connecting still works (the kernel accepts), sending too: only the reply never
    comes. Only a deadline on the whole call, not the connect timeout, ends it."""
    own_server.start()
    breaker = CircuitBreaker(threshold=2, cooldown_s=0.2)
    tier = RemoteTier(own_server.url_with(300), fingerprint("sigstop"), breaker=breaker)
    process = own_server.process
    assert process is not None
    try:
        store(tier, KEYS[:6])
        process.send_signal(signal.SIGSTOP)
        assert read(tier, KEYS[:6]) == [False] * 6  # on a pooled connection
        assert finishes(lambda: tier.present(KEYS[:6])) == 0
        assert breaker.is_open
        tier.write(KEYS[6:8], [content(key, BLOCK) for key in KEYS[6:8]])
        finishes(lambda: tier.poll(wait=True))
        assert tier.stats.failed == 6 + 2
        process.send_signal(signal.SIGCONT)
        threading.Event().wait(0.25)
        assert read(tier, KEYS[:6]) == [True] * 6 and not breaker.is_open
    finally:
        process.send_signal(signal.SIGCONT)
        tier.close()


def test_one_dead_cluster_node_fails_only_its_slots(tmp_path: Path) -> None:
    cluster = ValkeyClusterProcesses(tmp_path / "cluster").start()
    keys = [block_id_key(i, 9) for i in range(60)]
    tier = RemoteTier(cluster.url, fingerprint("cluster-node"), breaker=CircuitBreaker(1, 60))
    try:
        store(tier, keys)
        dead = cluster.nodes[1]
        where = [tier.node_address(tier.name(key)) for key in keys]
        on_dead = [w == ("127.0.0.1", dead.port) for w in where]
        assert 0 < sum(on_dead) < len(keys)
        dead.stop()
        assert read(tier, keys) == [not d for d in on_dead]
        breakers = tier.breakers
        assert breakers[f"127.0.0.1:{dead.port}"].is_open
        assert [b.is_open for name, b in breakers.items() if name != f"127.0.0.1:{dead.port}"] == [
            False,
            False,
        ]
        # The live nodes keep taking stores and answering lookups.
        more = [block_id_key(i, 10) for i in range(30)]
        store(tier, more)
        alive = [key for key in more if tier.node_address(tier.name(key))[1] != dead.port]
        assert tier.stats.stored_blocks == len(keys) + len(alive)
        assert tier.present(alive) == len(alive)
    finally:
        tier.close()
        cluster.stop()


@pytest.fixture
def fake_cluster() -> Iterator[FakeValkeyCluster]:
    cluster = FakeValkeyCluster(3, timeout_ms=1000)
    try:
        yield cluster
    finally:
        cluster.stop()


def keys_by_node(tier: RemoteTier, each: int) -> list[list[OffloadKey]]:
    """``each`` keys on every node of ``tier``'s Cluster, node by node."""
    nodes: dict[tuple[str, int], list[OffloadKey]] = {}
    for i in range(10_000):
        key = block_id_key(i, 11)
        nodes.setdefault(tier.node_address(tier.name(key)), []).append(key)
    assert len(nodes) == len(tier.breakers)
    return [keys[:each] for keys in nodes.values()]


def test_one_cluster_operation_with_every_node_hung_ends_within_one_deadline(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """Lookups, loads and stores each ask every node in turn: under one deadline for the
    whole operation, not one per node (a partition held the scheduler nodes x longer)."""
    tier = RemoteTier(fake_cluster.url, fingerprint("hung-cluster"), breaker=CircuitBreaker(100))
    timeout_s = fake_cluster.timeout_ms / 1000
    try:
        a, b, c = keys_by_node(tier, 2)
        keys = [key for trio in zip(a, b, c, strict=True) for key in trio]
        store(tier, keys)
        assert tier.present(keys) == len(keys)
        fake_cluster.mode = "hang"
        calls: list[Callable[[], object]] = [
            lambda: tier.present(keys),
            lambda: read(tier, keys),
            lambda: store(tier, keys),
        ]
        for call in calls:
            started = time.monotonic()
            finishes(call)
            assert time.monotonic() - started < 2 * timeout_s  # 3 nodes took 3
        assert tier.stats.failed == 2 * len(keys) and tier.stats.hit_blocks == 0
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_lookup_asks_no_node_once_its_leading_run_is_decided(
    fake_cluster: FakeValkeyCluster,
) -> None:
    tier = RemoteTier(fake_cluster.url, fingerprint("decided-run"))
    try:
        a, b, c = keys_by_node(tier, 2)
        store(tier, [*b, *c])  # b's and c's nodes now have a pooled connection each
        node = {n.port: n for n in fake_cluster.nodes}
        node_b, node_c = (node[tier.node_address(tier.name(keys[0]))[1]] for keys in (b, c))
        before = node_b.commands, node_c.commands
        assert tier.present([*a, *b, *c]) == 0
        assert tier.present([b[0], a[0], c[0]]) == 1
        assert (node_b.commands, node_c.commands) == (before[0] + 1, before[1])  # one EXISTS
    finally:
        tier.close()


def server_of(tier: RemoteTier, cluster: FakeValkeyCluster, key: OffloadKey) -> FakeValkey:
    port = tier.node_address(tier.name(key))[1]
    return next(node for node in cluster.nodes if node.port == port)


def breaker_of(tier: RemoteTier, key: OffloadKey) -> CircuitBreaker:
    host, port = tier.node_address(tier.name(key))
    return tier.breakers[f"{host}:{port}"]


def test_a_healthy_node_left_a_sliver_of_the_deadline_keeps_its_breaker_closed(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """Node a answers in time but late, leaving b less time than a took: b's timeouts
    are the operation's, not b's, and open no breaker of b's (before, 3 of them did and
    b's keys were refused until a trial). A lookup's leading run asks its nodes in turn,
    in the order of their keys (a whole lookup asks them at once). b's delay leaves its
    last lookup time for two
    answers, as that one opens a fresh connection (a PING, then the EXISTS): at half the
    timeout each, the second landed on the deadline itself and lost the race now and then.
    Behind a, b's answer must land well past the wait slice the deadline falls in, whose
    bytes are taken: at 0.7 and 0.35 of the timeout it landed 10 ms after that slice's end,
    and a loaded machine took it now and then (b held, the test failed)."""
    tier = RemoteTier(fake_cluster.url, fingerprint("starved-node"))
    timeout_s = fake_cluster.timeout_ms / 1000
    try:
        (a,), (b,), _ = keys_by_node(tier, 1)
        store(tier, [a, b])
        server_of(tier, fake_cluster, a).delay_s = 0.8 * timeout_s
        server_of(tier, fake_cluster, b).delay_s = 0.4 * timeout_s  # more than a leaves
        for _ in range(tier.breaker.threshold):
            assert finishes(lambda: tier.present([a, b])) == 1
        assert tier.unavailable == tier.breaker.threshold
        assert not breaker_of(tier, a).is_open and not breaker_of(tier, b).is_open
        assert finishes(lambda: tier.held([b])) == [True]  # given its time, b answers
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_node_that_fails_with_its_fair_time_still_opens_its_breaker(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """A node that trickles past the deadline while first, or hangs after a quick one, is
    charged: only a node left less time than the earlier ones took is excused."""
    tier = RemoteTier(fake_cluster.url, fingerprint("fair-time"), breaker=CircuitBreaker(2, 60))
    timeout_s = fake_cluster.timeout_ms / 1000
    try:
        (a,), (b,), (c,) = keys_by_node(tier, 1)
        store(tier, [a, b, c])
        server_of(tier, fake_cluster, a).delay_s = 2 * timeout_s
        for _ in range(2):  # a asked as b is: it has the whole deadline
            assert finishes(lambda: tier.held([a, b])) == [False, True]
        assert breaker_of(tier, a).is_open and not breaker_of(tier, b).is_open
        assert finishes(lambda: tier.held([a, b])) == [False, True]  # a refused at once
        server_of(tier, fake_cluster, b).mode = "hang"
        for _ in range(2):
            assert finishes(lambda: tier.held([c, b])) == [True, False]
        assert breaker_of(tier, b).is_open and not breaker_of(tier, c).is_open
        assert tier.unavailable == 5
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_hung_node_costs_only_its_own_keys(fake_cluster: FakeValkeyCluster) -> None:
    """Under one deadline per operation, a hung node asked first left the others no time:
    until its breaker opened, every whole look-up, read and store spread over the Cluster
    failed on every node (a paused node had SGLang's shared tier count a batch whose other
    pages had landed as failed, all of it). Then a node whose last call failed went last,
    and only the first operation after the hang failed on every node; now every node is
    asked at once, the first operation's too."""
    tier = RemoteTier(fake_cluster.url, fingerprint("failing-last"), breaker=CircuitBreaker(100))
    try:
        (a, a2), (b, b2), (c, c2) = keys_by_node(tier, 2)
        store(tier, [a, b, c])
        hung = server_of(tier, fake_cluster, a)
        hung.mode = "hang"
        assert finishes(lambda: tier.held([a, b, c])) == [False, True, True]
        assert breaker_of(tier, a).failing and not breaker_of(tier, a).is_open
        assert finishes(lambda: tier.held([a, b, c])) == [False, True, True]
        assert finishes(lambda: read(tier, [c, b, a])) == [True, True, False]
        stored = tier.stats.stored_blocks
        finishes(lambda: store(tier, [c2, b2, a2]))
        assert tier.stats.stored_blocks == stored + 2
        hung.mode = "normal"
        assert finishes(lambda: tier.held([a2, b2, c2])) == [False, True, True]
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_hung_node_asked_last_behind_a_slow_one_still_opens_its_breaker(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """A lookup's leading run asks its nodes in turn: behind a node that takes most of the
    deadline, a node begins with less time left than the operation spent, which excuses a
    healthy node. One that failed with its fair time before is charged all the same:
    excused, its breaker never opened, and every such lookup waited out the deadline on it."""
    tier = RemoteTier(fake_cluster.url, fingerprint("hung-behind-slow"))
    timeout_s = fake_cluster.timeout_ms / 1000
    try:
        (a,), (b,), _ = keys_by_node(tier, 1)
        store(tier, [a, b])
        server_of(tier, fake_cluster, a).mode = "hang"
        server_of(tier, fake_cluster, b).delay_s = 0.6 * timeout_s  # on its pooled connection
        assert finishes(lambda: tier.present([a, b])) == 0  # a first, charged
        for _ in range(tier.breaker.threshold - 1):  # b first, a starved but charged
            assert finishes(lambda: tier.present([b, a])) == 1
        assert breaker_of(tier, a).is_open and not breaker_of(tier, b).is_open
        assert finishes(lambda: tier.present([b, a])) == 1  # a refused at once
        assert tier.unavailable == 1 + tier.breaker.threshold
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_cluster_node_that_drips_its_values_has_only_its_reads_rested(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """Every node has a read breaker of its own: one node that drips its values has its
    reads refused once they have failed ``threshold`` times, while it keeps answering
    lookups and stores, and the other nodes keep serving reads."""
    tier = RemoteTier(fake_cluster.url, fingerprint("drip-node"), breaker=CircuitBreaker(2, 60))
    try:
        (a,), (b,), (c,) = keys_by_node(tier, 1)
        store(tier, [a, b, c])
        dripping = server_of(tier, fake_cluster, a)
        dripping.mode = "drip"
        for _ in range(2):
            assert finishes(lambda: tier.held([a, b, c])) == [True, True, True]
            assert read(tier, [a, b, c]) == [False, True, True]
        sent = dripping.commands
        assert read(tier, [a, b, c]) == [False, True, True]
        assert dripping.commands == sent  # a's read refused at once
        host, port = tier.node_address(tier.name(a))
        resting = [name for name, breaker in tier.read_breakers.items() if breaker.is_open]
        assert resting == [f"{host}:{port}"]
        assert not any(breaker.is_open for breaker in tier.breakers.values())
        store(tier, [a])  # the dripping node still takes stores
        assert tier.stats.stored_blocks == 4 and tier.stats.failed == 3
    finally:
        fake_cluster.stop()
        tier.close()


def test_a_trial_left_a_sliver_of_the_deadline_is_tried_again(
    fake_cluster: FakeValkeyCluster,
) -> None:
    """An open breaker's trial call that starts too late to show anything neither keeps
    the breaker open for good (no other trial would ever be let through) nor closes it."""
    tier = RemoteTier(fake_cluster.url, fingerprint("starved-trial"), breaker=CircuitBreaker(1, 0))
    timeout_s = fake_cluster.timeout_ms / 1000
    try:
        (a,), (b,), _ = keys_by_node(tier, 1)
        store(tier, [a, b])
        slow, healthy = server_of(tier, fake_cluster, a), server_of(tier, fake_cluster, b)
        healthy.mode = "hang"
        assert finishes(lambda: tier.held([a, b])) == [True, False]
        assert breaker_of(tier, b).is_open
        healthy.mode = "normal"
        slow.delay_s, healthy.delay_s = 0.7 * timeout_s, 0.5 * timeout_s
        assert finishes(lambda: tier.present([a, b])) == 1  # b's trial starved, behind a
        assert breaker_of(tier, b).is_open
        slow.delay_s = healthy.delay_s = 0.0
        assert finishes(lambda: tier.held([a, b])) == [True, True]
        assert not breaker_of(tier, b).is_open
    finally:
        fake_cluster.stop()
        tier.close()


def slots_of(*owners: tuple[int, int, FakeValkey]) -> bytes:
    """A CLUSTER SLOTS reply giving each ``(low, high, node)`` range to its node."""
    entries = [
        b"*3\r\n:%d\r\n:%d\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % (low, high, node.port)
        for low, high, node in owners
    ]
    return b"*%d\r\n" % len(entries) + b"".join(entries)


def test_a_slot_map_refresh_asks_the_map_s_nodes_before_one_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seed, taken out of the Cluster, now hangs (its host gone): a refresh that asked
    it first spent its whole deadline there, every time, and never learnt the map."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    cluster = FakeValkeyCluster(4, timeout_ms=1000)
    seed, b, c, d = cluster.nodes
    tier = RemoteTier(cluster.url, fingerprint("refresh-order"))
    try:
        keys = [block_id_key(i, 14) for i in range(1000)]
        on_c = next(key for key in keys if server_of(tier, cluster, key) is c)
        on_d = next(key for key in keys if server_of(tier, cluster, key) is d)
        store(tier, [on_c])
        for node in cluster.nodes:  # the seed and d leave; d dies
            node.cluster_slots = slots_of((0, 8191, b), (8192, 16383, c))
        d.stop()
        until = time.monotonic() + STALL_S
        while server_of(tier, cluster, on_d) is d:
            assert time.monotonic() < until, "the first map was never learnt"
            read(tier, [on_d])  # fails: the map is asked again
            time.sleep(0.05)
        seed.mode = "hang"
        for node in (b, c):  # c fails over to b, then dies
            node.cluster_slots = slots_of((0, 16383, b))
        b.values.update(c.values)
        c.stop()
        while read(tier, [on_c]) != [True]:
            assert time.monotonic() < until, "c's slots were never found on b"
            time.sleep(0.05)
    finally:
        cluster.stop()
        tier.close()


def test_the_url_s_seed_finds_the_cluster_again_once_every_node_known_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The URL names a seed the map does not (a Service's name, not a pod's address): the
    map's nodes are replaced twice, each time by one the tier never knew. A refresh asks
    the URL's seed once no known node answers: the seed, out of the map, is forgotten."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    seed, *owners = nodes = [FakeValkey() for _ in range(4)]
    tier = None
    try:
        for node in nodes:
            node.cluster_slots = slots_of((0, 16383, owners[0]))
        tier = RemoteTier(seed.url, fingerprint("seed-again"))
        store(tier, KEYS[:1])
        until = time.monotonic() + STALL_S
        for old, new in pairwise(owners):
            new.values.update(old.values)
            for node in nodes:
                node.cluster_slots = slots_of((0, 16383, new))
            old.stop()
            while read(tier, KEYS[:1]) != [True]:
                assert time.monotonic() < until, f"node {new.port} was never found"
                time.sleep(0.05)
        assert not {f"127.0.0.1:{node.port}" for node in (seed, owners[0])} & set(tier.breakers)
    finally:
        if tier is not None:
            tier.close()
        for node in nodes:
            node.stop()


class Blackhole:
    """A 127.0.0.1 port where a connect hangs, as at a moved pod's old address, whose
    packets are dropped: a listener that never accepts, its queue filled, so the kernel
    drops every later handshake."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port: int = self._listener.getsockname()[1]
        self._queued: list[socket.socket] = []
        for _ in range(2):  # a backlog of 0 queues one connection; the second is dropped
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", self.port))
            self._queued.append(sock)

    def close(self) -> None:
        for sock in [*self._queued, self._listener]:
            sock.close()


def cluster_ports(node: ValkeyProcess) -> set[int]:
    """The ports ``node``'s CLUSTER SLOTS names."""
    return {entry[2][1] for entry in node.client().execute_command("CLUSTER", "SLOTS")}


def announced(nodes: list[ValkeyProcess], ports: list[int], seen_by: ValkeyProcess) -> None:
    """Have each node announce its port in ``ports`` (0: its own), and wait until
    ``seen_by`` names them all (the Cluster's gossip spreads them)."""
    for node, port in zip(nodes, ports, strict=True):
        node.client().config_set("cluster-announce-port", port)
    wanted = {port or node.port for node, port in zip(nodes, ports, strict=True)}
    until = time.monotonic() + STALL_S
    while cluster_ports(seen_by) != wanted:
        assert time.monotonic() < until, "the Cluster never told the announced ports"
        time.sleep(0.05)


def test_a_map_refresh_reaches_the_url_s_seed_past_known_addresses_that_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node of a real Cluster moved (pods restarted elsewhere): the addresses the
    tier learnt now drop packets, so connecting to them hangs, and only the URL's seed, a
    name, reaches the Cluster. A refresh gave its first address its whole deadline, so
    with one node ahead of the seed hanging it never asked the seed, at every refresh.
    The breakers never open here (they would take the hung nodes out of the refresh after
    a few failures): only the refresh can find the Cluster again."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    cluster = ValkeyClusterProcesses(tmp_path / "moved").start()
    seed = cluster.nodes[-1]
    resolver = Resolver(
        lambda host, port: [(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", port))]
    )
    holes: list[Blackhole] = []
    tier = None
    try:
        holes += [Blackhole() for _ in cluster.nodes]
        announced(cluster.nodes, [hole.port for hole in holes], seed)
        tier = RemoteTier(
            f"redis://seed.test:{seed.port}?timeout_ms=2000",
            fingerprint("moved"),
            breaker=CircuitBreaker(threshold=10**6),
            resolver=resolver,
        )
        keys = [block_id_key(i, 15) for i in range(30)]
        assert {tier.node_address(tier.name(key))[1] for key in keys} == {h.port for h in holes}
        announced(cluster.nodes, [0] * len(holes), seed)
        real = {node.port for node in cluster.nodes}
        until = time.monotonic() + STALL_S
        while {tier.node_address(tier.name(key))[1] for key in keys} != real:
            assert time.monotonic() < until, "the seed was never asked for the new map"
            tier.held(keys)  # fails on a hung node: the map is asked again
        store(tier, keys)
        assert read(tier, keys) == [True] * len(keys)
    finally:
        if tier is not None:
            tier.close()
        for hole in holes:
            hole.close()
        cluster.stop()


def test_a_moved_past_the_cap_has_the_map_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier knows as many nodes as it may (the seed, out of the map, and the slots'
    owner) when the owner answers MOVED to a node it never knew: the map is asked again,
    which forgets the seed and names the new owner. Not asked, every load of the slot
    failed for good (nothing else fails, so nothing else asked)."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAX_NODES", 2)
    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    nodes = seed, owner, new = [FakeValkey() for _ in range(3)]
    tier = None
    try:
        for node in nodes:
            node.cluster_slots = slots_of((0, 16383, owner))
        tier = RemoteTier(seed.url, fingerprint("moved-at-cap"))
        store(tier, KEYS[:1])
        assert len(tier.breakers) == 2
        new.values.update(owner.values)
        for node in nodes:
            node.cluster_slots = slots_of((0, 16383, new))
        owner.redirect = b"127.0.0.1:%d" % new.port
        until = time.monotonic() + STALL_S
        while read(tier, KEYS[:1]) != [True]:
            assert time.monotonic() < until, "the slot's new owner was never found"
            time.sleep(0.05)
        assert f"127.0.0.1:{seed.port}" not in tier.breakers
    finally:
        if tier is not None:
            tier.close()
        for node in nodes:
            node.stop()


@pytest.fixture
def planted(valkey_server: ValkeyProcess) -> Iterator[RemoteTier]:
    tier = RemoteTier(valkey_server.url, fingerprint("planted-length"))
    tier.delete_all()
    try:
        yield tier
    finally:
        tier.delete_all()
        tier.close()


def test_a_valid_header_with_the_wrong_length_is_counted_once_and_deleted(
    planted: RemoteTier, valkey_server: ValkeyProcess
) -> None:
    """Right key, fingerprint and checksum, but 64 payload bytes where the layout has 32."""
    client = valkey_server.client()
    store(planted, KEYS[:3])
    longer = encode_trailed_block(KEYS[1], planted.fingerprint, content(KEYS[1], 2 * BLOCK))
    client.set(planted.name(KEYS[1]), longer)
    assert read(planted, KEYS[:3]) == [True, False, True]
    assert planted.stats.corrupt == 1 and planted.stats.failed == 0
    assert client.exists(planted.name(KEYS[1])) == 0  # so it is never read again
    assert read(planted, KEYS[:3]) == [True, False, True] and planted.stats.corrupt == 1


def test_a_header_that_misstates_the_payload_length_is_corrupt_and_deleted(
    planted: RemoteTier, valkey_server: ValkeyProcess
) -> None:
    """The value has the layout's length and its trailer matches the payload, but the
    header announces 64 payload bytes: a header that lies is not trusted for the rest."""
    client = valkey_server.client()
    store(planted, KEYS[:3])
    body = content(KEYS[1], BLOCK)
    lying = b"".join(
        (
            encode_trailed_header(KEYS[1], planted.fingerprint, 2 * BLOCK),
            body,
            encode_trailer(payload_digest(body)),
        )
    )
    client.set(planted.name(KEYS[1]), lying)
    assert read(planted, KEYS[:3]) == [True, False, True]
    assert planted.stats.corrupt == 1 and client.exists(planted.name(KEYS[1])) == 0


def test_a_long_planted_value_is_refused_before_its_bytes_are_read(
    planted: RemoteTier, valkey_server: ValkeyProcess
) -> None:
    client = valkey_server.client()
    store(planted, KEYS[:3])
    size = 64 * 2**20
    client.set(
        planted.name(KEYS[0]), encode_trailed_block(KEYS[0], planted.fingerprint, bytes(size))
    )
    sent = client.info("stats")["total_net_output_bytes"]
    assert read(planted, KEYS[:3]) == [False, True, True]  # its neighbours still load
    # The server got as far as the sockets' buffers take, nowhere near the whole value.
    assert client.info("stats")["total_net_output_bytes"] - sent < size // 2
    assert planted.stats.corrupt == 1 and client.exists(planted.name(KEYS[0])) == 0


def test_values_of_another_type_or_empty_are_corrupt_and_deleted(
    planted: RemoteTier, valkey_server: ValkeyProcess
) -> None:
    client = valkey_server.client()
    store(planted, KEYS[:4])
    client.delete(planted.name(KEYS[1]), planted.name(KEYS[2]))
    client.rpush(planted.name(KEYS[1]), b"a list")
    client.set(planted.name(KEYS[2]), b"")
    assert read(planted, KEYS[:4]) == [True, False, False, True]
    assert planted.stats.corrupt == 2
    assert client.exists(planted.name(KEYS[1]), planted.name(KEYS[2])) == 0


def test_the_tier_follows_ask_during_a_slot_migration(tmp_path: Path) -> None:
    """A slot half-way between two nodes: a key the old owner lacks is asked of the new
    one, with ASKING, for stores, loads and lookups (a lookup called it absent), as the
    client library does."""
    cluster = ValkeyClusterProcesses(tmp_path / "ask").start()
    tier = RemoteTier(cluster.url, fingerprint("ask"))
    try:
        key = KEYS[0]
        name = tier.name(key)
        source_port = tier.node_address(name)[1]
        source = next(node for node in cluster.nodes if node.port == source_port)
        target = next(node for node in cluster.nodes if node.port != source_port)
        slot = source.client().execute_command("CLUSTER", "KEYSLOT", name)
        target_id = target.client().execute_command("CLUSTER", "MYID")
        source_id = source.client().execute_command("CLUSTER", "MYID")
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        store(tier, [key])
        assert tier.stats.stored_blocks == 1 and tier.stats.failed == 0
        assert source.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        assert target.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
        assert read(tier, [key]) == [True]
        assert tier.present([key]) == 1 and tier.held([key, KEYS[1]]) == [True, False]
        assert tier.node_address(name)[1] == source_port  # ASK never changes the map
    finally:
        tier.close()
        cluster.stop()


def move_slot(
    cluster: ValkeyClusterProcesses, slot: int, source: ValkeyProcess, target: ValkeyProcess
) -> None:
    """``slot`` and its keys from ``source`` to ``target``, every node told (a resharding)."""
    source_id = source.client().execute_command("CLUSTER", "MYID")
    target_id = target.client().execute_command("CLUSTER", "MYID")
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    for name in source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, name, 0, 5000)
    for node in cluster.nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def test_after_a_resharding_one_moved_reply_teaches_the_whole_slot_map(tmp_path: Path) -> None:
    """Slots move from one node to another: the first MOVED has the map asked again, so a
    lookup of another moved slot is sent to its new owner at once (each slot cost a
    redirection of its own, as only the slot of a MOVED was learnt)."""
    cluster = ValkeyClusterProcesses(tmp_path / "reshard").start()
    tier = RemoteTier(cluster.url, fingerprint("reshard"))
    try:
        source, target = cluster.nodes[2], cluster.nodes[0]
        keys = [block_id_key(i, 15) for i in range(200)]
        on_source = [k for k in keys if tier.node_address(tier.name(k))[1] == source.port]
        first, second = on_source[:2]
        slots = [
            source.client().execute_command("CLUSTER", "KEYSLOT", tier.name(key))
            for key in (first, second)
        ]
        assert slots[0] != slots[1]
        store(tier, [first, second])
        for slot in slots:
            move_slot(cluster, slot, source, target)
        assert tier.held([first]) == [True]  # MOVED, followed
        until = time.monotonic() + STALL_S
        while tier.node_address(tier.name(second))[1] != target.port:
            assert time.monotonic() < until, "the second moved slot was never learnt"
            time.sleep(0.05)
        assert tier.held([second]) == [True]
    finally:
        tier.close()
        cluster.stop()


def test_a_redirection_to_a_node_of_unknown_host_name_goes_to_the_answering_host(
    tmp_path: Path,
) -> None:
    """With ``cluster-preferred-endpoint-type hostname``, a node without a host name is
    announced as ``?``: CLUSTER SLOTS' ``?`` was the seed's host, but ``MOVED 3999 ?:port``
    was looked up as a name, and the moved slot's keys failed until the next slot map."""
    cluster = ValkeyClusterProcesses(tmp_path / "unknown-host").start()
    tier = RemoteTier(cluster.url, fingerprint("unknown-host"), breaker=CircuitBreaker(100))
    try:
        for node in cluster.nodes:
            node.client().config_set("cluster-preferred-endpoint-type", "hostname")
        source, target = cluster.nodes[2], cluster.nodes[0]
        keys = [block_id_key(i, 18) for i in range(200)]
        key = next(k for k in keys if tier.node_address(tier.name(k))[1] == source.port)
        store(tier, [key])
        slot = source.client().execute_command("CLUSTER", "KEYSLOT", tier.name(key))
        move_slot(cluster, slot, source, target)
        assert tier.held([key]) == [True]
        assert tier.node_address(tier.name(key)) == ("127.0.0.1", target.port)
    finally:
        tier.close()
        cluster.stop()


def test_each_key_of_a_batch_has_its_own_redirections(tmp_path: Path) -> None:
    """Three slots, one per node, each moved to the next node and then migrating on to the
    third: each key takes a MOVED and an ASK, two redirections, six in the batch. With one
    budget of MAX_HOPS per batch, the batch's last key failed, loads and stores alike."""
    cluster = ValkeyClusterProcesses(tmp_path / "hops").start()
    loader, storer = (RemoteTier(cluster.url, fingerprint("hops")) for _ in range(2))
    try:
        nodes = cluster.nodes
        keys = [block_id_key(i, 16) for i in range(300)]
        batch = [
            next(k for k in keys if loader.node_address(loader.name(k))[1] == node.port)
            for node in nodes
        ]
        store(loader, batch)
        for i, key in enumerate(batch):
            owner, after, last = nodes[i], nodes[(i + 1) % 3], nodes[(i + 2) % 3]
            slot = owner.client().execute_command("CLUSTER", "KEYSLOT", loader.name(key))
            move_slot(cluster, slot, owner, after)
            after_id = after.client().execute_command("CLUSTER", "MYID")
            last_id = last.client().execute_command("CLUSTER", "MYID")
            last.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", after_id)
            after.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", last_id)
            after.client().execute_command(
                "MIGRATE", "127.0.0.1", last.port, loader.name(key), 0, 5000
            )
        assert read(loader, batch) == [True] * 3 and loader.stats.failed == 0
        store(storer, batch)
        assert storer.stats.stored_blocks == 3 and storer.stats.failed == 0
    finally:
        loader.close()
        storer.close()
        cluster.stop()


def joined(nodes: list[ValkeyProcess], directory: Path) -> ValkeyProcess:
    """A new cluster-mode server met by ``nodes``' Cluster, once every node knows it; a
    primary still once it hands its last slot back (no replica migration)."""
    node = ValkeyProcess(
        directory,
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-allow-replica-migration",
        "no",
    ).start()
    node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)

    def knows(one: ValkeyProcess, other: ValkeyProcess) -> bool:
        other_id = other.client().execute_command("CLUSTER", "MYID").decode()
        return other_id in str(one.client().execute_command("CLUSTER", "NODES"))

    until = time.monotonic() + STALL_S
    while not (
        all(knows(node, other) and knows(other, node) for other in nodes)
        and "cluster_state:ok" in str(node.client().execute_command("CLUSTER", "INFO"))
    ):
        assert time.monotonic() < until, "the new node never joined"
        time.sleep(0.05)
    return node


def handed_over(
    nodes: list[ValkeyProcess], slot: int, source: ValkeyProcess, target: ValkeyProcess
) -> None:
    """``slot`` and its keys from ``source`` to ``target``, each of ``nodes`` told."""
    source_id = source.client().execute_command("CLUSTER", "MYID")
    target_id = target.client().execute_command("CLUSTER", "MYID")
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    for name in source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
        source.client().execute_command("MIGRATE", "127.0.0.1", target.port, name, 0, 5000)
    for node in nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def test_nodes_that_left_the_cluster_are_forgotten_and_leave_room_under_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node joins, serves a slot, hands it back and goes (a pod restarted elsewhere), and
    another joins and takes the slot: a tier that never forgot a node knew all five, past a
    cap of four, and refused the map and the redirection, so the slot's block stayed
    unreachable. Under the real cap of 1,024 it takes a long run of restarts."""
    from kvoffload.tiers import remote

    monkeypatch.setattr(remote, "MAX_NODES", 4)
    monkeypatch.setattr(remote, "MAP_REFRESH_S", 0.0)
    cluster = ValkeyClusterProcesses(tmp_path / "churn").start()
    nodes = list(cluster.nodes)
    tier = RemoteTier(cluster.url, fingerprint("churn"), breaker=CircuitBreaker(1, 0.05))
    extra: list[ValkeyProcess] = []
    try:
        key = KEYS[0]
        owner = next(node for node in nodes if node.port == tier.node_address(tier.name(key))[1])
        slot = owner.client().execute_command("CLUSTER", "KEYSLOT", tier.name(key))
        store(tier, [key])

        def served_by(node: ValkeyProcess) -> None:
            until = time.monotonic() + STALL_S
            while tier.held([key]) != [True] or tier.node_address(tier.name(key))[1] != node.port:
                assert time.monotonic() < until, f"the slot was never found on {node.port}"
                time.sleep(0.05)

        extra.append(joined(nodes, tmp_path / "first"))
        handed_over([*nodes, extra[0]], slot, owner, extra[0])
        served_by(extra[0])
        handed_over([*nodes, extra[0]], slot, extra[0], owner)
        extra[0].stop()
        served_by(owner)
        extra.append(joined(nodes, tmp_path / "second"))
        handed_over([*nodes, extra[1]], slot, owner, extra[1])
        served_by(extra[1])
        assert f"127.0.0.1:{extra[0].port}" not in tier.breakers
        assert len(tier.breakers) == 4
    finally:
        tier.close()
        for node in extra:
            node.stop()
        cluster.stop()


def replica_of(primary: ValkeyProcess, directory: Path) -> ValkeyProcess:
    """A cluster-mode server joined to ``primary``'s Cluster as its replica, in sync."""
    replica = ValkeyProcess(
        directory, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"
    ).start()
    client = replica.client()
    primary.client().config_set("repl-diskless-sync-delay", 0)  # the 5 s default, waited out
    client.execute_command("CLUSTER", "MEET", "127.0.0.1", primary.port)
    primary_id = primary.client().execute_command("CLUSTER", "MYID")
    until = time.monotonic() + STALL_S
    while True:  # refused until the MEET has told the replica of the primary
        try:
            client.execute_command("CLUSTER", "REPLICATE", primary_id)
            break
        except Exception:
            assert time.monotonic() < until, "the replica never learnt of its primary"
            time.sleep(0.05)
    while client.dbsize() < primary.client().dbsize():
        assert time.monotonic() < until, "the replica never caught up"
        time.sleep(0.05)
    return replica


def test_after_a_failover_the_tier_finds_the_promoted_replica(tmp_path: Path) -> None:
    """A primary dies and its replica takes its slots over: the dead node never answers
    MOVED, so the tier must ask a live node for the slot map (it served the other nodes'
    slots only, for good, until restarted)."""
    cluster = ValkeyClusterProcesses(tmp_path / "failover").start()
    replica = None
    tier = RemoteTier(cluster.url, fingerprint("failover"), breaker=CircuitBreaker(1, 0.2))
    try:
        keys = [block_id_key(i, 12) for i in range(30)]
        store(tier, keys)
        primary = cluster.nodes[2]
        on_primary = [k for k in keys if tier.node_address(tier.name(k))[1] == primary.port]
        assert 0 < len(on_primary) < len(keys)
        replica = replica_of(primary, tmp_path / "replica")
        primary.stop()
        replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        until = time.monotonic() + STALL_S
        while not all(read(tier, keys)):
            assert time.monotonic() < until, "the promoted replica's slots stayed unreachable"
            time.sleep(0.1)
        assert {tier.node_address(tier.name(k))[1] for k in on_primary} == {replica.port}
        more = [block_id_key(i, 13) for i in range(30)]
        store(tier, more)
        assert tier.present(more) == len(more)
    finally:
        tier.close()
        if replica is not None:
            replica.stop()
        cluster.stop()


def test_a_dead_node_s_address_answering_clusterdown_still_finds_the_promoted_replica(
    tmp_path: Path,
) -> None:
    """A primary dies and a blank Cluster node (its ``nodes.conf`` lost) starts at its
    address, then the replica takes the slots over: the blank node answers every command
    with ``CLUSTERDOWN Hash slot not served``, never ``MOVED``, and an answer opens no
    breaker, so the tier sent those slots there for good unless it asked for the map."""
    cluster = ValkeyClusterProcesses(tmp_path / "blank").start()
    replica = blank = None
    tier = RemoteTier(cluster.url, fingerprint("blank"), breaker=CircuitBreaker(1, 0.2))
    try:
        keys = [block_id_key(i, 14) for i in range(30)]
        store(tier, keys)
        primary = cluster.nodes[2]
        on_primary = [k for k in keys if tier.node_address(tier.name(k))[1] == primary.port]
        assert 0 < len(on_primary) < len(keys)
        replica = replica_of(primary, tmp_path / "replica")
        primary.stop()
        cluster_mode = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        blank = ValkeyProcess(tmp_path / "restarted", *cluster_mode)
        blank.port = primary.port
        blank.start()
        assert not any(read(tier, on_primary))
        replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        until = time.monotonic() + STALL_S
        while not all(read(tier, on_primary)):
            assert time.monotonic() < until, "the slots stayed on the blank node"
            time.sleep(0.1)
        assert {tier.node_address(tier.name(k))[1] for k in on_primary} == {replica.port}
    finally:
        tier.close()
        for server in (replica, blank):
            if server is not None:
                server.stop()
        cluster.stop()


def test_simulate_against_a_server_paused_with_sigstop_at_start_up_or_mid_run(
    tmp_path: Path, own_server: ValkeyProcess
) -> None:
    own_server.start()
    process = own_server.process
    assert process is not None
    url = own_server.url.replace("timeout_ms=2000", "timeout_ms=300")
    argv = [sys.executable, "-m", "kvoffload", "simulate", "--mix", "oneshot=1"]
    argv += ["--requests", "200", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    argv += ["--layout", "tiny", "--no-bound", "--no-progress", "--remote", url]
    try:
        process.send_signal(signal.SIGSTOP)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 1
        assert "not reachable: no full answer before the deadline" in done.stderr
        process.send_signal(signal.SIGCONT)
        path = tmp_path / "first.json"
        subprocess.run([*argv, "--json", str(path)], timeout=120, check=True)
        admin = own_server.client()

        def lookups() -> int:  # EXISTS calls: the run's lookups, not this test's INFOs
            return int(admin.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))

        seen = lookups()
        path = tmp_path / "second.json"
        run = subprocess.Popen([*argv, "--json", str(path)], stderr=subprocess.PIPE, text=True)
        while lookups() < seen + 20:
            assert run.poll() is None, "the run ended before the server was paused"
            threading.Event().wait(0.005)
        process.send_signal(signal.SIGSTOP)
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        remote = json.loads(path.read_text())["tiers"]["remote"]
        assert remote["failed"] > 0
    finally:
        process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("sizes", [[0], [1, 2, 3], [2**20 + 7], [5, 70_000, 1, 300_000]])
def test_the_streaming_checksum_of_loads_is_the_format_s_digest(sizes: list[int]) -> None:
    """Loads checksum each piece as it lands, stores each piece as it goes out: the same
    digest as the payload's whole."""
    data = bytes(range(256)) * (sum(sizes) // 256 + 1)
    payload = data[: sum(sizes)]
    hasher = payload_hasher()
    start = 0
    for size in sizes:
        hasher.update(memoryview(payload)[start : start + size])
        start += size
    assert hasher.intdigest() == payload_digest(payload)


def test_connections_the_server_closed_while_idle_are_replaced_not_failed(
    own_server: ValkeyProcess,
) -> None:
    """Valkey's idle ``timeout``, a proxy or a restart closes pooled connections: the next
    call opens a fresh one instead of failing its blocks."""
    own_server.start()
    tier = RemoteTier(own_server.url, fingerprint("idle"))
    try:
        store(tier, KEYS[:2])
        assert read(tier, KEYS[:2]) == [True, True]
        own_server.client().execute_command("CLIENT", "KILL", "TYPE", "normal")
        store(tier, KEYS[2:4])
        assert read(tier, KEYS[:4]) == [True] * 4
        assert tier.stats.failed == 0 and tier.unavailable == 0
    finally:
        tier.close()


@pytest.fixture
def over_1024_descriptors() -> Iterator[None]:
    """An engine's process: over 1024 open descriptors, so every socket opened now gets
    a number ``select`` refuses (the lowest free ones are taken first, holes included)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = HELD_DESCRIPTORS + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard limit of open files is {hard}, under {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(HELD_DESCRIPTORS)]
    try:
        yield
    finally:
        for descriptor in held:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_pooled_connections_are_reused_in_a_process_with_over_1024_descriptors(
    valkey_server: ValkeyProcess, over_1024_descriptors: None
) -> None:
    tier = RemoteTier(valkey_server.url, fingerprint("many-descriptors"))
    try:
        with tier.open_socket(tier.name(KEYS[0])) as sock:
            assert sock.fileno() >= 1024
        for _ in range(3):  # every call after the first takes a pooled connection
            store(tier, KEYS[:4])
            assert tier.present(KEYS[:4]) == 4
            assert read(tier, KEYS[:4]) == [True] * 4
        assert tier.stats.stored_blocks == 12 and tier.stats.hit_blocks == 12
        assert tier.stats.failed == 0 and tier.unavailable == 0
    finally:
        tier.delete_all()
        tier.close()


def test_a_value_found_corrupt_as_a_read_runs_out_of_time_is_still_deleted(
    tmp_path: Path,
) -> None:
    """A read of a block on a paused node and a corrupt block on another ends only at its
    deadline, waiting for the paused node: the corrupt value is deleted all the same, under
    a deadline of its own. (Its deletion was skipped with no time left: the value stayed,
    held by every lookup and failed by every read.)"""
    cluster = ValkeyClusterProcesses(tmp_path / "late-corrupt").start()
    hosts = ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes)
    tier = RemoteTier(f"redis://{hosts}?timeout_ms=300", fingerprint("late-corrupt"))
    paused, other = cluster.nodes[0], cluster.nodes[1]
    process = paused.process
    assert process is not None
    try:
        keys = [block_id_key(i, 16) for i in range(200)]
        ports = [tier.node_address(tier.name(key))[1] for key in keys]
        hung = keys[ports.index(paused.port)]
        bad = keys[ports.index(other.port)]
        store(tier, [hung, bad])
        flipped = bytearray(other.client().get(tier.name(bad)) or b"")
        flipped[-1] ^= 0x10
        other.client().set(tier.name(bad), bytes(flipped))
        process.send_signal(signal.SIGSTOP)
        assert read(tier, [hung, bad]) == [False, False]
        assert tier.stats.corrupt == 1
        tier.close()  # waits for the deletion, if one was handed on
        assert other.client().exists(tier.name(bad)) == 0
    finally:
        process.send_signal(signal.SIGCONT)
        tier.close()
        cluster.stop()


def test_delete_all_follows_a_del_redirected_by_a_node_now_a_replica(tmp_path: Path) -> None:
    """After a failover the tier's slot map still names the old primary, now a replica: its
    SCAN lists the blocks, its DEL answers MOVED to the promoted replica, and the DEL is
    sent there, so every block goes. (The first MOVED ended the node's deletion: the
    promoted replica's blocks, all of those slots', stayed.)"""
    cluster = ValkeyClusterProcesses(tmp_path / "delete-all").start()
    replica = None
    tier = RemoteTier(cluster.url, fingerprint("delete-all"))
    try:
        keys = [block_id_key(i, 17) for i in range(30)]
        store(tier, keys)
        old = cluster.nodes[2]
        held = sum(tier.node_address(tier.name(k))[1] == old.port for k in keys)
        assert 0 < held < len(keys)
        replica = replica_of(old, tmp_path / "replica")
        replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        until = time.monotonic() + STALL_S
        while (
            old.client().execute_command("ROLE")[::3] != [b"slave", b"connected"]
            or old.client().dbsize() < held  # resynced from the promoted replica
            or not all(_cluster_ok(node) for node in [*cluster.nodes, replica])
        ):
            assert time.monotonic() < until, "the old primary never followed the new one"
            time.sleep(0.05)
        assert tier.delete_all() == len(keys)
        primaries = [*cluster.nodes[:2], replica]
        assert [node.client().dbsize() for node in primaries] == [0, 0, 0]
    finally:
        tier.close()
        if replica is not None:
            replica.stop()
        cluster.stop()


def test_the_first_operation_after_a_cluster_node_freezes_gets_the_other_nodes_blocks(
    tmp_path: Path,
) -> None:
    """A node paused (``SIGSTOP``) before anything marked it as failing: the very first
    lookup, read and store spread over the Cluster still get the other nodes' blocks, the
    paused node's keys first in the batch or last. Its nodes asked one after another under
    the operation's one deadline, that first operation spent all of it on the paused node
    whenever it was asked first, and the nodes after it got none: their blocks read as
    absent, failed, or were dropped unstored (only the next operation asked it last)."""
    cluster = ValkeyClusterProcesses(tmp_path / "frozen").start()
    hosts = ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes)
    url = f"redis://{hosts}?timeout_ms=300"
    frozen = cluster.nodes[0]
    process = frozen.process
    assert process is not None
    tiers: list[RemoteTier] = []
    try:
        for _ in range(6):
            tiers.append(RemoteTier(url, fingerprint("frozen-node"), breaker=CircuitBreaker(100)))
        by_node = keys_by_node(tiers[0], 4)
        ports = [tiers[0].node_address(tiers[0].name(keys[0]))[1] for keys in by_node]
        hung = by_node[ports.index(frozen.port)]
        live = [key for keys in by_node if keys is not hung for key in keys]
        held, fresh = [*hung[:2], *live[::2]], [*hung[2:], *live[1::2]]
        store(tiers[0], held)
        for tier in tiers:  # every node has a pooled connection, as in a running engine
            assert tier.held(held) == [True] * len(held)
        process.send_signal(signal.SIGSTOP)
        for first, tier in zip((True, False), tiers[:2], strict=True):
            batch = held if first else held[::-1]
            expected = [key not in hung for key in batch]
            assert finishes(partial(tier.held, batch)) == expected, f"paused node first: {first}"
        for first, tier in zip((True, False), tiers[2:4], strict=True):
            batch = held if first else held[::-1]
            expected = [key not in hung for key in batch]
            assert finishes(partial(read, tier, batch)) == expected, f"paused node first: {first}"
            assert tier.stats.failed == 2
        for first, tier in zip((True, False), tiers[4:], strict=True):
            finishes(partial(store, tier, fresh if first else fresh[::-1]))
            assert tier.stats.stored_blocks == len(live) // 2, f"paused node first: {first}"
            assert tier.stats.failed == 2
    finally:
        process.send_signal(signal.SIGCONT)
        for tier in tiers:
            tier.close()
        cluster.stop()
