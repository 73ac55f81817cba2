"""Pipelined SETs of blocks whose header and payload reach the socket as two pieces.

A block's value on the server is ``header | key | payload`` (see
:mod:`.format`). The client library's pipeline takes one buffer per value,
so it needs the two joined: a copy of every payload, which ran at 1.4-1.6 GB/s
on the dev VM against 3.2-4.4 GB/s for the SET itself and held the shared
tier's stores to 0.6 of plain SET. Here the RESP of ``SET name value`` is
written out directly: the bulk-string length covers both pieces, the small
parts of consecutive commands are joined, and each large payload is handed to
``sendall`` as it is. Each header, and so its payload digest, is computed
just before its payload goes out, while the payload is still in the CPU's
cache: 0.87-0.95 of plain SET against 0.82-0.89 with every header of a batch
computed first (dev VM, same runs). A payload in parts (:data:`~.format.Parts`)
goes out the same way: its small parts joined with the bytes around them,
each run of large ones as one tuple, which the connection sends with one
scatter-gather ``sendmsg`` (an SGLang ``layer_first`` page is 2 parts per
layer: a ``sendall`` each cost 0.7 of the single-buffer store rate), so a
value built from several buffers is never joined either. The shared tier has the headers
made on another thread instead (:class:`HeadersAhead`), sends the pieces and
reads the replies on its own connections (:mod:`.resp`), under the
operation's deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import NamedTuple, Protocol

from kvoffload.core.keys import OffloadKey
from kvoffload.tiers.checksum import holds_gil
from kvoffload.tiers.format import (
    Buffer,
    Payload,
    encode_header,
    payload_parts,
)
from kvoffload.tiers.resp import Deadline, Piece

__all__ = ["JOIN_BELOW", "BlockWrite", "HeaderSource", "HeadersAhead", "Payload", "pack_sets"]

JOIN_BELOW = 16 * 1024
"""Payloads shorter than this are joined with the command bytes around them:
one ``sendall`` per small block would cost more than copying it."""


class BlockWrite(NamedTuple):
    """One ``SET name value``, the value being ``key``'s block (see :mod:`.format`)."""

    name: bytes
    key: OffloadKey
    payload: Payload


class HeaderSource(Protocol):
    """Where :func:`pack_sets` takes each write's header from (:class:`HeadersAhead`)."""

    def header(self, index: int) -> bytes:
        """Write ``index``'s header (``header | key``)."""
        ...

    def sending(self, index: int) -> None:
        """Write ``index``'s payload is about to go out."""
        ...


def pack_sets(
    writes: Sequence[BlockWrite],
    fingerprint: bytes,
    headers: HeaderSource | None = None,
) -> Iterator[Piece]:
    """The RESP of one SET per write, as the pieces to send in order, made as they are sent.
    ``headers``: where each header comes from; by default each is made here, just before
    its payload goes out."""
    joined: list[Buffer] = []
    for i, (name, key, payload) in enumerate(writes):
        parts = payload_parts(payload)
        header = encode_header(key, fingerprint, parts) if headers is None else headers.header(i)
        sizes = [part.nbytes if type(part) is memoryview else len(part) for part in parts]
        value_length = len(header) + sum(sizes)
        joined.append(
            b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (len(name), name, value_length, header)
        )
        if len(parts) > 1 and min(sizes) >= JOIN_BELOW:
            # Every part large (an SGLang page's segments): one run, no part looked at twice.
            yield b"".join(joined)
            if headers is not None:
                headers.sending(i)
            yield tuple(parts)
            joined = [b"\r\n"]
            continue
        large: list[Buffer] = []
        told = headers is None
        for part, size in zip(parts, sizes, strict=True):
            if size >= JOIN_BELOW:
                large.append(part)
                continue
            if large:
                yield b"".join(joined)
                if not told and headers is not None:
                    headers.sending(i)
                    told = True
                yield large[0] if len(large) == 1 else tuple(large)
                joined, large = [], []
            joined.append(part)
        if large:
            yield b"".join(joined)
        if not told and headers is not None:  # a payload of small parts only: now
            headers.sending(i)
        if large:
            yield large[0] if len(large) == 1 else tuple(large)
            joined = []
        joined.append(b"\r\n")
    yield b"".join(joined)


class HeadersAhead:
    """The headers of a batch of writes (each the checksum of its payload), made on
    ``executor`` while the payloads before them go out (a :class:`HeaderSource`).

    A store must hash each payload as well as send it, and the raw socket does
    not: on one thread the two add up. Here the sender makes the first header
    itself (nothing to overlap with yet) and one job makes the others in order,
    running ahead of the sender (XXH3 reads a payload 2-3x as fast as the
    socket sends it), so the sender seldom waits: one hand-over per batch,
    where a job per header cost a thread wake-up per block (see docs/tiers.md,
    "Stores: the checksum beside the send"). A payload in several parts, some
    of them small (an SGLang ``layer_first`` page), is hashed with the GIL
    released through :mod:`.checksum`; only where that is not available
    (:func:`~.checksum.holds_gil`) would its hash stall the sender's Python, and
    then each header gets its own job, started only as the payload before it
    goes out (:meth:`sending`), so that the sender is inside its ``sendmsg``
    (GIL released) by the time the job takes the GIL. Waiting
    for a header counts against the operation's ``deadline``; :meth:`stop` ends
    the job early when the send fails.
    """

    def __init__(
        self,
        writes: Sequence[BlockWrite],
        fingerprint: bytes,
        executor: Executor,
        deadline: Deadline,
    ) -> None:
        self._writes = writes
        self._fingerprint = fingerprint
        self._executor = executor
        self._deadline = deadline
        self._stopped = threading.Event()
        self._one_by_one = bool(writes) and holds_gil(payload_parts(writes[0].payload))
        self._made: list[Future[bytes]] = [Future() for _ in writes]
        if len(writes) > 1 and not self._one_by_one:
            executor.submit(self._make_from, 1)

    def header(self, index: int) -> bytes:
        """Write ``index``'s header: made here for the first, else waited for (within the
        deadline: :class:`TimeoutError`)."""
        if index == 0:
            return self._encode(0)
        return self._made[index].result(self._deadline.left())

    def sending(self, index: int) -> None:
        """Payload ``index`` goes out now: time to make the next header, if it is made
        one by one."""
        if self._one_by_one and index + 1 < len(self._writes) and not self._stopped.is_set():
            self._made[index + 1] = self._executor.submit(self._encode, index + 1)

    def stop(self) -> None:
        """Make no more headers (those already made stay)."""
        self._stopped.set()

    def _make_from(self, first: int) -> None:
        for index in range(first, len(self._writes)):
            if self._stopped.is_set():
                return
            try:
                self._made[index].set_result(self._encode(index))
            except BaseException as exc:  # handed to the sender, who fails the operation
                for made in self._made[index:]:
                    made.set_exception(exc)
                return

    def _encode(self, index: int) -> bytes:
        _, key, payload = self._writes[index]
        return encode_header(key, self._fingerprint, payload_parts(payload))
