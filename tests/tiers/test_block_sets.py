"""Pipelined SETs with header and payload sent apart, against real Valkey servers."""

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
from kvoffload.tiers import RemoteTier, checksum, layout_fingerprint
from kvoffload.tiers.block_sets import (
    JOIN_BELOW,
    BlockWrite,
    HeadersAhead,
    pack_sets,
)
from kvoffload.tiers.checksum import GIL_HELD_UP_TO
from kvoffload.tiers.format import CorruptBlockError, decode_block, encode_header
from kvoffload.tiers.remote import SLOTS
from kvoffload.tiers.resp import Deadline
from tier_servers import ValkeyClusterProcesses, ValkeyProcess

FP = layout_fingerprint("block-sets", layout_preset("tiny"), 0)


def writes_of(sizes: list[int], prefix: bytes = b"bs:") -> list[BlockWrite]:
    writes = []
    for i, size in enumerate(sizes):
        key = block_id_key(i)
        payload = bytes((i + j) % 251 for j in range(size))
        writes.append(BlockWrite(prefix + key.hex().encode(), key, payload))
    return writes


def test_large_payloads_go_out_as_they_are_and_small_ones_are_joined() -> None:
    writes = writes_of([10, JOIN_BELOW, 3, JOIN_BELOW + 1, 0])
    pieces = list(pack_sets(writes, FP))
    assert [piece is writes[i].payload for i in (1, 3) for piece in pieces].count(True) == 2
    assert len(pieces) == 5  # commands before block 1, block 1, between, block 3, the rest
    assert b"".join(pieces).count(b"*3\r\n$3\r\nSET\r\n") == len(writes)


class CountingExecutor(ThreadPoolExecutor):
    """A real one-thread pool that counts the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__(1, "headers")
        self.jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


def test_headers_made_ahead_are_the_inline_ones_from_one_job_per_batch() -> None:
    """One job makes every header after the first (the sender makes that one): the
    pipeline is byte for byte the one whose headers are made inline."""
    writes = writes_of([JOIN_BELOW, 5, 2 * JOIN_BELOW, 0, JOIN_BELOW + 7])
    with CountingExecutor() as executor:
        headers = HeadersAhead(writes, FP, executor, Deadline(10))
        ahead = list(pack_sets(writes, FP, headers))
        assert executor.jobs == 1
        assert HeadersAhead(writes[:1], FP, executor, Deadline(10)).header(0)
        assert executor.jobs == 1  # a batch of one has nothing to make ahead
    assert b"".join(ahead) == b"".join(pack_sets(writes, FP))
    for (_, key, payload), i in zip(writes, range(len(writes)), strict=True):
        assert headers.header(i) == encode_header(key, FP, payload)


def parted_writes(part_bytes: int, parts: int, count: int) -> list[BlockWrite]:
    """Writes whose payloads come in ``parts`` buffers of ``part_bytes`` each."""
    return [
        BlockWrite(
            b"bs:%d" % i,
            block_id_key(i),
            [bytes([i + k]) * part_bytes for k in range(parts)],
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("gil_free", [True, False])
def test_payloads_of_small_parts_get_their_jobs_by_how_they_are_hashed(
    gil_free: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 64 KiB or less (an SGLang layer_first page): hashed with the GIL released
    (XXH3 through ctypes) they get one job per batch, as single buffers do; hashed with
    ``xxhash`` (GIL held: no GIL-free digest here) each header after the first is one
    job, started as the payload before it goes out. The pipeline is the inline one."""
    assert checksum.parts_digest is not None  # the xxhash wheel exports XXH3's C API
    if not gil_free:
        monkeypatch.setattr(checksum, "parts_digest", None)
    writes = parted_writes(GIL_HELD_UP_TO, 4, 5)
    with CountingExecutor() as executor:
        ahead = list(pack_sets(writes, FP, HeadersAhead(writes, FP, executor, Deadline(10))))
        assert executor.jobs == (1 if gil_free else len(writes) - 1)
    assert b"".join(map(joined, ahead)) == b"".join(map(joined, pack_sets(writes, FP)))


def test_payloads_of_small_parts_only_still_get_their_headers() -> None:
    """Parts too small to go out on their own (joined with the command bytes) still
    start the next header's job: the batch goes out well within its deadline."""
    writes = parted_writes(JOIN_BELOW // 4, 3, 4)
    with ThreadPoolExecutor(1) as executor:
        started = time.monotonic()
        ahead = list(pack_sets(writes, FP, HeadersAhead(writes, FP, executor, Deadline(5))))
        assert time.monotonic() - started < 2
    assert b"".join(map(joined, ahead)) == b"".join(map(joined, pack_sets(writes, FP)))


def joined(piece: object) -> bytes:
    """A piece's bytes (a tuple of parts joined)."""
    if isinstance(piece, tuple):
        return b"".join(bytes(part) for part in piece)
    assert isinstance(piece, bytes | bytearray | memoryview)
    return bytes(piece)


def gated_executor() -> tuple[ThreadPoolExecutor, threading.Event]:
    """A one-thread pool whose thread is held until the event is set."""
    executor, gate = ThreadPoolExecutor(1), threading.Event()
    executor.submit(gate.wait, 10)
    return executor, gate


def test_waiting_for_a_header_counts_against_the_deadline() -> None:
    """A header the job has not made yet (its thread held) fails the send in time."""
    writes = writes_of([JOIN_BELOW] * 3)
    executor, gate = gated_executor()
    try:
        headers = HeadersAhead(writes, FP, executor, Deadline(0.3))
        assert headers.header(0) == encode_header(writes[0].key, FP, writes[0].payload)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            headers.header(1)
        assert time.monotonic() - started < 2
    finally:
        gate.set()
        executor.shutdown()


def test_a_stopped_batch_makes_no_more_headers() -> None:
    """After a failed send the job ends without hashing the rest of the batch."""
    writes = writes_of([JOIN_BELOW] * 4)
    executor, gate = gated_executor()
    headers = HeadersAhead(writes, FP, executor, Deadline(0.5))
    headers.stop()
    gate.set()
    executor.shutdown(wait=True)  # the job has run, and made nothing
    with pytest.raises(TimeoutError):
        headers.header(1)


def test_a_header_that_cannot_be_made_fails_the_send() -> None:
    """The job's error reaches the sender (a fingerprint of the wrong size, here)."""
    writes = writes_of([JOIN_BELOW] * 3)
    with ThreadPoolExecutor(1) as executor:
        headers = HeadersAhead(writes, FP[:5], executor, Deadline(10))
        for i in range(3):
            with pytest.raises(CorruptBlockError):
                headers.header(i)


SIZES = [1, 7, 100, JOIN_BELOW - 1, JOIN_BELOW, 3 * JOIN_BELOW + 5, 2**20, 5, 2**20 + 3]


def test_every_size_stores_as_header_then_payload_and_loads_back(
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
                assert value == encode_header(key, fp, payload) + payload
                assert bytes(decode_block(value, key, fp)) == payload
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
    tier = RemoteTier(server.url, fp)
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
