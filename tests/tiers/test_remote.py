"""The shared tier against real Valkey servers: standalone, Cluster, failures, AUTH."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import valkey
from tier_helpers import ByteSlots, content
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.tiers import CircuitBreaker, RemoteTier, RemoteTierError, layout_fingerprint
from kvoffload.tiers.format import encode_trailed_block
from tier_servers import ValkeyClusterProcesses, ValkeyProcess, _cluster_ok

KEYS = [block_id_key(i) for i in range(40)]
T = TypeVar("T")


def payload(key: OffloadKey) -> bytes:
    return (key * 4)[:32]


def read_all(tier: RemoteTier, keys: list[OffloadKey]) -> tuple[list[bool], dict[int, bytes]]:
    buffers = [bytearray(32) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10)
    return ok, {i: bytes(buffers[i]) for i, good in enumerate(ok) if good}


def store(tier: RemoteTier, keys: list[OffloadKey]) -> None:
    tier.write(keys, [payload(key) for key in keys])
    tier.poll(wait=True)


def test_standalone_round_trip_under_the_fingerprint(valkey_server: ValkeyProcess) -> None:
    tier = RemoteTier(valkey_server.url, fingerprint("standalone"), enable_events=True)
    try:
        assert not tier.is_cluster
        tier.delete_all()
        store(tier, KEYS[:10])
        assert tier.present(KEYS) == 10 and tier.present(KEYS[5:]) == 5
        ok, got = read_all(tier, KEYS[:12])
        assert ok == [True] * 10 + [False] * 2
        assert got == {i: payload(k) for i, k in enumerate(KEYS[:10])}
        [event] = tier.take_events()
        assert (event.medium, event.removed, event.keys) == ("REMOTE", False, KEYS[:10])
        raw = valkey_server.client().get(tier.name(KEYS[0]))
        assert raw == encode_trailed_block(KEYS[0], tier.fingerprint, payload(KEYS[0]))
        other = RemoteTier(valkey_server.url, fingerprint("another-model"))
        try:
            assert other.present(KEYS) == 0
        finally:
            other.close()
    finally:
        tier.close()


def test_calls_on_a_closed_tier_fail_counted_and_raise_nothing(
    valkey_server: ValkeyProcess,
) -> None:
    """A read or write after close (its I/O threads gone) is a counted failure, as every
    other failure of the tier is: nothing raises into the engine."""
    tier = RemoteTier(valkey_server.url, fingerprint("closed"))
    tier.delete_all()
    store(tier, KEYS[:2])
    tier.close()
    ok, _ = read_all(tier, KEYS[:2])
    assert ok == [False, False]
    tier.write(KEYS[2:5], [payload(key) for key in KEYS[2:5]])
    tier.poll(wait=True)
    tier.close()
    assert tier.stats.stored_blocks == 2 and tier.stats.failed == 3


class LateSubmit:
    """The tier's read pool, whose ``submit`` says it was entered, then waits (a bounded
    while) for the pool's ``shutdown``: a read on another thread paused between its
    closed check and its submit while close runs."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.entered = threading.Event()
        self.shut = threading.Event()

    def submit(self, call: Callable[..., T], /, *args: object) -> Future[T]:
        self.entered.set()
        self.shut.wait(1.0)
        return self.pool.submit(call, *args)

    def shutdown(self, wait: bool) -> None:
        self.pool.shutdown(wait)
        self.shut.set()


def test_a_read_racing_close_on_another_thread_raises_nothing(
    valkey_server: ValkeyProcess,
) -> None:
    """SGLang's prefetch reads the shared tier without a lock while another thread closes
    it: a read that had found the tier open when close shut its pool raised RuntimeError
    (cannot schedule new futures after shutdown) into that thread."""
    tier = RemoteTier(valkey_server.url, fingerprint("close-race"))
    store(tier, KEYS[:2])
    late = LateSubmit(tier._reads)
    tier._reads = late  # type: ignore[assignment]
    outcome: list[object] = []

    def reading() -> None:
        try:
            outcome.append(read_all(tier, KEYS[:2])[0])
        except Exception as exc:  # the failure this test is about
            outcome.append(exc)

    reader = threading.Thread(target=reading)
    reader.start()
    assert late.entered.wait(10)
    tier.close()
    reader.join(10)
    assert outcome == [[True, True]]  # it was asked before close: close finished it


def test_lookups_and_delete_all_on_a_closed_tier_touch_no_server(
    valkey_server: ValkeyProcess,
) -> None:
    """After close a lookup says nothing is held and delete_all deletes nothing: both
    opened a connection that nothing closed, and delete_all emptied the server."""
    tier = RemoteTier(valkey_server.url, fingerprint("closed-lookups"))
    tier.delete_all()
    store(tier, KEYS[:2])
    tier.close()
    connected = valkey_server.client().info("stats")["total_connections_received"]
    assert tier.present(KEYS[:2]) == 0 and tier.held(KEYS[:2]) == [False, False]
    assert tier.delete_all() == 0
    assert valkey_server.client().info("stats")["total_connections_received"] == connected
    assert valkey_server.client().exists(*(tier.name(key) for key in KEYS[:2])) == 2


def test_cluster_round_trip_spreads_blocks_over_the_nodes(
    valkey_cluster: ValkeyClusterProcesses,
) -> None:
    tier = RemoteTier(valkey_cluster.url, fingerprint("cluster"))
    try:
        assert tier.is_cluster
        store(tier, KEYS)
        assert tier.present(KEYS) == len(KEYS)
        ok, got = read_all(tier, KEYS)
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS)}
        assert all(node.client().dbsize() > 0 for node in valkey_cluster.nodes)
        # Per key, every node asked, in any order: a block past a missing one is found.
        absent = [block_id_key(i) for i in range(100, 140)]
        mixed = [key for pair in zip(absent, reversed(KEYS), strict=True) for key in pair]
        assert tier.held(mixed) == [False, True] * len(KEYS)
        assert tier.present(mixed) == 0
    finally:
        tier.close()


def test_delete_all_asks_again_for_names_a_node_answered_clusterdown(tmp_path: Path) -> None:
    """A node answering ``CLUSTERDOWN`` for a while (here one of its slots is dropped, so it
    says the Cluster is down, as nodes do during a failover) failed its whole DEL pipeline
    at the first answer: the reset left its blocks. Now each such name is asked again until
    the page's deadline, and the reset deletes every block once the node serves again."""
    cluster = ValkeyClusterProcesses(tmp_path / "down").start()
    url = cluster.url.replace("timeout_ms=2000", "timeout_ms=30000")  # waits, never expires
    tier = RemoteTier(url, fingerprint("down"))
    try:
        store(tier, KEYS)
        node = cluster.nodes[2]
        name = tier.name(next(k for k in KEYS if tier.node_address(tier.name(k))[1] == node.port))
        admin = node.client()
        slot = admin.execute_command("CLUSTER", "KEYSLOT", name)
        admin.execute_command("CLUSTER", "DELSLOTS", slot)
        with pytest.raises(valkey.exceptions.ResponseError, match="CLUSTERDOWN"):
            admin.delete(name)
        delete, answered_down = tier._delete, threading.Event()

        def serving_again() -> None:
            """Give the slot back once a DEL was answered CLUSTERDOWN, until it is served."""
            if answered_down.is_set():
                return
            answered_down.set()
            admin.execute_command("CLUSTER", "ADDSLOTS", slot)
            until = time.monotonic() + 20
            while not all(_cluster_ok(each) for each in cluster.nodes):
                assert time.monotonic() < until, "the Cluster stayed down"
                time.sleep(0.05)

        def deleting(*args: Any) -> Any:
            try:
                counts = delete(*args)
            except Exception as error:
                if "CLUSTERDOWN" in str(error):
                    serving_again()
                raise
            if None in counts:
                serving_again()
            return counts

        tier._delete = deleting  # type: ignore[method-assign]
        deleted = tier.delete_all()
        assert answered_down.is_set()
        assert (deleted, tier.held(KEYS)) == (len(KEYS), [False] * len(KEYS))
    finally:
        tier.close()
        cluster.stop()


def test_a_cluster_database_past_0_holds_the_tier_s_blocks_apart(tmp_path: Path) -> None:
    """Valkey 9 Clusters serve several databases (``cluster-databases``): every node
    connection selects the URL's, so blocks go there alone, and a tier on database 0 with
    the same fingerprint sees none of them (the URL parser refused any but 0)."""
    cluster = ValkeyClusterProcesses(tmp_path / "dbs", "--cluster-databases", "4").start()
    tiers: list[RemoteTier] = []
    try:
        tier = RemoteTier(cluster.url.replace("?", "/2?"), fingerprint("dbs"))
        tiers.append(tier)
        first = cluster.nodes[0].port  # one seed: the Cluster found, then its map, in db 2
        seeded = RemoteTier(f"redis://127.0.0.1:{first}/2?timeout_ms=2000", fingerprint("dbs"))
        tiers.append(seeded)
        beside = RemoteTier(cluster.url, fingerprint("dbs"))
        tiers.append(beside)
        assert tier.is_cluster and seeded.is_cluster
        store(tier, KEYS)
        ok, got = read_all(seeded, KEYS)
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS)}
        assert beside.held(KEYS) == [False] * len(KEYS)
        in_two = [valkey.Valkey("127.0.0.1", node.port, db=2) for node in cluster.nodes]
        try:
            assert all(client.dbsize() > 0 for client in in_two)
            assert [node.client().dbsize() for node in cluster.nodes] == [0, 0, 0]
            assert tier.delete_all() == len(KEYS)
            assert [client.dbsize() for client in in_two] == [0, 0, 0]
        finally:
            for client in in_two:
                client.close()
    finally:
        for each in tiers:
            each.close()
        cluster.stop()


def test_a_database_a_cluster_does_not_serve_fails_start_up_saying_which_servers_do(
    valkey_cluster: ValkeyClusterProcesses,
) -> None:
    """A Cluster at Valkey 9's default ``cluster-databases 1`` (or an older one, or Redis,
    which refuse SELECT in Cluster mode) refuses database 1: one line, naming it and the
    servers that take it."""
    with pytest.raises(RemoteTierError) as error:
        RemoteTier(valkey_cluster.url.replace("?", "/1?"), fingerprint("db1"))
    message = str(error.value)
    assert "database 1 refused (ERR DB index is out of range)" in message
    assert "a Cluster takes one past 0 only from Valkey 9.0 on" in message
    assert "\n" not in message


ROUNDS = 150
"""Write-then-poll rounds per thread in the two-thread test: enough that unlocked polls
lost or twice-counted writes in every run tried."""


def test_writes_and_polls_from_two_threads_count_every_block_once(
    valkey_server: ValkeyProcess,
) -> None:
    """vLLM's worker threads, or SGLang's backup thread beside its prefetch, may write and
    poll the shared tier at once. Unguarded, a poll that waited on its jobs put back a job
    table that another thread's write or poll had changed meanwhile: writes were counted
    twice, or dropped from the table and never counted, their events never told."""
    tier = RemoteTier(valkey_server.url, fingerprint("two-threads"), enable_events=True)
    tier.delete_all()
    batches = [[block_id_key(i, 16 + t) for i in range(ROUNDS)] for t in range(2)]
    start = threading.Barrier(2)

    def writing(keys: list[OffloadKey], wait: bool) -> None:
        start.wait()
        for key in keys:
            tier.write([key], [payload(key)])
            tier.poll(wait=wait)

    try:
        threads = [
            threading.Thread(target=writing, args=(keys, wait))
            for keys, wait in zip(batches, (True, False), strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a writer stalled"
        tier.poll(wait=True)
        every = [key for keys in batches for key in keys]
        told = Counter(key for event in tier.take_events() for key in event.keys)
        assert (tier.stats.stored_blocks, tier.stats.failed) == (len(every), 0)
        assert told == Counter(every)
        assert tier.present(every) == len(every)
    finally:
        tier.close()


WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from tier_helpers import ByteSlots, content
from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload import CPUOffloadingManager
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.tiers import RemoteTier, layout_fingerprint
remote = RemoteTier(sys.argv[1], layout_fingerprint("shared", layout_preset("tiny"), 48))
slots = ByteSlots(64, 48)
m = TieredOffloadingManager(
    CPUOffloadingManager(64), [(remote, TierSettings(write_through=True))], slots
)
keys = [block_id_key(i) for i in range(100, 130)]
out = m.prepare_store(keys)
for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist()):
    slots.view(slot)[:] = content(key, 48)
m.complete_store(out.keys_to_store)
m.close()
print(remote.stats.stored_blocks)
"""


def test_two_managers_in_two_processes_share_the_cluster_tier(
    valkey_cluster: ValkeyClusterProcesses,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WRITER, valkey_cluster.url, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "30"
    keys = [block_id_key(i) for i in range(100, 130)]
    remote = RemoteTier(valkey_cluster.url, layout_fingerprint("shared", layout_preset("tiny"), 48))
    slots = ByteSlots(64, 48)
    m = TieredOffloadingManager(CPUOffloadingManager(64), [(remote, TierSettings(True))], slots)
    try:
        assert m.lookup(keys) is None
        deadline = time.monotonic() + 10
        while (found := m.lookup(keys)) is None:
            assert time.monotonic() < deadline, "a promotion never finished"
            time.sleep(0.001)
        assert found == 30 and remote.stats.hit_blocks == 30
        spec = m.prepare_load(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        for key, slot in zip(keys, spec.block_ids.tolist(), strict=True):
            assert bytes(slots.view(slot)) == content(key, 48)
        m.complete_load(keys)
    finally:
        m.close()


def test_a_killed_server_degrades_to_counted_misses_and_recovers_by_itself(
    own_server: ValkeyProcess,
) -> None:
    own_server.start()
    breaker = CircuitBreaker(threshold=1, cooldown_s=0.05)
    tier = RemoteTier(own_server.url_with(1000), fingerprint("kill"), breaker=breaker)
    try:
        store(tier, KEYS[:5])
        own_server.stop()
        assert tier.present(KEYS[:5]) == 0
        ok, got = read_all(tier, KEYS[:5])
        assert ok == [False] * 5 and not got
        store(tier, KEYS[5:8])
        assert tier.stats.failed >= 3 + 5 and tier.unavailable >= 2 and breaker.is_open
        own_server.start()  # same port, empty: what was stored before is gone
        time.sleep(0.06)
        assert tier.present(KEYS[:5]) == 0
        assert not breaker.is_open
        store(tier, KEYS[10:12])
        assert tier.present(KEYS[10:12]) == 2
        ok, got = read_all(tier, KEYS[10:12])
        assert ok == [True, True] and got[1] == payload(KEYS[11])
    finally:
        tier.close()


def test_planted_corrupt_and_foreign_values_are_never_loaded_and_are_deleted(
    valkey_server: ValkeyProcess,
) -> None:
    fp = fingerprint("planted")
    tier = RemoteTier(valkey_server.url, fp)
    client = valkey_server.client()
    try:
        tier.delete_all()
        store(tier, KEYS[:4])
        flipped = bytearray(client.get(tier.name(KEYS[1])) or b"")
        flipped[-1] ^= 0x10
        client.set(tier.name(KEYS[1]), bytes(flipped))
        foreign = encode_trailed_block(KEYS[2], fingerprint("someone-else"), payload(KEYS[2]))
        client.set(tier.name(KEYS[2]), foreign)
        misplaced = encode_trailed_block(KEYS[0], fp, payload(KEYS[0]))
        client.set(tier.name(KEYS[3]), misplaced)
        ok, got = read_all(tier, KEYS[:4])
        assert ok == [True, False, False, False] and list(got) == [0]
        assert tier.stats.corrupt == 3
        assert [client.exists(tier.name(k)) for k in KEYS[:4]] == [1, 0, 0, 0]
    finally:
        tier.close()


def test_auth_wrong_or_missing_password_fails_clearly_at_start_up(tmp_path: Path) -> None:
    server = ValkeyProcess(tmp_path / "auth", password="right-one")
    server.start()
    try:
        base = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(RemoteTierError, match="authentication failed") as wrong:
            RemoteTier(f"redis://:wrong@127.0.0.1:{server.port}/0", fingerprint("auth"))
        assert "wrong" not in str(wrong.value).split("(")[0]
        with pytest.raises(RemoteTierError, match="authentication failed"):
            RemoteTier(base, fingerprint("auth"))
        tier = RemoteTier(f"redis://default:right-one@127.0.0.1:{server.port}/0", fingerprint("a"))
        try:
            store(tier, KEYS[:2])
            assert tier.present(KEYS[:2]) == 2
        finally:
            tier.close()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("rules", "refused"),
    [
        (["~*", "+ping", "+info", "+get", "+set", "+del"], "run the 'exists' command"),
        (["~other:*", "+@all"], "access a key"),
    ],
)
def test_a_user_the_acl_refuses_the_tier_s_commands_fails_clearly_at_start_up(
    own_server: ValkeyProcess, rules: list[str], refused: str
) -> None:
    """An ACL without EXISTS, or without the tier's keys: start-up said nothing, then every
    lookup (or every store and load) failed, counted, and the tier held nothing usable."""
    own_server.start().client().execute_command("ACL", "SETUSER", "kv", "on", ">pw", *rules)
    url = f"redis://kv:pw@127.0.0.1:{own_server.port}/0"
    with pytest.raises(RemoteTierError, match="may not run the tier's commands") as refusal:
        RemoteTier(url, fingerprint("acl"))
    assert refused in str(refusal.value) and "EXISTS, GET, SET and DEL on keys kvo3:*" in str(
        refusal.value
    )
    assert own_server.client().keys("*") == []  # the probe wrote nothing


def test_a_cluster_user_the_acl_refuses_asking_fails_clearly_at_start_up(
    tmp_path: Path,
) -> None:
    """A Cluster's tier sends ASKING before each command an ``ASK`` redirects (a slot being
    migrated): a user refused it started, then failed every block of a migrating slot,
    counted, with no word of why; the message named only EXISTS, GET, SET and DEL."""
    cluster = ValkeyClusterProcesses(tmp_path / "acl").start()
    try:
        for node in cluster.nodes:  # ACLs are each node's own
            node.client().execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all")
            node.client().execute_command("ACL", "SETUSER", "kv", "-asking")
        url = cluster.url.replace("redis://", "redis://kv:pw@")
        with pytest.raises(RemoteTierError, match="may not run the tier's commands") as refusal:
            RemoteTier(url, fingerprint("acl"))
        assert "'asking'" in str(refusal.value) and "(and ASKING in a Cluster)" in str(
            refusal.value
        )
        for node in cluster.nodes:
            node.client().execute_command("ACL", "SETUSER", "kv", "+asking")
        RemoteTier(url, fingerprint("acl")).close()
    finally:
        cluster.stop()


def test_a_read_only_replica_fails_clearly_at_start_up(tmp_path: Path) -> None:
    """Every store to a replica fails with READONLY: start-up says so instead."""
    primary = ValkeyProcess(tmp_path / "primary").start()
    replica = ValkeyProcess(tmp_path / "replica").start()
    try:
        replica.client().execute_command("REPLICAOF", "127.0.0.1", primary.port)
        with pytest.raises(RemoteTierError, match="read-only replica"):
            RemoteTier(replica.url, fingerprint("replica"))
        tier = RemoteTier(primary.url, fingerprint("replica"))
        tier.close()
    finally:
        replica.stop()
        primary.stop()


@pytest.mark.parametrize("renamed", ["EXISTS", "GET", "SET", "DEL"])
def test_a_server_that_renamed_a_tier_command_fails_clearly_at_start_up(
    tmp_path: Path, renamed: str
) -> None:
    """``rename-command SET ""`` (or GET, EXISTS, DEL) answers the probe with an unknown
    command, not NOPERM: the tier started, then failed every store (or load, or lookup),
    counted, with no word of why."""
    server = ValkeyProcess(tmp_path / "renamed", "--rename-command", renamed, "").start()
    try:
        with pytest.raises(RemoteTierError, match=f"does not know {renamed}, renamed or disabled"):
            RemoteTier(server.url, fingerprint("renamed"))
    finally:
        server.stop()


def test_an_unreachable_server_fails_clearly_at_start_up(own_server: ValkeyProcess) -> None:
    with pytest.raises(RemoteTierError, match="not reachable"):
        RemoteTier(f"redis://127.0.0.1:{own_server.port}/0?timeout_ms=100", fingerprint("x"))


def test_a_seed_that_refuses_the_connection_is_passed_over_for_the_next(
    tmp_path: Path,
) -> None:
    """A Cluster URL's first seed at its ``maxclients`` (or ``LOADING`` as it restarts)
    answers the connection with an error reply: start-up ended there, with the Cluster's
    other seeds never asked; a standalone server's refusal still ends it in one line."""
    cluster = ValkeyClusterProcesses(tmp_path / "seeds").start()
    try:
        full = cluster.nodes[0]
        full.client().config_set("maxclients", 1)  # its one client: the admin connection
        tier = RemoteTier(cluster.url, fingerprint("seeds"))
        try:
            assert tier.is_cluster
            full.client().config_set("maxclients", 100)
            store(tier, KEYS[:10])
            assert tier.present(KEYS[:10]) == 10
        finally:
            tier.close()
        full.client().config_set("maxclients", 1)
        with pytest.raises(RemoteTierError, match="max number of clients"):
            RemoteTier(full.url, fingerprint("seeds"))
    finally:
        cluster.stop()


def test_blocks_the_server_evicted_are_plain_misses(tmp_path: Path) -> None:
    server = ValkeyProcess(
        tmp_path / "small", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"
    )
    server.start()
    try:
        tier = RemoteTier(server.url, fingerprint("maxmemory"))
        big = [block_id_key(i) for i in range(200)]
        try:
            for start in range(0, len(big), 20):
                chunk = big[start : start + 20]
                tier.write(chunk, [payload(key) * 1000 for key in chunk])  # 32 kB each
                tier.poll(wait=True)
            held = [tier.present([key]) for key in big]
            assert 0 < sum(held) < len(big)  # the server evicted some
            buffers = [bytearray(32_000) for _ in big]
            ok = tier.read(big, lambda i: memoryview(buffers[i])).result(timeout=10)
            # The server may evict more while it serves the read: a miss, never a wrong block.
            assert sum(ok) > 0 and all(held[i] for i, good in enumerate(ok) if good)
            assert all(bytes(buffers[i]) == payload(k) * 1000 for i, k in enumerate(big) if ok[i])
            assert tier.stats.corrupt == 0 and tier.unavailable == 0
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_batch_larger_than_the_server_s_output_buffer_limit_is_read_whole(
    tmp_path: Path,
) -> None:
    """A server with ``client-output-buffer-limit normal 24mb`` serves a 128 MiB read batch,
    twice: its GETs go out as the values come in, so the replies waiting in the server's
    output buffer stay under the limit. (Sent all at once, the replies piled up past it and
    the server closed the connection: every block of the batch failed.)"""
    limit = "normal 24mb 0 0"
    server = ValkeyProcess(tmp_path / "obuf", "--client-output-buffer-limit", limit).start()
    size = 2**20
    keys = [block_id_key(i) for i in range(128)]
    try:
        tier = RemoteTier(server.url, layout_fingerprint("obuf", layout_preset("tiny"), size))
        try:
            tier.write(keys, [content(key, size) for key in keys])
            tier.poll(wait=True)
            assert tier.stats.stored_blocks == len(keys)
            buffers = [bytearray(size) for _ in keys]
            for _ in range(2):
                ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=30)
                assert ok == [True] * len(keys) and tier.unavailable == 0
            assert all(bytes(buffers[i]) == content(key, size) for i, key in enumerate(keys))
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_full_server_refusing_stores_still_serves_loads(tmp_path: Path) -> None:
    """With maxmemory and Valkey's default policy, noeviction, a full server answers SET
    with OOM: the stores fail, but the server is up, so its breaker stays closed and the
    blocks it holds are still loaded (the first OOM opened it, and every load was refused)."""
    server = ValkeyProcess(
        tmp_path / "full", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction"
    )
    server.start()
    try:
        size = 32_000
        tier = RemoteTier(
            server.url,
            layout_fingerprint("full", layout_preset("tiny"), size),
            breaker=CircuitBreaker(threshold=1, cooldown_s=60),
        )
        keys = [block_id_key(i) for i in range(200)]
        try:
            stored = 0
            while tier.stats.failed == 0 and stored < len(keys):
                tier.write([keys[stored]], [content(keys[stored], size)])
                tier.poll(wait=True)
                stored = tier.stats.stored_blocks
            assert tier.stats.failed == 1 and 0 < stored < len(keys)  # OOM came
            buffers = [bytearray(size) for _ in range(stored)]
            ok = tier.read(keys[:stored], lambda i: memoryview(buffers[i])).result(timeout=10)
            assert ok == [True] * stored
            assert all(bytes(buffers[i]) == content(k, size) for i, k in enumerate(keys[:stored]))
            assert not tier.breaker.is_open and tier.unavailable == 1
        finally:
            tier.close()
    finally:
        server.stop()


def _sets_received(admin: valkey.Valkey) -> int:
    """SET commands the server has taken, those it refused included."""
    stats = admin.info("commandstats").get("cmdstat_set", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))


def test_a_full_server_is_sent_no_store_for_its_breaker_s_cool_down(tmp_path: Path) -> None:
    """After an OOM reply the node rests from stores for its breaker's cool-down: each
    store to a full server was sent whole (its bytes and a round trip) to be refused;
    now it is dropped unsent, counted, loads go on, and after the cool-down one is sent."""
    server = ValkeyProcess(
        tmp_path / "full", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction"
    ).start()
    admin = server.client()

    try:
        size = 32_000
        tier = RemoteTier(
            server.url,
            layout_fingerprint("resting", layout_preset("tiny"), size),
            breaker=CircuitBreaker(threshold=1, cooldown_s=60),
        )
        keys = [block_id_key(i) for i in range(200)]
        try:
            sent = 0
            while tier.stats.failed == 0 and sent < len(keys) - 20:
                tier.write([keys[sent]], [content(keys[sent], size)])
                tier.poll(wait=True)
                sent += 1
            stored = tier.stats.stored_blocks
            assert tier.stats.failed == 1 and stored > 0  # OOM came
            seen = _sets_received(admin)
            for key in keys[sent : sent + 10]:
                tier.write([key], [content(key, size)])
                tier.poll(wait=True)
            assert _sets_received(admin) == seen
            assert tier.skipped_full == 10 and tier.stats.failed == 11
            buffers = [bytearray(size) for _ in range(stored)]
            ok = tier.read(keys[:stored], lambda i: memoryview(buffers[i])).result(timeout=10)
            assert ok == [True] * stored and tier.unavailable == 1
            tier.breaker.cooldown_s = 0.0  # the rest is over: the next store goes out
            tier.write([keys[sent + 10]], [content(keys[sent + 10], size)])
            tier.poll(wait=True)
            assert _sets_received(admin) == seen + 1 and tier.skipped_full == 10
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_server_that_cannot_persist_is_sent_no_store_for_its_breaker_s_cool_down(
    tmp_path: Path,
) -> None:
    """A server whose snapshot failed (stop-writes-on-bgsave-error, Valkey's default, with
    save points) answers every SET with MISCONF until an operator acts, as a full one does
    with OOM: the node rests from stores for its breaker's cool-down, loads go on, and a
    tier starts against it (its PING is refused with MISCONF too)."""
    server = ValkeyProcess(tmp_path / "misconf").start()
    admin = server.client()

    try:
        size = 32_000
        tier = RemoteTier(
            server.url,
            layout_fingerprint("misconf", layout_preset("tiny"), size),
            breaker=CircuitBreaker(threshold=1, cooldown_s=60),
        )
        keys = [block_id_key(i) for i in range(20)]
        try:
            tier.write(keys[:4], [content(key, size) for key in keys[:4]])
            tier.poll(wait=True)
            assert tier.stats.stored_blocks == 4
            admin.config_set("save", "3600 1")
            shutil.rmtree(server.directory)  # the snapshot has nowhere to go, even as root
            admin.bgsave()
            deadline = time.monotonic() + 30
            while admin.info("persistence")["rdb_last_bgsave_status"] != "err":
                assert time.monotonic() < deadline, "the snapshot did not fail"
                time.sleep(0.05)
            tier.write([keys[4]], [content(keys[4], size)])
            tier.poll(wait=True)
            assert tier.stats.failed == 1 and tier.unavailable == 1  # MISCONF came
            seen = _sets_received(admin)
            for key in keys[5:15]:
                tier.write([key], [content(key, size)])
                tier.poll(wait=True)
            assert _sets_received(admin) == seen
            assert tier.skipped_full == 10 and tier.stats.failed == 11
            buffers = [bytearray(size) for _ in range(4)]
            ok = tier.read(keys[:4], lambda i: memoryview(buffers[i])).result(timeout=10)
            assert ok == [True] * 4
            assert not tier.breaker.is_open and tier.unavailable == 1
            late = RemoteTier(server.url, tier.fingerprint)  # starts: the server answers
            try:
                assert late.held(keys[:5]) == [True] * 4 + [False]
            finally:
                late.close()
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_manager_keeps_serving_its_cpu_tier_while_the_server_is_down(
    own_server: ValkeyProcess,
) -> None:
    own_server.start()
    fp = layout_fingerprint("down", layout_preset("tiny"), 48)

    def manager() -> tuple[TieredOffloadingManager, ByteSlots]:
        remote = RemoteTier(own_server.url_with(1000), fp, breaker=CircuitBreaker(1, 0.05))
        slots = ByteSlots(8, 48)
        tiers = [(remote, TierSettings(write_through=True))]
        return TieredOffloadingManager(CPUOffloadingManager(8), tiers, slots), slots

    def store(m: TieredOffloadingManager, slots: ByteSlots, keys: list[OffloadKey]) -> None:
        out = m.prepare_store(keys)
        assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            slots.view(slot)[:] = content(key, 48)
        m.complete_store(out.keys_to_store)

    writer, writer_slots = manager()
    reader, reader_slots = manager()
    try:
        store(writer, writer_slots, KEYS[:4])
        writer.close()
        assert reader.lookup(KEYS[:4]) is None  # promotion under way
        own_server.stop()
        deadline = time.monotonic() + 10
        while (found := reader.lookup(KEYS[:6])) is None:
            assert time.monotonic() < deadline, "a promotion never finished"
            time.sleep(0.001)
        # Whatever arrived before the kill is intact; what did not is a miss.
        assert 0 <= found <= 4
        spec = reader.prepare_load(KEYS[:found])
        assert isinstance(spec, CPULoadStoreSpec)
        for key, slot in zip(KEYS[:found], spec.block_ids.tolist(), strict=True):
            assert bytes(reader_slots.view(slot)) == content(key, 48)
        reader.complete_load(KEYS[:found])
        store(reader, reader_slots, KEYS[6:8])  # CPU store fine, write-through dropped
        assert reader.lookup(KEYS[6:8]) == 2
        reader.poll()
        time.sleep(0.1)
        reader.poll()
        remote = reader.tiers[0]
        assert isinstance(remote, RemoteTier) and remote.stats.failed >= 2
        own_server.start()
        time.sleep(0.06)
        store(reader, reader_slots, [KEYS[9]])
        deadline = time.monotonic() + 10
        while remote.stats.stored_blocks < 1 and time.monotonic() < deadline:
            reader.poll()
            time.sleep(0.005)
        assert remote.present([KEYS[9]]) == 1  # reconnected by itself
    finally:
        reader.close()
