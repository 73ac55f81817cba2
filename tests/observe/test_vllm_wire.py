"""Our KV events on vLLM 0.33's own terms: its structs, its decoder, its publisher.

vLLM is imported in the test process, as the integration tests import it: a child
process of its own paid its import (about 10 s of CPU) once a test.
"""

from __future__ import annotations

import hashlib
import time
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import msgspec
import zmq

from kvoffload import OffloadingEvent, block_id_key
from kvoffload.core.keys import make_offload_key
from kvoffload.observe import events as ours
from kvoffload.observe.events import AllBlocksCleared, BlockStored, decode_batch, make_batch
from kvoffload.observe.publisher import KVEventPublisher
from kvoffload.observe.subscriber import Delivered, KVEventSubscriber
from tier_servers import free_port
from vllm_import import import_vllm

LOCAL = "tcp://127.0.0.1:0"
SHA_KEY = make_offload_key(hashlib.sha256(b"a page").digest(), 1)
"""A 32-byte hash, as SGLang's pages and vLLM's sha256 blocks have, in KV group 1."""


def _vllm_kv_events() -> ModuleType:
    """vLLM's ``kv_events`` module, with the modules its publisher goes on to import (whose
    import warns too)."""
    events = "vllm.distributed.kv_events"
    return import_vllm((events, "vllm.v1.core.kv_cache_utils", "vllm.v1.kv_offload.base"))[events]


def _replayed(pub: KVEventPublisher) -> list[list[bytes]]:
    """Every buffered batch as ``[topic, seq, payload]``, asked of the replay socket as a
    router does (``[b"", start_seq]``), up to the end-of-replay marker."""
    assert pub.replay_endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
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


def test_our_structs_are_vllms_field_for_field() -> None:
    """Names, order, defaults and msgspec options of every struct: a field vLLM adds, renames
    or reorders (the batch is an array, so order is the wire) fails here."""
    theirs_module = _vllm_kv_events()

    def shape(struct: type) -> list[tuple[str, str, object]]:
        return [(f.name, f.encode_name, f.default) for f in msgspec.structs.fields(struct)]

    options = ("array_like", "omit_defaults", "tag", "tag_field", "forbid_unknown_fields")
    for name in ("KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"):
        mine, theirs = getattr(ours, name), getattr(theirs_module, name)
        assert shape(mine) == shape(theirs), name
        for option in options:
            got = getattr(mine.__struct_config__, option)
            assert got == getattr(theirs.__struct_config__, option), (name, option)


def test_vllms_decoder_reads_int_block_hashes_as_vllm_publishes_them() -> None:
    """With ``int_block_hashes``, each hash is the integer vLLM's own conversion gives for
    the same key (its default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a router that reads
    only 64-bit integers (Dynamo's) decodes the batch, and a block hashed with sha256
    has one name in vLLM's events and ours."""
    theirs = _vllm_kv_events()
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    with KVEventPublisher(LOCAL, LOCAL, int_block_hashes=True, data_parallel_rank=2) as pub:
        events = [
            OffloadingEvent([block_id_key(7), block_id_key(2**64 - 1), SHA_KEY], "CPU", False),
            OffloadingEvent([SHA_KEY], "CPU", removed=True),
        ]
        pub.publish(events)
        pub.flush()
        ((topic, seq, payload),) = _replayed(pub)
    assert topic == b"kvoffload" and seq == (0).to_bytes(8, "big")
    batch = msgspec.msgpack.Decoder(theirs.KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 2
    by_group = {(type(e).__name__, e.group_idx): e for e in batch.events}
    stored, stored_sha, removed = (
        by_group[("BlockStored", 0)],
        by_group[("BlockStored", 1)],
        by_group[("BlockRemoved", 1)],
    )
    assert stored.block_hashes == [7, 2**64 - 1]
    sha = maybe_convert_block_hash(BlockHash(get_offload_block_hash(SHA_KEY)))
    assert isinstance(sha, int)
    assert stored_sha.block_hashes == [sha] and removed.block_hashes == [sha]
    assert stored.medium == "CPU" and stored.token_ids == []
    assert stored.parent_block_hash is None


def test_a_batch_published_without_a_rank_carries_the_publishers() -> None:
    """As vLLM's publisher does: a router tells data-parallel ranks apart by it."""
    batch = make_batch([AllBlocksCleared()])
    with KVEventPublisher(LOCAL, LOCAL, data_parallel_rank=3) as pub:
        pub.publish_batch(batch)
        pub.publish_batch(make_batch([AllBlocksCleared()], data_parallel_rank=1))
        pub.flush()
        frames = _replayed(pub)
    assert [decode_batch(payload).data_parallel_rank for _, _, payload in frames] == [3, 1]
    assert batch.data_parallel_rank is None  # the caller's batch is left as it was


def test_our_subscriber_follows_vllms_publisher_past_its_replay_buffer() -> None:
    """vLLM's ZmqEventPublisher keeps 3 batches for replay and has published 8 when we
    join: a catch-up gets 5..7 and counts 0..4 lost (vLLM's replay sends what it holds from
    the number asked, nothing for what it dropped), then the live batches follow in order."""
    theirs = _vllm_kv_events()
    port, replay_port = free_port(), free_port()
    # vLLM's publisher binds an endpoint with a ``*`` and connects to any other
    pub = theirs.ZmqEventPublisher(0, f"tcp://*:{port}", f"tcp://*:{replay_port}", buffer_steps=3)

    def publish(i: int) -> None:
        pub.publish(
            theirs.KVEventBatch(
                ts=time.time(), events=[theirs.BlockStored([i], None, [1, 2], 2, None, "GPU", None)]
            )
        )

    try:
        for i in range(8):
            publish(i)
        _until_sent(pub)
        with KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}") as sub:
            caught_up = sub.catch_up()
            lost = sub.lost
            live: Delivered = []
            deadline = time.monotonic() + 60
            for i in range(8, 10):
                time.sleep(0.5)  # the SUB socket joins while the catch-up runs
                publish(i)
            while len(live) < 2 and time.monotonic() < deadline:
                live += sub.receive(0.2)
    finally:
        pub.shutdown()
    assert [seq for seq, _ in caught_up] == [5, 6, 7] and lost == 5
    assert [seq for seq, _ in live] == [8, 9]
    events = [batch.events[0] for _, batch in caught_up + live]
    assert all(isinstance(event, BlockStored) for event in events)
    assert [event.block_hashes for event in events] == [[i] for i in range(5, 10)]
    assert {batch.data_parallel_rank for _, batch in caught_up + live} == {0}


def _until_sent(pub: Any, within_s: float = 30.0) -> None:
    """Until vLLM's publisher thread has taken every batch from its queue."""
    deadline = time.monotonic() + within_s
    while not pub._event_queue.empty():
        assert time.monotonic() < deadline, "vLLM's publisher never sent its batches"
        time.sleep(0.05)
    time.sleep(0.2)  # the last one taken is in its replay buffer once sent


def test_int_block_hashes_that_is_no_bool_is_refused_naming_it() -> None:
    """A "no" or a 0 is not "off" by accident; refused before a port is bound."""
    from kvoffload import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="int_block_hashes must be true or false"):
        KVEventPublisher(LOCAL, int_block_hashes="no")  # type: ignore[arg-type]
