"""Pipelined SETs of trailed blocks, each payload hashed just before it goes out.

A block's value on the server is ``header | key | payload | digest`` (a trailed
block, see :mod:`.format`). The client library's pipeline takes one buffer per
value, so it needs them joined: a copy of every payload, which ran at 1.4-1.6
GB/s on the dev VM against 3.2-4.4 GB/s for the SET itself and held the shared
tier's stores to 0.6 of plain SET. Here the RESP of ``SET name value`` is
written out directly: the bulk-string length covers every piece, the small
parts of consecutive commands are joined, and each large payload is handed
to ``send`` as it is, hashed just before it goes out; the digest follows the
payload. A payload in parts (:data:`~.format.Parts`, an SGLang page's K and V
segments) goes out part by part, a part longer than :data:`HASH_PIECE` in
pieces of that size, each hashed while the server drains the one before: MHA
pages stored through SGLang's zero-copy interface went from medians of
0.83-0.89 (``page_first``) and 0.76-0.89 (``layer_first``) of plain SET, with
every digest made ahead on another thread for a header, to 0.88-1.00 and
0.82-0.97 (dev VM, alternating runs). A single buffer is hashed whole, then
sent whole: cut into pieces, single 1 MiB pages stored at 0.74-0.80 of plain
SET against 0.75-0.89 with the look-ahead, whole at 0.71-0.81, and 2 MiB
blocks of the plain tier at 0.76-0.87 against 0.76-0.88 (docs/tiers.md,
"Stores: the digest after the payload"). So a
value is never joined, and never read ahead of its send. The shared tier sends
the pieces and reads the replies on its own connections (:mod:`.resp`), under
the operation's deadline.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from kvoffload.core.keys import OffloadKey
from kvoffload.tiers.format import (
    TRAILER_BYTES,
    Buffer,
    Payload,
    encode_trailed_header,
    encode_trailer,
    payload_hasher,
    payload_parts,
)
from kvoffload.tiers.resp import Piece

__all__ = ["HASH_PIECE", "JOIN_BELOW", "BlockWrite", "Payload", "pack_sets"]

JOIN_BELOW = 16 * 1024
"""Payloads shorter than this are joined with the command bytes around them:
one ``sendall`` per small block would cost more than copying it."""

HASH_PIECE = 64 * 1024
"""Bytes of a part hashed, then sent, at a time (a payload in parts): while the client
hashes one piece the server drains the one before (in a raw-socket script, 1 MiB
pages hashed in 64 KiB pieces, each sent after its hash, ran at 0.92-1.03 of plain
SET; hashed 256 KiB or more at a time before a ``sendmsg``, at 0.71-0.74)."""


class BlockWrite(NamedTuple):
    """One ``SET name value``, the value being ``key``'s block (see :mod:`.format`)."""

    name: bytes
    key: OffloadKey
    payload: Payload


def pack_sets(writes: Sequence[BlockWrite], fingerprint: bytes) -> Iterator[Piece]:
    """The RESP of one SET per write, its value a trailed block, as the pieces to send in
    order, each large one hashed as it is taken: just before it goes out. A single
    buffer goes out whole, a payload in parts part by part, in pieces of at most
    :data:`HASH_PIECE`."""
    joined: list[Buffer] = []
    for name, key, payload in writes:
        parts = payload_parts(payload)
        sizes = [part.nbytes if type(part) is memoryview else len(part) for part in parts]
        size = sum(sizes)
        header = encode_trailed_header(key, fingerprint, size)
        joined.append(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b"
            % (len(name), name, len(header) + size + TRAILER_BYTES, header)
        )
        digest = payload_hasher()
        update = digest.update
        for part, part_size in zip(parts, sizes, strict=True):
            if part_size < JOIN_BELOW:
                update(part)
                joined.append(part)
                continue
            if joined:
                yield b"".join(joined)
                joined = []
            if part_size <= HASH_PIECE or len(parts) == 1:
                update(part)
                yield part
                continue
            view = memoryview(part).cast("B")
            for start in range(0, part_size, HASH_PIECE):
                piece = view[start : start + HASH_PIECE]
                update(piece)
                yield piece
        joined.append(encode_trailer(digest.intdigest()) + b"\r\n")
    yield b"".join(joined)
