"""The shared tier's RESP reader over a real socket pair: replies cut into any pieces
read back whole, values land in their destinations, and the deadline holds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers.resp import (
    CHUNK,
    DIRECT_BELOW,
    MAX_DEPTH,
    MAX_LINE,
    PEEK,
    WAIT_SLICE,
    Connection,
    Deadline,
    DeadlineExceeded,
    ErrorReply,
    Piece,
    ProtocolError,
    Reply,
)


def encode(reply: Reply) -> bytes:
    if isinstance(reply, ErrorReply):
        return b"-%s\r\n" % reply.message.encode()
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, bytes):
        return b"$%d\r\n%b\r\n" % (len(reply), reply)
    return b"*%d\r\n" % len(reply) + b"".join(encode(item) for item in reply)


replies: st.SearchStrategy[Reply] = st.recursive(
    st.none()
    | st.integers(-(2**62), 2**62)
    | st.binary(max_size=300)
    | st.builds(ErrorReply, st.from_regex(r"[A-Z]{2,6} [a-z0-9 ]{0,20}", fullmatch=True)),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


class Collect:
    """A digest that keeps the pieces it is fed."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def update(self, data: memoryview, /) -> None:
        self.pieces.append(bytes(data))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Connection]]:
    left, right = socket.socketpair()
    connection = Connection(right)
    try:
        yield left, connection
    finally:
        left.close()
        connection.close()


def send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> threading.Thread:
    """Send ``data`` from a thread, cut at ``cuts``, as a slow link delivers it."""

    def run() -> None:
        start = 0
        for cut in [*sorted(set(cuts)), len(data)]:
            if start < cut <= len(data):
                sock.sendall(data[start:cut])
                start = cut

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@settings(max_examples=60, deadline=None)
@given(st.lists(replies, min_size=1, max_size=6), st.lists(st.integers(0, 4000), max_size=30))
def test_replies_cut_anywhere_are_read_whole(batch: list[Reply], cuts: list[int]) -> None:
    left, right = socket.socketpair()
    connection = Connection(right)
    try:
        sender = send_in_pieces(left, b"".join(encode(reply) for reply in batch), cuts)
        assert [connection.read_reply(Deadline(10)) for _ in batch] == batch
        sender.join(10)
    finally:
        left.close()
        connection.close()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 17, DIRECT_BELOW - 1, DIRECT_BELOW, 3 * DIRECT_BELOW + 5]))
    .filter(bool)
    .map(lambda sizes: sizes[:4]),
    st.lists(st.integers(0, 4 * DIRECT_BELOW), max_size=20),
    st.booleans(),
)
def test_values_land_in_their_destinations_with_their_digest(
    sizes: list[int], cuts: list[int], peek: bool
) -> None:
    """``peek``: the buffer takes only a few hundred bytes before a large value, as
    block loads ask, so that the value's bytes are received into it directly."""
    values = [bytes((i * 7 + j) % 251 for j in range(size)) for i, size in enumerate(sizes)]
    left, right = socket.socketpair()
    connection = Connection(right)
    try:
        sender = send_in_pieces(left, b"".join(encode(value) for value in values) + b":7\r\n", cuts)
        for value in values:
            most = PEEK if peek else CHUNK
            length = connection.read_bulk_length(Deadline(10), peek)
            assert length == len(value)
            destination = bytearray(len(value))
            collect = Collect()
            connection.read_into(memoryview(destination), Deadline(10), collect, most)
            connection.end_of_value(Deadline(10), peek)
            assert destination == value and b"".join(collect.pieces) == value
        assert connection.read_reply(Deadline(10)) == 7  # nothing was read past its value
        sender.join(10)
    finally:
        left.close()
        connection.close()


def test_a_reply_that_never_ends_meets_the_deadline(pair: tuple[socket.socket, Connection]) -> None:
    left, connection = pair
    left.sendall(b"$10\r\nonly")
    with pytest.raises(TimeoutError):
        connection.read_reply(Deadline(0.2))
    with pytest.raises(DeadlineExceeded):
        Deadline(-1).left()


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("reader", ["never reads", "trickles"])
def test_a_send_the_peer_does_not_take_meets_the_deadline_within_a_slice(
    pair: tuple[socket.socket, Connection], reader: str, gathered: bool
) -> None:
    """The socket is blocking with kernel timeouts of a slice: a peer that reads nothing,
    or a byte now and then, cannot hold a send past its deadline by more than a slice."""
    left, connection = pair
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.01):
            try:
                left.recv(1)
            except OSError:
                return

    thread = threading.Thread(target=trickle, daemon=True)
    if reader == "trickles":
        thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            payload = b"x" * (8 * 2**20)
            piece: Piece = (payload, payload) if gathered else payload + payload
            connection.send([piece], Deadline(0.3))
        assert time.monotonic() - started < 0.3 + WAIT_SLICE + 0.5
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5)


def test_a_receive_from_a_trickling_peer_meets_the_deadline(
    pair: tuple[socket.socket, Connection],
) -> None:
    """Each byte that comes in resets the kernel's timeout: the deadline is checked between
    receives all the same."""
    left, connection = pair
    stop = threading.Event()

    def trickle() -> None:
        left.sendall(b"$100000\r\n")
        while not stop.wait(0.01):
            left.sendall(b"y")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            connection.read_into(memoryview(bytearray(100_000)), Deadline(0.3))
        assert time.monotonic() - started < 0.3 + WAIT_SLICE + 0.5
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"$99999999999\r\n", "more than this call accepts"),
        (b"*99999999999\r\n", "more than this call accepts"),
        (b"?what\r\n", "unknown reply type"),
        (b":12x\r\n", "bad number"),
        (b"$3\r\nabcXY", "not followed by CRLF"),
        (b"+" + b"P" * 70_000, "longer than 65536 bytes"),
        (b"*1\r\n" * 5000 + b"+PONG\r\n", "nested more than 8 deep"),
        (b"*1\r\n" * (MAX_DEPTH + 1) + b":1\r\n", "nested more than 8 deep"),
    ],
)
def test_replies_we_do_not_accept_are_protocol_errors(
    pair: tuple[socket.socket, Connection], data: bytes, message: str
) -> None:
    left, connection = pair
    threading.Thread(target=left.sendall, args=(data,), daemon=True).start()
    with pytest.raises(ProtocolError, match=message):
        connection.read_reply(Deadline(5))


def test_an_array_of_long_lines_is_refused_past_the_call_s_limit(
    pair: tuple[socket.socket, Connection],
) -> None:
    """Simple strings count against the limit as bulk strings do: 64 KiB-long lines in an
    array of 64 Ki of them held 4 GiB for a reply limited to 64 KiB."""
    left, connection = pair
    line = b"+" + b"x" * 60_000 + b"\r\n"
    data = b"*100\r\n" + line * 100

    def send() -> None:
        with contextlib.suppress(OSError):  # the reader stops early and the test closes
            left.sendall(data)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    with pytest.raises(ProtocolError, match="longer than this call accepts"):
        connection.read_reply(Deadline(5), MAX_LINE)
    left.shutdown(socket.SHUT_RDWR)
    sender.join(5)


def _size(reply: Reply) -> int:
    """Bytes ``reply`` holds, counting one for each item that is not a string."""
    if isinstance(reply, list):
        return 1 + sum(_size(item) for item in reply)
    if isinstance(reply, bytes):
        return len(reply)
    if isinstance(reply, ErrorReply):
        return len(reply.message)
    return 1


_LENGTHS = [b"-1", b"-2", b"-99999999999", b"0", b"1", b"3", b"99999999999", b"9" * 5000, b"x", b""]
_ENDINGS = [b"\r\n", b"\r", b"\n", b"", b"\r\r\n"]
hostile_tokens = st.one_of(
    st.builds(
        lambda kind, length, ending: kind + length + ending,
        st.sampled_from([bytes([c]) for c in b"+-:$*%~>|(,=_#!"]),
        st.sampled_from(_LENGTHS),
        st.sampled_from(_ENDINGS),
    ),
    st.builds(lambda size: b"+" + b"y" * size + b"\r\n", st.sampled_from([10, 100, 1000])),
    st.binary(max_size=20),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(hostile_tokens, max_size=30),
    st.lists(st.integers(0, 3000), max_size=8),
    st.booleans(),
    st.sampled_from([64, MAX_LINE]),
)
def test_hostile_replies_end_in_a_reply_or_a_connection_error_by_the_deadline(
    tokens: list[bytes], cuts: list[int], closes: bool, limit: int
) -> None:
    """A server on 127.0.0.1 sends any bytes (RESP3 types, wrong lengths, lines without
    CRLF), cut and trickled, then closes or falls silent: the read ends by its deadline,
    within its limit, with a reply or an error the tier counts (all ``OSError``)."""
    data = b"".join(tokens)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    connection = Connection(client)

    def serve() -> None:
        start = 0
        for cut in [*sorted(set(cuts)), len(data)]:
            if start < cut <= len(data):
                with contextlib.suppress(OSError):
                    server.sendall(data[start:cut])
                time.sleep(0.002)
                start = cut
        if closes:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=serve, daemon=True)
    sender.start()
    started = time.monotonic()
    try:
        try:
            reply = connection.read_reply(Deadline(0.3), limit)
        except OSError:  # ProtocolError, ConnectionError, DeadlineExceeded
            pass
        else:
            assert _size(reply) <= limit
        assert time.monotonic() - started < 0.3 + WAIT_SLICE + 0.5
    finally:
        sender.join(5)
        server.close()
        connection.close()


def test_arrays_nested_as_deep_as_allowed_are_read(
    pair: tuple[socket.socket, Connection],
) -> None:
    left, connection = pair
    left.sendall(b"*1\r\n" * MAX_DEPTH + b":1\r\n")
    reply: Reply = connection.read_reply(Deadline(5))
    for _ in range(MAX_DEPTH):
        assert isinstance(reply, list)
        [reply] = reply
    assert reply == 1


def test_a_closed_server_is_a_connection_error(pair: tuple[socket.socket, Connection]) -> None:
    left, connection = pair
    left.sendall(b"+OK\r\n")
    left.close()
    assert connection.read_reply(Deadline(5)) == b"OK"
    assert connection.readable_now()  # end-of-file waits: the pool would drop it
    with pytest.raises(ConnectionError, match="closed the connection"):
        connection.read_reply(Deadline(5))


def receive_all(sock: socket.socket, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        piece = sock.recv(size - len(got))
        if not piece:
            break
        got += piece
    return bytes(got)


def test_a_gathered_piece_the_peer_takes_in_pauses_goes_out_whole_and_in_order() -> None:
    """A peer that pauses longer than a slice between reads makes ``sendmsg`` return having
    sent part of the buffers (inside one, or at a boundary); the next call picks up there."""
    buffers = tuple(
        memoryview(bytearray((i * 7 + j) % 251 for j in range(size))).cast("H")
        for i, size in enumerate([10_000, 6, 30_000, 0, 4_096, 50_002])
    )
    expected = b"head" + b"".join(bytes(b) for b in buffers) + b"tail"
    left, right = socket.socketpair()
    left.settimeout(10)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    left.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection = Connection(right)

    def pausing() -> bytes:
        got = bytearray()
        while len(got) < len(expected):
            time.sleep(2 * WAIT_SLICE if len(got) < len(expected) // 2 else 0)
            piece = left.recv(3_000)
            if not piece:
                break
            got += piece
        return bytes(got)

    try:
        with ThreadPoolExecutor(1) as receiver:
            got = receiver.submit(pausing)
            connection.send([b"head", buffers, b"tail"], Deadline(30))
            assert got.result(30) == expected
    finally:
        left.close()
        connection.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=3 * DIRECT_BELOW).filter(bool), min_size=1, max_size=6))
def test_pieces_made_as_they_are_sent_go_out_in_order(pieces: list[bytes]) -> None:
    """A SET pipeline is a generator (each header made as its turn comes): the stream is
    the pieces in order, whole."""

    def make() -> Iterator[bytes]:
        yield from pieces

    left, right = socket.socketpair()
    connection = Connection(right)
    expected = b"".join(pieces)
    try:
        with ThreadPoolExecutor(1) as receiver:
            got = receiver.submit(receive_all, left, len(expected))
            connection.send(make(), Deadline(10))
            assert got.result(10) == expected
    finally:
        left.close()
        connection.close()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 3 * DIRECT_BELOW), min_size=1, max_size=12),
    st.sampled_from(["bytes", "bytearray", "view", "wide view"]),
    st.lists(st.integers(1, 4), max_size=6),
)
def test_pieces_go_out_whole_and_in_order_however_much_one_send_takes(
    sizes: list[int], kind: str, groups: list[int]
) -> None:
    """Pieces through a small send buffer: each ``send`` (or ``sendmsg`` of a tuple of
    buffers) takes what fits, the next picks up inside the buffer where it stopped, and the
    stream is the pieces one after the other (empty pieces, wide views and buffers gathered
    in ``groups`` of that many included)."""
    data = [bytes((i * 13 + j) % 251 for j in range(size)) for i, size in enumerate(sizes)]
    parts: list[bytes | bytearray | memoryview]
    if kind == "bytes":
        parts = list(data)
    elif kind == "bytearray":
        parts = [bytearray(d) for d in data]
    elif kind == "view":
        parts = [memoryview(bytearray(d)) for d in data]
    else:  # a view of 2-byte items counts its bytes, not its items
        parts = [memoryview(bytearray(d[: len(d) // 2 * 2])).cast("H") for d in data]
        data = [bytes(part) for part in parts]
    expected = b"".join(data)
    pieces: list[Piece] = []
    for size in groups:
        if parts:
            pieces.append(tuple(parts[:size]))
            parts = parts[size:]
    pieces.extend(parts)
    left, right = socket.socketpair()
    left.settimeout(10)  # a lost byte fails the test rather than hanging it
    right.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    connection = Connection(right)
    try:
        with ThreadPoolExecutor(1) as receiver:
            got = receiver.submit(receive_all, left, len(expected))
            connection.send(pieces, Deadline(10))
            assert got.result(10) == expected
    finally:
        left.close()
        connection.close()
