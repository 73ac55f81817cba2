"""The on-disk and on-server form of one block: a checksummed header, then raw bytes.

Every value the disk tier writes is ``header | key | payload``. The header names the
format, the key, the layout fingerprint and the payload length, and carries
two checksums: the 64-bit XXH3 digest of the payload and a CRC32 over the
header fields and the key. The shared tier's values are *trailed*
(:data:`TRAILED_VERSION`): ``header | key | payload | digest``, the header's
digest field zero and the digest in the 8 bytes after the payload. A SET's
header goes out before its payload, so a digest inside it must be made before
the first payload byte is sent, reading the payload once to hash it and once
more to send it; trailed, the store hashes each piece just before it sends it
(see :mod:`.block_sets` for what that gained). The disk tier keeps
the digest in the header: its crash safety rests on the header, written
last, vouching for the payload before it. XXH3 runs at about 18 GB/s on one core here,
where CRC32 runs at 4 and the position-weighted 64-bit sums of format
version 1 at 8: the checksum is on every store and load, and at those rates
it would cost a tier a third of its speed. The payload is never copied to be
checked. Nothing is pickled.

A payload may come as several buffers (:data:`Parts`: an SGLang MHA page is
its K and V segments, one pair per layer in ``layer_first``): its bytes are
the parts one after the other, its digest runs over them in order, and no
tier ever joins them; the stored block is the same as for the joined bytes.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import xxhash

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import KVLayout
from kvoffload.tiers import checksum

MAGIC = b"KVOB"
FORMAT_VERSION = 2
"""The digest in the header (the disk tier)."""
TRAILED_VERSION = 3
"""The digest after the payload (the shared tier)."""
FINGERPRINT_BYTES = 16


def check_fingerprint(fingerprint: object) -> None:
    """:class:`InvalidArgumentError` unless ``fingerprint`` is :data:`FINGERPRINT_BYTES`
    bytes: what a tier's blocks mean, in every block's header and every key's name."""
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        shown = f"{len(fingerprint)} bytes" if isinstance(fingerprint, bytes) else repr(fingerprint)
        raise InvalidArgumentError(
            f"a tier's fingerprint is {FINGERPRINT_BYTES} bytes, got {shown}"
        )


Buffer = bytes | bytearray | memoryview
Parts = Sequence[Buffer]
"""One payload in several buffers, in order (a list or tuple of them)."""
Payload = Buffer | Parts
"""A block's payload: one buffer, or its parts."""

_FIELDS = struct.Struct("<4sHH16sQQ")
"""magic, format version, key length, layout fingerprint, payload length, payload digest."""
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size
_TRAILER = struct.Struct("<Q")
TRAILER_BYTES = _TRAILER.size


class CorruptBlockError(KVOffloadError, ValueError):
    """A stored value is not a valid block for the key and fingerprint asked for."""


class CutShortError(CorruptBlockError):
    """The data ends inside the header or its key: a write cut short, not a bad header."""


def layout_fingerprint(model: str, layout: KVLayout, payload_bytes: int) -> bytes:
    """16 bytes naming what a block's bytes mean: model, KV layout, block size, payload size.

    Blocks of two different models, layouts or block sizes get different
    fingerprints, so a shared tier never hands one model another's bytes.
    ``payload_bytes`` is 0 for bookkeeping-only runs, which then never mix
    with runs that store real bytes.
    """
    return fingerprint_of(
        model,
        layout.num_layers,
        layout.kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.tokens_per_block,
        payload_bytes,
    )


def fingerprint_of(*parts: object) -> bytes:
    """16 bytes naming ``parts``; for callers that describe their blocks without a KVLayout."""
    text = "|".join(str(part) for part in parts)
    return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()


def payload_parts(payload: Payload) -> Parts:
    """``payload``'s buffers in order (one for a single buffer)."""
    return (payload,) if isinstance(payload, bytes | bytearray | memoryview) else payload


def buffer_size(buffer: Buffer) -> int:
    """Bytes of ``buffer`` (a memoryview of wider items counts its bytes, not its items)."""
    return buffer.nbytes if isinstance(buffer, memoryview) else len(buffer)


def payload_size(payload: Payload) -> int:
    """Bytes of ``payload``, all its parts together."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return buffer_size(payload)
    # In line: a page of many parts is sized on every store (16 parts an SGLang page).
    return sum(part.nbytes if type(part) is memoryview else len(part) for part in payload)


def payload_digest(payload: Payload) -> int:
    """The XXH3 64-bit digest of ``payload`` (its parts in order), read in place; several
    parts, some small, are hashed with the GIL released (:mod:`.checksum`)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return xxhash.xxh3_64_intdigest(payload)
    gil_free = checksum.parts_digest
    if gil_free is not None and checksum.many_small(payload):
        return gil_free(payload)
    digest = xxhash.xxh3_64()
    for part in payload:
        digest.update(part)
    return digest.intdigest()


def payload_hasher() -> xxhash.xxh3_64:
    """A running XXH3 64-bit digest, for payloads read piece by piece: ``intdigest()`` at
    the end equals :func:`payload_digest` of the whole."""
    return xxhash.xxh3_64()


def _header(key: bytes, fingerprint: bytes, version: int, size: int, digest: int) -> bytes:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise CorruptBlockError(
            f"a fingerprint has {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"
        )
    fields = _FIELDS.pack(MAGIC, version, len(key), fingerprint, size, digest)
    return fields + _CRC.pack(zlib.crc32(key, zlib.crc32(fields))) + key


def encode_header(key: bytes, fingerprint: bytes, payload: Payload) -> bytes:
    """``header | key``, to be followed by ``payload`` as it is (no copy of the payload)."""
    return _header(key, fingerprint, FORMAT_VERSION, payload_size(payload), payload_digest(payload))


def encode_trailed_header(key: bytes, fingerprint: bytes, payload_bytes: int) -> bytes:
    """``header | key`` of a trailed block: made without reading the payload, which follows,
    then :func:`encode_trailer` of its digest."""
    return _header(key, fingerprint, TRAILED_VERSION, payload_bytes, 0)


def encode_trailer(digest: int) -> bytes:
    """The 8 bytes after a trailed block's payload: its XXH3 64-bit digest."""
    return _TRAILER.pack(digest)


def parse_trailer(data: bytes | bytearray | memoryview) -> int:
    """The digest a trailer carries."""
    (digest,) = _TRAILER.unpack(data)
    return int(digest)


def encode_block(key: bytes, fingerprint: bytes, payload: Payload) -> bytes:
    """The whole value in one buffer, a copy of the payload: for clients that take one
    buffer per value (see :mod:`.block_sets` for the way without the copy)."""
    return b"".join((encode_header(key, fingerprint, payload), *payload_parts(payload)))


def encode_trailed_block(key: bytes, fingerprint: bytes, payload: Payload) -> bytes:
    """A trailed block (the shared tier's values) in one buffer, a copy of the payload."""
    parts = payload_parts(payload)
    return b"".join(
        (
            encode_trailed_header(key, fingerprint, payload_size(parts)),
            *parts,
            encode_trailer(payload_digest(parts)),
        )
    )


class Header:
    """A parsed, CRC-checked header: what the payload after it must be."""

    __slots__ = ("digest", "fingerprint", "key", "payload_bytes")

    def __init__(self, key: bytes, fingerprint: bytes, payload_bytes: int, digest: int):
        self.key = key
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.digest = digest

    @property
    def size(self) -> int:
        """Bytes of header and key: where the payload starts."""
        return HEADER_BYTES + len(self.key)

    def check(self, key: bytes, fingerprint: bytes) -> None:
        if self.key != key:
            raise CorruptBlockError(f"block holds key {self.key!r}, expected {key!r}")
        if self.fingerprint != fingerprint:
            raise CorruptBlockError(f"block of key {key!r} has another layout fingerprint")

    def verify_digest(self, digest: int) -> None:
        """The payload's digest, computed by the caller as it read the payload, must match."""
        if digest != self.digest:
            raise CorruptBlockError(f"block of key {self.key!r} fails its checksum")

    def verify(self, payload: Payload) -> None:
        size = payload_size(payload)
        if size != self.payload_bytes:
            raise CorruptBlockError(
                f"block of key {self.key!r} has {size} payload bytes, "
                f"header says {self.payload_bytes}"
            )
        if payload_digest(payload) != self.digest:
            raise CorruptBlockError(f"block of key {self.key!r} fails its checksum")


def parse_header(data: bytes | bytearray | memoryview, version: int = FORMAT_VERSION) -> Header:
    """The header at the start of ``data`` (which holds at least header and key), of
    format ``version`` (:data:`TRAILED_VERSION` for the shared tier's values)."""
    if len(data) < HEADER_BYTES:
        raise CutShortError(f"a block header needs {HEADER_BYTES} bytes, got {len(data)}")
    magic, found, key_len, fingerprint, size, digest = _FIELDS.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}")
    if found != version:
        raise CorruptBlockError(f"block format version {found}, expected {version}")
    if len(data) < HEADER_BYTES + key_len:
        raise CutShortError("block header cut short inside the key")
    key = bytes(data[HEADER_BYTES : HEADER_BYTES + key_len])
    (crc,) = _CRC.unpack_from(data, _FIELDS.size)
    if zlib.crc32(key, zlib.crc32(bytes(data[: _FIELDS.size]))) != crc:
        raise CorruptBlockError("block header fails its checksum")
    return Header(key, bytes(fingerprint), size, digest)


def decode_block(data: bytes | memoryview, key: bytes, fingerprint: bytes) -> memoryview:
    """The payload of ``data`` (a view), after checking key, fingerprint, length and sums."""
    view = memoryview(data)
    header = parse_header(view)
    header.check(key, fingerprint)
    payload = view[header.size :]
    header.verify(payload)
    return payload


def decode_trailed_block(data: bytes | memoryview, key: bytes, fingerprint: bytes) -> memoryview:
    """:func:`decode_block` for a trailed block."""
    view = memoryview(data)
    header = parse_header(view, TRAILED_VERSION)
    header.check(key, fingerprint)
    if view.nbytes < header.size + TRAILER_BYTES:
        raise CorruptBlockError(f"block of key {key!r} cut short before its digest")
    payload = view[header.size : view.nbytes - TRAILER_BYTES]
    header.digest = parse_trailer(view[view.nbytes - TRAILER_BYTES :])
    header.verify(payload)
    return payload
