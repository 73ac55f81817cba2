"""Pipelined SETs of trailed blocks, each payload hashed as it goes out.

A block's value on the server is ``header | key | payload | digest`` (a trailed
block, see :mod:`.format`). The client library's pipeline takes one buffer per
value, so it needs them joined: a copy of every payload, which ran at 1.4-1.6
GB/s on the dev VM against 3.2-4.4 GB/s for the SET itself and held the shared
tier's stores to 0.6 of plain SET. Here the RESP of ``SET name value`` is
written out directly: the bulk-string length covers every piece, the small
parts of consecutive commands are joined, and each large payload is handed
to ``send`` as it is and hashed as it goes out; the digest follows the
payload. A payload in parts (:data:`~.format.Parts`, an SGLang page's K and V
segments) goes out part by part, a part longer than :data:`HASH_PIECE` in
pieces of that size, each hashed while the server drains the one before: MHA
pages stored through SGLang's zero-copy interface went from medians of
0.83-0.90 (``page_first``) and 0.75-0.89 (``layer_first``) of plain SET, with
every digest made ahead on another thread for a header, to 0.88-1.00 and
0.79-0.97 (dev VM, alternating runs). A single buffer is sent whole while
another thread hashes it (:class:`DigestsAhead`, one job per batch): hashed by
the sender instead, whole, then sent, 1 MiB blocks stored at 0.61-0.75 of
plain SET against 0.78-0.85 for the look-ahead; beside the send, 0.82-0.84;
cut into pieces, copy-interface pages at 0.74-0.80. So a value is never
joined. The shared tier sends the pieces and reads the replies on its own
connections (:mod:`.resp`), under the operation's deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import NamedTuple

from kvoffload.core.keys import OffloadKey
from kvoffload.tiers.format import (
    TRAILER_BYTES,
    Buffer,
    Payload,
    buffer_size,
    encode_trailed_header,
    encode_trailer,
    payload_digest,
    payload_hasher,
    payload_parts,
)
from kvoffload.tiers.resp import Deadline, Piece

__all__ = ["HASH_PIECE", "JOIN_BELOW", "BlockWrite", "DigestsAhead", "Payload", "pack_sets"]

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


def hashed_ahead(parts: Sequence[Buffer]) -> bool:
    """Whether a payload goes out whole with its digest from :class:`DigestsAhead`: one
    buffer too large to be joined (the job and the sender both ask this, so they agree)."""
    return len(parts) == 1 and buffer_size(parts[0]) >= JOIN_BELOW


class DigestsAhead:
    """The digests of a batch's single-buffer payloads, made in order by one job on
    ``executor`` while the sender sends them: a single buffer is sent whole while
    another thread hashes it (the hash reads it 2-3x as fast as the socket takes it, so
    the digest is seldom waited for). Payloads in parts are hashed by the sender, piece
    by piece (:func:`pack_sets`). Waiting counts against ``deadline``; :meth:`stop` ends
    the job early when the send fails."""

    def __init__(self, writes: Sequence[BlockWrite], executor: Executor, deadline: Deadline):
        self._writes = writes
        self._deadline = deadline
        self._stopped = threading.Event()
        self._made: list[Future[int]] = [Future() for _ in writes]
        if writes:
            executor.submit(self._make_all)

    def digest(self, index: int) -> int:
        """Write ``index``'s digest, waited for within the deadline (:class:`TimeoutError`)."""
        return self._made[index].result(self._deadline.left())

    def stop(self) -> None:
        """Make no more digests (those made stay)."""
        self._stopped.set()

    def _make_all(self) -> None:
        for index, (_, _, payload) in enumerate(self._writes):
            if self._stopped.is_set():
                return
            parts = payload_parts(payload)
            try:  # 0 for a payload the sender hashes itself
                self._made[index].set_result(payload_digest(parts) if hashed_ahead(parts) else 0)
            except BaseException as exc:  # handed to the sender, who fails the operation
                for made in self._made[index:]:
                    made.set_exception(exc)
                return


def pack_sets(
    writes: Sequence[BlockWrite], fingerprint: bytes, ahead: DigestsAhead | None = None
) -> Iterator[Piece]:
    """The RESP of one SET per write, its value a trailed block, as the pieces to send in
    order, each large one hashed as it is taken: just before it goes out. A single
    buffer goes out whole (its digest from ``ahead``, made beside the send, where given),
    a payload in parts part by part, in pieces of at most :data:`HASH_PIECE`."""
    joined: list[Buffer] = []
    for index, (name, key, payload) in enumerate(writes):
        parts = payload_parts(payload)
        sizes = [part.nbytes if type(part) is memoryview else len(part) for part in parts]
        size = sum(sizes)
        header = encode_trailed_header(key, fingerprint, size)
        joined.append(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b"
            % (len(name), name, len(header) + size + TRAILER_BYTES, header)
        )
        if ahead is not None and hashed_ahead(parts):
            yield b"".join(joined)
            yield parts[0]
            joined = [encode_trailer(ahead.digest(index)) + b"\r\n"]
            continue
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
