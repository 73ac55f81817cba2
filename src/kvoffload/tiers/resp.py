"""RESP2 over one socket, every exchange under a deadline on the whole of it.

The shared tier's own client: the ``valkey`` library bounds each socket read
by its timeout, so a server that trickles a reply one byte at a time, or
announces a 512 MB value and drips it, held a call for ever. Here every call
of :class:`Connection` takes a :class:`Deadline`, and no ``send`` or ``recv``
waits past what is left of it (plus one slice, below); replies are bounded in
size (a value is read only when its announced length is the one expected), and
a value is read straight into its destination with ``recv_into``, no intermediate ``bytes``.

A plain (not TLS) socket stays blocking, with kernel send and receive timeouts
of :data:`WAIT_SLICE`: a call that moves no byte for a slice comes back, the
deadline is checked, and the call goes again. A socket with a Python timeout
instead costs a ``poll`` before every ``send`` and ``recv`` and a system call
for every change of timeout: stores sent in 64 KiB pieces ran at 0.87-0.92 of
plain SET that way, against 0.92-0.96 with slices (dev VM, same runs). A
call that moves bytes slowly (a trickling server) comes back with what it
moved, so no call outlasts the deadline by more than a slice.

Connecting (name resolution, TCP, then TLS, then AUTH and SELECT) runs under
the same deadline (:class:`Resolver`); its failures are :class:`ConnectError`
with a message that never holds the password.
"""

from __future__ import annotations

import ipaddress
import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvoffload.tiers.format import Buffer, buffer_size
from kvoffload.tiers.url import TLSOptions

CHUNK = 256 * 1024
"""Bytes read per ``recv`` into the connection's own buffer (lines and small values)."""
MAX_LINE = 64 * 1024
MAX_REPLY = 16 * 2**20
"""Largest reply (other than a block read into its slot) accepted: INFO, CLUSTER SLOTS, SCAN."""
MAX_DEPTH = 8
"""Arrays nested in one reply at most: CLUSTER SLOTS, the deepest the tier reads, nests 4
(a node's metadata); parsing recurses once per level, so a hostile reply must not choose."""
PEEK = 512
"""Bytes received for a length line, or a block's header, when a large value follows."""
DIRECT_BELOW = 64 * 1024
"""Values at least this long are received straight into their destination."""

DIRECT_PIECE = 256 * 1024
"""Most bytes one ``recv_into`` takes: each piece is checksummed while it is in cache."""
Piece = Buffer | tuple[Buffer, ...]
"""Bytes to send: one buffer, or a tuple of buffers sent together (one ``sendmsg``)."""


SENDMSG_BUFFERS = 512
"""Buffers per ``sendmsg`` or ``recvmsg_into`` call, under the kernel's IOV_MAX (1024)."""

WAIT_SLICE = 0.05
"""Seconds a plain socket's send or receive may wait without moving a byte before the
deadline is checked again: the most a deadline can be overrun by."""
_SLICE = struct.pack("ll", 0, int(WAIT_SLICE * 1e6))
_R = TypeVar("_R")


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
        return error_code(self.message)


def error_code(message: str) -> str:
    """An error reply's code: its first word (``OOM``, ``MOVED``, ``WRONGPASS``)."""
    return message.split(" ", 1)[0]


Reply = bytes | int | None | list["Reply"] | ErrorReply


ECHOED_ARGUMENTS = ", with args beginning with:"
"""Where Valkey's (and Redis's) reply to a command it does not know starts to quote the
command's arguments: an AUTH renamed away (``rename-command``), or sent to a server that
lacks it, had the password quoted back, and start-up's error showed it."""


def _refused(reply: ErrorReply, password: str | None) -> ConnectError:
    """The error of a connection whose set-up the server answered with ``reply``, without
    ``password``: the arguments a server quotes back are cut off (it quotes a long one
    cut, which no search for the whole would find), and the password anywhere else hidden."""
    message = reply.message.partition(ECHOED_ARGUMENTS)[0]
    if password:
        message = message.replace(password, "***")
    auth = reply.code in ("WRONGPASS", "NOAUTH") or "AUTH" in message
    return ConnectError("auth" if auth else "server", message)


def _database_refused(db: int, refused: ConnectError) -> ConnectError:
    """The error of a ``SELECT db`` the server refused, saying which servers take it: a
    Cluster answered "SELECT is not allowed in cluster mode" (Redis, Valkey before 9.0) or
    "DB index is out of range" (Valkey 9 with ``cluster-databases`` at its default, 1)."""
    return ConnectError(
        "server",
        f"database {db} refused ({refused}): a standalone server takes databases up to its "
        "databases - 1; a Cluster takes one past 0 only from Valkey 9.0 on, up to its "
        "cluster-databases - 1",
    )


class Deadline:
    """A point in time (``time.monotonic``) an operation must end by, and when it began."""

    __slots__ = ("at", "since")

    def __init__(self, seconds: float, since: float | None = None) -> None:
        """``seconds`` from ``since`` (default: now)."""
        self.since = time.monotonic() if since is None else since
        self.at = self.since + seconds

    def left(self) -> float:
        """Seconds left; :class:`DeadlineExceeded` once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("no full answer before the deadline")
        return left

    def passed(self) -> bool:
        """Whether no time is left, without raising: for a caller that skips a step."""
        return time.monotonic() >= self.at

    def share(self, parts: int) -> Deadline:
        """A deadline of ``1/parts`` of the time left, from now: one step's, of ``parts``
        steps to come that must all get their turn (it has passed if this one has)."""
        return Deadline(max(0.0, self.at - time.monotonic()) / parts)


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
            context.load_cert_chain(options.certfile, options.keyfile, _no_pass_phrase)
        return context


FileStamp = tuple[int, int, int] | None
"""A file's inode, size and modification time (ns); ``None`` if it cannot be read."""


class TLSContexts:
    """The client's TLS context for each new connection, made again from ``credentials``'
    files (CA bundle, certificate, key) once one of them changes on disk.

    Certificates are rotated in place (cert-manager's renewals, short-lived SPIFFE ones):
    a context made once kept the first files, so once they expired, or the server's CA
    moved on, every new connection of a running tier failed its handshake until a restart.
    A change seen mid-rotation (a certificate whose key is not written yet) keeps the
    context in use and is tried again at the next connection. Thread-safe."""

    def __init__(self, credentials: Credentials) -> None:
        options = credentials.tls
        self._credentials = credentials
        self._paths = (
            []
            if options is None
            else [path for path in (options.ca_certs, options.certfile, options.keyfile) if path]
        )
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self._context = credentials.context()  # raises at start-up, where it is reported

    def get(self) -> ssl.SSLContext | None:
        """The context to connect with: the files' own, as they are now where they can be
        loaded."""
        if not self._paths:
            return self._context
        stamps = self._read_stamps()
        with self._lock:
            if stamps != self._stamps:
                try:
                    self._context = self._credentials.context()
                    self._stamps = stamps
                except (OSError, ssl.SSLError):
                    pass  # half rotated: the files in use keep serving, read again next time
            return self._context

    def _read_stamps(self) -> list[FileStamp]:
        stamps: list[FileStamp] = []
        for path in self._paths:
            try:
                status = os.stat(path)
            except OSError:
                stamps.append(None)
                continue
            stamps.append((status.st_ino, status.st_size, status.st_mtime_ns))
        return stamps


def _no_pass_phrase() -> bytes:
    """Refuse an encrypted client key: without a callback OpenSSL asks for its pass phrase
    on the terminal, and start-up waited there for ever."""
    raise OSError("the client key is encrypted; the tier takes only an unencrypted one")


Address = tuple[int, int, int, tuple[Any, ...]]
"""What :func:`socket.getaddrinfo` gives for one address: family, type, protocol, sockaddr."""
Lookup = Callable[[str, int], list[Address]]


def getaddrinfo(host: str, port: int) -> list[Address]:
    """The system resolver's TCP addresses of ``host``."""
    return [
        (family, kind, proto, sockaddr)
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )
    ]


class Resolver:
    """Host names to addresses, each lookup bounded by the operation's deadline.

    ``getaddrinfo`` has no timeout of its own: a resolver that does not answer
    held a connect, and with it the scheduler, for as long as it liked. Here
    a lookup runs on a daemon thread and the caller waits for it no longer
    than its deadline allows, then fails (a counted failure, like a server
    that does not answer). One lookup per name runs at a time, however many
    callers wait for it, so a hung resolver holds one thread per name.
    Answers are kept ``ttl_s`` seconds; past that the last answer is still
    used for up to ``stale_s`` more while a new lookup runs in the background,
    so a resolver outage neither stalls nor takes down a running tier. A name
    whose kept address refuses a connection is looked up again at once, the same
    way (:meth:`expire`). IP addresses are never looked up.
    """

    def __init__(self, lookup: Lookup = getaddrinfo, ttl_s: float = 60.0, stale_s: float = 3600.0):
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._stale_s = stale_s
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, int], tuple[float, list[Address]]] = {}
        self._running: dict[tuple[str, int], Future[list[Address]]] = {}

    def resolve(self, host: str, port: int, deadline: Deadline) -> list[Address]:
        """The addresses of ``host``; :class:`ConnectError` (``resolve``) if there is no
        answer before ``deadline``."""
        numeric = _numeric(host, port)
        if numeric is not None:
            return numeric
        name = (host, port)
        with self._lock:
            answer = self._answers.get(name)
            age = math.inf if answer is None else time.monotonic() - answer[0]
            if answer is not None and age < self._ttl_s:
                return answer[1]
            running = self._running.get(name)
            if running is None:
                running = self._running[name] = self._start(name)
            if answer is not None and age < self._ttl_s + self._stale_s:
                return answer[1]  # refreshed in the background, nobody waits for it
        try:
            return running.result(timeout=max(0.0, deadline.at - time.monotonic()))
        except Exception as exc:  # late, or the resolver's own error
            if isinstance(exc, TimeoutError):
                why = "no answer before the deadline"
            elif isinstance(exc, OSError) and exc.strerror:
                why = exc.strerror  # without gaierror's "[Errno -2]"
            else:
                why = _describe(exc)
            raise ConnectError("resolve", f"cannot resolve host {host!r} ({why})") from None

    def expire(self, host: str, port: int) -> None:
        """Have the next :meth:`resolve` of ``host`` start a new lookup, the kept answer
        used until it lands: a server unreachable at its kept address may have moved (a
        pod restarted), and ``getaddrinfo`` tells no TTL, so the name pointed at the old
        address for up to ``ttl_s``."""
        name = (host, port)
        with self._lock:
            answer = self._answers.get(name)
            if answer is not None:
                aged = min(answer[0], time.monotonic() - self._ttl_s)
                self._answers[name] = (aged, answer[1])

    def forget(self, host: str, port: int) -> None:
        """Keep nothing of ``host``, nor the answer of a lookup under way when it lands: a
        tier that forgot a node forgets its name, so the names a Cluster gave over a long
        run (or a hostile one made up) do not pile up."""
        with self._lock:
            self._answers.pop((host, port), None)
            self._running.pop((host, port), None)

    def _start(self, name: tuple[str, int]) -> Future[list[Address]]:
        """A lookup of ``name`` on its own daemon thread (a hung one never blocks exit)."""
        future: Future[list[Address]] = Future()

        def run() -> None:
            try:
                addresses = self._lookup(*name)
                if not addresses:
                    raise OSError("no addresses")
            except BaseException as exc:  # handed to every waiter
                with self._lock:
                    if self._running.get(name) is future:
                        del self._running[name]
                future.set_exception(exc)
                return
            with self._lock:
                if self._running.get(name) is future:  # else forgotten meanwhile: not kept
                    del self._running[name]
                    self._answers[name] = (time.monotonic(), addresses)
            future.set_result(addresses)

        threading.Thread(target=run, name=f"kvoffload-resolve-{name[0]}", daemon=True).start()
        return future


def _numeric(host: str, port: int) -> list[Address] | None:
    """The address of an IP ``host``, no lookup; ``None`` for a name. An IPv6 zone
    (``fe80::1%eth0``) becomes the address's scope: Python's ``connect`` takes the scope
    from the address tuple, not from the text, and a link-local address without one is
    refused (``EINVAL``)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address):
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, (host, port))]
    address = host.partition("%")[0]
    return [(socket.AF_INET6, socket.SOCK_STREAM, 0, (address, port, 0, _scope(ip, host)))]


def _scope(ip: ipaddress.IPv6Address, host: str) -> int:
    """The interface index of ``ip``'s zone (a name or a number); 0 without one."""
    zone = ip.scope_id
    if not zone:
        return 0
    if zone.isdigit():
        return int(zone)
    try:
        return socket.if_nametoindex(zone)
    except OSError:
        raise ConnectError(
            "resolve", f"cannot resolve host {host!r} (no network interface {zone!r})"
        ) from None


def _connect(addresses: list[Address], deadline: Deadline) -> socket.socket:
    """A TCP connection to the first of ``addresses`` that takes one before ``deadline``."""
    last: BaseException | None = None
    for family, kind, proto, sockaddr in addresses:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # a family this kernel lacks (IPv6 turned off): the next one
            last = exc
            continue
        try:
            sock.settimeout(deadline.left())
            sock.connect(sockaddr)
        except (OSError, UnicodeError) as exc:
            sock.close()
            last = exc
            if isinstance(exc, DeadlineExceeded):
                break
            continue
        return sock
    raise ConnectError("network", _describe(last) if last else "no address to connect to")


class Connection:
    """One socket to one server, with a read buffer; pipelines are sent whole, then read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.broken = False
        """Set when replies are left unread: the connection must be closed, not reused."""
        self._tls = isinstance(sock, ssl.SSLSocket)
        if not self._tls:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _SLICE)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _SLICE)
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
        resolver: Resolver,
    ) -> Connection:
        """Resolve (under the deadline too), connect, then TLS, AUTH and SELECT as
        ``credentials`` ask; :class:`ConnectError`."""
        addresses = resolver.resolve(host, port, deadline)
        try:
            sock = _connect(addresses, deadline)
        except ConnectError:
            resolver.expire(host, port)
            raise
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
        except ProtocolError as exc:  # an answer, not a sane one: the server's, not the network's
            raise ConnectError(
                "server", f"the server answered with something unexpected ({exc})"
            ) from None
        except TimeoutError:
            raise ConnectError("network", "no full answer before the deadline") from None
        except OSError as exc:
            raise ConnectError("network", _describe(exc)) from None
        *setup, ping = replies
        for position, reply in enumerate(setup):
            if isinstance(reply, ErrorReply):
                refused = _refused(reply, credentials.password)
                selecting = credentials.db and position == len(setup) - 1
                if selecting and refused.kind == "server":
                    raise _database_refused(credentials.db, refused)
                raise refused
        # A server that cannot persist refuses PING with MISCONF as it refuses writes, yet
        # serves reads: it answered in RESP, so the connection is good (its stores then rest
        # the node, see the shared tier's ``REFUSES_STORES``), not a failure of every call.
        if isinstance(ping, ErrorReply) and ping.code != "MISCONF":
            raise _refused(ping, credentials.password)

    def close(self) -> None:
        self.sock.close()

    def readable_now(self) -> bool:
        """Whether bytes, or end-of-file, wait unasked: on an idle connection, a sign the
        server closed it. ``poll``, not ``select``: a process with over 1024 descriptors
        (an engine's) gets sockets ``select`` refuses; TLS may hold decrypted bytes the
        socket no longer shows."""
        sock = self.sock
        if self._start != self._end or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, pieces: Iterable[Piece], deadline: Deadline) -> None:
        """Send every piece in order, all before ``deadline`` (making a piece, when
        ``pieces`` makes them as they are taken, counts against it too)."""
        for piece in pieces:
            self._send_piece(piece, deadline)

    def _send_piece(self, piece: Piece, deadline: Deadline) -> None:
        """Send ``piece`` whole: ``send`` after ``send``, each under ``deadline``."""
        if isinstance(piece, tuple):
            self._send_gathered(piece, deadline)
            return
        size = piece.nbytes if type(piece) is memoryview else len(piece)
        sent = self._moved(self.sock.send, piece, deadline)
        if sent == size:
            return
        view = memoryview(piece).cast("B")[sent:]
        while view.nbytes:
            view = view[self._moved(self.sock.send, view, deadline) :]

    def _send_gathered(self, buffers: tuple[Buffer, ...], deadline: Deadline) -> None:
        """Send ``buffers`` in order, as few ``sendmsg`` calls as the kernel takes them in
        (a TLS socket has none: one buffer after another)."""
        if self._tls:
            for buffer in buffers:
                self._send_piece(buffer, deadline)
            return
        pending = [b for b in buffers if buffer_size(b)]
        start = 0
        while start < len(pending):
            sent = self._moved(
                self.sock.sendmsg, pending[start : start + SENDMSG_BUFFERS], deadline
            )
            while sent:
                first = pending[start]
                size = buffer_size(first)
                if sent < size:
                    pending[start] = memoryview(first).cast("B")[sent:]
                    break
                sent -= size
                start += 1

    def _moved(self, call: Callable[[Any], _R], buffers: Any, deadline: Deadline) -> _R:
        """``call(buffers)`` (a send or receive on the socket) once it moves bytes, under
        ``deadline``: on a plain socket tried again after each slice without any."""
        if self._tls:
            self.sock.settimeout(deadline.left())
            return call(buffers)
        while True:
            deadline.left()
            try:
                return call(buffers)
            except BlockingIOError:  # a slice without a byte moved
                continue

    def _fill(self, deadline: Deadline, most: int = CHUNK) -> None:
        """Receive up to ``most`` more bytes into the buffer (moving what is unread to its
        front first)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            unread = self._end - self._start
            self._buffer[:unread] = self._buffer[self._start : self._end]
            self._start, self._end = 0, unread
        got = self._moved(self.sock.recv_into, self._view[self._end : self._end + most], deadline)
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
                piece = destination[done : done + DIRECT_PIECE]
                got = self._moved(self.sock.recv_into, piece, deadline)
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
        :data:`DIRECT_PIECE` bytes (TLS sockets have none: :meth:`read_into` each). Each
        part is checksummed as it fills, while in cache; the loop is written for an SGLang
        ``layer_first`` page (16 parts of 64 KiB, 16,384 a GiB)."""
        views = [part for part in parts if part.nbytes]
        sizes = [view.nbytes for view in views]
        count = len(views)
        k = at = 0
        while k < count and self._start < self._end:
            n = min(sizes[k] - at, self._end - self._start)
            views[k][at : at + n] = self._view[self._start : self._start + n]
            self._start += n
            if digest is not None:
                digest.update(views[k][at : at + n])
            at += n
            if at == sizes[k]:
                k, at = k + 1, 0
        if self._tls:
            for index in range(k, count):
                self.read_into(views[index][at:], deadline, digest)
                at = 0
            return
        sock = self.sock
        update = None if digest is None else digest.update
        while k < count:
            # Up to a piece from where part k stands; a part is sliced only where the
            # piece starts or ends inside it.
            if at or sizes[k] > DIRECT_PIECE:
                batch = [views[k][at : at + DIRECT_PIECE]]
                room = DIRECT_PIECE - batch[0].nbytes
            else:
                batch = [views[k]]
                room = DIRECT_PIECE - sizes[k]
            j, last = k + 1, min(count, k + SENDMSG_BUFFERS)
            while room > 0 and j < last:
                batch.append(views[j] if sizes[j] <= room else views[j][:room])
                room -= sizes[j]
                j += 1
            got = self._moved(sock.recvmsg_into, batch, deadline)[0]
            if not got:
                raise ConnectionError("the server closed the connection")
            while got:
                left = sizes[k] - at
                if got < left:
                    if update is not None:
                        update(views[k][at : at + got])
                    at += got
                    break
                if update is not None:
                    update(views[k][at:] if at else views[k])
                got -= left
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
        return self._reply(deadline, budget, 0)

    def _reply(self, deadline: Deadline, budget: list[int], depth: int) -> Reply:
        """One reply (``depth``: arrays it sits in), its bytes counted against ``budget``."""
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        budget[0] -= len(line) + 2
        if budget[0] < 0:  # lines count too: an array of long ones was otherwise unbounded
            raise ProtocolError("a reply longer than this call accepts")
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
            if depth == MAX_DEPTH:
                raise ProtocolError(f"arrays nested more than {MAX_DEPTH} deep in a reply")
            return [self._reply(deadline, budget, depth + 1) for _ in range(count)]
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
