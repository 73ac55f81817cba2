"""The GIL-free XXH3 over a payload's parts gives xxhash's digest of the joined bytes."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.core.keys import block_id_key
from kvoffload.tiers import checksum
from kvoffload.tiers.format import (
    CorruptBlockError,
    decode_block,
    encode_block,
    payload_digest,
)

FP = b"f" * 16


def gil_free(parts: list[checksum.Buffer]) -> int:
    digest = checksum.parts_digest
    assert digest is not None  # the xxhash wheel exports XXH3's C API
    return digest(parts)


def test_every_kind_of_buffer_is_read_in_place() -> None:
    """bytes, a bytearray, read-only and writable views, a view of wider items, an empty
    part: the digest is the one of their bytes one after the other."""
    backing = bytearray(range(256)) * 600
    parts: list[checksum.Buffer] = [
        b"header-ish" * 7,
        bytearray(b"\x01\x02" * 40_000),
        memoryview(bytes(range(200)) * 50)[13:9_001],
        memoryview(backing)[1_000:70_000],
        memoryview(backing)[:4_096].cast("H"),
        b"",
    ]
    assert gil_free(parts) == xxhash.xxh3_64_intdigest(b"".join(bytes(p) for p in parts))


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=300_000), st.lists(st.integers(0, 300_000), max_size=12))
def test_any_split_of_a_payload_has_the_digest_of_the_whole(data: bytes, cuts: list[int]) -> None:
    edges = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    parts: list[checksum.Buffer] = [memoryview(data)[a:b] for a, b in itertools.pairwise(edges)]
    assert gil_free(parts) == xxhash.xxh3_64_intdigest(data)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=300_000), st.lists(st.integers(0, 300_000), max_size=12))
def test_addressed_parts_hash_their_bytes_at_their_addresses(data: bytes, cuts: list[int]) -> None:
    """Parts that come with their addresses (an SGLang pool's segments) are hashed there:
    the digest of the whole; a part given the address of another part's bytes is not."""
    backing = bytearray(data)
    whole = memoryview(backing)
    base = ctypes.addressof(ctypes.c_char.from_buffer(backing)) if data else 0
    edges = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    spans = list(itertools.pairwise(edges))
    parts = checksum.AddressedParts([whole[a:b] for a, b in spans], [base + a for a, _ in spans])
    assert gil_free(parts) == xxhash.xxh3_64_intdigest(data)
    moved = [(a, b) for a, b in spans if b - a > 1 and data[a:b] != data[a + 1 : b + 1]]
    if moved:
        a, b = moved[0]
        addresses = [base + x + (1 if (x, y) == (a, b) else 0) for x, y in spans]
        wrong = checksum.AddressedParts([whole[x:y] for x, y in spans], addresses)
        assert gil_free(wrong) != xxhash.xxh3_64_intdigest(data)
    with pytest.raises(ValueError, match="addresses"):
        checksum.AddressedParts([whole], [])


@pytest.mark.parametrize("available", [True, False])
def test_blocks_of_small_parts_are_the_same_either_way(
    available: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload of 64 KiB parts (an SGLang layer_first page) makes the same block with
    the GIL-free digest as with xxhash, and a flipped byte still fails its checksum."""
    if not available:
        monkeypatch.setattr(checksum, "parts_digest", None)
    parts = [bytes([k]) * checksum.GIL_HELD_UP_TO for k in range(6)]
    assert checksum.many_small(parts)
    whole = b"".join(parts)
    assert payload_digest(parts) == xxhash.xxh3_64_intdigest(whole)
    key = block_id_key(7)
    block = encode_block(key, FP, parts)
    assert block == encode_block(key, FP, whole)
    assert bytes(decode_block(block, key, FP)) == whole
    flipped = bytearray(block)
    flipped[-5] ^= 1
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(flipped), key, FP)


def test_large_parts_and_single_buffers_keep_xxhash() -> None:
    """Only several parts with some small ones take the ctypes path: xxhash releases the
    GIL itself above 64 KiB."""
    big = b"x" * (checksum.GIL_HELD_UP_TO + 1)
    assert not checksum.many_small([big, big])
    assert not checksum.many_small([b"small"])
    assert checksum.many_small([big, b"small"])


def test_a_part_stays_exported_while_it_is_hashed() -> None:
    """The hash runs with the GIL released: a bytearray part is held exported meanwhile,
    so no other thread can resize it under the hash."""
    part = bytearray(b"page" * 1000)
    address, held = checksum._pinned(part)
    with pytest.raises(BufferError):
        part.extend(b"more")
    assert ctypes.string_at(address, 4) == b"page"
    del held
    part.extend(b"more")
    assert part.endswith(b"more")
