"""XXH3-64 over a payload of many small parts, with the GIL released while it hashes.

``xxhash`` (4.x) hashes a buffer of up to 64 KiB with the GIL held. An SGLang
``layer_first`` page is one K and one V segment per layer, 64 KiB each for
32-token pages of 8 heads of 128 in bfloat16, so its digest held the GIL for
the whole page and stalled every other thread (when the shared tier made its
headers on a look-ahead thread, before format 3, those stores ran at
0.52-0.62 of plain SET on a quiet VM, against 0.8 for pages of large parts);
the disk tier's headers still need the digest of a whole page. The
``xxhash`` extension exports XXH3's C streaming API; called through
:mod:`ctypes`, each call releases the GIL, so the hash of such a page runs
beside the sender's Python. The digest is the same function over the same
bytes (checked against ``xxhash`` when the library loads); where the symbols
are missing (another build of ``xxhash``) :func:`parts_digest` is ``None``
and callers hash with ``xxhash`` as before.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

Buffer = bytes | bytearray | memoryview

GIL_HELD_UP_TO = 64 * 1024
"""``xxhash`` (4.x) hashes a buffer of up to this many bytes without releasing the GIL."""


class AddressedParts(list[memoryview]):
    """A payload's parts, each with the address of its first byte, for parts whose memory
    outlives them (an SGLang host pool's segments, made from the pointers the pool gives;
    whoever makes one vouches that each address is its part's): they are hashed without
    exporting each part to :mod:`ctypes` first, which costs 1-2 us a part (a
    ``layer_first`` page has 16). SGLang ``layer_first`` page stores went from medians of
    0.65-0.73 of plain SET to 0.69-0.75 (four alternating pairs, dev VM)."""

    __slots__ = ("addresses",)

    def __init__(self, parts: list[memoryview], addresses: list[int]) -> None:
        if len(parts) != len(addresses):
            raise ValueError(f"{len(parts)} parts with {len(addresses)} addresses")
        super().__init__(parts)
        self.addresses = addresses


def _pinned(part: Buffer) -> tuple[int, object]:
    """Where ``part``'s bytes start, and the object that holds its buffer exported (so a
    bytearray cannot be resized under the hash) until the caller drops it."""
    held: object
    if isinstance(part, bytes):  # immutable: the pointer stays valid while part lives
        held = ctypes.c_char_p(part)
        address = ctypes.cast(held, ctypes.c_void_p).value
    elif isinstance(part, bytearray) or not part.readonly:
        held = ctypes.c_char.from_buffer(part)
        address = ctypes.addressof(held)
    else:
        array = np.frombuffer(part, np.uint8)
        held, address = array, array.ctypes.data
    if address is None:  # pragma: no cover - ctypes gives NULL only for empty buffers
        raise ValueError("a buffer without an address")
    return address, held


def _size(part: Buffer) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(part)


def _load() -> Callable[[Sequence[Buffer]], int] | None:
    """The GIL-free digest over parts, from the ``xxhash`` extension's own XXH3; ``None``
    where it cannot be loaded or does not give ``xxhash``'s digest."""
    try:
        lib = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        create, free = lib.XXH3_createState, lib.XXH3_freeState
        reset, final = lib.XXH3_64bits_reset, lib.XXH3_64bits_digest
    except (ImportError, OSError, AttributeError):
        return None
    # The extension's own hashing goes through the CPU dispatcher (AVX2/AVX-512): the plain
    # XXH3_64bits_update there is its SSE2 build, 3x slower on the dev VM.
    update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
    create.restype = ctypes.c_void_p
    create.argtypes = []
    free.argtypes = [ctypes.c_void_p]
    reset.argtypes = [ctypes.c_void_p]
    update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    final.argtypes = [ctypes.c_void_p]
    final.restype = ctypes.c_uint64

    exported, address_of = ctypes.c_char.from_buffer, ctypes.addressof

    def digest(parts: Sequence[Buffer]) -> int:
        state = create()
        if not state:
            raise MemoryError("XXH3_createState failed")
        try:
            reset(state)
            if type(parts) is AddressedParts:
                for segment, address in zip(parts, parts.addresses, strict=True):
                    if segment.nbytes:
                        update(state, address, segment.nbytes)
                return int(final(state))
            for part in parts:
                # A writable view (an SGLang segment) is exported in line: the helpers'
                # calls and checks cost more than the update itself for 64 KiB parts.
                if type(part) is memoryview and not part.readonly:
                    size = part.nbytes
                    if size:
                        view = exported(part)
                        update(state, address_of(view), size)
                        del view
                    continue
                size = _size(part)
                if size:
                    address, held = _pinned(part)
                    update(state, address, size)
                    del held
            return int(final(state))
        finally:
            free(state)

    sample: list[Buffer] = [
        bytes(range(256)) * 300,
        bytearray(b"kv" * 5000),
        memoryview(b"offload" * 999)[3:],
    ]
    expected = xxhash.xxh3_64()
    for part in sample:
        expected.update(part)
    try:
        same = digest(sample) == expected.intdigest()
    except (OSError, ValueError, TypeError):  # pragma: no cover - a foreign build misbehaving
        return None
    return digest if same else None


parts_digest = _load()
"""XXH3-64 of parts in order with the GIL released during the hashing, or ``None``."""


def many_small(parts: Sequence[Buffer]) -> bool:
    """Whether ``parts`` are several, some of them small enough for ``xxhash`` to hash with
    the GIL held (an SGLang ``layer_first`` page)."""
    return len(parts) > 1 and any(_size(part) <= GIL_HELD_UP_TO for part in parts)
