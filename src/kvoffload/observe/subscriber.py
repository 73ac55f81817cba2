"""Receive KV event batches from a vLLM-compatible publisher, repairing gaps by replay.

A subscriber that joins late, or loses a batch (PUB sockets drop under
load), sees a sequence number beyond the next one it expects; it then asks
the replay socket for everything from the next expected number, so batches
reach the caller exactly once and in order.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict

import zmq

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError, is_number
from kvoffload.observe.events import AllBlocksCleared, DecodeError, KVEventBatch, decode_batch
from kvoffload.observe.publisher import END_SEQ, is_ipv6, topic_bytes

logger = logging.getLogger(__name__)

Delivered = list[tuple[int, KVEventBatch]]

RESTART_SEQ = -1
"""The number of the ``AllBlocksCleared`` batch a subscriber delivers for a restart."""

MAX_POLL_MS = 2**31 - 1
"""The longest wait ZMQ's poll takes in one call (a C int of milliseconds, ~24.8 days)."""


class SubscriberClosedError(KVOffloadError, RuntimeError):
    """:meth:`KVEventSubscriber.receive` after ``close``: the caller's mistake, said in one
    line (ZMQ's own error said only "Operation not supported")."""


class KVEventSubscriber:
    """Connects to ``endpoint`` (PUB) and, for repairs, ``replay_endpoint`` (ROUTER).

    ``bind=True`` binds ``endpoint`` instead, for publishers that connect
    (vLLM's publisher connects to any endpoint without a ``*``). An endpoint (or
    ``replay_endpoint``) that cannot be bound or connected to is an
    :class:`InvalidArgumentError` naming it.

    ``gaps`` counts the gaps seen; ``repaired`` the batches recovered by
    replay. Without a replay endpoint a gap is skipped over (and counted).
    ``lost`` counts the batches skipped over, neither received nor replayed (the
    replay buffer no longer held them), or received but not decodable (an event
    type we do not know; logged): an index built from the batches may then hold
    blocks that are gone and lack some that are there.

    A publisher numbers its batches up from 0, and one socket delivers them in
    order: a live batch numbered at or below the last one seen there comes from
    a new publisher on the same endpoints (a restarted engine). That is counted
    in ``restarts`` and delivered first as a batch of one ``AllBlocksCleared``,
    numbered -1 (the old instance's blocks are gone), and the new numbering is
    followed from 0, repaired by replay like any gap. A live batch numbered as one
    replay delivered but not yet seen live is that batch again unless its payload
    differs: then it too is a new publisher's (one that restarted after a catch-up).

    A message that is no batch (another number of frames, a number that is not 8
    bytes from 0 up), live or from replay, is logged and ignored: a batch it stood
    for shows as a gap. Replay, like the live socket, delivers only batches whose topic
    starts with ``topic``.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 5.0,
        bind: bool = False,
    ) -> None:
        # ZMQ waits without end for a negative time; a str compared raised TypeError.
        if not (is_number(replay_timeout_s) and 0 <= replay_timeout_s < math.inf):
            raise InvalidArgumentError(
                f"replay_timeout_s must be a finite number of seconds >= 0, "
                f"got {replay_timeout_s!r}"
            )
        self._topic = topic_bytes(topic)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        if replay_endpoint is not None:
            self._check_replay_endpoint(replay_endpoint)
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if is_ipv6(endpoint):
            self._sub.setsockopt(zmq.IPV6, 1)
        try:
            if bind:
                self._sub.bind(endpoint)
            else:
                self._sub.connect(endpoint)
        except zmq.ZMQError as exc:  # a port in use, an endpoint ZMQ cannot parse
            self._sub.close(linger=0)
            verb = "bind" if bind else "connect"
            raise InvalidArgumentError(
                f"cannot {verb} the KV event subscriber to {endpoint!r}: {exc}"
            ) from None
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.next_seq = 0
        self.gaps = 0
        self.repaired = 0
        self.restarts = 0
        self.lost = 0
        self._last_live: int | None = None
        """The last batch number the live socket delivered (replay numbers are not live)."""
        self._replayed: OrderedDict[int, int] = OrderedDict()
        """Hashes of the payloads a catch-up delivered past ``_last_live``, by number,
        ascending: what a live batch below ``next_seq`` must match to be a duplicate."""

    def receive(self, timeout_s: float = 1.0) -> Delivered:
        """Batches that arrived within ``timeout_s`` (waiting only for the first), in order;
        a negative ``timeout_s`` waits for none (ZMQ would wait without end), ``math.inf``
        for the first without end. After :meth:`close`, :class:`SubscriberClosedError`."""
        if math.isnan(timeout_s):
            raise InvalidArgumentError("receive's timeout_s must be a number of seconds, got nan")
        if self._sub.closed:
            raise SubscriberClosedError(
                f"receive on the KV event subscriber of {self.endpoint!r}: it is closed"
            )
        delivered: Delivered = []
        timeout_ms = -1 if timeout_s == math.inf else max(0, int(timeout_s * 1000))
        while _ready(self._sub, timeout_ms):
            timeout_ms = 0
            frames = self._sub.recv_multipart()
            seq = _seq_of(frames, 3)
            if seq is None:
                logger.warning("ignoring a malformed KV event message of %d frames", len(frames))
                continue
            self.accept(seq, frames[2], delivered)
        return delivered

    def accept(self, seq: int, payload: bytes, delivered: Delivered) -> None:
        """Take one published batch: note a restart, drop a duplicate (a batch replay has
        delivered already), repair a gap before it, then add it."""
        restarted = self._is_restart(seq, payload)
        self._last_live = seq
        self._forget_replayed(up_to=seq)
        if restarted:
            self.restarts += 1
            self.next_seq = 0
            self._replayed.clear()
            delivered.append((RESTART_SEQ, KVEventBatch(time.time(), [AllBlocksCleared()])))
        elif seq < self.next_seq:
            return
        if seq > self.next_seq:
            self.gaps += 1
            self._repair(seq, delivered)
        self._deliver(seq, payload, delivered)
        self.next_seq = seq + 1

    def catch_up(self) -> Delivered:
        """Everything the replay socket still holds from ``next_seq`` on."""
        delivered: Delivered = []
        self._repair(None, delivered)
        return delivered

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_replay_endpoint(self, endpoint: str) -> None:
        """A trial connect, closed at once: an endpoint ZMQ cannot parse raised out of the
        first repair, in :meth:`receive`, and the batch that showed the gap was lost."""
        trial = self._context.socket(zmq.DEALER)
        try:
            if is_ipv6(endpoint):
                trial.setsockopt(zmq.IPV6, 1)
            trial.connect(endpoint)
        except zmq.ZMQError as exc:
            raise InvalidArgumentError(
                f"cannot connect the KV event subscriber's replay to {endpoint!r}: {exc}"
            ) from None
        finally:
            trial.close(linger=0)

    def _is_restart(self, seq: int, payload: bytes) -> bool:
        """Numbered at or below the last live batch, or as a batch a catch-up replayed but
        with another payload: a new publisher's (the old one's would be the same bytes)."""
        if self._last_live is not None and seq <= self._last_live:
            return True
        replayed = self._replayed.get(seq)
        return replayed is not None and replayed != hash(payload)

    def _forget_replayed(self, up_to: int) -> None:
        """Live numbers only go up: no later live batch can repeat one up to ``up_to``."""
        replayed = self._replayed
        while replayed and next(iter(replayed)) <= up_to:
            replayed.popitem(last=False)

    def _repair(self, before: int | None, delivered: Delivered) -> None:
        if self._replay_endpoint is None:
            if before is not None:
                self._skip_to(before)
            return
        dealer = self._context.socket(zmq.DEALER)
        if is_ipv6(self._replay_endpoint):
            dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while _ready(dealer, self._replay_timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:
                    break
                seq = _seq_of(frames, 4)
                if seq is None:
                    logger.warning("ignoring a malformed replay message of %d frames", len(frames))
                    continue
                if seq < self.next_seq or (before is not None and seq >= before):
                    continue
                if not frames[1].startswith(self._topic):  # as the SUB socket filters live
                    continue
                payload = frames[3]
                self._skip_to(seq)  # older batches have left the replay buffer
                if self._deliver(seq, payload, delivered):
                    self.repaired += 1
                if before is None:  # a catch-up: the live socket may bring these again
                    self._replayed[seq] = hash(payload)
                self.next_seq = seq + 1
        finally:
            dealer.close(linger=0)
        if before is not None:
            self._skip_to(before)

    def _deliver(self, seq: int, payload: bytes, delivered: Delivered) -> bool:
        """Add the batch; one that does not decode (an event type we do not know) is logged
        and counted as lost, not raised past the batches already taken in this call."""
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            logger.warning("KV event batch %d does not decode, counted as lost: %s", seq, exc)
            self.lost += 1
            return False
        delivered.append((seq, batch))
        return True

    def _skip_to(self, seq: int) -> None:
        """Move ``next_seq`` up to ``seq``, counting the batches passed over as lost."""
        if seq > self.next_seq:
            self.lost += seq - self.next_seq
            self.next_seq = seq


def _ready(sock: zmq.Socket[bytes], timeout_ms: int) -> bool:
    """Whether a message arrived on ``sock`` within ``timeout_ms`` (-1: without end), waited
    for in calls ZMQ takes: a longer wait raised OverflowError."""
    while timeout_ms > MAX_POLL_MS:
        if sock.poll(MAX_POLL_MS):
            return True
        timeout_ms -= MAX_POLL_MS
    return sock.poll(timeout_ms) != 0


def _seq_of(frames: list[bytes], count: int) -> int | None:
    """The batch number of a ``[..., seq, payload]`` message of ``count`` frames, or ``None``
    for one that is not: a publisher numbers up from 0 in 8 bytes, so a number with the
    sign bit set (a stray end-of-replay ``-1``) or of another width is no batch's, and taken
    as one it would count ~2**64 batches lost and overflow the next replay request."""
    if len(frames) != count or len(frames[-2]) != 8:
        return None
    seq = int.from_bytes(frames[-2], "big", signed=True)
    return seq if seq >= 0 else None
