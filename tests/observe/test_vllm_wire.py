"""Our KV events on vLLM 0.33's own terms: its structs, its decoder, its publisher.

vLLM is imported in a child process (its import is heavy and sets up logging);
the child asserts, and its stderr is the failure message.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import zmq

from kvoffload import OffloadingEvent, block_id_key
from kvoffload.core.keys import make_offload_key
from kvoffload.observe.events import AllBlocksCleared, BlockStored, decode_batch, make_batch
from kvoffload.observe.publisher import KVEventPublisher
from kvoffload.observe.subscriber import Delivered, KVEventSubscriber

LOCAL = "tcp://127.0.0.1:0"
SHA_KEY = make_offload_key(hashlib.sha256(b"a page").digest(), 1)
"""A 32-byte hash, as SGLang's pages and vLLM's sha256 blocks have, in KV group 1."""


def _run_vllm(script: str) -> subprocess.Popen[bytes]:
    pytest.importorskip("vllm")
    code = "import warnings\nwarnings.simplefilter('ignore')\n" + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)


def _check(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    _, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until the child creates ``path``; its error if it ends first."""
    deadline = time.monotonic() + 90
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _check(proc, timeout_s=10)
            raise AssertionError(f"the child never created {path.name}")
        time.sleep(0.05)


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
    proc = _run_vllm(
        """
        import msgspec
        from vllm.distributed import kv_events as V
        from kvoffload.observe import events as O
        for name in ("KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                     "KVEventBatch"):
            ours, theirs = getattr(O, name), getattr(V, name)
            def shape(struct):
                return [(f.name, f.encode_name, f.default) for f in msgspec.structs.fields(struct)]
            assert shape(ours) == shape(theirs), (name, shape(ours), shape(theirs))
            for option in ("array_like", "omit_defaults", "tag", "tag_field",
                           "forbid_unknown_fields"):
                mine = getattr(ours.__struct_config__, option)
                vllms = getattr(theirs.__struct_config__, option)
                assert mine == vllms, (name, option, mine, vllms)
        """
    )
    _check(proc)


def test_vllms_decoder_reads_int_block_hashes_as_vllm_publishes_them(tmp_path: Path) -> None:
    """With ``int_block_hashes``, each hash is the integer vLLM's own conversion gives for
    the same key (its default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a router that reads
    only 64-bit integers (Dynamo's) decodes the batch, and a block hashed with sha256
    has one name in vLLM's events and ours."""
    with KVEventPublisher(LOCAL, LOCAL, int_block_hashes=True, data_parallel_rank=2) as pub:
        events = [
            OffloadingEvent([block_id_key(7), block_id_key(2**64 - 1), SHA_KEY], "CPU", False),
            OffloadingEvent([SHA_KEY], "CPU", removed=True),
        ]
        pub.publish(events)
        pub.flush()
        ((topic, seq, payload),) = _replayed(pub)
    (tmp_path / "payload").write_bytes(payload)
    proc = _run_vllm(
        f"""
        import msgspec
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
        from vllm.v1.kv_offload.base import get_offload_block_hash
        sha_key = bytes.fromhex({SHA_KEY.hex()!r})
        payload = open({str(tmp_path / "payload")!r}, "rb").read()
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        assert batch.data_parallel_rank == 2, batch
        by_group = {{(type(e).__name__, e.group_idx): e for e in batch.events}}
        stored, stored_sha, removed = (
            by_group[("BlockStored", 0)], by_group[("BlockStored", 1)],
            by_group[("BlockRemoved", 1)])
        assert stored.block_hashes == [7, 2**64 - 1], stored
        sha = maybe_convert_block_hash(BlockHash(get_offload_block_hash(sha_key)))
        assert isinstance(sha, int), sha
        assert stored_sha.block_hashes == [sha] and removed.block_hashes == [sha], batch
        assert stored.medium == "CPU" and stored.token_ids == []
        assert stored.parent_block_hash is None
        """
    )
    _check(proc)
    assert topic == b"kvoffload" and seq == (0).to_bytes(8, "big")


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


def test_our_subscriber_follows_vllms_publisher_past_its_replay_buffer(tmp_path: Path) -> None:
    """vLLM's ZmqEventPublisher keeps 3 batches for replay and has published 8 when we
    join: a catch-up gets 5..7 and counts 0..4 lost (vLLM's replay sends what it holds from
    the number asked, nothing for what it dropped), then the live batches follow in order."""
    ready, caught, done = tmp_path / "ready", tmp_path / "caught", tmp_path / "done"
    port, replay_port = _free_port(), _free_port()
    proc = _run_vllm(
        f"""
        import os, time
        from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

        def wait_for(path):
            deadline = time.monotonic() + 90
            while not os.path.exists(path):
                assert time.monotonic() < deadline, path
                time.sleep(0.05)

        pub = ZmqEventPublisher(0, "tcp://*:{port}", "tcp://*:{replay_port}", buffer_steps=3)
        def publish(i):
            pub.publish(KVEventBatch(ts=time.time(), events=[
                BlockStored([i], None, [1, 2], 2, None, "GPU", None)]))
        for i in range(8):
            publish(i)
        time.sleep(1)
        open({str(ready)!r}, "w").close()
        wait_for({str(caught)!r})
        for i in range(8, 10):
            publish(i)
            time.sleep(0.5)
        wait_for({str(done)!r})
        pub.shutdown()
        """
    )
    try:
        _wait_for(ready, proc)
        with KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}") as sub:
            caught_up = sub.catch_up()
            lost = sub.lost
            caught.touch()
            live: Delivered = []
            deadline = time.monotonic() + 60
            while len(live) < 2 and time.monotonic() < deadline:
                live += sub.receive(0.2)
    finally:
        caught.touch()
        done.touch()
        _check(proc)
    assert [seq for seq, _ in caught_up] == [5, 6, 7] and lost == 5
    assert [seq for seq, _ in live] == [8, 9]
    events = [batch.events[0] for _, batch in caught_up + live]
    assert all(isinstance(event, BlockStored) for event in events)
    assert [event.block_hashes for event in events] == [[i] for i in range(5, 10)]
    assert {batch.data_parallel_rank for _, batch in caught_up + live} == {0}


def test_int_block_hashes_that_is_no_bool_is_refused_naming_it() -> None:
    """A "no" or a 0 is not "off" by accident; refused before a port is bound."""
    from kvoffload import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="int_block_hashes must be true or false"):
        KVEventPublisher(LOCAL, int_block_hashes="no")  # type: ignore[arg-type]
