"""The L3 backend's KV events on SGLang 0.5.23's own terms: its decoder, its page numbers.

A router that reads SGLang's KV events decodes every payload with SGLang's
``KVEventBatch`` (``block_hashes: list[int]``) and knows a page by
``hash_str_to_int64`` of its hash, the number SGLang's own GPU and host events give the
same page (``namespaced_block_hash`` with no namespace, a plain request's). The frames
are read here with plain ZMQ, as such a router reads them, from the replay socket,
which sends what the PUB socket sent.
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import msgspec
import zmq
from sglang.srt.disaggregation import kv_events as sglang_events
from sglang.srt.mem_cache.utils import hash_str_to_int64
from sglang_helpers import HostPool, create_backend, page_hash

from kvoffload.integrations.sglang.storage import offset_endpoint
from kvoffload.observe.indexer import PrefixIndex
from kvoffload.observe.subscriber import KVEventSubscriber
from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess, free_port

KEYS = [page_hash(i) for i in range(8)]
INT64 = range(-(2**63), 2**63)


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


def _port_pair() -> int:
    """A free port whose successor is free as well (data-parallel rank 1 binds it)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _events_of() -> dict[str, str]:
    """A publisher and replay endpoint for ranks 0 and 1."""
    return {
        "kvoffload.kv_events_endpoint": f"tcp://127.0.0.1:{_port_pair()}",
        "kvoffload.kv_events_replay_endpoint": f"tcp://127.0.0.1:{_port_pair()}",
    }


def _disk(tmp_path: Path, pages: int) -> dict[str, Any]:
    return {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(pages, len(HostPool().page_bytes(0))),
    }


def _frames(replay_endpoint: str) -> list[list[bytes]]:
    """Every batch published so far as ``[topic, seq, payload]``, asked of the replay socket
    as SGLang's router protocol does (``[b"", start_seq]``), up to the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while dealer.poll(10_000):
            empty, *frames = dealer.recv_multipart()
            assert empty == b""
            if frames == [b"", (-1).to_bytes(8, "big", signed=True), b""]:
                return got
            got.append(frames)
        raise AssertionError("the replay never ended")
    finally:
        dealer.close(linger=0)


def _decoded(backend: Any, replay_endpoint: str) -> list[Any]:
    """The batches ``backend`` published, decoded by SGLang's own decoder, in order."""
    backend.flush_events()
    decoder = msgspec.msgpack.Decoder(sglang_events.KVEventBatch)
    frames = _frames(replay_endpoint)
    assert [int.from_bytes(seq, "big") for _, seq, _ in frames] == list(range(len(frames)))
    return [decoder.decode(payload) for _, _, payload in frames]


def _page_number(key: str) -> int:
    """What SGLang's own events call the page of ``key`` (a plain request's)."""
    return sglang_events.namespaced_block_hash(hash_str_to_int64(key), namespace_seed=None)


def test_sglang_decodes_our_l3_events_naming_pages_as_its_own_events_do(
    backend_of: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    events = _events_of()
    extra = {**_disk(tmp_path, 4), "kvoffload.remote_url": valkey_server.url, **events}
    pool = HostPool()
    backend = backend_of(extra, pool, model="sglang-wire")
    pool.fill(list(range(6)), seed=1)
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))
    assert all(backend.batch_set_v1(KEYS[4:6], pool.indices([4, 5])))
    assert backend.clear()
    batches = _decoded(backend, events["kvoffload.kv_events_replay_endpoint"])
    seen: dict[tuple[str, str | None], set[int]] = {}
    for batch in batches[:-1]:
        assert batch.attn_dp_rank == 0
        for event in batch.events:
            if isinstance(event, sglang_events.BlockStored):
                assert (event.block_size, event.token_ids) == (pool.page_size, [])
                assert (event.parent_block_hash, event.lora_id, event.cache_salt) == (None,) * 3
                assert (event.session_id, event.lora_name) == (None, None)
            seen.setdefault((type(event).__name__, event.medium), set()).update(event.block_hashes)
    assert seen == {
        ("BlockStored", "DISK"): {_page_number(key) for key in KEYS[:6]},
        ("BlockStored", "EXTERNAL"): {_page_number(key) for key in KEYS[:6]},
        ("BlockRemoved", "DISK"): {_page_number(key) for key in KEYS[:2]},
    }
    assert batches[-1].events == [sglang_events.AllBlocksCleared()]


def test_sglang_reads_the_data_parallel_rank_where_its_own_batches_carry_it(
    backend_of: Any, tmp_path: Path
) -> None:
    from sglang.srt.runtime_context import get_parallel

    events = _events_of()
    pool = HostPool()
    with get_parallel().override(dp_rank=1):
        backend = backend_of({**_disk(tmp_path, 4), **events}, pool, model="sglang-dp")
    pool.fill([0, 1], seed=2)
    assert all(backend.batch_set_v1(KEYS[:2], pool.indices([0, 1])))
    replay = offset_endpoint(events["kvoffload.kv_events_replay_endpoint"], 1)
    [batch] = _decoded(backend, replay)
    assert batch.attn_dp_rank == 1
    assert batch.events[0].block_hashes == [_page_number(key) for key in KEYS[:2]]


def test_keys_that_are_no_page_hash_get_numbers_of_their_own(
    backend_of: Any, tmp_path: Path
) -> None:
    """SGLang names pages by their hash only; a key that is none (another caller's) is a
    page of its own for the tiers, so it is announced, and removed, under a number no
    other key shares: not its first 16 characters read as hex, which would make an
    upper-case page hash, a page of ours apart from the lower-case one, remove it."""
    events = _events_of()
    pool = HostPool()
    backend = backend_of({**_disk(tmp_path, 2), **events}, pool, model="sglang-text")
    odd = ["page-0", KEYS[0].upper(), KEYS[0] + "-k"]
    pool.fill([0, 1, 2, 3], seed=3)
    assert all(backend.batch_set_v1([KEYS[0]], pool.indices([0])))
    assert all(backend.batch_set_v1(odd[:1], pool.indices([1])))
    assert all(backend.batch_set_v1(odd[1:2], pool.indices([2])))  # evicts KEYS[0]
    batches = _decoded(backend, events["kvoffload.kv_events_replay_endpoint"])
    events_in_order = [event for batch in batches for event in batch.events]
    stored = [e.block_hashes for e in events_in_order if isinstance(e, sglang_events.BlockStored)]
    removed = [e.block_hashes for e in events_in_order if isinstance(e, sglang_events.BlockRemoved)]
    assert stored[0] == [_page_number(KEYS[0])] and removed == [[_page_number(KEYS[0])]]
    numbers = [h for hashes in stored[1:] for h in hashes]
    assert len(numbers) == 2 and all(n in INT64 for n in numbers)
    assert len({*numbers, _page_number(KEYS[0])}) == 3
    assert all(backend.batch_set_v1(odd[2:], pool.indices([3])))
    batches = _decoded(backend, events["kvoffload.kv_events_replay_endpoint"])
    [suffixed] = [e for e in batches[-1].events if isinstance(e, sglang_events.BlockStored)]
    assert suffixed.block_hashes[0] not in {*numbers, _page_number(KEYS[0])}


def test_our_subscriber_and_index_read_what_the_sglang_backend_sends(
    backend_of: Any, tmp_path: Path
) -> None:
    events = _events_of()
    pool = HostPool()
    backend = backend_of({**_disk(tmp_path, 4), **events}, pool, model="sglang-ours")
    pool.fill([0, 1, 2], seed=4)
    assert all(backend.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])))
    backend.flush_events()
    index = PrefixIndex()
    endpoints = [events[f"kvoffload.kv_events_{end}endpoint"] for end in ("", "replay_")]
    with KVEventSubscriber(*endpoints) as subscriber:
        for _, batch in subscriber.catch_up():
            index.apply("sglang", batch)
        assert subscriber.lost == 0
    assert index.longest_prefix([_page_number(key) for key in KEYS[:4]]) == ("sglang", 3)


def test_our_sglang_structs_have_sglangs_names_fields_and_order() -> None:
    from kvoffload.integrations.sglang import events as ours

    pairs = [
        (ours.SGLangBlockStored, sglang_events.BlockStored),
        (ours.SGLangBlockRemoved, sglang_events.BlockRemoved),
    ]
    for mine, theirs in pairs:
        assert mine.__struct_config__.tag == theirs.__struct_config__.tag
        assert [f.name for f in msgspec.structs.fields(mine)] == [
            f.name for f in msgspec.structs.fields(theirs)
        ]


def _chains(events: list[Any]) -> list[tuple[int | None, list[int]]]:
    """Each ``BlockStored`` as SGLang's routers read it: a parent page, then a chain."""
    return [
        (event.parent_block_hash, event.block_hashes)
        for event in events
        if isinstance(event, sglang_events.BlockStored)
    ]


def test_stores_link_each_page_to_the_one_before_it_as_sglangs_own_events_do(
    backend_of: Any, tmp_path: Path
) -> None:
    """SGLang's routers read a ``BlockStored``'s pages as one chain hanging from
    ``parent_block_hash`` (SGLang's own events do so; a store with no parent starts at the
    root). A write's pages follow each other, the first following SGLang's prefix keys, so
    a router given no parent, or a page skipped inside the list, would hang the pages
    under the wrong one: a longest-prefix walk would stop at the gap."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    events = _events_of()
    pool = HostPool()
    backend = backend_of({**_disk(tmp_path, 8), **events}, pool, model="sglang-chain")
    pool.fill(list(range(7)), seed=5)
    assert all(backend.batch_set_v1(KEYS[1:2], pool.indices([1])))
    assert all(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))  # KEYS[1] held
    after = HiCacheStorageExtraInfo(prefix_keys=KEYS[:4])
    assert all(backend.batch_set_v1(KEYS[4:7], pool.indices([4, 5, 6]), after))
    batches = _decoded(backend, events["kvoffload.kv_events_replay_endpoint"])
    number = [_page_number(key) for key in KEYS]
    assert _chains([event for batch in batches for event in batch.events]) == [
        (None, [number[1]]),
        (None, [number[0]]),
        (number[1], [number[2], number[3]]),
        (number[3], [number[4], number[5], number[6]]),
    ]


@pytest.mark.parametrize("ending", ["clear", "close"])
def test_a_clear_or_a_close_during_a_shared_write_the_server_holds_loses_nothing(
    backend_of: Any, own_server: ValkeyProcess, ending: str
) -> None:
    """SGLang's ``clear`` or ``close`` while the server holds a shared-tier write batch
    (``CLIENT PAUSE ... WRITE``, as during a failover; the path waits for the batch outside
    its lock). A clear never waits for it (the server keeps its pages), and the batch's
    pages are announced once, after ``AllBlocksCleared``, so a router applying events in
    order keeps them; a close waits for it. Either way the batch ends stored and counted
    once, nothing raises, and no thread of ours is left behind."""
    import threading

    own_server.start()
    events = _events_of()
    extra = {"kvoffload.remote_url": own_server.url_with(300_000), **events}
    ours_before = set(threading.enumerate())
    pool = HostPool()
    backend = backend_of(extra, pool, model=f"sglang-held-{ending}")
    [path] = backend.paths
    pool.fill([0, 1, 2, 3], seed=6)
    raised: list[BaseException] = []
    done: list[list[bool]] = []

    def guarded(job: Any) -> None:
        try:
            job()
        except BaseException as exc:  # collected for the test thread to report
            raised.append(exc)

    client = own_server.client()
    client.client_pause(300_000, all=False)
    try:

        def write() -> None:
            done.append(backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])))

        writer = threading.Thread(target=guarded, args=(write,))
        writer.start()
        for _ in range(1000):
            if path.tier.has_pending_work():
                break
            writer.join(0.01)
        assert path.tier.has_pending_work(), "the write never reached the shared tier"
        ender = threading.Thread(target=guarded, args=(getattr(backend, ending),))
        ender.start()
        if ending == "clear":
            ender.join(60)
            assert not ender.is_alive(), "the clear waits for the write the server holds"
    finally:
        client.client_unpause()
    writer.join(60)
    ender.join(60)
    assert not writer.is_alive() and not ender.is_alive()
    assert raised == [] and done == [[True] * 4]
    c = path.counters()
    assert (c.stores_completed, c.stores_failed, c.bytes_stored) == (4, 0, 4 * path.page_bytes)
    if ending == "clear":
        batches = _decoded(backend, events["kvoffload.kv_events_replay_endpoint"])
        in_order = [event for batch in batches for event in batch.events]
        assert in_order[0] == sglang_events.AllBlocksCleared()
        stored = [h for e in in_order[1:] for h in e.block_hashes]
        assert stored == [_page_number(key) for key in KEYS[:4]]
        assert backend.batch_exists(KEYS[:4]) == 4
        backend.close()
    left = [t.name for t in set(threading.enumerate()) - ours_before if t.is_alive()]
    assert not [name for name in left if name.startswith("kvoffload")], left
    again = backend_of(extra | _events_of(), HostPool(), model=f"sglang-held-{ending}")
    assert again.batch_exists(KEYS[:4]) == 4
