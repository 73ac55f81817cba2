"""RESP2 over one socket, every exchange under a deadline on the whole of it.

The shared tier's own client: the ``valkey`` library bounds each socket read
by its timeout, so a server that trickles a reply one byte at a time, or
announces a 512 MB value and drips it, held a call for ever. Here every call
of :class:`Connection` takes a :class:`Deadline` and gives each ``recv`` only
what is left of it; replies are bounded in size (a value is read only when
its announced length is the one expected), and a value is read straight into
its destination with ``recv_into``, no intermediate ``bytes``.

Connecting (TCP, then TLS, then AUTH and SELECT) runs under the same
deadline; its failures are :class:`ConnectError` with a message that never
holds the password.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.tiers.url import TLSOptions

CHUNK = 256 * 1024
"""Bytes read per ``recv`` into the connection's own buffer (lines and small values)."""
MAX_LINE = 64 * 1024
MAX_REPLY = 16 * 2**20
"""Largest reply (other than a block read into its slot) accepted: INFO, CLUSTER SLOTS, SCAN."""
PEEK = 512
"""Bytes received for a length line, or a block's header, when a large value follows."""
DIRECT_BELOW = 64 * 1024
"""Values at least this long are received straight into their destination."""

DIRECT_PIECE = 256 * 1024
"""Most bytes one ``recv_into`` takes: each piece is checksummed while it is in cache."""
Piece = bytes | bytearray | memoryview | tuple[bytes | bytearray | memoryview, ...]
"""Bytes to send; a tuple of buffers goes out with scatter-gather ``sendmsg`` (the parts of
one value, :mod:`.block_sets`), one system call for many buffers."""
SENDMSG_BUFFERS = 512
"""Buffers per ``sendmsg`` call, under the kernel's IOV_MAX (1024)."""


class Digest(Protocol):
    """A running checksum, fed piece by piece."""

    def update(self, data: memoryview, /) -> None: ...


class DeadlineExceeded(TimeoutError):
    """The operation's deadline passed before the server answered in full."""


class ProtocolError(ConnectionError):
    """The server sent something that is not a RESP reply we accept (or too much of it)."""


class ConnectError(Exception):
    """A connection could not be opened. ``kind``: ``network``, ``tls`` (the handshake),
    ``tls-refused`` (the server ended TLS after the handshake, as TLS 1.3 refuses a
    client certificate), ``auth`` or ``server`` (another error reply)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ErrorReply:
    """An error reply (``-ERR ...``, ``-MOVED 3999 host:port``): a value, not an exception,
    so that a pipeline's other replies are still read."""

    message: str

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]


Reply = bytes | int | None | list["Reply"] | ErrorReply


class Deadline:
    """A point in time (``time.monotonic``) an operation must end by."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; :class:`DeadlineExceeded` once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("no full answer before the deadline")
        return left


def command(*args: bytes | str | int) -> bytes:
    """The RESP of one command."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(raw), raw))
    return b"".join(parts)


@dataclass(frozen=True)
class Credentials:
    """What a new connection needs besides the address: TLS, AUTH, database."""

    username: str | None
    password: str | None = field(repr=False)
    db: int
    tls: TLSOptions | None

    def context(self) -> ssl.SSLContext | None:
        """The client's TLS context, as the URL's ``ssl_*`` options ask."""
        options = self.tls
        if options is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if options.cert_reqs == "required":
            context.check_hostname = options.check_hostname
        else:
            context.check_hostname = False
            context.verify_mode = (
                ssl.CERT_NONE if options.cert_reqs == "none" else ssl.CERT_OPTIONAL
            )
        if options.ca_certs:
            context.load_verify_locations(options.ca_certs)
        else:
            context.load_default_certs()
        if options.certfile:
            context.load_cert_chain(options.certfile, options.keyfile)
        return context


class Connection:
    """One socket to one server, with a read buffer; pipelines are sent whole, then read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.broken = False
        """Set when replies are left unread: the connection must be closed, not reused."""
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._buffer = bytearray(CHUNK)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        credentials: Credentials,
        context: ssl.SSLContext | None,
        deadline: Deadline,
    ) -> Connection:
        """Connect, then TLS, AUTH and SELECT as ``credentials`` ask; :class:`ConnectError`."""
        try:
            sock = socket.create_connection((host, port), timeout=deadline.left())
        except (OSError, UnicodeError) as exc:
            raise ConnectError("network", _describe(exc)) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                sock = _handshake(sock, host, context, deadline)
            connection = cls(sock)
            connection._hello(credentials, deadline)
        except BaseException:
            sock.close()
            raise
        return connection

    def _hello(self, credentials: Credentials, deadline: Deadline) -> None:
        """AUTH and SELECT, pipelined, then PING: the server proves it speaks RESP."""
        parts = []
        if credentials.password is not None:
            if credentials.username:
                parts.append(command("AUTH", credentials.username, credentials.password))
            else:
                parts.append(command("AUTH", credentials.password))
        if credentials.db:
            parts.append(command("SELECT", credentials.db))
        parts.append(command("PING"))
        try:
            self.send(parts, deadline)
            replies = [self.read_reply(deadline, MAX_LINE) for _ in parts]
        except ssl.SSLError as exc:  # TLS 1.3 refuses a missing client certificate here
            raise ConnectError("tls-refused", _describe(exc)) from None
        except TimeoutError:
            raise ConnectError("network", "no full answer before the deadline") from None
        except OSError as exc:
            raise ConnectError("network", _describe(exc)) from None
        for reply in replies:
            if isinstance(reply, ErrorReply):
                auth = reply.code in ("WRONGPASS", "NOAUTH") or "AUTH" in reply.message
                raise ConnectError("auth" if auth else "server", reply.message)

    def close(self) -> None:
        self.sock.close()

    def readable_now(self) -> bool:
        """Whether bytes, or end-of-file, wait unasked: on an idle connection, a sign the
        server closed it."""
        if self._start != self._end:
            return True
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def send(self, pieces: Iterable[Piece], deadline: Deadline) -> None:
        """Send every piece in order, all before ``deadline``."""
        sock = self.sock
        for piece in pieces:
            if isinstance(piece, tuple):
                self._send_parts(piece, deadline)
                continue
            if not self._tls:
                sock.settimeout(deadline.left())
                sock.sendall(piece)  # the timeout bounds the whole sendall
                continue
            view = memoryview(piece).cast("B")
            while view.nbytes:
                sock.settimeout(deadline.left())
                sent = sock.send(view)
                view = view[sent:]

    def _send_parts(
        self, parts: tuple[bytes | bytearray | memoryview, ...], deadline: Deadline
    ) -> None:
        """Send ``parts`` in order: ``sendmsg`` over as many as it takes at once (TLS sockets
        have none: one send each)."""
        if self._tls:
            self.send(parts, deadline)
            return
        views = [view for view in (memoryview(part).cast("B") for part in parts) if view.nbytes]
        first = 0
        while first < len(views):
            self.sock.settimeout(deadline.left())
            sent = self.sock.sendmsg(views[first : first + SENDMSG_BUFFERS])
            while sent and first < len(views):
                size = views[first].nbytes
                if sent < size:
                    views[first] = views[first][sent:]
                    break
                sent -= size
                first += 1

    def _fill(self, deadline: Deadline, most: int = CHUNK) -> None:
        """Receive up to ``most`` more bytes into the buffer (moving what is unread to its
        front first)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            unread = self._end - self._start
            self._buffer[:unread] = self._buffer[self._start : self._end]
            self._start, self._end = 0, unread
        self.sock.settimeout(deadline.left())
        got = self.sock.recv_into(self._view[self._end : self._end + most])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self, deadline: Deadline, most: int = CHUNK) -> bytes:
        """The next line, without its CRLF."""
        while True:
            end = self._buffer.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._buffer[self._start : end])
                self._start = end + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            self._fill(deadline, most)

    def read_into(
        self,
        destination: memoryview,
        deadline: Deadline,
        digest: Digest | None = None,
        most: int = CHUNK,
    ) -> None:
        """Fill ``destination`` (bytes) from the stream: buffered bytes first, then, for
        a destination of :data:`DIRECT_BELOW` bytes or more, ``recv_into`` straight into
        it. ``digest`` is fed each piece as it lands, while it is still in cache; ``most``:
        bytes a ``recv`` into the buffer may take (less before a large value)."""
        size = destination.nbytes
        direct = size >= DIRECT_BELOW
        done = min(size, self._end - self._start)
        destination[:done] = self._view[self._start : self._start + done]
        self._start += done
        if digest is not None and done:
            digest.update(destination[:done])
        while done < size:
            if not direct:
                self._fill(deadline, most)
                got = min(size - done, self._end - self._start)
                destination[done : done + got] = self._view[self._start : self._start + got]
                self._start += got
            else:
                self.sock.settimeout(deadline.left())
                got = self.sock.recv_into(destination[done : done + DIRECT_PIECE])
                if not got:
                    raise ConnectionError("the server closed the connection")
            if digest is not None:
                digest.update(destination[done : done + got])
            done += got

    def read_parts_into(
        self, parts: Sequence[memoryview], deadline: Deadline, digest: Digest | None = None
    ) -> None:
        """Fill ``parts`` (bytes) in order from the stream, as :meth:`read_into` fills one:
        buffered bytes first, then one ``recvmsg_into`` across as many parts as make
        :data:`DIRECT_PIECE` bytes (TLS sockets have none: :meth:`read_into` each)."""
        views = [part for part in parts if part.nbytes]
        k = at = 0
        while k < len(views) and self._start < self._end:
            view = views[k]
            n = min(view.nbytes - at, self._end - self._start)
            view[at : at + n] = self._view[self._start : self._start + n]
            self._start += n
            if digest is not None:
                digest.update(view[at : at + n])
            at += n
            if at == view.nbytes:
                k, at = k + 1, 0
        while k < len(views):
            if self._tls:
                self.read_into(views[k][at:], deadline, digest)
                k, at = k + 1, 0
                continue
            batch: list[memoryview] = []
            room = DIRECT_PIECE
            for view in views[k : k + SENDMSG_BUFFERS]:
                piece = view[at : at + room] if not batch else view[:room]
                batch.append(piece)
                room -= piece.nbytes
                if room <= 0:
                    break
            self.sock.settimeout(deadline.left())
            got = self.sock.recvmsg_into(batch)[0]
            if not got:
                raise ConnectionError("the server closed the connection")
            while got:
                view = views[k]
                n = min(view.nbytes - at, got)
                if digest is not None:
                    digest.update(view[at : at + n])
                at += n
                got -= n
                if at == view.nbytes:
                    k, at = k + 1, 0

    def skip(self, size: int, deadline: Deadline) -> None:
        """Read and drop ``size`` bytes."""
        while size:
            if self._start == self._end:
                self._fill(deadline)
            take = min(size, self._end - self._start)
            self._start += take
            size -= take

    def end_of_value(self, deadline: Deadline, large_next: bool = False) -> None:
        """The CRLF after a bulk string's bytes. ``large_next``: a large value is expected
        next, so receive no more than its length line, lest its bytes be copied twice."""
        while self._end - self._start < 2:
            self._fill(deadline, PEEK if large_next else CHUNK)
        crlf = self._buffer[self._start : self._start + 2]
        self._start += 2
        if crlf != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")

    def read_bulk_length(self, deadline: Deadline, large: bool = False) -> int | ErrorReply:
        """The length of the next reply, a bulk string (-1: nil), its bytes left unread;
        or the error reply in its place. ``large``: a large value is expected, so receive
        little more than this line (its bytes then go straight to their destination)."""
        line = self._line(deadline, PEEK if large else CHUNK)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind != b"$":
            raise ProtocolError(f"expected a bulk string, got a {kind!r} reply")
        return _number(rest)

    def read_reply(self, deadline: Deadline, limit: int = MAX_REPLY) -> Reply:
        """The next whole reply, refused past ``limit`` bytes."""
        budget = [limit]
        return self._reply(deadline, budget)

    def _reply(self, deadline: Deadline, budget: list[int]) -> Reply:
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        budget[0] -= len(line) + 2
        if kind == b"+":
            return rest
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return _number(rest)
        if kind == b"$":
            size = _number(rest)
            if size < 0:
                return None
            budget[0] -= size + 2
            if budget[0] < 0:
                raise ProtocolError(f"a reply of {size} bytes, more than this call accepts")
            value = bytearray(size)
            self.read_into(memoryview(value), deadline)
            self.end_of_value(deadline)
            return bytes(value)
        if kind == b"*":
            count = _number(rest)
            if count < 0:
                return None
            if count > budget[0]:
                raise ProtocolError(f"an array of {count} replies, more than this call accepts")
            return [self._reply(deadline, budget) for _ in range(count)]
        raise ProtocolError(f"unknown reply type {kind!r}")


def _number(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"bad number {text[:20]!r} in a reply") from None


def _handshake(
    sock: socket.socket, host: str, context: ssl.SSLContext, deadline: Deadline
) -> ssl.SSLSocket:
    """The TLS handshake, bounded by ``deadline``: a plain server that never answers the
    client's hello is a handshake failure, not a hang."""
    try:
        sock.settimeout(deadline.left())
        return context.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as exc:
        if isinstance(exc, TimeoutError):
            why = "no answer to the TLS hello in time: does that port speak TLS?"
        else:
            why = _describe(exc)
        raise ConnectError("tls", why) from None


def _describe(exc: BaseException) -> str:
    """``exc`` as a short phrase (timeouts say so: their own text is often empty)."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    return str(exc) or type(exc).__name__
