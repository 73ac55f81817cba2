"""The backend under failures: a server killed mid-batch, planted corrupt values, bad config.

None of them may raise into SGLang once it runs: a dead server is a counted
miss or failed write, a corrupt value is counted and never loaded. Bad
configuration, on the other hand, stops start-up with an error naming the key.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import BAD_CONFIGS, HeldLink, HostPool, create_backend, page_hash

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.storage import page_key
from kvoffload.tiers import RemoteTierError
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import footprint
from tier_servers import TEST_TIMEOUT_MS, ValkeyClusterProcesses, ValkeyProcess

KEYS = [page_hash(i) for i in range(64)]
STALL_S = 20.0
"""Far longer than a disk read here takes: reaching it means the read waited on the write."""


def test_server_killed_mid_batch_is_counted_never_raised(
    backends: Any, own_server: ValkeyProcess
) -> None:
    own_server.start()
    pool = HostPool(pages=64)
    url = own_server.url.replace("timeout_ms=2000", "timeout_ms=300")
    backend = backends({"interface_v1": 1, "kvoffload.remote_url": url}, pool, model="killed")
    pool.fill(list(range(64)), seed=1)
    assert all(backend.batch_set_v1(KEYS[:8], pool.indices(list(range(8)))))
    errors: list[BaseException] = []
    results: list[list[bool]] = []

    def keep_writing() -> None:
        try:
            for start in range(8, 64, 4):
                pages = list(range(start, start + 4))
                results.append(backend.batch_set_v1(KEYS[start : start + 4], pool.indices(pages)))
        except BaseException as exc:  # recorded: the test fails on any
            errors.append(exc)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    own_server.stop()
    writer.join(timeout=60)
    assert not writer.is_alive() and errors == []
    assert backend.batch_exists(KEYS[:8]) == 0
    assert backend.batch_get_v1(KEYS[:8], pool.indices(list(range(8)))) == [False] * 8
    assert backend.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
    assert backend.get(KEYS[0]) is None
    assert backend.batch_set(KEYS[:1], [pool.get_data_page(0)]) is False
    remote = backend.get_stats().kvoffload["remote"]
    written = sum(r.count(True) for r in results)
    failed = sum(r.count(False) for r in results)
    assert written + failed == 56 and remote["stores_completed"] == 8 + written
    assert remote["stores_failed"] == failed + 3
    assert remote["loads_failed"] >= 9 and remote["unavailable"] >= 1


def test_a_stalled_server_is_a_counted_miss_and_recovers(
    backends: Any, own_server: ValkeyProcess
) -> None:
    own_server.start()
    pool = HostPool()
    url = own_server.url.replace("timeout_ms=2000", "timeout_ms=300")
    backend = backends({"interface_v1": 1, "kvoffload.remote_url": url}, pool, model="stalled")
    pool.fill([0, 1, 2], seed=4)
    assert all(backend.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])))
    assert own_server.process is not None
    own_server.process.send_signal(signal.SIGSTOP)
    try:
        assert backend.batch_exists(KEYS[:3]) == 0
        assert backend.batch_get_v1(KEYS[:3], pool.indices([3, 4, 5])) == [False] * 3
    finally:
        own_server.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30  # the breaker lets a trial call through after its cooldown
    while backend.batch_exists(KEYS[:3]) != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert backend.batch_get_v1(KEYS[:3], pool.indices([3, 4, 5])) == [True] * 3
    remote = backend.get_stats().kvoffload["remote"]
    assert remote["unavailable"] >= 2 and remote["loads_failed"] == 3 and remote["loads"] == 3


def test_a_write_stuck_on_the_shared_tier_never_holds_up_a_disk_read(
    backends: Any, valkey_server: ValkeyProcess, tmp_path: Path
) -> None:
    """SGLang's prefetch thread reads the disk while its backup thread writes: a page the
    shared tier is still taking (up to its deadline) must not keep the disk from the read."""
    pool = HostPool()
    link = HeldLink(valkey_server.port)
    url = f"redis://127.0.0.1:{link.port}/0?timeout_ms=60000"
    extra = {
        "interface_v1": 1,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, len(pool.page_bytes(0))),
        "kvoffload.remote_url": url,
    }
    try:
        backend = backends(extra, pool, model="stuck-write")
        pool.fill([0, 1], seed=5)
        assert backend.batch_set_v1(KEYS[:1], pool.indices([0])) == [True]
        order: list[str] = []
        written: list[list[bool]] = []
        read: list[tuple[int, list[bool]]] = []
        read_done = threading.Event()

        def write() -> None:
            written.append(backend.batch_set_v1(KEYS[1:2], pool.indices([1])))
            order.append("write")

        def prefetch() -> None:
            found = backend.batch_exists(KEYS[:1])
            read.append((found, backend.batch_get_v1(KEYS[:1], pool.indices([2]))))
            order.append("read")
            read_done.set()

        link.hold()
        writer = threading.Thread(target=write)
        writer.start()
        assert link.holding.wait(STALL_S)  # the shared tier's SET is on a stopped link
        reader = threading.Thread(target=prefetch)
        reader.start()
        read_done.wait(STALL_S)  # only so that a failing run ends: the order decides
        link.release()
        writer.join(STALL_S)
        reader.join(STALL_S)
    finally:
        link.stop()
    assert order == ["read", "write"]
    assert read == [(1, [True])] and written == [[True]]
    assert pool.page_bytes(2) == pool.page_bytes(0)
    counters = backend.get_stats().kvoffload
    assert counters["disk"]["stores_completed"] == counters["remote"]["stores_completed"] == 2


def test_a_corrupt_value_on_the_server_is_never_loaded(
    backends: Any, valkey_server: ValkeyProcess
) -> None:
    pool = HostPool()
    backend = backends(
        {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}, pool, model="corrupt"
    )
    pool.fill([0, 1], seed=2)
    assert all(backend.batch_set_v1(KEYS[:2], pool.indices([0, 1])))
    client = valkey_server.client()
    name = backend.paths[0].tier.name(page_key(KEYS[1]))
    value = bytearray(client.get(name))
    value[-1] ^= 0xFF
    client.set(name, bytes(value))
    expected = pool.page_bytes(0)
    pool.zero()
    # Reported missing: SGLang frees page 3 unread (the bytes land in place, as they do for
    # every page read into its own segments).
    assert backend.batch_get_v1(KEYS[:2], pool.indices([2, 3])) == [True, False]
    assert pool.page_bytes(2) == expected
    assert client.get(name) is None  # the broken value is deleted
    assert backend.get_stats().kvoffload["remote"]["corrupt"] == 1


def test_a_corrupt_page_on_disk_is_never_loaded(backends: Any, tmp_path: Path) -> None:
    pool = HostPool()
    page_bytes = len(pool.page_bytes(0))
    extra = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": footprint(8, page_bytes)}
    backend = backends(extra, pool, model="corrupt-disk")
    pool.fill([0, 1], seed=3)
    pages = [pool.get_data_page(p * pool.page_size) for p in (0, 1)]
    assert backend.batch_set(KEYS[:2], pages) is True
    disk = backend.paths[0].tier
    offset = disk.slot_offset(page_key(KEYS[0]))
    fd = os.open(disk.path, os.O_RDWR)
    try:  # into the payload, past the header and the key
        os.pwrite(fd, b"\x5a" * 16, offset + HEADER_BYTES + len(page_key(KEYS[0])) + 8)
    finally:
        os.close(fd)
    got = backend.batch_get(KEYS[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert got[0] is None and got[1] is not None
    assert backend.get_stats().kvoffload["disk"]["corrupt"] == 1
    assert backend.batch_exists(KEYS[:2]) == 0  # forgotten once found broken


@pytest.mark.parametrize("extra,named", BAD_CONFIGS)
def test_bad_configuration_stops_start_up_naming_the_key(
    sglang: dict[str, ModuleType], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        create_backend(sglang, extra, None)


def test_tiers_that_cannot_open_stop_start_up_naming_the_key(
    sglang: dict[str, ModuleType], tmp_path: Path, own_server: ValkeyProcess
) -> None:
    pool = HostPool()
    unreachable = f"redis://127.0.0.1:{own_server.port}/0?timeout_ms=200"
    with pytest.raises(RemoteTierError, match=re.escape("kvoffload.remote_url")):
        create_backend(sglang, {"kvoffload.remote_url": unreachable}, pool)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match=re.escape("kvoffload.disk_dir")):
        create_backend(
            sglang, {"kvoffload.disk_dir": str(blocker), "kvoffload.disk_bytes": 10**9}, pool
        )
    with pytest.raises(InvalidArgumentError, match=re.escape("kvoffload.disk_bytes")):
        tiny = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1}
        create_backend(sglang, tiny, pool)


def test_unsupported_host_layout_is_refused(sglang: dict[str, ModuleType], tmp_path: Path) -> None:
    pool = HostPool()
    pool.layout = "page_head"
    with pytest.raises(InvalidArgumentError, match="page_head"):
        create_backend(
            sglang, {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 10**7}, pool
        )


def test_a_disk_tier_is_one_processs(backends: Any, tmp_path: Path) -> None:
    """Two servers of one model and rank on one directory would corrupt its slot file."""
    extra = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 10**7}
    first = backends(extra, HostPool(), model="locked")
    with pytest.raises(InvalidArgumentError, match=r"'kvoffload\.disk_dir'.*in use by process"):
        backends(extra, HostPool(), model="locked")
    backends(extra, HostPool(), model="locked", tp_rank=1, tp_size=2)  # another shard: its own
    first.close()
    backends(extra, HostPool(), model="locked")  # free again once closed


def test_a_disk_tier_that_cannot_reopen_after_clear_goes_off_never_raising(
    backends: Any, tmp_path: Path
) -> None:
    """``clear()`` reopens the disk tier; a directory that became unsafe meanwhile (here a
    symbolic link) leaves the tier off: no exception into SGLang, and no page claimed that
    the closed tier can no longer read."""
    extra = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 10**7}
    pool = HostPool()
    backend = backends(extra, pool, model="relinked")
    pool.fill([0, 1, 2, 3], seed=4)
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))
    directory = backend.paths[0].tier.path.parent
    directory.rename(tmp_path / "moved")
    directory.symlink_to(tmp_path / "moved")
    assert backend.clear()
    assert backend.batch_exists(KEYS[:4]) == 0
    assert backend.batch_get_v1(KEYS[:4], pool.indices([4, 5, 6, 7])) == [False] * 4
    assert backend.batch_set_v1(KEYS[4:6], pool.indices([0, 1])) == [False, False]
    disk = backend.get_stats().kvoffload["disk"]
    assert (disk["held_pages"], disk["stores_failed"], disk["loads_failed"]) == (0, 2, 4)


def test_clear_empties_the_tiers_own_file_never_one_a_planted_link_leads_to(
    backends: Any, tmp_path: Path
) -> None:
    """``clear()`` removed the slot file by its path after closing the tier, so a directory
    replaced by a link since sent the removal into the link's target: another directory's
    ``blocks.kvs`` was deleted. The tier now empties its own file through the descriptor it
    opened, before closing it."""
    extra = {"kvoffload.disk_dir": str(tmp_path / "l3"), "kvoffload.disk_bytes": 10**7}
    pool = HostPool()
    backend = backends(extra, pool, model="planted")
    pool.fill([0, 1, 2, 3], seed=4)
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))
    own = backend.paths[0].tier.path
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / own.name).write_bytes(b"another process's file")
    own.parent.rename(tmp_path / "moved")
    own.parent.symlink_to(foreign)
    assert backend.clear()
    assert (foreign / own.name).read_bytes() == b"another process's file"
    assert (tmp_path / "moved" / own.name).stat().st_size == 0
    assert backend.batch_exists(KEYS[:4]) == 0


def test_a_cluster_node_down_fails_only_its_own_pages(backends: Any, tmp_path: Path) -> None:
    """With one node of three down, the pages the live nodes took are stored: each page's
    result and the counters say which, never the whole batch failed beside pages stored."""
    cluster = ValkeyClusterProcesses(tmp_path / "cluster").start()
    try:
        pool = HostPool(pages=32)
        url = cluster.url.replace(f"timeout_ms={TEST_TIMEOUT_MS}", "timeout_ms=300")
        backend = backends({"interface_v1": 1, "kvoffload.remote_url": url}, pool, model="node")
        cluster.nodes[2].stop()
        pool.fill(list(range(16)), seed=6)
        done = backend.batch_set_v1(KEYS[:16], pool.indices(list(range(16))))
        tier = backend.paths[0].tier
        down = cluster.nodes[2].port
        on_live = [tier.node_address(tier.name(page_key(k)))[1] != down for k in KEYS[:16]]
        assert 0 < sum(on_live) < 16
        assert done == on_live
        remote = backend.get_stats().kvoffload["remote"]
        assert remote["stores_completed"] == sum(on_live)
        assert remote["stores_failed"] == 16 - sum(on_live)
    finally:
        cluster.stop()


def test_a_paused_cluster_node_fails_only_its_own_pages(backends: Any, tmp_path: Path) -> None:
    """A node paused (``SIGSTOP``: its connections open, never answered) is a hung node, not a
    refused one: each batch waits for it until the deadline. Asked first, it took the whole
    of it, and the check of which pages had landed never reached the live nodes: every page
    of the batch read as failed, those stored too (counted completed and failed at once)."""
    cluster = ValkeyClusterProcesses(tmp_path / "cluster").start()
    try:
        pool = HostPool(pages=32)
        url = cluster.url.replace(f"timeout_ms={TEST_TIMEOUT_MS}", "timeout_ms=500")
        backend = backends({"interface_v1": 1, "kvoffload.remote_url": url}, pool, model="paused")
        tier = backend.paths[0].tier
        first = tier.node_address(tier.name(page_key(KEYS[0])))[1]  # the look-up asks it first
        paused = next(node for node in cluster.nodes if node.port == first)
        assert paused.process is not None
        paused.process.send_signal(signal.SIGSTOP)
        later = sorted(
            KEYS[16:32], key=lambda k: tier.node_address(tier.name(page_key(k)))[1] != first
        )
        for batch in (KEYS[:16], later):  # each begins on the paused node
            on_live = [tier.node_address(tier.name(page_key(k)))[1] != first for k in batch]
            pool.fill(list(range(16)), seed=7)
            before = backend.get_stats().kvoffload["remote"]
            done = backend.batch_set_v1(batch, pool.indices(list(range(16))))
            remote = backend.get_stats().kvoffload["remote"]
            completed = remote["stores_completed"] - before["stores_completed"]
            failed = remote["stores_failed"] - before["stores_failed"]
            assert not on_live[0] and 0 < sum(on_live) < 16
            assert done == on_live
            assert (completed, failed) == (sum(on_live), 16 - sum(on_live))
    finally:
        for node in cluster.nodes:
            if node.process is not None:
                node.process.send_signal(signal.SIGCONT)
        cluster.stop()


def test_a_close_during_a_partly_failed_batch_leaves_its_stored_pages_stored(
    backends: Any, tmp_path: Path
) -> None:
    """A close while a batch waited on its writes, one node of three down, closed the tier
    before the batch asked which pages had landed: asked a closed tier, every page of the
    batch read as failed, the ones the live nodes took too. The close waits for the batch's
    outcome now. The live nodes hold their writes back a while (``CLIENT PAUSE``), so that
    the batch is still waiting on them when the close comes."""
    cluster = ValkeyClusterProcesses(tmp_path / "cluster").start()
    try:
        pool = HostPool(pages=32)
        url = cluster.url.replace(f"timeout_ms={TEST_TIMEOUT_MS}", "timeout_ms=10000")
        backend = backends({"interface_v1": 1, "kvoffload.remote_url": url}, pool, model="close")
        (path,) = backend.paths
        tier = path.tier
        down = cluster.nodes[2].port
        on_live = [tier.node_address(tier.name(page_key(k)))[1] != down for k in KEYS[:16]]
        assert 0 < sum(on_live) < 16
        cluster.nodes[2].stop()
        for node in cluster.nodes[:2]:
            node.client().execute_command("CLIENT", "PAUSE", 2000, "WRITE")
        pool.fill(list(range(16)), seed=9)
        done: list[list[bool]] = []
        writer = threading.Thread(
            target=lambda: done.append(
                backend.batch_set_v1(KEYS[:16], pool.indices(list(range(16))))
            )
        )
        writer.start()
        deadline = time.monotonic() + STALL_S  # only so that a failing run ends
        while not path._write_lock.locked() and writer.is_alive():
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.001)
        backend.close()
        writer.join(STALL_S)
        assert done == [on_live]
        counters = path.counters()
        assert counters.stores_completed == sum(on_live)
        assert counters.stores_failed == 16 - sum(on_live)
    finally:
        cluster.stop()


def test_a_page_one_tier_passed_over_and_the_other_failed_is_a_failed_write(
    backends: Any, own_server: ValkeyProcess, tmp_path: Path
) -> None:
    """A page is stored if some tier holds it, and a write held back by admission is no
    failure; but a page the disk's admission passed over while the shared tier failed to
    write it is stored nowhere: SGLang hears ``False``, as from the shared tier alone (it
    heard ``True``, and went on backing up the pages behind it)."""
    own_server.start()
    pool = HostPool()
    page = len(pool.page_bytes(0))
    url = own_server.url.replace("timeout_ms=2000", "timeout_ms=300")
    extra = {
        "interface_v1": 1,
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(16, page),
        "kvoffload.disk_admission": "sketch",  # holds back a page's first sighting
        "kvoffload.remote_url": url,
    }
    backend = backends(extra, pool, model="passed-over")
    pool.fill(list(range(8)), seed=8)
    assert backend.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
    assert backend.get_stats().kvoffload["disk"]["stores_skipped"] == 2
    assert backend.batch_exists(KEYS[:2]) == 2  # on the server alone
    own_server.stop()
    assert backend.batch_set_v1(KEYS[2:4], pool.indices([2, 3])) == [False, False]
    assert backend.batch_set(KEYS[4:5], [pool.get_data_page(int(pool.indices([4])[0]))]) is False
    counters = backend.get_stats().kvoffload
    assert counters["disk"]["stores_skipped"] == 5 and counters["disk"]["stores_failed"] == 0
    assert counters["remote"]["stores_failed"] == 3
    # Seen twice, the disk takes the pages: stored there, beside the server's failure.
    assert backend.batch_exists(KEYS[2:4]) == 0 and backend.batch_exists(KEYS[2:4]) == 0
    assert backend.batch_set_v1(KEYS[2:4], pool.indices([2, 3])) == [True, True]
    assert backend.batch_exists(KEYS[2:4]) == 2


def test_an_events_endpoint_that_cannot_be_bound_is_named_by_its_own_key(
    sglang: dict[str, ModuleType], tmp_path: Path
) -> None:
    """The replay endpoint's error named ``kvoffload.kv_events_endpoint``, whose value was
    fine."""
    pool = HostPool()
    extra = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": 10**6,
        "kvoffload.kv_events_endpoint": "tcp://127.0.0.1:0",
        "kvoffload.kv_events_replay_endpoint": "no-transport",
    }
    replay = "'kvoffload.kv_events_replay_endpoint': cannot bind KV events to 'no-transport'"
    with pytest.raises(InvalidArgumentError, match=re.escape(replay)):
        create_backend(sglang, extra, pool)
    extra["kvoffload.kv_events_endpoint"] = "no-transport"
    extra["kvoffload.kv_events_replay_endpoint"] = "tcp://127.0.0.1:0"
    main = "'kvoffload.kv_events_endpoint': cannot bind KV events to 'no-transport'"
    with pytest.raises(InvalidArgumentError, match=re.escape(main)):
        create_backend(sglang, extra, pool)
