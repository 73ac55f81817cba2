"""Publish KV event batches on a ZMQ PUB socket, with a replay socket for missed batches.

The wire protocol is vLLM's ``ZmqEventPublisher``'s, so its subscribers and
routers work unchanged: each batch is a multipart ``[topic, seq, payload]``
(``seq`` 8 bytes big-endian, from 0); a replay client sends
``[b"", start_seq]`` to the ROUTER socket and gets every buffered batch from
``start_seq`` as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.
Both sockets live on one background thread (ZMQ sockets are not
thread-safe), so ``publish`` never blocks the manager's caller.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvoffload.core.errors import InvalidArgumentError, brief, check_integer
from kvoffload.core.manager import OffloadingEvent
from kvoffload.observe.events import KVEventBatch, encode_batch, make_batch, to_kv_events

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame that ends a replay."""

EventsOf = Callable[[Sequence[OffloadingEvent]], list[Any]]
"""Turns the manager's events into another engine's event structs (``to_events``)."""


def topic_bytes(topic: object) -> bytes:
    """``topic`` as the bytes a ZMQ frame carries; :class:`InvalidArgumentError` for one that
    is no str (``b"kvoffload"``, ``None``) or no UTF-8, which raised ``AttributeError`` or
    ``UnicodeEncodeError`` from inside."""
    if not isinstance(topic, str):
        raise InvalidArgumentError(f"topic must be a str, got {brief(topic)}")
    try:
        return topic.encode()
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"topic must be UTF-8, got {brief(topic)}") from None


def is_ipv6(endpoint: str) -> bool:
    """A ``tcp://[ADDRESS]:PORT`` endpoint: ZMQ sockets refuse IPv6 unless told (``zmq.IPV6``)."""
    return endpoint.startswith("tcp://[")


class KVEventPublisher:
    """Binds ``endpoint`` (PUB) and, if given, ``replay_endpoint`` (ROUTER) at once.

    A port that cannot be bound is an :class:`InvalidArgumentError` naming
    the endpoint. Blocks are named by their keys' hash bytes, or with
    ``int_block_hashes`` as vLLM names them by default, 64-bit integers (routers that
    decode only integers, Dynamo's, refuse a batch that holds bytes). The last
    ``buffer_batches`` batches stay available for replay until :meth:`close`. Usable as
    an event sink of :class:`~kvoffload.observe.ObservedManager` (``publisher.publish``).
    ``to_events`` turns the manager's events into another engine's structs, for routers
    that decode that engine's (SGLang's: the same batch array and frames, other events);
    without it they are vLLM's.
    A batch given after :meth:`close` is dropped, never queued (no thread is left to
    send it), and counted in :attr:`dropped_after_close`; the first is logged.

    A ZMQ error (the process's shared context terminated by other code) does not stop
    the thread: a batch the PUB socket fails to send is counted in :attr:`send_failures`
    and kept for replay under its number, so a subscriber repairs the gap; a replay
    socket that fails is closed and its requests go unanswered. The first failure of
    each socket is logged with its traceback.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kvoffload",
        block_size: int = 16,
        buffer_batches: int = 10_000,
        data_parallel_rank: int = 0,
        int_block_hashes: bool = False,
        to_events: EventsOf | None = None,
    ) -> None:
        # Checked before binding: refused, the publisher binds no port.
        check_integer("buffer_batches", buffer_batches, 0)
        # Sent in every batch: a str one was taken, and no subscriber decoded a batch.
        check_integer("block_size", block_size, 1)
        check_integer("data_parallel_rank", data_parallel_rank, 0)
        self.topic = topic_bytes(topic)
        if not isinstance(int_block_hashes, bool):  # "no" is not "off" by accident
            raise InvalidArgumentError(
                f"int_block_hashes must be true or false, got {int_block_hashes!r}"
            )
        self.int_block_hashes = int_block_hashes
        self._to_events: EventsOf = to_events or self._vllm_events
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.published = 0
        self.send_failures = 0
        """Batches numbered and kept for replay that the PUB socket failed to send."""
        self.dropped_after_close = 0
        """Batches given to :meth:`publish` or :meth:`publish_batch` after :meth:`close`."""
        self._closed = False
        self._closing = threading.Lock()
        """Orders each queued batch before :meth:`close`'s stop, or drops it after."""
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint)
        self._replay_hwm = 2 * (buffer_batches + 1)
        """Messages queued per replay peer: a whole replay and its end marker fit twice over
        (ZMQ learns of a peer's reads only every half HWM, as vLLM's publisher allows for);
        past it a peer that asks without reading gets nothing more, where without bound
        each unread replay stayed queued in the engine's memory."""
        self._replay = None if replay_endpoint is None else self._bind(zmq.ROUTER, replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._batches_a_turn = max(1, buffer_batches // 4)
        """Queued batches sent between two replay answers at most. One a turn fell behind
        while peers kept asking for replays, the queue growing without bound; every one
        queued kept a replay request waiting while a backlog rolled the buffer past the
        batches it asked for. A quarter of the buffer keeps both going."""
        # A batch to send, an Event to set once everything before it is sent, or None: stop.
        self._queue: queue.Queue[KVEventBatch | threading.Event | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[OffloadingEvent]) -> None:
        """Queue the manager's events as one batch (nothing is sent for no events)."""
        kv_events = self._to_events(events)
        if kv_events:
            self._put(make_batch(kv_events, self.data_parallel_rank))

    def _vllm_events(self, events: Sequence[OffloadingEvent]) -> list[Any]:
        return to_kv_events(events, self.block_size, self.int_block_hashes)

    def publish_batch(self, batch: KVEventBatch) -> None:
        """Queue ``batch``; one that does not encode is logged and dropped, unnumbered.

        A batch without a ``data_parallel_rank`` goes out with the publisher's, as vLLM's
        publisher sends it: routers tell the ranks' batches apart by it. The caller's
        batch is left as it was."""
        if batch.data_parallel_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, self.data_parallel_rank)
        self._put(batch)

    def _put(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` unless closed: then drop it, counted (queued, it stayed in memory
        with no thread left to send it)."""
        with self._closing:
            if not self._closed:
                self._queue.put(batch)
                return
            self.dropped_after_close += 1
            first = self.dropped_after_close == 1
        if first:
            logger.warning(
                "KV event batch given after the publisher on %s closed: dropped; such "
                "batches are counted in dropped_after_close",
                self.endpoint,
            )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the thread has handled every queued batch; ``False``, and a warning,
        when it had not within ``timeout_s`` or never will (given after :meth:`close`).
        A batch the PUB socket failed to send counts as handled: it is in
        :attr:`send_failures` and kept for replay, so compare that count to tell.
        ``math.inf`` waits as long as it takes."""
        if math.isnan(timeout_s):
            raise InvalidArgumentError("flush's timeout_s must be a number of seconds, got nan")
        done = threading.Event()
        with self._closing:  # after close's stop, no thread would ever set it
            queued = not self._closed and self._thread.is_alive()
            if queued:
                self._queue.put(done)
        if queued:
            # Past TIMEOUT_MAX (math.inf too) threading raised OverflowError: wait without end.
            wait_s = None if timeout_s > threading.TIMEOUT_MAX else timeout_s
            sent, why = done.wait(wait_s), f"within {timeout_s:g} s"
        else:
            sent = self._queue.empty() and not self.dropped_after_close
            why = "(the publisher is closed)"
        if not sent:
            logger.warning("KV event batches queued for %s were not sent %s", self.endpoint, why)
        return sent

    def close(self) -> None:
        """Send what is queued, then stop the thread and close both sockets."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        self._pub.close(linger=1000)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(kind)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.SNDHWM, self._replay_hwm)
        if is_ipv6(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if kind == zmq.ROUTER:
                self._pub.close(linger=0)
            raise InvalidArgumentError(f"cannot bind KV events to {endpoint!r}: {exc}") from None
        return sock

    def _run(self) -> None:
        while True:
            # One replay request a turn, as vLLM's publisher: a peer asking without pause
            # held up every batch after it for as long as it kept asking.
            served = self._replay is not None and self._answer_replay()
            try:
                item = self._queue.get(block=not served, timeout=0.02)
            except queue.Empty:
                continue
            # Then the batches queued by now, up to a turn's worth (``_batches_a_turn``).
            for _ in range(min(self._queue.qsize(), self._batches_a_turn - 1)):
                if not self._handle(item):
                    return
                item = self._queue.get_nowait()  # this thread alone takes from the queue
            if not self._handle(item):
                return

    def _handle(self, item: KVEventBatch | threading.Event | None) -> bool:
        """Send a batch or set a flush's event; ``False`` for the stop."""
        if item is None:
            return False
        if isinstance(item, threading.Event):
            item.set()
            return True
        # A value msgpack cannot hold: another type, too wide an int, or a str that is
        # no UTF-8 (UnicodeEncodeError, a ValueError).
        try:
            payload = encode_batch(item)
        except (TypeError, OverflowError, ValueError) as exc:
            logger.warning("dropping a KV event batch that does not encode: %s", exc)
            return True
        seq = self.published
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self.send_failures += 1
            if self.send_failures == 1:
                logger.exception(
                    "KV event batch %d not sent on %s; batches that fail are counted in "
                    "send_failures and kept for replay",
                    seq,
                    self.endpoint,
                )
        self._buffer.append((seq, payload))
        self.published += 1
        return True

    def _answer_replay(self) -> bool:
        """Serve one waiting replay request, if any; whether one was waiting."""
        assert self._replay is not None
        try:
            if not self._replay.poll(0):
                return False
            self._serve_replay()
        except zmq.ZMQError:
            logger.exception(
                "KV event replay on %s failed; its requests are no longer answered",
                self.replay_endpoint,
            )
            self._replay.close(linger=0)
            self._replay = None
            return False
        return True

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
