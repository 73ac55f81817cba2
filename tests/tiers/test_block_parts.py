"""Blocks whose payload is several buffers (an SGLang MHA page's K and V segments): written
part by part, read back into parts, checksummed over all of them, on disk and real Valkey."""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tier_helpers import flip_byte

from kvoffload import block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, RemoteTier, layout_fingerprint
from kvoffload.tiers.block_sets import JOIN_BELOW, BlockWrite, pack_sets
from kvoffload.tiers.format import (
    HEADER_BYTES,
    TRAILER_BYTES,
    CorruptBlockError,
    decode_block,
    encode_block,
    encode_header,
    encode_trailed_block,
    payload_digest,
)
from kvoffload.tiers.resp import DIRECT_PIECE
from kvoffload.tiers.slot_file import FileLayer
from tier_servers import ValkeyProcess

SPLIT = [JOIN_BELOW + 7, 2 * JOIN_BELOW, 100, 3 * JOIN_BELOW]
"""Part sizes of a written block: two large parts, a small one, a large one (all sent as
they are, gathered in one ``sendmsg``)."""
SIZE = sum(SPLIT)
FP = layout_fingerprint("block-parts", layout_preset("tiny"), SIZE)
KEYS = [block_id_key(i, 31) for i in range(4)]
IOV_MAX = os.sysconf("SC_IOV_MAX")
"""Buffers one vectored system call takes (1,024 on Linux)."""


def parts_of(i: int, split: list[int] = SPLIT) -> list[memoryview]:
    whole = random.Random(i).randbytes(sum(split))
    out, at = [], 0
    for size in split:
        out.append(memoryview(bytearray(whole[at : at + size])))
        at += size
    return out


def joined(parts: list[Any]) -> bytes:
    return b"".join(bytes(part) for part in parts)


def flat(pieces: list[Any]) -> bytes:
    """The bytes ``pieces`` send, a gathered piece's buffers in order."""
    return b"".join(flat(list(p)) if isinstance(p, tuple) else bytes(p) for p in pieces)


def into_parts(split: list[int], n: int) -> list[list[memoryview]]:
    return [[memoryview(bytearray(size)) for size in split] for _ in range(n)]


def test_a_payload_in_parts_is_the_same_block_as_its_bytes_joined() -> None:
    parts = parts_of(1)
    whole = joined(parts)
    assert payload_digest(parts) == payload_digest(whole)
    assert encode_header(KEYS[0], FP, parts) == encode_header(KEYS[0], FP, whole)
    assert encode_block(KEYS[0], FP, parts) == encode_block(KEYS[0], FP, whole)
    assert encode_trailed_block(KEYS[0], FP, parts) == encode_trailed_block(KEYS[0], FP, whole)
    pieces = list(pack_sets([BlockWrite(b"n", KEYS[0], parts)], FP))
    gathered, trailer = pieces
    assert isinstance(gathered, tuple) and isinstance(trailer, bytes)
    # every part in place, the small one too: one sendmsg takes them all
    assert len(gathered) == 1 + len(parts)
    assert all(a is b for a, b in zip(gathered[1:], parts, strict=True))
    stream = flat(pieces)
    assert stream[: -TRAILER_BYTES - 2].endswith(whole) and stream.endswith(b"\r\n")


def test_a_payload_of_large_parts_only_goes_out_as_its_own_buffers() -> None:
    """An SGLang page's segments (every part large): each part itself, none joined, a page's
    parts gathered in one piece, and the stream is the SET of the joined bytes."""
    split = [JOIN_BELOW, 3 * JOIN_BELOW + 1, JOIN_BELOW]
    writes = [BlockWrite(b"n%d" % i, KEYS[i], parts_of(i, split)) for i in range(2)]
    pieces = list(pack_sets(writes, FP))
    gathered = [piece for piece in pieces if isinstance(piece, tuple)]
    assert len(gathered) == 2
    for piece, write in zip(gathered, writes, strict=True):
        assert all(a is b for a, b in zip(piece[1:], write.payload, strict=True))
    whole = [BlockWrite(w.name, w.key, joined(list(w.payload))) for w in writes]
    assert flat(pieces) == flat(list(pack_sets(whole, FP)))


def test_a_flipped_byte_in_the_second_part_fails_the_checksum() -> None:
    block = bytearray(encode_block(KEYS[0], FP, parts_of(2)))
    block[HEADER_BYTES + len(KEYS[0]) + SPLIT[0] + 3] ^= 0xFF
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(bytes(block), KEYS[0], FP)


@pytest.mark.parametrize("read_split", [SPLIT, [SIZE], [5, SIZE - 5 - 9, 9]])
def test_disk_tier_writes_parts_and_reads_into_parts(tmp_path: Path, read_split: list[int]) -> None:
    tier = DiskTier(tmp_path, 8, FP)
    try:
        written = [parts_of(i) for i in range(3)]
        tier.write(KEYS[:3], written)
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == 3
        targets = into_parts(read_split, 3)
        assert tier.read(KEYS[:3], targets.__getitem__).result(timeout=10) == [True] * 3
        assert [joined(t) for t in targets] == [joined(p) for p in written]
        flip_byte(tier, KEYS[1], HEADER_BYTES + len(KEYS[1]) + SPLIT[0] + 3)
        again = into_parts(read_split, 3)
        assert tier.read(KEYS[:3], again.__getitem__).result(timeout=10) == [True, False, True]
        assert tier.stats.corrupt == 1
        short = into_parts([SIZE - 1], 1)  # parts that do not hold the block: not delivered
        assert tier.read(KEYS[:1], short.__getitem__).result(timeout=10) == [False]
    finally:
        tier.close()


class CountsBuffers(FileLayer):
    """Records how many buffers each vectored read from the cache and each write took."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self.counts.append(len(buffers))
        return super().preadv_cached(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        self.counts.append(len(buffers))
        return super().pwritev(fd, buffers, offset)


def test_disk_tier_stores_and_loads_blocks_of_more_parts_than_one_system_call_takes(
    tmp_path: Path,
) -> None:
    """80 layers, K and V each split in 8: 1,280 parts a block, past IOV_MAX (1,024 on
    Linux), where one ``pwritev`` of them all failed every store with EINVAL."""
    split = [48 + i % 5 for i in range(80 * 2 * 8)]
    assert len(split) > IOV_MAX
    fingerprint = layout_fingerprint("many-parts", layout_preset("tiny"), sum(split))
    written = [parts_of(i, split) for i in range(3)]
    layer = CountsBuffers()
    tier = DiskTier(tmp_path, 8, fingerprint, file_layer=layer)
    try:
        tier.write(KEYS[:3], written)
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == 3 and tier.stats.failed == 0
        targets = into_parts(split, 3)
        assert tier.read(KEYS[:3], targets.__getitem__).result(timeout=10) == [True] * 3
        assert [joined(t) for t in targets] == [joined(p) for p in written]
    finally:
        tier.close()
    assert layer.counts and max(layer.counts) <= IOV_MAX
    again = DiskTier(tmp_path, 8, fingerprint)
    try:
        assert again.recovery.recovered == 3
        targets = into_parts(split, 3)
        assert again.read(KEYS[:3], targets.__getitem__).result(timeout=10) == [True] * 3
        assert [joined(t) for t in targets] == [joined(p) for p in written]
    finally:
        again.close()


@pytest.mark.parametrize("read_split", [SPLIT, [SIZE], [5, SIZE - 5 - 9, 9]])
def test_valkey_tier_writes_parts_and_reads_into_parts(
    valkey_server: ValkeyProcess, read_split: list[int]
) -> None:
    tier = RemoteTier(valkey_server.url, FP)
    client = valkey_server.client()
    try:
        written = [parts_of(i) for i in range(3)]
        tier.write(KEYS[:3], written)
        tier.poll(wait=True)
        assert tier.stats.stored_blocks == 3
        for key, parts in zip(KEYS, written, strict=False):
            assert client.get(tier.name(key)) == encode_trailed_block(key, FP, joined(parts))
        targets = into_parts(read_split, 3)
        assert tier.read(KEYS[:3], targets.__getitem__).result(timeout=10) == [True] * 3
        assert [joined(t) for t in targets] == [joined(p) for p in written]
        name = tier.name(KEYS[1])
        value = bytearray(client.get(name))
        value[HEADER_BYTES + len(KEYS[1]) + SPLIT[0] + 3] ^= 0xFF
        client.set(name, bytes(value))
        again = into_parts(read_split, 3)
        assert tier.read(KEYS[:3], again.__getitem__).result(timeout=10) == [True, False, True]
        assert tier.stats.corrupt == 1 and client.exists(name) == 0  # deleted, never loaded
    finally:
        tier.delete_all()
        tier.close()


def test_more_large_parts_than_one_recvmsg_into_takes(valkey_server: ValkeyProcess) -> None:
    """A value of 700 large parts goes out in two ``sendmsg`` calls or more (at most 512
    buffers each) and comes back into one buffer, into
    its parts (several ``recvmsg_into`` calls, each picking up where the kernel stopped)
    and into parts that cut across the written ones."""
    split = [JOIN_BELOW] * 700
    fp = layout_fingerprint("block-parts", layout_preset("tiny"), sum(split))
    tier = RemoteTier(valkey_server.url, fp)
    try:
        written = [parts_of(i, split) for i in range(2)]
        tier.write(KEYS[:2], written)
        tier.poll(wait=True)
        big = DIRECT_PIECE + 11  # a part longer than one recvmsg_into piece, then a tiny one
        splits = ([sum(split)], split, [big, 7, sum(split) - big - 7])
        for read_split in splits:  # one buffer; many recvmsg_into calls
            targets = into_parts(read_split, 2)
            assert tier.read(KEYS[:2], targets.__getitem__).result(timeout=30) == [True, True]
            assert [joined(t) for t in targets] == [joined(p) for p in written]
    finally:
        tier.delete_all()
        tier.close()


BIG = 512 * 1024
"""A block past the size at which the tiers read straight into the destination."""
BIG_FP = layout_fingerprint("block-parts-2d", layout_preset("tiny"), BIG)


def two_dimensional(fmt: str) -> memoryview:
    """A destination shaped as a host pool's page is: rows of ``fmt`` items, not flat bytes."""
    width = struct.calcsize(fmt)
    return memoryview(bytearray(BIG)).cast("B").cast(fmt, [64, BIG // 64 // width])


@pytest.mark.parametrize("fmt", ["B", "f"])
def test_a_block_reads_into_a_two_dimensional_buffer(
    tmp_path: Path, valkey_server: ValkeyProcess, fmt: str
) -> None:
    """A large block read from a fresh disk tier (nothing cached) or from Valkey into a
    2-D view arrives whole, whatever its item format (a 2-D ``uint8`` view failed the
    read, and the batch's other blocks with it)."""
    payloads = [random.Random(i).randbytes(BIG) for i in range(2)]
    keys = KEYS[:2]
    disk = DiskTier(tmp_path, 4, BIG_FP)
    disk.write(keys, payloads)
    disk.poll(wait=True)
    disk.close()
    remote = RemoteTier(valkey_server.url, BIG_FP)
    remote.write(keys, payloads)
    remote.poll(wait=True)
    tiers = [DiskTier(tmp_path, 4, BIG_FP), remote]
    try:
        for tier in tiers:
            targets = [two_dimensional(fmt) for _ in keys]
            assert tier.read(keys, targets.__getitem__).result(timeout=10) == [True, True]
            assert [t.tobytes() for t in targets] == payloads
    finally:
        remote.delete_all()
        for tier in tiers:
            tier.close()
