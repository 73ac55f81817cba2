"""Pipelined SETs of trailed blocks, each large payload hashed while it goes out.

A block's value on the server is ``header | key | payload | digest`` (a trailed
block, see :mod:`.format`). The client library's pipeline takes one buffer per
value, so it needs them joined: a copy of every payload, which ran at 1.4-1.6
GB/s on the dev VM against 3.2-4.4 GB/s for the SET itself and held the shared
tier's stores to 0.6 of plain SET. Here the RESP of ``SET name value`` is
written out directly: the bulk-string length covers every piece, small
payloads are joined with the command bytes around them, and a large payload
goes out as its own memory, all its parts (an SGLang page's K and V segments,
:data:`~.format.Parts`) gathered into one ``sendmsg`` behind the command
bytes, while another thread hashes it (:class:`DigestsAhead`, one job per
batch); its digest follows. So a value is never joined, and a page costs one
system call whatever its parts. Sending a part in 64 KiB pieces, each hashed
by the sender just before it went out, ran at 0.80-1.00 of plain SET on one
dev VM and at 0.50-0.53 on another, where 64 KiB sends alone, unhashed, cost
0.30 of the link (docs/tiers.md). The shared tier sends the pieces and reads
the replies on its own connections (:mod:`.resp`), under the operation's
deadline.
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
    encode_trailed_header,
    encode_trailer,
    payload_digest,
    payload_parts,
    payload_size,
)
from kvoffload.tiers.resp import Deadline, Piece

__all__ = ["JOIN_BELOW", "BlockWrite", "DigestsAhead", "Payload", "pack_sets"]

JOIN_BELOW = 16 * 1024
"""Payloads shorter than this are joined with the command bytes around them (and
hashed by the sender): a system call per small block would cost more than copying it."""


class BlockWrite(NamedTuple):
    """One ``SET name value``, the value being ``key``'s block (see :mod:`.format`)."""

    name: bytes
    key: OffloadKey
    payload: Payload


def hashed_ahead(size: int) -> bool:
    """Whether a payload of ``size`` bytes goes out as its own memory, its digest from
    :class:`DigestsAhead` (the job and the sender both ask this, so they agree)."""
    return size >= JOIN_BELOW


class DigestsAhead:
    """The digests of a batch's large payloads, made in order by one job on ``executor``
    while the sender sends them (the hash reads a payload 2-3x as fast as the socket takes
    it, so the digest is seldom waited for); small payloads are hashed by the sender
    (:func:`pack_sets`). Waiting counts against ``deadline``; :meth:`stop` ends the job
    early when the send fails."""

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
                digest = payload_digest(parts) if hashed_ahead(payload_size(parts)) else 0
                self._made[index].set_result(digest)
            except BaseException as exc:  # handed to the sender, who fails the operation
                for made in self._made[index:]:
                    made.set_exception(exc)
                return


def pack_sets(
    writes: Sequence[BlockWrite], fingerprint: bytes, ahead: DigestsAhead | None = None
) -> Iterator[Piece]:
    """The RESP of one SET per write, its value a trailed block, as the pieces to send in
    order. A payload of :data:`JOIN_BELOW` bytes or more goes out as its own memory, its
    parts gathered into one piece (one ``sendmsg``) behind the command bytes before it,
    and its digest follows: from ``ahead``, made while it was sent, where given, else
    hashed just before. Smaller payloads are joined with the command bytes around them."""
    joined: list[Buffer] = []
    for index, (name, key, payload) in enumerate(writes):
        parts = payload_parts(payload)
        size = payload_size(parts)
        header = encode_trailed_header(key, fingerprint, size)
        joined.append(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b"
            % (len(name), name, len(header) + size + TRAILER_BYTES, header)
        )
        if not hashed_ahead(size):
            joined.extend(parts)
            joined.append(encode_trailer(payload_digest(parts)) + b"\r\n")
            continue
        digest = 0 if ahead is not None else payload_digest(parts)  # before it goes out
        yield (b"".join(joined), *parts)
        if ahead is not None:
            digest = ahead.digest(index)
        joined = [encode_trailer(digest) + b"\r\n"]
    yield b"".join(joined)
