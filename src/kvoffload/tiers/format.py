"""The on-disk and on-server form of one block: a checksummed header, then raw bytes.

Every value a tier writes is ``header | key | payload``. The header names the
format, the key, the layout fingerprint and the payload length, and one CRC32
covers the header fields, the key and the payload, so a torn, flipped or
misplaced value is recognised before a byte of it is loaded. Nothing is ever
pickled.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from kvoffload.core.errors import KVOffloadError
from kvoffload.core.layout import KVLayout

MAGIC = b"KVOB"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16

_FIXED = struct.Struct("<4sHH16sQI")
"""magic, format version, key length, layout fingerprint, payload length, CRC32."""
HEADER_BYTES = _FIXED.size


class CorruptBlockError(KVOffloadError, ValueError):
    """A stored value is not a valid block for the key and fingerprint asked for."""


def layout_fingerprint(model: str, layout: KVLayout, payload_bytes: int) -> bytes:
    """16 bytes naming what a block's bytes mean: model, KV layout, block size, payload size.

    Blocks of two different models, layouts or block sizes get different
    fingerprints, so a shared tier never hands one model another's bytes.
    ``payload_bytes`` is 0 for bookkeeping-only runs, which then never mix
    with runs that store real bytes.
    """
    text = (
        f"{model}|{layout.num_layers}|{layout.kv_heads}|{layout.head_dim}|{layout.dtype}|"
        f"{layout.tokens_per_block}|{payload_bytes}"
    )
    return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()


def _checksum(fields: bytes, key: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(key, zlib.crc32(fields)))


def encode_header(key: bytes, fingerprint: bytes, payload: bytes | memoryview) -> bytes:
    """``header | key``, to be followed by ``payload`` as it is (no copy of the payload)."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise CorruptBlockError(
            f"a fingerprint has {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"
        )
    size = len(payload)
    fields = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), fingerprint, size, 0)[:-4]
    return fields + struct.pack("<I", _checksum(fields, key, payload)) + key


def encode_block(key: bytes, fingerprint: bytes, payload: bytes | memoryview) -> bytes:
    """The whole value in one buffer (for servers, which take one value per key)."""
    return encode_header(key, fingerprint, payload) + payload


def parse_header(data: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """``(key, fingerprint, payload length)`` from the start of ``data``, or CorruptBlockError."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlockError(f"a block header needs {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, key_len, fingerprint, size, _ = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unknown block format version {version}")
    if len(data) < HEADER_BYTES + key_len:
        raise CorruptBlockError("block header cut short inside the key")
    return bytes(data[HEADER_BYTES : HEADER_BYTES + key_len]), bytes(fingerprint), size


def decode_block(data: bytes | memoryview, key: bytes, fingerprint: bytes) -> memoryview:
    """The payload of ``data`` (a view), after checking key, fingerprint, length and checksum."""
    view = memoryview(data)
    stored_key, stored_fingerprint, size = parse_header(view)
    if stored_key != key:
        raise CorruptBlockError(f"block holds key {stored_key!r}, expected {key!r}")
    if stored_fingerprint != fingerprint:
        raise CorruptBlockError(f"block of key {key!r} has another layout fingerprint")
    start = HEADER_BYTES + len(key)
    if len(view) != start + size:
        raise CorruptBlockError(
            f"block of key {key!r} has {len(view) - start} payload bytes, header says {size}"
        )
    (checksum,) = struct.unpack_from("<I", view, HEADER_BYTES - 4)
    payload = view[start:]
    if _checksum(bytes(view[: HEADER_BYTES - 4]), key, payload) != checksum:
        raise CorruptBlockError(f"block of key {key!r} fails its checksum")
    return payload
