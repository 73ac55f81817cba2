"""What the world sees of the backend: KV events (media DISK and EXTERNAL), Prometheus, get_stats.

SGLang's routers see nothing of L3 today; the backend publishes our KV
events (SGLang's wire format, ``test_sglang_event_wire``) and serves our per-tier counters.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
pytest.importorskip("zmq")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families
from sglang.srt.mem_cache.utils import hash_str_to_int64
from sglang_helpers import HeldLink, HostPool, create_backend, page_hash, storage_config

from kvoffload.integrations.sglang.storage import offset_endpoint
from kvoffload.observe.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.observe.indexer import PrefixIndex
from kvoffload.observe.subscriber import KVEventSubscriber
from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess, free_port

KEYS = [page_hash(i) for i in range(8)]
KEY_OF = {hash_str_to_int64(key): key for key in KEYS}
"""Each page's key by the number SGLang's events give it."""
STALL_S = 20.0
"""Far longer than any step here takes: reaching it means a thread never got there."""


@pytest.fixture
def backend_of(sglang: dict[str, ModuleType]) -> Any:
    made: list[Any] = []

    def make(extra: dict[str, Any], pool: HostPool, **kwargs: Any) -> Any:
        backend = create_backend(sglang, {"interface_v1": 1, **extra}, pool, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def tiers(tmp_path: Path, server: ValkeyProcess, disk_pages: int = 4) -> dict[str, Any]:
    page_bytes = len(HostPool().page_bytes(0))
    return {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(disk_pages, page_bytes),
        "kvoffload.remote_url": server.url,
    }


def _events_of() -> dict[str, str]:
    """A publisher and replay endpoint on free ports."""
    return {
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "kvoffload.kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }


def _index_of(backend: Any, events: dict[str, str], name: str) -> PrefixIndex:
    """The index a router builds from every batch ``backend`` has published so far."""
    backend.flush_events()
    index = PrefixIndex()
    endpoints = (
        events["kvoffload.kv_events_endpoint"],
        events["kvoffload.kv_events_replay_endpoint"],
    )
    with KVEventSubscriber(*endpoints) as subscriber:
        for _, batch in subscriber.catch_up():
            index.apply(name, batch)
    return index


def test_kv_events_name_the_medium_of_each_store_and_eviction(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events = {"kvoffload.kv_events_endpoint": pub, "kvoffload.kv_events_replay_endpoint": replay}
    pool = HostPool()
    backend = backend_of({**tiers(tmp_path, valkey_server), **events}, pool, model="events")
    pool.fill(list(range(6)), seed=1)
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))
    assert all(backend.batch_set_v1(KEYS[4:6], pool.indices([4, 5])))
    backend.flush_events()
    with KVEventSubscriber(pub, replay) as subscriber:
        batches = subscriber.catch_up()
    seen: dict[tuple[str, str | None], set[str]] = {}
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                hashes = {KEY_OF[h] for h in event.block_hashes}
                seen.setdefault((type(event).__name__, event.medium), set()).update(hashes)
    assert seen == {
        ("BlockStored", "DISK"): set(KEYS[:6]),
        ("BlockStored", "EXTERNAL"): set(KEYS[:6]),
        ("BlockRemoved", "DISK"): set(KEYS[:2]),
    }


def test_clear_tells_subscribers_this_instance_holds_no_page(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """After ``clear()`` a router's index holds nothing of this instance: it would otherwise
    send requests here for pages the disk tier just dropped. The shared tier's pages stay
    (other instances use them): this instance still reads them, its router under-told."""
    events = _events_of()
    pool = HostPool()
    backend = backend_of({**tiers(tmp_path, valkey_server), **events}, pool, model="cleared")
    pool.fill(list(range(4)), seed=3)
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))
    assert _index_of(backend, events, "sglang").num_blocks("sglang") == 4
    assert backend.clear()
    assert _index_of(backend, events, "sglang").num_blocks("sglang") == 0
    counters = backend.counters()
    assert counters["disk"]["held_pages"] == 0 and counters["remote"]["held_pages"] == 4
    assert backend.batch_get_v1(KEYS[:4], pool.indices([4, 5, 6, 7])) == [True] * 4
    assert backend.counters()["remote"]["loads"] == 4


def test_one_instances_clear_leaves_the_pages_other_instances_announced_on_the_shared_tier(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """Two SGLang servers of one model share the server; one clears (an operator's
    ``/hicache/storage-backend/clear``, a PD role switch). The other one's pages stay: it
    announced them, and nothing would ever tell its router they were gone."""
    events = _events_of()
    pool, other_pool = HostPool(), HostPool()
    clearing = backend_of(tiers(tmp_path, valkey_server), pool, model="shared-clear")
    other = backend_of(
        {"kvoffload.remote_url": valkey_server.url, **events}, other_pool, model="shared-clear"
    )
    other_pool.fill(list(range(4)), seed=4)
    assert all(other.batch_set_v1(KEYS[:4], other_pool.indices([0, 1, 2, 3])))
    pool.fill([4, 5], seed=5)
    assert all(clearing.batch_set_v1(KEYS[4:6], pool.indices([4, 5])))
    assert clearing.clear()
    assert _index_of(other, events, "other").num_blocks("other") == 4
    assert other.batch_exists(KEYS[:4]) == 4  # what its router was told is still true
    assert clearing.counters()["disk"]["held_pages"] == 0  # its own disk tier is emptied
    # Content-addressed and still valid: the clearing server reads them back as well.
    assert clearing.batch_get_v1(KEYS[:6], pool.indices(list(range(6, 12)))) == [True] * 6
    assert [pool.page_bytes(p) for p in range(6, 10)] == [
        other_pool.page_bytes(p) for p in range(4)
    ]


def _announced(backend: Any, events: dict[str, str]) -> dict[str | None, set[str]]:
    """Per medium, the pages a router applying every batch published so far, in order,
    takes this instance to hold."""
    backend.flush_events()
    held: dict[str | None, set[str]] = {}
    endpoints = (
        events["kvoffload.kv_events_endpoint"],
        events["kvoffload.kv_events_replay_endpoint"],
    )
    with KVEventSubscriber(*endpoints) as subscriber:
        for _, batch in subscriber.catch_up():
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    held.clear()
                    continue
                hashes = {KEY_OF[h] for h in event.block_hashes}
                if isinstance(event, BlockStored):
                    held.setdefault(event.medium, set()).update(hashes)
                else:
                    held.get(event.medium, set()).difference_update(hashes)
    return held


def _until(condition: Callable[[], bool]) -> None:
    """Wait until another thread's step makes ``condition`` true (at most ``STALL_S``)."""
    deadline = time.monotonic() + STALL_S
    while not condition():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.005)


def test_a_page_landing_on_disk_during_clear_is_announced_after_all_blocks_cleared(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """``clear()`` runs while a write is still on its way to a slow server, and another
    write lands a page on the emptied disk tier: that page must be announced after
    ``AllBlocksCleared``, or a router applying the events in order drops a page the disk
    tier holds."""
    events = _events_of()
    pool = HostPool()
    link = HeldLink(valkey_server.port)
    slow_url = valkey_server.url_with(60_000).replace(f":{valkey_server.port}/", f":{link.port}/")
    extra = {**tiers(tmp_path, valkey_server), **events, "kvoffload.remote_url": slow_url}
    written: list[list[bool]] = []
    try:
        backend = backend_of(extra, pool, model="clear-race")
        disk = backend.paths[0]
        pool.fill([0, 1], seed=6)
        link.hold()
        slow = threading.Thread(target=backend.batch_set_v1, args=(KEYS[:1], pool.indices([0])))
        slow.start()
        assert link.holding.wait(STALL_S)  # its shared-tier SET is on a stopped link
        _until(lambda: disk.counters().stores_completed == 1)  # its disk page has landed
        before = disk.tier
        clearing = threading.Thread(target=backend.clear)
        clearing.start()
        _until(lambda: disk.tier is not before)  # the disk tier is emptied
        writer = threading.Thread(
            target=lambda: written.append(backend.batch_set_v1(KEYS[1:2], pool.indices([1])))
        )
        writer.start()
        _until(lambda: disk.counters().stores_completed == 2)  # a page lands on it again
        link.release()
        for thread in (slow, clearing, writer):
            thread.join(STALL_S)
    finally:
        link.stop()
    assert written == [[True]]
    assert backend.counters()["disk"]["held_pages"] == 1
    assert _announced(backend, events).get("DISK") == {KEYS[1]}


def test_prometheus_serves_each_tiers_counters(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    port = free_port()
    pool = HostPool()
    extra = {**tiers(tmp_path, valkey_server), "kvoffload.metrics_port": port}
    backend = backend_of(extra, pool, model="metrics", tp_rank=0)
    pool.fill(list(range(6)), seed=2)
    assert all(backend.batch_set_v1(KEYS[:6], pool.indices(list(range(6))))[:4])
    assert backend.batch_get_v1(KEYS[:2], pool.indices([6, 7])) == [True, True]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {
        (sample.name, sample.labels["tier"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvoffload_l3_")
    }
    counters = backend.get_stats().kvoffload
    for tier in ("disk", "remote"):
        assert (
            samples[("kvoffload_l3_stores_completed_total", tier)]
            == (counters[tier]["stores_completed"])
        )
    assert samples[("kvoffload_l3_held_pages", "disk")] == counters["disk"]["held_pages"] == 4
    assert samples[("kvoffload_l3_stores_completed_total", "disk")] == 4
    assert samples[("kvoffload_l3_rejected_total", "disk")] == 2
    assert samples[("kvoffload_l3_stores_completed_total", "remote")] == 6
    assert samples[("kvoffload_l3_loads_total", "disk")] == 2


def test_held_pages_is_the_disk_tiers_alone(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """The shared tier's pages are the server's to count (it evicts, other instances write
    the same pages): its ``kvoffload_l3_held_pages`` was the pages this rank wrote, each
    rewrite counted again, here 12 for the 6 pages the server holds."""
    port = free_port()
    pool = HostPool()
    extra = {**tiers(tmp_path, valkey_server, 8), "kvoffload.metrics_port": port}
    backend = backend_of(extra, pool, model="held", tp_rank=0)
    pool.fill(list(range(6)), seed=4)
    for _ in range(2):
        assert all(backend.batch_set_v1(KEYS[:6], pool.indices(list(range(6)))))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    held = {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvoffload_l3_held_pages"
    }
    assert held == {"disk": 6}


def test_pages_a_full_server_was_not_sent_are_counted_in_stats_and_prometheus(
    backend_of: Any, own_server: ValkeyProcess
) -> None:
    """After the server refuses a store as full (OOM), the shared tier rests from stores and
    drops them unsent, counted in its ``skipped_full``: SGLang's operators see it too."""
    own_server.start()
    port = free_port()
    pool = HostPool()
    extra = {"kvoffload.remote_url": own_server.url, "kvoffload.metrics_port": port}
    backend = backend_of(extra, pool, model="full", tp_rank=0)
    backend.paths[0].tier.breaker.cooldown_s = 600.0  # the rest outlasts the test
    pool.fill(list(range(6)), seed=5)
    assert all(backend.batch_set_v1(KEYS[:2], pool.indices([0, 1])))
    own_server.client().config_set("maxmemory", 1)  # full, under the default noeviction
    assert backend.batch_set_v1(KEYS[2:3], pool.indices([2])) == [False]  # refused: OOM
    assert backend.batch_set_v1(KEYS[3:6], pool.indices([3, 4, 5])) == [False] * 3
    assert backend.batch_get_v1(KEYS[:2], pool.indices([6, 7])) == [True, True]
    remote = backend.get_stats().kvoffload["remote"]
    assert (remote["skipped_full"], remote["stores_failed"], remote["unavailable"]) == (3, 4, 1)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("tier") == "remote"
    }
    assert samples["kvoffload_l3_skipped_full_total"] == 3
    assert samples["kvoffload_l3_stores_failed_total"] == 4


def test_get_stats_gives_sglang_its_metrics_and_ours(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    pool = HostPool()
    backend = backend_of(tiers(tmp_path, valkey_server, 8), pool, model="stats", metrics=True)
    pool.fill([0, 1, 2], seed=3)
    assert all(backend.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])))
    assert backend.batch_get_v1(KEYS[:3], pool.indices([3, 4, 5])) == [True] * 3
    stats = backend.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert len(stats.backup_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert stats.kvoffload["disk"]["loads"] == 3 and stats.kvoffload["remote"]["loads"] == 0
    again = backend.get_stats()
    assert again.prefetch_pgs == [] and again.kvoffload["disk"]["stores_completed"] == 3


def _two_free_ports() -> int:
    """A port whose successor is free as well (one metrics port per rank)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _stores_completed(port: int) -> Any:
    """The one ``kvoffload_l3_stores_completed_total`` sample served on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    [stored] = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvoffload_l3_stores_completed_total"
    ]
    return stored


def test_each_rank_serves_its_metrics_on_its_own_port_and_rank_0_publishes(
    backend_of: Any, tmp_path: Path
) -> None:
    port = _two_free_ports()
    page_bytes = len(HostPool().page_bytes(0))
    extra = {
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, page_bytes),
        "kvoffload.metrics_port": port,
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    pools = [HostPool(), HostPool()]
    ranks = [backend_of(extra, pools[r], model="ranks", tp_rank=r, tp_size=2) for r in (0, 1)]
    pools[1].fill([0, 1, 2], seed=4)
    assert all(ranks[1].batch_set_v1(KEYS[:3], pools[1].indices([0, 1, 2])))
    for rank in (0, 1):
        stored = _stores_completed(port + rank)
        assert stored.labels["tp_rank"] == str(rank) and stored.value == (3 if rank else 0)
    assert ranks[0].publishes_events and not ranks[1].publishes_events
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"


def test_with_metrics_port_0_each_rank_says_which_port_it_picked(
    backend_of: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``kvoffload.metrics_port`` 0 gives every rank a free port: each rank logs its port
    once and exposes it as ``metrics_port``, and that port serves that rank's counters.
    Before, the picked ports were said nowhere, so nobody could scrape them."""
    extra = {
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, len(HostPool().page_bytes(0))),
        "kvoffload.metrics_port": 0,
    }
    pools = [HostPool(), HostPool()]
    with caplog.at_level("INFO", logger="kvoffload.integrations.sglang.storage"):
        ranks = [backend_of(extra, pools[r], model="port0", tp_rank=r, tp_size=2) for r in (0, 1)]
    ports = [rank.metrics_port for rank in ranks]
    assert all(isinstance(port, int) and port > 0 for port in ports) and ports[0] != ports[1]
    said = [record.getMessage() for record in caplog.records if "/metrics" in record.message]
    assert said == [
        f"kvoffload: L3 metrics of tp_rank {r}, pp_rank 0, cp_rank 0, dp_rank 0 on "
        f"http://127.0.0.1:{ports[r]}/metrics"
        for r in (0, 1)
    ]
    pools[1].fill([0, 1], seed=6)
    assert all(ranks[1].batch_set_v1(KEYS[:2], pools[1].indices([0, 1])))
    for rank in (0, 1):
        stored = _stores_completed(ports[rank])
        assert stored.labels["tp_rank"] == str(rank) and stored.value == 2 * rank
    ranks[0].close()
    assert ranks[0].metrics_port is None


def test_plain_data_parallel_replicas_keep_their_disk_metrics_and_events_apart(
    backend_of: Any, tmp_path: Path
) -> None:
    """``--dp-size`` without DP attention runs a process per replica with the same TP ranks,
    and SGLang's storage config says ``dp_rank`` 0 in each; the replica number its launcher
    recorded gives each its own slot file, metrics port, event endpoint and data-parallel
    rank, as DP attention's groups have. The second replica stopped at start-up before,
    its disk tier's directory in use by the first."""
    from sglang.srt.runtime_context import get_parallel

    metrics, pub, replay = _two_free_ports(), _two_free_ports(), _two_free_ports()
    extra = {
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, len(HostPool().page_bytes(0))),
        "kvoffload.metrics_port": metrics,
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
        "kvoffload.kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    pools = [HostPool(), HostPool()]
    replicas = []
    for replica in (0, 1):
        with get_parallel().override(dp_rank=replica):
            replicas.append(backend_of(extra, pools[replica], model="replicas"))
    pools[1].fill([0, 1], seed=5)
    assert replicas[1].batch_set_v1(KEYS[:2], pools[1].indices([0, 1])) == [True, True]
    assert replicas[0].batch_exists(KEYS[:2]) == 0  # each replica's disk tier is its own
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dp0", "dp1"]
    for replica in (0, 1):
        stored = _stores_completed(metrics + replica)
        assert stored.labels["dp_rank"] == str(replica) and stored.value == 2 * replica
    replicas[1].flush_events()
    endpoints = (f"tcp://127.0.0.1:{pub + 1}", f"tcp://127.0.0.1:{replay + 1}")
    with KVEventSubscriber(*endpoints) as subscriber:
        batches = [batch for _, batch in subscriber.catch_up()]
    assert batches and {batch.data_parallel_rank for batch in batches} == {1}


def test_only_the_first_pipeline_stage_publishes_on_the_port_of_its_data_parallel_rank(
    sglang: dict[str, ModuleType], tmp_path: Path
) -> None:
    """SGLang 0.5.23 publishes one KV event stream per data-parallel replica, from pipeline
    stage 0, on the endpoint's port plus the replica (``is_kv_publisher_rank``,
    ``select_kv_publisher_dp_rank``): a router set up for SGLang subscribes to those ports.
    Before, every stage published, on the port plus ``dp * pp_size + pp``: replica 0's
    second stage took replica 1's port, and replica 1 went out on a port nobody reads."""
    from sglang.srt.runtime_context import get_parallel

    pub, replay = _two_free_ports(), _two_free_ports()
    extra = {
        "interface_v1": 1,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, len(HostPool().page_bytes(0))),
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
        "kvoffload.kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    factory = sglang["sglang.srt.mem_cache.storage.backend_factory"].StorageBackendFactory
    pools = {(d, p): HostPool() for d in (0, 1) for p in (0, 1)}
    backends = {}
    try:
        for (replica, stage), pool in pools.items():
            config = dataclasses.replace(
                storage_config(sglang, extra, model="stages"), pp_rank=stage, pp_size=2
            )
            with get_parallel().override(dp_rank=replica):
                backend = factory.create_backend("dynamic", config, pool)
                backends[replica, stage] = backend
                backend.register_mem_pool_host(pool)
        assert {at: b.publishes_events for at, b in backends.items()} == {
            (0, 0): True,
            (0, 1): False,
            (1, 0): True,
            (1, 1): False,
        }
        pools[1, 0].fill([0, 1], seed=6)
        assert backends[1, 0].batch_set_v1(KEYS[:2], pools[1, 0].indices([0, 1])) == [True] * 2
        backends[1, 0].flush_events()
        endpoints = (f"tcp://127.0.0.1:{pub + 1}", f"tcp://127.0.0.1:{replay + 1}")
        with KVEventSubscriber(*endpoints) as subscriber:
            batches = [batch for _, batch in subscriber.catch_up()]
        assert batches and {batch.data_parallel_rank for batch in batches} == {1}
    finally:
        for backend in backends.values():
            backend.close()


def test_only_the_first_context_parallel_rank_publishes_and_each_serves_its_own_port(
    sglang: dict[str, ModuleType], tmp_path: Path
) -> None:
    """SGLang's ``is_kv_publisher_rank`` names the first TP and attention-CP rank of stage
    0: the other CP ranks hold their shards of the same pages, so one stream speaks for them
    (as the Keys table says of ``kvoffload.kv_events_endpoint``), while each rank has its
    own tiers and so its own metrics port, the given one plus its rank."""
    port, pub = _two_free_ports(), free_port()
    extra = {
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": footprint(8, len(HostPool().page_bytes(0))),
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
        "kvoffload.metrics_port": port,
    }
    factory = sglang["sglang.srt.mem_cache.storage.backend_factory"].StorageBackendFactory
    backends = []
    try:
        for cp_rank in (0, 1):
            config = dataclasses.replace(
                storage_config(sglang, extra, model="cp"), attn_cp_rank=cp_rank, attn_cp_size=2
            )
            pool = HostPool()
            backend = factory.create_backend("dynamic", config, pool)
            backends.append(backend)
            backend.register_mem_pool_host(pool)
        assert [b.publishes_events for b in backends] == [True, False]
        assert [b.metrics_port for b in backends] == [port, port + 1]
        for cp_rank, backend in enumerate(backends):  # series told apart by label, not port
            assert _stores_completed(backend.metrics_port).labels["cp_rank"] == str(cp_rank)
    finally:
        for backend in backends:
            backend.close()


def test_backup_bandwidth_counts_only_the_bytes_the_tiers_wrote(
    backend_of: Any, tmp_path: Path
) -> None:
    """SGLang's backup bandwidth leaves out pages the backend already held: a batch the
    disk holds already moves no byte, so its rate is 0, not the batch's size over no I/O."""
    pool = HostPool()
    page_bytes = len(pool.page_bytes(0))
    extra = {
        "interface_v1": 1,
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(8, page_bytes),
    }
    backend = backend_of(extra, pool, model="bandwidth", metrics=True)
    pool.fill([0, 1, 2], seed=4)
    assert all(backend.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])))
    assert all(backend.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])))
    stats = backend.get_stats()
    assert stats.backup_pgs == [3, 3]
    assert stats.backup_bandwidth[0] > 0 and stats.backup_bandwidth[1] == 0.0
    assert stats.kvoffload["disk"]["bytes_stored"] == 3 * page_bytes
