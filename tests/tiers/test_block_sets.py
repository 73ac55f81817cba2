"""Pipelined SETs of trailed blocks, payloads hashed piece by piece, against real Valkey."""

from __future__ import annotations

import binascii
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvoffload import block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import CircuitBreaker, RemoteTier, layout_fingerprint
from kvoffload.tiers.block_sets import JOIN_BELOW, BlockWrite, DigestsAhead, pack_sets
from kvoffload.tiers.format import (
    TRAILER_BYTES,
    CorruptBlockError,
    decode_trailed_block,
    encode_trailed_block,
)
from kvoffload.tiers.remote import SLOTS
from kvoffload.tiers.resp import Deadline, command
from tier_servers import ValkeyClusterProcesses, ValkeyProcess

FP = layout_fingerprint("block-sets", layout_preset("tiny"), 0)


def writes_of(sizes: list[int], prefix: bytes = b"bs:") -> list[BlockWrite]:
    writes = []
    for i, size in enumerate(sizes):
        key = block_id_key(i)
        payload = bytes((i + j) % 251 for j in range(size))
        writes.append(BlockWrite(prefix + key.hex().encode(), key, payload))
    return writes


LARGE = 64 * 1024


def joined(piece: object) -> bytes:
    if isinstance(piece, tuple):
        return b"".join(map(joined, piece))
    assert isinstance(piece, bytes | bytearray | memoryview)
    return bytes(piece)


def test_the_pipeline_is_one_set_of_each_trailed_block() -> None:
    """Byte for byte, the pieces are ``SET name block`` of each write, the block trailed by
    its payload's digest, whatever the sizes and however the payloads are split."""
    writes = writes_of([10, JOIN_BELOW, 3, 3 * LARGE + 5, 0, LARGE])
    writes.append(BlockWrite(b"parts", block_id_key(9), [b"a" * 5, b"b" * JOIN_BELOW, b"c" * 7]))
    writes.append(BlockWrite(b"small", block_id_key(10), [b"d" * 5, b"e" * 9]))
    stream = b"".join(map(joined, pack_sets(writes, FP)))
    assert stream == b"".join(
        command(b"SET", name, encode_trailed_block(key, FP, payload))
        for name, key, payload in writes
    )


def test_large_payloads_go_out_in_place_and_small_ones_are_joined() -> None:
    """A payload of ``JOIN_BELOW`` bytes or more goes out as its own memory, never copied:
    all its parts gathered in one piece (one ``sendmsg``) behind the command bytes before
    them; smaller payloads are joined with the command bytes around them."""
    writes = writes_of([10, JOIN_BELOW, 3, 2 * LARGE + 1, 0])
    small, long_part = b"a" * 100, bytes(range(256)) * (2 * LARGE // 256) + b"x"
    writes.append(BlockWrite(b"parts", block_id_key(9), [small, long_part]))
    pieces = list(pack_sets(writes, FP))
    gathered = [piece for piece in pieces if isinstance(piece, tuple)]
    assert [piece[1:] for piece in gathered] == [
        (writes[1].payload,),
        (writes[3].payload,),
        (small, long_part),
    ]
    assert all(
        a is b
        for piece, w in zip(gathered, (1, 3, 5), strict=True)
        for a, b in zip(
            piece[1:], (writes[w].payload,) if w < 5 else (small, long_part), strict=True
        )
    )
    # each large payload behind its own command bytes, then what follows the last
    assert len(pieces) == len(gathered) + 1
    assert b"".join(map(joined, pieces)).count(b"*3\r\n$3\r\nSET\r\n") == len(writes)


class CountingExecutor(ThreadPoolExecutor):
    """A real one-thread pool that counts the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__(1, "digests")
        self.jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


def test_digests_made_ahead_give_the_same_pipeline_from_one_job_per_batch() -> None:
    """Large payloads' digests made on another thread, beside their send: the pipeline is
    byte for byte the one hashed by the sender, and a batch is one job."""
    writes = writes_of([10, JOIN_BELOW, 3, 3 * LARGE + 5, 0, 2 * JOIN_BELOW])
    writes.append(BlockWrite(b"parts", block_id_key(9), [b"a" * JOIN_BELOW, b"b" * 9]))
    with CountingExecutor() as executor:
        ahead = list(pack_sets(writes, FP, DigestsAhead(writes, executor, Deadline(10))))
        assert executor.jobs == 1
    assert b"".join(map(joined, ahead)) == b"".join(map(joined, pack_sets(writes, FP)))
    assert any(isinstance(p, tuple) and p[1] is writes[3].payload for p in ahead)  # in place


def gated_executor() -> tuple[ThreadPoolExecutor, threading.Event]:
    """A one-thread pool whose thread is held until the event is set."""
    executor, gate = ThreadPoolExecutor(1), threading.Event()
    executor.submit(gate.wait, 10)
    return executor, gate


def test_waiting_for_a_digest_counts_against_the_deadline() -> None:
    """A digest the job has not made yet (its thread held) fails the send in time."""
    writes = writes_of([JOIN_BELOW] * 3)
    executor, gate = gated_executor()
    try:
        pieces = pack_sets(writes, FP, DigestsAhead(writes, executor, Deadline(0.3)))
        next(pieces)  # the first SET's head and payload
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            next(pieces)  # its trailer needs the digest
        assert time.monotonic() - started < 2
    finally:
        gate.set()
        executor.shutdown()


def test_a_stopped_batch_makes_no_more_digests() -> None:
    """After a failed send the job ends without hashing the rest of the batch."""
    writes = writes_of([JOIN_BELOW] * 4)
    executor, gate = gated_executor()
    ahead = DigestsAhead(writes, executor, Deadline(0.5))
    ahead.stop()
    gate.set()
    executor.shutdown(wait=True)  # the job has run, and made nothing
    with pytest.raises(TimeoutError):
        ahead.digest(0)


def test_a_block_that_cannot_be_encoded_fails_the_send() -> None:
    """A fingerprint of the wrong size: the first piece is never made."""
    with pytest.raises(CorruptBlockError):
        next(iter(pack_sets(writes_of([JOIN_BELOW]), FP[:5])))


def test_a_trailed_block_checks_its_digest_and_its_version() -> None:
    payload = bytes(range(256)) * 300
    block = bytearray(encode_trailed_block(block_id_key(1), FP, payload))
    assert bytes(decode_trailed_block(bytes(block), block_id_key(1), FP)) == payload
    flipped = bytearray(block)
    flipped[-TRAILER_BYTES - 1] ^= 1  # the payload's last byte
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_trailed_block(bytes(flipped), block_id_key(1), FP)
    with pytest.raises(CorruptBlockError, match="cut short"):
        decode_trailed_block(bytes(block[:60]), block_id_key(1), FP)


SIZES = [1, 7, 100, JOIN_BELOW - 1, JOIN_BELOW, 3 * JOIN_BELOW + 5, 2**20, 5, 2**20 + 3]


def test_every_size_stores_as_header_payload_digest_and_loads_back(
    valkey_server: ValkeyProcess,
) -> None:
    """One tier per size (a tier's blocks have one size): small ones go through the
    connection's buffer, large ones are received straight into their slot."""
    client = valkey_server.client()
    for size in SIZES:
        fp = layout_fingerprint("block-sets", layout_preset("tiny"), size)
        tier = RemoteTier(valkey_server.url, fp)
        try:
            keys = [block_id_key(i, size) for i in range(3)]
            payloads = [bytes((i + j) % 251 for j in range(size)) for i in range(3)]
            tier.write(keys, payloads)
            tier.poll(wait=True)
            for key, payload in zip(keys, payloads, strict=True):
                value = client.get(tier.name(key))
                assert value == encode_trailed_block(key, fp, payload)
                assert bytes(decode_trailed_block(value, key, fp)) == payload
            buffers = [bytearray(size) for _ in keys]
            ok = tier.read(keys, lambda i, b=buffers: memoryview(b[i])).result(timeout=10)
            assert ok == [True] * 3 and [bytes(b) for b in buffers] == payloads
            tier.delete_all()
        finally:
            tier.close()


def test_an_error_reply_fails_the_pipeline_and_leaves_no_stale_reply(tmp_path: Path) -> None:
    server = ValkeyProcess(
        tmp_path / "oom", "--maxmemory", "3mb", "--maxmemory-policy", "noeviction"
    ).start()
    fp = layout_fingerprint("oom", layout_preset("tiny"), 2**20)
    # No cool-down: the store after memory is freed goes out at once, not rested (OOM).
    tier = RemoteTier(server.url, fp, breaker=CircuitBreaker(cooldown_s=0))
    try:
        keys = [block_id_key(i) for i in range(8)]
        tier.write(keys, [bytes([i]) * 2**20 for i in range(8)])  # 8 MiB into 3
        tier.poll(wait=True)
        assert tier.stats.failed == 8 and tier.stats.stored_blocks == 0
        # Whatever landed before the OOM replies, the next call reads its own replies.
        assert tier.present(keys[:1]) == server.client().exists(tier.name(keys[0]))
        server.client().config_set("maxmemory", "0")
        tier.write(keys[:1], [b"x" * 2**20])
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == 1 and tier.present(keys[:1]) == 1
    finally:
        tier.close()
        server.stop()


def test_a_cluster_tier_with_a_stale_slot_map_follows_moved_for_writes_and_reads(
    valkey_cluster: ValkeyClusterProcesses,
) -> None:
    tier = RemoteTier(valkey_cluster.url, FP)
    try:
        keys = [block_id_key(i, 77) for i in range(30)]
        owners = list(tier._slots or [])
        assert len(owners) == SLOTS
        nodes = list(dict.fromkeys(owners))
        assert len(nodes) == 3
        stale = [nodes[(nodes.index(owner) + 1) % 3] for owner in owners]

        def go_stale() -> None:  # as after a resharding the tier has not heard of
            assert tier._slots is not None
            tier._slots[:] = stale

        go_stale()
        payloads = [bytes([i]) * 40_000 for i in range(len(keys))]
        tier.write(keys, payloads)
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == len(keys) and tier.stats.failed == 0
        for key in keys:  # each MOVED put its slot right
            slot = binascii.crc_hqx(tier.name(key), 0) % SLOTS
            assert tier._slots is not None and tier._slots[slot] is owners[slot]
        go_stale()
        buffers = [bytearray(40_000) for _ in keys]
        assert all(tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10))
        assert [bytes(buffer) for buffer in buffers] == payloads
        assert tier.delete_all() == len(keys)
    finally:
        tier.close()
