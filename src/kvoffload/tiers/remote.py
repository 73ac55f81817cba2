"""The shared tier on Valkey or Redis, standalone or Cluster, through its own RESP client.

Values are trailed :mod:`~kvoffload.tiers.format` blocks (a checksummed header,
the raw bytes, then their digest) under ``kvo3:<fingerprint hex>:<key hex>``, so two
models never read each other's blocks. Reads are one pipeline of GETs per batch and node,
sent :data:`READ_WINDOW` bytes of values ahead of those received, each reply received
straight into its destination slot and checksummed as it lands (:mod:`.resp`); writes
one pipeline of SETs per batch and node, header, payload and digest sent apart
(:mod:`.block_sets`), never joined, each piece of the payload hashed just before it
goes out.

Every operation (a lookup, a read batch, a write pipeline) has one deadline on the whole
of it, name lookup, connect, send and full reply, on every node it asks, retries and
redirections included: ``timeout_ms`` plus the time its bytes take at :data:`SLOWEST_LINK`.
Each node's part goes through one call wrapper and the breaker of that node (one per Cluster
node, so a dead node fails its slots only), on a thread of its own (a hung node costs only
its own keys, :meth:`RemoteTier._each_node`), a read's through the node's read breaker too,
a write's through its write breaker: when a server is slow, paused or down, lookups miss
and stores are dropped, counted, and the tier reconnects by itself once a trial call
succeeds; reads, or writes, that keep failing while the node's other calls succeed (a
server that drips its values, or takes in large requests slowly) are rested on their own.
A Cluster's slot map is asked again of a live node when a node fails, is refused or answers
``CLUSTERDOWN`` (a failover moves a dead node's slots, and the dead node cannot say where).
A part left less time than the parts before it took is not charged to its node when it runs
out of it (:meth:`RemoteTier._call`). A block the server evicted (maxmemory) is a plain miss. A
value that fails its header check, or whose announced length is not the layout's
(refused before its bytes are read), is never loaded: it is counted corrupt and deleted.
"""

from __future__ import annotations

import binascii
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from functools import partial
from typing import TypeVar

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError, check_integer
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import EventLog, OffloadingEvent
from kvoffload.core.tier_protocol import Target, TierStats, check_io_threads
from kvoffload.tiers.backlog import BacklogFigures, WriteBacklog, default_pending_bytes
from kvoffload.tiers.block_sets import BlockWrite, DigestsAhead, pack_sets
from kvoffload.tiers.breaker import CircuitBreaker, Pass
from kvoffload.tiers.deadline import Watchdog, done_future
from kvoffload.tiers.format import (
    HEADER_BYTES,
    TRAILED_VERSION,
    TRAILER_BYTES,
    CorruptBlockError,
    check_fingerprint,
    parse_header,
    parse_trailer,
    payload_hasher,
    payload_size,
)
from kvoffload.tiers.resp import (
    CHUNK,
    DIRECT_BELOW,
    MAX_LINE,
    PEEK,
    ConnectError,
    Connection,
    Credentials,
    Deadline,
    ErrorReply,
    ProtocolError,
    Reply,
    Resolver,
    TLSContexts,
    command,
    error_code,
)
from kvoffload.tiers.targets import destination_parts
from kvoffload.tiers.url import MAX_PORT, RemoteAddress, parse_remote_url

MEDIUM = "REMOTE"
SLOTS = 16384
SLOWEST_LINK = 100e6
"""Bytes per second an operation's deadline allows on top of ``timeout_ms``."""
SKIP_BELOW = 1 << 20
"""A value of the wrong length up to this size is read and dropped; a longer one is
never read: its connection is closed instead."""
READ_WINDOW = 8 * 2**20
"""Bytes of values a read asks one node for ahead of those it has received: a batch's GETs
go out as its values come in (more once half of these have), so the replies the server
holds for the connection stay small. Sent all at once, a large batch's replies piled up in
the server's output buffer, and a ``client-output-buffer-limit normal`` set below them
closed the connection: the whole batch failed, every time it was asked. Valkey counts
about twice the values' bytes against that limit (its reply blocks): a limit of 16 MiB
or more is never reached by the window. One value is one reply, though: a block of about
twice the limit or more (32 MiB under 16 MiB) still closes the connection."""
MAX_HOPS = 4
"""MOVED/ASK redirections followed per key before its block counts as failed: each key has
its own, so a batch over many moved slots is served as each key alone would be."""
MAX_NODES = 1024
"""Nodes the tier will know, past Valkey's largest Cluster (1,000 nodes): a redirection to
a node beyond them is not followed, so a hostile server's made-up addresses cannot grow
the tier's nodes, breakers and lookup threads without end. A node a new slot map leaves
out is forgotten once no call uses it, so the cap bounds live nodes, not a long run's."""
NOT_SERVED = "CLUSTERDOWN"
"""Error code of a Cluster node that serves none of the slot's keys, without ``MOVED`` to say
where they went: a node restarted blank at a dead node's address (its ``nodes.conf`` lost)
answers it for every slot, and so does a Cluster while it is down. It has the slot map
asked again, as a failure does: the breaker counts no failure for an answer, so without
it the tier sent the slots there for good, after their failover too."""
NOT_SERVED_PAUSE_S = 0.05
"""Seconds :meth:`RemoteTier.delete_all` waits before it asks again for names a node
answered ``CLUSTERDOWN`` (a failover under way), on the node the slot map then names."""
DEMOTED = "READONLY"
"""Error code of a server that became a replica: a standalone failover behind a DNS name (a
managed service's primary endpoint) leaves the old primary up, serving reads and refusing
every store. Its idle connections are closed and its name looked up again, so the stores
after the next reach the new primary; before, pooled connections and the kept answer
(a minute old at most) sent every store to the replica for that long."""
REFUSES_STORES = frozenset({"OOM", "MISCONF"})
"""Error codes of a server that will refuse every store until an operator acts: ``OOM``
(full, maxmemory with ``noeviction``) and ``MISCONF`` (a snapshot failed to save, with
``stop-writes-on-bgsave-error``). Either rests the node from stores; loads go on."""
NODE_THREADS = 64
"""Threads at most that ask a node for its part of an operation spread over a Cluster,
beside the operation's own thread (which asks one node itself); a part finding none free
waits for one, its deadline running."""
MAP_REFRESH_S = 1.0
"""Seconds between two refreshes of a Cluster's slot map at least. A node that fails or is
refused has its map asked again of a live node: after a failover or a node's removal its
slots belong to another node, and a dead one never answers ``MOVED`` to say which."""
MAP_ASK_SHARES = 8
"""The most addresses a slot map refresh shares the time it has left among: each address
gets its share to connect in, so addresses that hang (a moved pod's, whose packets are
dropped) cannot spend the whole refresh before the live ones after them, the URL's seeds
last, are asked; a live node connects in a few round trips. Past this many addresses to
ask, each still gets an eighth of what is left, so a large Cluster's first live node is
not cut to a sliver."""

T = TypeVar("T")


class RemoteTierError(KVOffloadError):
    """The shared tier cannot start: the server refuses us or cannot be reached."""


class ServerReplyError(Exception):
    """The server answered a command with an error (OOM, NOAUTH, LOADING, ...)."""

    @property
    def code(self) -> str:
        return error_code(str(self))


class _Node:
    """One server: its idle connections, its breaker, its read and its write breaker."""

    def __init__(self, host: str, port: int, breaker: CircuitBreaker) -> None:
        self.host = host
        self.port = port
        self.breaker = breaker
        self.reads = breaker.fresh()
        """Reads pass it as well as :attr:`breaker`, and only reads count in it: a server
        that drips its values but answers lookups and stores in time fails every read at
        its deadline, and those successes closed :attr:`breaker` between the failures."""
        self.writes = breaker.fresh()
        """Writes pass it as well as :attr:`breaker`, and only writes count in it: a server
        that takes in large requests slowly but answers lookups and reads in time fails every
        write pipeline at its deadline, and those successes closed :attr:`breaker` between
        the failures."""
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.full_at = -math.inf
        """When the node last refused a store as full or unable to persist (an error code of
        :data:`REFUSES_STORES`; monotonic)."""
        self.calls = 0
        """Calls under way on the node (under the tier's lock): a node a new slot map
        leaves out is forgotten only when there are none."""

    def is_resting(self) -> bool:
        """Whether the node refused a store as full or unable to persist less than its
        breaker's cool-down ago: such a server (maxmemory with ``noeviction``, a failed
        snapshot with ``stop-writes-on-bgsave-error``) refuses every store until memory is
        freed or the snapshot saves, so sending each one cost a round trip and its bytes for
        nothing."""
        return time.monotonic() - self.full_at < self.breaker.cooldown_s

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    def take(self) -> Connection | None:
        """An idle connection the server has not closed meanwhile (its idle timeout, a
        restart): one with something to read while idle is closed, not used."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            try:
                closed = connection.readable_now()
            except BaseException:  # not handed back: nobody else would ever close it
                connection.close()
                raise
            if not closed:
                return connection
            connection.close()

    def give(self, connection: Connection) -> None:
        """Keep ``connection`` for the next call; close it if replies were left unread or the
        node was closed meanwhile (a lookup on the scheduler's thread may outlast close)."""
        with self._lock:
            if not (connection.broken or self._closed):
                self._idle.append(connection)
                return
        connection.close()

    def drop_idle(self) -> None:
        """Close the idle connections: they reach a server that no longer takes stores."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop_idle()


# What one block of a batch came to on its node.
_HIT, _MISS, _CORRUPT, _AGAIN = "hit", "miss", "corrupt", "again"


class _Redirect:
    """A MOVED or ASK reply: the slot lives (for good, or for this one command) elsewhere."""

    __slots__ = ("address", "ask", "slot")

    def __init__(self, slot: int, address: tuple[str, int], ask: bool) -> None:
        self.slot = slot
        self.address = address
        self.ask = ask


_Status = str | _Redirect
_Job = tuple[_Node, list[int], bool, int]
"""A node, the indices of a batch to send it, whether each command needs ASKING, and the
redirections those indices have followed so far (each key has :data:`MAX_HOPS`)."""
_Part = Callable[[_Job], tuple[list[_Job], int]]
"""One node's part of an operation: asks the node for a job's keys, records what it
answered, and gives the jobs that follow from it (redirections, a rest sent again) and a
count (blocks failed, names deleted)."""
_WriteJob = tuple[list[OffloadKey], Future[list[bool]]]
"""A write pipeline's keys and its job on the I/O pool, until a poll counts it."""
ASKING = command("ASKING")


class RemoteTier(BacklogFigures):
    """Blocks on a Valkey/Redis server or Cluster named by ``url`` (see :mod:`.url`).

    Writes go out in pipelines of about ``chunk_bytes`` on ``io_threads``
    connections, encoded there, never on the caller's thread; a write offered while
    ``max_pending_write_bytes`` of them are queued or under way (default: two pipelines
    per thread) is dropped at once, counted in ``failed`` and :attr:`skipped_backlog`, so
    a server slower than the write-back never grows the queue without end; reads run on
    ``io_threads`` threads of their own, so none waits behind a write. ``breaker`` is
    the standalone server's; in Cluster mode every node gets a fresh one with
    its settings (:attr:`breakers`), and every node a read breaker and a write breaker
    with them (:attr:`read_breakers`, :attr:`write_breakers`).

    Start-up connects once, under one deadline of ``timeout_ms``, and raises
    :class:`RemoteTierError` with a clear message (never the password) for a
    wrong password, a failed TLS handshake, a host name that does not resolve
    or an unreachable server; after that no call raises for the server's sake.
    ``resolver`` looks host names up under each operation's deadline (default:
    the system's, answers kept a minute, see :class:`~.resp.Resolver`).

    Every public method may be called from several threads at once (vLLM's
    worker threads, SGLang's prefetch beside its backup): each call takes its
    own connections, and what calls share (the write jobs :meth:`poll` counts,
    the events, the nodes and slot map, the counts) changes only under a lock
    that is never held across a network wait. ``poll(wait=True)`` returns once
    every write submitted before it is counted, whichever thread's poll took it.
    """

    medium = MEDIUM

    def __init__(
        self,
        url: str,
        fingerprint: bytes,
        *,
        breaker: CircuitBreaker | None = None,
        io_threads: int = 2,
        chunk_bytes: int = 256 * 2**20,
        enable_events: bool = False,
        resolver: Resolver | None = None,
        max_pending_write_bytes: int | None = None,
    ) -> None:
        # Checked before start-up connects: a pool that cannot be made leaked its connection.
        check_fingerprint(fingerprint)
        check_io_threads(io_threads)
        check_integer("chunk_bytes", chunk_bytes, 1)
        self._backlog = WriteBacklog(
            max_pending_write_bytes, default_pending_bytes(io_threads, chunk_bytes)
        )
        self.address = parse_remote_url(url)
        self._resolver = resolver or Resolver()
        self._chunk_bytes = chunk_bytes
        self.fingerprint = fingerprint
        # The format version in the name: blocks of another version's clients on the same
        # server are never found (they age out), never read as corrupt and deleted.
        self._prefix = b"kvo%d:" % TRAILED_VERSION + fingerprint.hex().encode() + b":"
        self.breaker = breaker or CircuitBreaker()
        self.stats = TierStats()
        self.unavailable = 0
        """Calls refused by an open breaker or failed by the server (timeouts included, those
        of a node left too little time too)."""
        self.skipped_full = 0
        """Blocks whose store was not sent, its node resting after an ``OOM`` or ``MISCONF``
        reply (:meth:`_Node.is_resting`); they count in ``failed`` too."""
        self.skipped_backlog = 0
        """Blocks dropped unsent as they were offered, the writes queued or under way being at
        ``max_pending_write_bytes`` (:attr:`pending_write_bytes`); they count in ``failed``
        too."""
        self._lock = threading.Lock()
        try:
            password = self.address.secret()  # read as the tier opens, not where parsed
        except InvalidArgumentError as exc:
            raise RemoteTierError(str(exc)) from None
        self._credentials = Credentials(
            self.address.username,
            password,
            self.address.db,
            self.address.tls_options,
        )
        self._tls = _tls_contexts(self._credentials, self.address.redacted())
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._slots: list[_Node] | None = None
        """A Cluster's owner of each hash slot; ``None`` for a standalone server."""
        self._server: _Node | None = None
        self._refresher: threading.Thread | None = None
        """The thread asking for a Cluster's slot map, while one does."""
        self._refreshed_at = -MAP_REFRESH_S
        """When the last slot map refresh began (``time.monotonic``)."""
        self._closed = False
        """Set by :meth:`close`: later reads and writes fail (counted), lookups answer that
        nothing is held; none raises, none opens a connection."""
        self.is_cluster = self._start()
        self._pool = ThreadPoolExecutor(io_threads, "kvoffload-remote")
        self._reads = ThreadPoolExecutor(io_threads, "kvoffload-remote-read")
        """Reads apart from the writes: a read's deadline starts when it is asked, not once
        the write pipelines queued before it (each with a deadline of its own bytes, up to
        seconds) have gone out or failed, as on a hung server."""
        self._waiting = Watchdog("kvoffload-remote-read-deadline")
        """Fails the reads still waiting for a read thread at their deadline."""
        self._ahead = ThreadPoolExecutor(io_threads, "kvoffload-remote-ahead")
        """Hashes a batch's single-buffer payloads while they go out (one per I/O thread)."""
        self._per_node = ThreadPoolExecutor(NODE_THREADS, "kvoffload-remote-node")
        """Asks the nodes of an operation spread over a Cluster at once (:meth:`_each_node`)."""
        self._writes: list[_WriteJob] = []
        self._events = EventLog(enable_events)

    @property
    def breakers(self) -> dict[str, CircuitBreaker]:
        """Each known node's breaker, by ``host:port``."""
        with self._lock:
            return {node.name: node.breaker for node in self._nodes.values()}

    @property
    def read_breakers(self) -> dict[str, CircuitBreaker]:
        """Each known node's read breaker, by ``host:port``."""
        with self._lock:
            return {node.name: node.reads for node in self._nodes.values()}

    @property
    def write_breakers(self) -> dict[str, CircuitBreaker]:
        """Each known node's write breaker, by ``host:port``."""
        with self._lock:
            return {node.name: node.writes for node in self._nodes.values()}

    def name(self, key: OffloadKey) -> bytes:
        return self._prefix + key.hex().encode()

    def present(self, keys: Sequence[OffloadKey]) -> int:
        """Leading run of ``keys`` on the server: one pipelined round trip of EXISTS per
        node, all under one deadline, each node asked only while the run could still reach
        its keys (a lookup runs on the scheduler's thread)."""
        found = self._exists_all(keys, whole=False)
        return found.index(False) if False in found else len(found)

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Per key, whether the server holds it: every node asked at once, under one
        deadline."""
        return self._exists_all(keys, whole=True)

    def _exists_all(self, keys: Sequence[OffloadKey], whole: bool) -> list[bool]:
        """Per key, whether the server answered that it holds it (a failed node's keys:
        no). With ``whole`` the nodes are asked at once (:meth:`_each_node`); without, in
        the order of their first key, and a node is skipped once a key before its first is
        not found: a leading run cannot reach it. A redirected key is asked where it points
        (after ASKING for an ``ASK``), at most :data:`MAX_HOPS` times."""
        names = [self.name(key) for key in keys]
        found = [False] * len(names)
        if self._closed:
            return found
        deadline = self._deadline(0)

        def part(job: _Job) -> tuple[list[_Job], int]:
            node, indices, asking, hops = job
            exists = partial(self._exists, names, indices, asking)
            replies = self._call(node, exists, deadline)
            if replies is None:
                return [], 0
            statuses: list[object] = []
            for index, reply in zip(indices, replies, strict=True):
                redirect = _redirect(reply) if isinstance(reply, ErrorReply) else None
                found[index] = redirect is None and reply == 1
                statuses.append(redirect)
            return self._redirected(node, indices, statuses, hops)[0], 0

        groups = self._by_node(names, range(len(names)))
        if whole:
            self._each_node(_first_hops(groups), part)
            return found
        # Nodes come in the order of their first key, every key before it already answered.
        for node, indices in groups.items():
            if not all(found[: indices[0]]):
                break
            self._in_turn([(node, indices, False, 0)], part)
        return found

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        """Read ``keys`` into ``target`` on a read thread, under a deadline that starts now:
        a read still waiting for a thread ``timeout_ms`` after it was asked (behind reads
        of larger batches, or on a hung server) fails unsent, counted, so its caller
        waits no longer than its deadline."""
        keys = list(keys)
        asked = time.monotonic()
        with self._lock:  # close sets _closed under it: no call submits to a pool shut down
            if not self._closed:
                queued = _QueuedRead(
                    self._reads.submit(self._read, keys, target, asked),
                    asked + self.address.timeout_s,
                    len(keys),
                    self._unsent,
                )
                self._waiting.watch(queued)
                return queued.outcome
        return done_future([False] * len(keys))

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> int:
        """Encode and send on the I/O threads: one pipeline per ``chunk_bytes`` of the batch;
        nothing queued if the writes not done yet are at ``max_pending_write_bytes``. Returns
        how many blocks it queued (every key: the server's SET writes a held one again).

        Each pipeline waits for its replies before its thread takes the next
        job, so small pipelines leave the link idle: 16 MiB ones stored at 0.72
        of plain SET, one per 256 MiB batch at 0.87 (medians of 8 rounds, dev VM).
        """
        keys, payloads = list(keys), list(payloads)
        size = payload_size(payloads[0]) if payloads else 0
        step = max(1, self._chunk_bytes // max(1, size))
        with self._lock:
            if not self._closed:
                if self._backlog.is_full:
                    self.skipped_backlog += len(keys)
                else:
                    for start in range(0, len(keys), step):
                        chunk = keys[start : start + step]
                        release = self._backlog.hold(size * len(chunk))
                        job = self._pool.submit(
                            self._write_then, release, chunk, payloads[start : start + step]
                        )
                        self._writes.append((chunk, job))
                    return len(keys)
        self.stats.add(failed=len(keys))
        return 0

    def has_pending_work(self) -> bool:
        """Writes not yet polled (read under the tier's lock, as its other calls take it)."""
        with self._lock:
            return bool(self._writes)

    def poll(self, wait: bool) -> None:
        """Count (and tell, as events) the writes that finished; with ``wait``, first wait
        for every write submitted before the call.

        The wait is outside the tier's lock, so a poll waiting on the network holds up no
        write, read or poll of another thread; the job table is then split into finished
        and running, and the finished ones counted, under it, so no job is counted twice
        or dropped, and a waiting poll returns only once its jobs are counted, whichever
        thread's poll took them."""
        if wait:
            self.wait_written()
        with self._lock:
            finished: list[_WriteJob] = []
            running: list[_WriteJob] = []
            for entry in self._writes:
                (finished if entry[1].done() else running).append(entry)
            self._writes = running
            for keys, job in finished:
                stored = [key for key, ok in zip(keys, job.result(), strict=True) if ok]
                self.stats.add(stored_blocks=len(stored), failed=len(keys) - len(stored))
                if stored:
                    self._events.record(stored, MEDIUM, removed=False)

    def wait_written(self) -> None:
        """Wait until the write pipelines submitted so far are done or past their deadline
        (each ends by its own, from when its thread takes it up): they go out on the I/O
        threads after :meth:`write` returns. Outside the tier's lock, counting none of
        them: the next :meth:`poll` does."""
        with self._lock:
            submitted = [job for _, job in self._writes]
        futures_wait(submitted)

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:  # a poll's event recorded meanwhile lands in the next list
            return self._events.take()

    def close(self) -> None:
        """Finish the writes under way, then close every connection. A read or write on
        another thread (SGLang's prefetch reads without a lock) is either submitted before
        ``_closed`` is set, and finished here, or fails counted: none reaches the I/O pool
        once it is shut down (that raised ``RuntimeError`` into the caller)."""
        with self._lock:
            self._closed = True
        self.poll(wait=True)
        self._pool.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self._waiting.close()
        self._ahead.shutdown(wait=True)
        self._per_node.shutdown(wait=True)
        with self._lock:
            refresher = self._refresher
        if refresher is not None:
            refresher.join()  # within its deadline; no new one starts once closed
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    def delete_all(self) -> int:
        """Delete every block under this tier's fingerprint (for tests and resets); none
        once closed. Each node's names are scanned, then deleted where the slot map puts
        them, a redirected DEL followed (a slot moved meanwhile, a node now a replica), one
        answered ``CLUSTERDOWN`` (a failover under way) asked again until its page's
        deadline."""
        deleted = 0
        if self._closed:
            return deleted
        for node in self._primaries():
            cursor = b"0"
            while True:  # a deadline per page: a large keyspace takes many
                deadline = self._deadline(0)
                page = self._call(node, partial(self._scan_page, cursor), deadline)
                if page is None:
                    break
                cursor, names = page
                deleted += self._delete_names(names, deadline, until_served=True)
                if cursor == b"0":
                    break
        return deleted

    def node_address(self, name: bytes) -> tuple[str, int]:
        """``(host, port)`` of the node that holds ``name``."""
        node = self._node_of(name)
        return node.host, node.port

    def open_socket(self, name: bytes) -> socket.socket:
        """A socket to the node holding ``name``, past TLS, AUTH and SELECT; the caller
        owns it. For the benchmark's raw-socket baseline."""
        node = self._node_of(name)
        connection = self._open(node.host, node.port, self._deadline(0))
        return connection.sock

    # The one funnel of every runtime operation.

    def _deadline(self, size: int, since: float | None = None) -> Deadline:
        """One operation's deadline: ``timeout_ms`` plus its ``size`` bytes at
        :data:`SLOWEST_LINK`, from ``since`` (default: now)."""
        return Deadline(self.address.timeout_s + size / SLOWEST_LINK, since)

    def _call(
        self,
        node: _Node,
        op: Callable[[Connection, Deadline], T],
        deadline: Deadline,
        lane: CircuitBreaker | None = None,
    ) -> T | None:
        """``op`` on a connection to ``node`` through its breaker (and ``lane``, the node's
        read or write breaker, for a read or a write: both must let it through, and both
        count its outcome), before the operation's ``deadline``; ``None`` if refused or
        failed (counted). One that finds the deadline passed (spent on other nodes) is not
        tried: no failure of this node's. Nor is one that runs out of time having begun with
        less left than the operation had spent: had the node been first, it would have had
        longer than the earlier nodes took, so they are the slow ones, and a healthy node
        left a sliver by a slow one would otherwise have its breaker opened by it. Unless it
        failed its last call too (its breaker still closed): asked last for that, it would
        be excused every time behind slow nodes, and its breaker never open however long it
        hung. An error reply fails the call but is no failure of the node's: a full server
        (``OOM``, maxmemory with ``noeviction``) refusing stores opened its breaker, and its
        loads were refused with them. An ``OOM`` or ``MISCONF`` rests the node from stores instead
        (:meth:`_Node.is_resting`); a ``CLUSTERDOWN`` has the slot map asked again
        (:data:`NOT_SERVED`); a ``READONLY`` has the node's name looked up again
        (:data:`DEMOTED`)."""
        if deadline.passed():
            with self._lock:
                self.unavailable += 1
            return None
        breakers = (node.breaker,) if lane is None else (lane, node.breaker)
        granted = _allow(breakers)
        if granted is None:
            with self._lock:
                self.unavailable += 1
            self._refresh_map_soon(node)
            return None
        with self._lock:
            node.calls += 1
        try:
            return self._call_on(node, op, deadline, granted)
        finally:
            with self._lock:
                node.calls -= 1

    def _call_on(
        self,
        node: _Node,
        op: Callable[[Connection, Deadline], T],
        deadline: Deadline,
        granted: list[tuple[CircuitBreaker, Pass]],
    ) -> T | None:
        """:meth:`_call`'s part once its breakers let it through (``granted``: each with
        the call's pass)."""
        begun = time.monotonic()
        connection = None
        try:
            connection = node.take() or self._open(node.host, node.port, deadline)
            result = op(connection, deadline)
        except Exception as exc:  # any socket, TLS or protocol failure is the server's
            if connection is not None:
                connection.close()
            # A node asked last for a failed last call (_first_hops) is no slow one's victim.
            starved = deadline.at - begun < begun - deadline.since and not any(
                breaker.failing and not breaker.is_open for breaker, _ in granted
            )
            if isinstance(exc, ServerReplyError):  # an answer: the node is up (full, loading)
                for breaker, ticket in granted:
                    breaker.success(ticket)
                if exc.code in REFUSES_STORES:
                    node.full_at = time.monotonic()
                elif exc.code == NOT_SERVED:
                    self._refresh_map_soon(node)
                elif exc.code == DEMOTED:
                    node.drop_idle()
                    self._resolver.expire(node.host, node.port)
            elif starved and deadline.passed():
                for breaker, ticket in granted:
                    breaker.excuse(ticket)
            else:
                for breaker, ticket in granted:
                    breaker.failure(ticket)
                self._refresh_map_soon(node)
            with self._lock:
                self.unavailable += 1
            return None
        node.give(connection)
        for breaker, ticket in granted:
            breaker.success(ticket)
        return result

    def _each_node(self, jobs: list[_Job], part: _Part) -> int:
        """``part`` of each of ``jobs`` (an operation's, one per node, under its one deadline)
        and of the jobs it leads to, every node's on a thread of its own: a node that hangs
        costs its own keys only. Asked one after another, the first operation after a node
        hung (nothing yet known to ask it last, :func:`_failing`) spent the whole deadline
        on it whenever it came first, and the nodes after it were left none: their blocks
        failed, read as absent or went unstored. What the parts counted, summed."""
        with self._lock:  # close sets _closed under it: nothing reaches a pool shut down
            handed = [] if self._closed else jobs[1:]
            asked = [self._per_node.submit(self._in_turn, [job], part) for job in handed]
        try:
            counted = self._in_turn(jobs[:1] if handed else jobs, part)
        finally:
            futures_wait(asked)
        return counted + sum(future.result() for future in asked)

    def _in_turn(self, jobs: list[_Job], part: _Part) -> int:
        """``part`` of each of ``jobs`` and of the jobs it leads to, one after another, on this
        thread; what they counted, summed."""
        counted = 0
        while jobs:
            more, count = part(jobs.pop())
            jobs += more
            counted += count
        return counted

    def _open(self, host: str, port: int, deadline: Deadline) -> Connection:
        return Connection.open(
            host, port, self._credentials, self._tls.get(), deadline, self._resolver
        )

    # Start-up: one deadline, clear errors.

    def _start(self) -> bool:
        """Connect to the first seed that answers and takes the tier, all seeds under one
        deadline (hung ones would otherwise cost ``timeout_ms`` each); whether it is a
        Cluster. A seed that refuses the connection with an error reply (``LOADING`` while
        it restarts, at ``maxclients``) is passed over like one that does not answer; a
        wrong password or a failed TLS handshake ends start-up at once, as every node
        shares them."""
        where = self.address.redacted()
        last: ConnectError | None = None
        deadline = Deadline(self.address.timeout_s)
        for host, port in self.address.hosts:
            try:
                connection = self._open(host, port, deadline)
            except ConnectError as exc:
                if exc.kind not in ("network", "resolve", "server"):
                    raise _start_error(exc, self.address, where) from None
                last = exc
                continue
            try:
                cluster = self._discover(host, port, connection, deadline)
                self._check_commands(connection, deadline, cluster)
            except (OSError, ServerReplyError) as exc:
                connection.close()
                # A reply we refuse is the server's doing, not the network's.
                refused = isinstance(exc, (ServerReplyError, ProtocolError))
                kind = "server" if refused else "network"
                last = ConnectError(kind, str(exc) or type(exc).__name__)
                continue
            node = self._node(host, port, None if cluster else self.breaker)
            node.give(connection)
            if not cluster:
                self._server = node
            return cluster
        assert last is not None
        raise _start_error(last, self.address, where) from None

    def _discover(self, host: str, port: int, connection: Connection, deadline: Deadline) -> bool:
        """Ask whether the server runs in Cluster mode (unless the URL says); if so, its
        slot map."""
        cluster = self.address.cluster
        if cluster is None:
            connection.send([command("INFO", "cluster")], deadline)
            info = _ok(connection.read_reply(deadline))
            cluster = isinstance(info, bytes) and b"cluster_enabled:1" in info
        if cluster:
            self._learn_slots(host, connection, deadline)
        return cluster

    def _check_commands(self, connection: Connection, deadline: Deadline, cluster: bool) -> None:
        """:class:`ServerReplyError` if the server refuses the commands the tier runs on its
        names: an ACL that denies one (``NOPERM``), a read-only replica, or a command
        renamed or disabled by ``rename-command`` (unknown). Such a tier started, then
        failed every lookup or store, counted, with no word of why. The probe name is never
        a block's (those end in hex); ``SET ... XX`` of an absent name writes nothing, and a
        redirection means the command was allowed. A Cluster's ``ASKING`` is probed first
        (the EXISTS after it takes its flag): refused, every block of a slot being migrated
        failed, counted, for as long as the migration ran."""
        probe = self._prefix + b"probe"
        probes = {"ASKING": ASKING} if cluster else {}
        probes |= {
            "EXISTS": command(b"EXISTS", probe),
            "GET": command(b"GET", probe),
            "SET": command(b"SET", probe, b"", b"XX"),
            "DEL": command(b"DEL", probe),
        }
        asking = " (and ASKING in a Cluster)" if cluster else ""
        connection.send([b"".join(probes.values())], deadline)
        replies = [connection.read_reply(deadline, MAX_LINE) for _ in probes]
        for name, reply in zip(probes, replies, strict=True):
            if not isinstance(reply, ErrorReply):
                continue
            if reply.code == "ERR" and "unknown command" in reply.message:
                raise ServerReplyError(
                    f"the server does not know {name}, renamed or disabled (rename-command):"
                    f" the tier needs EXISTS, GET, SET and DEL{asking} under their own names"
                )
            if reply.code == "NOPERM":
                raise ServerReplyError(
                    f"the user may not run the tier's commands ({reply.message}): it needs "
                    f"EXISTS, GET, SET and DEL on keys kvo{TRAILED_VERSION}:*{asking}"
                )
            if reply.code == "READONLY":
                raise ServerReplyError(
                    f"the server is a read-only replica ({reply.message}): give its primary"
                )

    def _learn_slots(self, seed_host: str, connection: Connection, deadline: Deadline) -> None:
        """The slot map from the CLUSTER SLOTS of the node ``connection`` reaches, put in
        use; the known nodes it leaves out, and no call uses, are forgotten (pods given new
        addresses over a long run filled :data:`MAX_NODES` with addresses long gone, and
        every map and redirection to a new node was refused from then on)."""
        connection.send([command("CLUSTER", "SLOTS")], deadline)
        owners = self._slot_map(_ok(connection.read_reply(deadline)), seed_host)
        in_map = set(owners)
        with self._lock:
            self._slots = owners
            gone = [n for n in self._nodes.values() if n not in in_map and not n.calls]
            for node in gone:
                del self._nodes[(node.host, node.port)]
        for node in gone:
            node.close()
            if (node.host, node.port) not in self.address.hosts:  # a seed's is kept for refreshes
                self._resolver.forget(node.host, node.port)

    def _slot_map(self, reply: Reply, seed_host: str) -> list[_Node]:
        """Owner of each slot from CLUSTER SLOTS; a slot nobody owns goes to the first node.
        A reply of another shape, or one that would make the tier know more than
        :data:`MAX_NODES` nodes (those it names, and known ones a call still uses), is
        :class:`ServerReplyError`, start-up's one-line error."""
        if not isinstance(reply, list) or not reply:
            raise ServerReplyError("CLUSTER SLOTS named no slots")
        ranges = [_slot_range(entry) for entry in reply]
        named = {(host or seed_host, port) for *_, host, port in ranges}
        with self._lock:
            busy = {address for address, node in self._nodes.items() if node.calls}
        if len(named | busy) > MAX_NODES:
            raise ServerReplyError(f"CLUSTER SLOTS named more than {MAX_NODES} nodes")
        owners: list[_Node | None] = [None] * SLOTS
        for low, high, host, port in ranges:
            node = self._node(host or seed_host, port)
            for slot in range(max(0, low), min(SLOTS - 1, high) + 1):
                owners[slot] = node
        first = next((node for node in owners if node is not None), None)
        if first is None:
            raise ServerReplyError(f"CLUSTER SLOTS named no slot from 0 to {SLOTS - 1}")
        return [node or first for node in owners]

    def _refresh_map_soon(self, failed: _Node | None) -> None:
        """After Cluster node ``failed`` failed or was refused, or a ``MOVED`` (``None``):
        ask for the slot map again on a thread of its own (the caller may be the scheduler's;
        an I/O thread would be taken from loads and stores for up to a deadline), one
        refresh at a time and at most one per :data:`MAP_REFRESH_S`."""
        if self._slots is None:
            return
        with self._lock:
            now = time.monotonic()
            running = self._refresher is not None and self._refresher.is_alive()
            if self._closed or running or now - self._refreshed_at < MAP_REFRESH_S:
                return
            self._refreshed_at = now
            self._refresher = threading.Thread(
                target=self._refresh_map, args=(failed,), name="kvoffload-remote-map", daemon=True
            )
            self._refresher.start()

    def _refresh_map(self, failed: _Node | None) -> None:
        """Ask the other known nodes whose breakers are closed for CLUSTER SLOTS, in turn
        under one deadline (the map's own nodes first: a node the map left may be gone for
        good), then the URL's seeds the tier does not know (a map forgets the seed it was
        learnt from when it names the node otherwise, and a name, unlike a pod's address,
        outlives every node's restart), until one answers; its map replaces the one in use.
        Each address connects within its share of the time left (:data:`MAP_ASK_SHARES`),
        then has the rest of it for the map. Upkeep, not an operation: no node's breaker
        nor :attr:`unavailable` counts its failures, and it asks on a connection of its
        own, so it never holds one an operation would take."""
        with self._lock:
            known = list(self._nodes.values())
        in_order = dict.fromkeys([*self._primaries(), *known])
        addresses = [
            (node.host, node.port)
            for node in in_order
            if node is not failed and not node.breaker.is_open
        ]
        seen = {(node.host, node.port) for node in in_order}
        addresses += [seed for seed in self.address.hosts if seed not in seen]
        deadline = self._deadline(0)
        for asked, (host, port) in enumerate(addresses):
            if deadline.passed():
                return
            connect_by = deadline.share(min(len(addresses) - asked, MAP_ASK_SHARES))
            try:
                connection = self._open(host, port, connect_by)
                try:
                    self._learn_slots(host, connection, deadline)
                finally:
                    connection.close()
            except Exception:  # this node cannot tell: the next one is asked
                continue
            return

    # Nodes and slots.

    def _node(self, host: str, port: int, breaker: CircuitBreaker | None = None) -> _Node:
        """The node at ``host:port``, made on first use with ``breaker`` (default: a fresh one);
        one made after :meth:`close` (a lookup that outlasts it following a redirection) is
        closed from the start, so the connection it lends is closed after use, not kept."""
        with self._lock:
            node = self._nodes.get((host, port))
            if node is None:
                node = _Node(host, port, breaker or self.breaker.fresh())
                if self._closed:
                    node.close()
                self._nodes[(host, port)] = node
            return node

    def _node_of(self, name: bytes) -> _Node:
        """The node that holds ``name``: the server, or the owner of its Cluster slot."""
        if self._slots is None:
            assert self._server is not None
            return self._server
        return self._slots[binascii.crc_hqx(name, 0) % SLOTS]

    def _primaries(self) -> list[_Node]:
        if self._slots is None:
            return [self._node_of(b"")]
        return list(dict.fromkeys(self._slots))

    def _by_node(self, names: Sequence[bytes], indices: Sequence[int]) -> dict[_Node, list[int]]:
        groups: dict[_Node, list[int]] = {}
        for index in indices:
            groups.setdefault(self._node_of(names[index]), []).append(index)
        return groups

    def _follow(self, redirect: _Redirect, node: _Node) -> _Node:
        """The node a redirection names; a MOVED one also updates the slot map and has the
        whole map asked again (a resharding moves many slots: each would cost a redirection
        of its own). Past :data:`MAX_NODES` known nodes a new one is not made: ``node`` is
        asked again, and the map too (it forgets the nodes that left, if any)."""
        host, port = redirect.address
        address = (host or node.host, port)
        with self._lock:
            full = address not in self._nodes and len(self._nodes) >= MAX_NODES
        if full:
            self._refresh_map_soon(None)
            return node  # asked again, it redirects again: failed past MAX_HOPS
        target = self._node(*address)
        if not redirect.ask and self._slots is not None:
            with self._lock:  # not if a new map forgot it meanwhile: that map is newer
                if self._nodes.get(address) is target:
                    self._slots[redirect.slot] = target
            self._refresh_map_soon(None)
        return target

    def _redirected(
        self, node: _Node, indices: list[int], statuses: Sequence[object], hops: int
    ) -> tuple[list[_Job], int]:
        """The jobs that follow the redirections among ``statuses`` (the replies of
        ``indices`` on ``node``, those keys redirected ``hops`` times so far), one per node
        they point to and kind (``ASK`` for one command, or ``MOVED``); and how many
        redirected keys are not asked again, being past :data:`MAX_HOPS`. Shared by the
        reads, stores and deletions, so all three follow redirections alike."""
        moved: dict[tuple[_Node, bool], list[int]] = {}
        for index, status in zip(indices, statuses, strict=True):
            if isinstance(status, _Redirect):
                moved.setdefault((self._follow(status, node), status.ask), []).append(index)
        if hops == MAX_HOPS:
            return [], sum(len(again) for again in moved.values())
        return [(where, again, ask, hops + 1) for (where, ask), again in moved.items()], 0

    # One node's part of an operation, each on one connection under its deadline.

    def _exists(
        self,
        names: list[bytes],
        indices: list[int],
        asking: bool,
        connection: Connection,
        deadline: Deadline,
    ) -> list[Reply]:
        """EXISTS each name (after ASKING, with ``asking``): its reply, or its redirection."""
        prefix = ASKING if asking else b""
        connection.send(
            [b"".join(prefix + command(b"EXISTS", names[i]) for i in indices)], deadline
        )
        replies = []
        for _ in indices:
            if asking:
                _ok(connection.read_reply(deadline, MAX_LINE))
            replies.append(connection.read_reply(deadline, MAX_LINE))
        for reply in replies:
            if isinstance(reply, ErrorReply) and _redirect(reply) is None:
                raise ServerReplyError(reply.message)
        return replies

    def _unsent(self, blocks: int) -> None:
        """A read of ``blocks`` failed unsent, its deadline come while it waited."""
        with self._lock:
            self.unavailable += 1
        self.stats.add(failed=blocks)

    def _read(self, keys: list[OffloadKey], target: Target, asked: float) -> list[bool]:
        names = [self.name(key) for key in keys]
        views = [destination_parts(target, i) for i in range(len(keys))]
        outcome = [False] * len(keys)
        corrupt: list[int] = []
        failed = sum(view is None for view in views)
        sizes = [0 if view is None else sum(part.nbytes for part in view) for view in views]
        readable = [i for i, view in enumerate(views) if view is not None]
        deadline = self._deadline(sum(len(names[i]) + sizes[i] for i in readable), asked)

        def part(job: _Job) -> tuple[list[_Job], int]:
            node, indices, asking, hops = job
            get = partial(self._get_into, keys, names, views, sizes, indices, asking)
            statuses = self._call(node, get, deadline, node.reads)
            if statuses is None:
                return [], len(indices)
            again = [i for i, status in zip(indices, statuses, strict=True) if status == _AGAIN]
            for index, status in zip(indices, statuses, strict=True):
                if status == _HIT:
                    outcome[index] = True
                elif status == _CORRUPT:
                    corrupt.append(index)
            followed, lost = self._redirected(node, indices, statuses, hops)
            if again:
                followed.append((node, again, asking, hops))
            return followed, lost

        jobs = _first_hops(self._by_node(names, readable), lambda node: node.reads)
        failed += self._each_node(jobs, part)
        if corrupt:
            self._delete_corrupt([names[i] for i in corrupt], deadline)
        self.stats.add(hit_blocks=sum(outcome), corrupt=len(corrupt), failed=failed)
        return outcome

    def _delete_corrupt(self, names: list[bytes], deadline: Deadline) -> None:
        """Delete the values ``names`` a read found corrupt: in what is left of its
        ``deadline``, or, if none is, on a write thread under a deadline of their own (left
        in place, each was held by every lookup and failed by every read of it, until one
        found it with time to spare)."""
        if not deadline.passed():
            self._delete_names(names, deadline)
            return
        with self._lock:  # close sets _closed under it: no call submits to a pool shut down
            if not self._closed:
                self._pool.submit(lambda: self._delete_names(names, self._deadline(0)))

    def _delete_names(
        self, names: list[bytes], deadline: Deadline, until_served: bool = False
    ) -> int:
        """DEL each of ``names`` on its node, a redirected one where it points (after ASKING
        for an ``ASK``), at most :data:`MAX_HOPS` times; how many the servers deleted. A
        name answered ``CLUSTERDOWN`` has the slot map asked again; ``until_served``: it is
        asked again too, every :data:`NOT_SERVED_PAUSE_S`, until ``deadline`` (a read's
        corrupt names are not: the read would wait for them)."""

        def part(job: _Job) -> tuple[list[_Job], int]:
            node, indices, asking, hops = job
            replies = self._call(node, partial(self._delete, names, indices, asking), deadline)
            if replies is None:
                return [], 0
            deleted = 0
            unserved: list[int] = []
            for index, reply in zip(indices, replies, strict=True):
                if reply is None:
                    unserved.append(index)
                elif not isinstance(reply, _Redirect):
                    deleted += reply
            jobs = self._redirected(node, indices, replies, hops)[0]
            if unserved:
                self._refresh_map_soon(node)
                if until_served:
                    time.sleep(max(0.0, min(NOT_SERVED_PAUSE_S, deadline.at - time.monotonic())))
                    jobs += [
                        (where, got, False, hops)
                        for where, got in self._by_node(names, unserved).items()
                    ]
            return jobs, deleted

        return self._each_node(_first_hops(self._by_node(names, range(len(names)))), part)

    def _get_into(
        self,
        keys: list[OffloadKey],
        names: list[bytes],
        views: list[list[memoryview] | None],
        sizes: list[int],
        indices: list[int],
        asking: bool,
        connection: Connection,
        deadline: Deadline,
    ) -> list[_Status]:
        """GET each value straight into its view: the length first (a wrong one is refused
        unread), then header and key (checked), then the payload, checksummed in place.
        The GETs go out :data:`READ_WINDOW` bytes of values ahead of those received."""
        prefix = ASKING if asking else b""
        gets = [prefix + command(b"GET", names[i]) for i in indices]
        sent = 0
        ahead = 0  # bytes of the values asked for and not yet received
        statuses: list[_Status] = []
        for position, index in enumerate(indices):
            if sent < len(indices) and ahead <= READ_WINDOW // 2:
                first = sent
                while sent < len(indices) and (
                    sent == position or ahead + sizes[indices[sent]] <= READ_WINDOW
                ):
                    ahead += sizes[indices[sent]]
                    sent += 1
                connection.send([b"".join(gets[first:sent])], deadline)
            size = sizes[index]
            ahead -= size
            if asking:
                _ok(connection.read_reply(deadline, MAX_LINE))
            view = views[index]
            assert view is not None
            large = size >= DIRECT_BELOW
            length = connection.read_bulk_length(deadline, large)
            if isinstance(length, ErrorReply):
                statuses.append(_read_error(length))
                continue
            if length < 0:
                statuses.append(_MISS)
                continue
            key = keys[index]
            if length != HEADER_BYTES + len(key) + size + TRAILER_BYTES:
                statuses.append(_CORRUPT)
                if length > SKIP_BELOW:  # never read: the rest of the batch goes again
                    connection.broken = True
                    statuses += [_AGAIN] * (len(indices) - position - 1)
                    return statuses
                connection.skip(length, deadline)
                connection.end_of_value(deadline, large)
                continue
            statuses.append(self._receive(connection, deadline, key, view, size, large))
        return statuses

    def _receive(
        self,
        connection: Connection,
        deadline: Deadline,
        key: OffloadKey,
        view: list[memoryview],
        size: int,
        large: bool,
    ) -> _Status:
        """Header and key (checked), then the payload into the parts of ``view`` in order,
        checksummed as it lands, then the digest it must have. ``large``: receive nothing
        past the header into the connection's buffer, so the payload is copied once, by
        the kernel."""
        most = PEEK if large else CHUNK
        head = bytearray(HEADER_BYTES + len(key))
        connection.read_into(memoryview(head), deadline, most=most)
        try:
            header = parse_header(head, TRAILED_VERSION)
            header.check(key, self.fingerprint)
        except CorruptBlockError:
            header = None
        digest = payload_hasher()
        # A bad block's bytes land in a slot nobody loads.
        if len(view) == 1:
            connection.read_into(view[0], deadline, digest)
        else:
            connection.read_parts_into(view, deadline, digest)
        trailer = bytearray(TRAILER_BYTES)
        connection.read_into(memoryview(trailer), deadline, most=most)
        connection.end_of_value(deadline, large)
        if header is None or header.payload_bytes != size:
            return _CORRUPT
        return _HIT if digest.intdigest() == parse_trailer(trailer) else _CORRUPT

    def _delete(
        self,
        names: list[bytes],
        indices: list[int],
        asking: bool,
        connection: Connection,
        deadline: Deadline,
    ) -> list[int | _Redirect | None]:
        """DEL each name (one each: a Cluster refuses one over several slots): how many it
        deleted (0 or 1), its redirection, or ``None`` where the node answered ``CLUSTERDOWN``
        (the others are deleted all the same)."""
        prefix = ASKING if asking else b""
        connection.send([b"".join(prefix + command(b"DEL", names[i]) for i in indices)], deadline)
        replies: list[Reply] = []
        for _ in indices:
            if asking:
                _ok(connection.read_reply(deadline, MAX_LINE))
            replies.append(connection.read_reply(deadline, MAX_LINE))
        counts: list[int | _Redirect | None] = []
        for reply in replies:
            if isinstance(reply, ErrorReply) and reply.code == NOT_SERVED:
                counts.append(None)
                continue
            redirect = _redirect(reply) if isinstance(reply, ErrorReply) else None
            counts.append(redirect or int(_ok(reply) == 1))
        return counts

    def _scan_page(
        self, cursor: bytes, connection: Connection, deadline: Deadline
    ) -> tuple[bytes, list[bytes]]:
        """One SCAN page of this tier's names; the next cursor (``b"0"``: done)."""
        connection.send(
            [command(b"SCAN", cursor, b"MATCH", self._prefix + b"*", b"COUNT", 1000)], deadline
        )
        reply = _ok(connection.read_reply(deadline))
        if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[1], list):
            raise ServerReplyError("SCAN gave a reply of an unknown shape")
        found = [name for name in reply[1] if isinstance(name, bytes)]
        return (reply[0] if isinstance(reply[0], bytes) else b"0"), found

    def _write_then(
        self, release: Callable[[], None], keys: list[OffloadKey], payloads: list[bytes]
    ) -> list[bool]:
        """:meth:`_write`, then its bytes out of the backlog before its future says it is
        done, so a waiting poll returns with them out."""
        try:
            return self._write(keys, payloads)
        finally:
            release()

    def _write(self, keys: list[OffloadKey], payloads: list[bytes]) -> list[bool]:
        writes = [
            BlockWrite(self.name(key), key, payload)
            for key, payload in zip(keys, payloads, strict=True)
        ]
        names = [write.name for write in writes]
        deadline = self._deadline(sum(payload_size(write.payload) for write in writes))
        stored = [False] * len(writes)

        def part(job: _Job) -> tuple[list[_Job], int]:
            node, indices, asking, hops = job
            if node.is_resting():
                with self._lock:
                    self.skipped_full += len(indices)
                return [], 0
            batch = [writes[i] for i in indices]
            set_all = partial(self._set_all, batch, asking)
            statuses = self._call(node, set_all, deadline, node.writes)
            if statuses is None:
                return [], 0
            for index, status in zip(indices, statuses, strict=True):
                if not isinstance(status, _Redirect):
                    stored[index] = True
            return self._redirected(node, indices, statuses, hops)[0], 0

        jobs = _first_hops(self._by_node(names, range(len(writes))), lambda node: node.writes)
        self._each_node(jobs, part)
        return stored

    def _set_all(
        self, writes: list[BlockWrite], asking: bool, connection: Connection, deadline: Deadline
    ) -> list[_Status]:
        """SET every write, then read every reply; an error reply (other than a redirection)
        fails the whole pipeline, as in the client library."""
        if asking:
            for write in writes:
                connection.send([ASKING, *pack_sets([write], self.fingerprint)], deadline)
        else:
            ahead = DigestsAhead(writes, self._ahead, deadline)
            try:
                connection.send(pack_sets(writes, self.fingerprint, ahead), deadline)
            finally:
                ahead.stop()
        statuses: list[_Status] = []
        error: ErrorReply | None = None
        for _ in writes:
            if asking:
                _ok(connection.read_reply(deadline, MAX_LINE))
            reply = connection.read_reply(deadline, MAX_LINE)
            redirect = _redirect(reply) if isinstance(reply, ErrorReply) else None
            if isinstance(reply, ErrorReply) and redirect is None:
                error = error or reply
            statuses.append(redirect or _HIT)
        if error is not None:
            raise ServerReplyError(error.message)
        return statuses


class _QueuedRead:
    """A read on the read threads and the future its caller holds: the read's, or, if no
    thread took the read by ``deadline``, a failure (counted by ``unsent``)."""

    __slots__ = ("blocks", "deadline", "future", "outcome", "unsent")

    def __init__(
        self,
        future: Future[list[bool]],
        deadline: float,
        blocks: int,
        unsent: Callable[[int], None],
    ) -> None:
        self.future = future
        self.deadline = deadline
        self.blocks = blocks
        self.unsent = unsent
        self.outcome: Future[list[bool]] = Future()
        future.add_done_callback(self._done)

    def expire(self) -> None:
        """The deadline came: the read fails unless a thread took it (it then ends by it)."""
        self.future.cancel()

    def _done(self, future: Future[list[bool]]) -> None:
        if future.cancelled():
            self.unsent(self.blocks)
            self.outcome.set_result([False] * self.blocks)
        elif (error := future.exception()) is not None:
            self.outcome.set_exception(error)
        else:
            self.outcome.set_result(future.result())


def _failing(node: _Node, lane: Callable[[_Node], CircuitBreaker] | None = None) -> bool:
    """Whether ``node``'s last call, or last call of ``lane`` (its reads or its writes: a
    node that drips values still answers look-ups), failed."""
    return node.breaker.failing or (lane is not None and lane(node).failing)


def _first_hops(
    groups: dict[_Node, list[int]], lane: Callable[[_Node], CircuitBreaker] | None = None
) -> list[_Job]:
    """The jobs of each node's part, unredirected, as a stack popped from its end: a
    :func:`_failing` node (hung, paused, partitioned) after the others, so that asked in
    turn (the tier closed) it spends only the time they left, and asked at once it is the
    part the operation's own thread asks, the others handed to the node threads first
    (:meth:`RemoteTier._each_node`)."""
    jobs: list[_Job] = [(node, got, False, 0) for node, got in groups.items()]
    return sorted(jobs, key=lambda job: not _failing(job[0], lane))


def _allow(breakers: tuple[CircuitBreaker, ...]) -> list[tuple[CircuitBreaker, Pass]] | None:
    """Each of ``breakers`` with the pass it let a call through with, if every one did;
    when one refuses, the trial an earlier one let through is handed back
    (:meth:`CircuitBreaker.excuse`)."""
    granted: list[tuple[CircuitBreaker, Pass]] = []
    for breaker in breakers:
        ticket = breaker.allow()
        if ticket is None:
            for earlier, given in granted:
                earlier.excuse(given)
            return None
        granted.append((breaker, ticket))
    return granted


def _ok(reply: Reply) -> Reply:
    """``reply``, unless it is an error reply: then :class:`ServerReplyError`."""
    if isinstance(reply, ErrorReply):
        raise ServerReplyError(reply.message)
    return reply


def _redirect(reply: ErrorReply) -> _Redirect | None:
    """The redirection in ``-MOVED 3999 host:port`` or ``-ASK 3999 host:port`` (``None``:
    not one, or to no TCP port). A host of ``""`` or ``?`` (a node without the host name a
    Cluster with ``cluster-preferred-endpoint-type hostname`` announces) is the answering
    node's, as CLUSTER SLOTS' is the seed's: ``?`` was looked up as a name, and every key
    of the slot failed until the next slot map."""
    parts = reply.message.split()
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    host = host.strip("[]")
    try:
        number = int(port)
        address = ("" if host == "?" else host, number)
        redirect = _Redirect(int(parts[1]) % SLOTS, address, parts[0] == "ASK")
    except ValueError:
        return None
    return redirect if 0 < number <= MAX_PORT else None  # no TCP port: an error, not a node


def _slot_range(entry: Reply) -> tuple[int, int, str, int]:
    """``low, high, host, port`` of one CLUSTER SLOTS entry (host ``""``: the seed's, as a
    node that does not know its own address announces it)."""
    if not isinstance(entry, list) or len(entry) < 3:
        raise ServerReplyError("CLUSTER SLOTS gave an entry of an unknown shape")
    low, high, node = entry[:3]
    if not (isinstance(node, list) and len(node) >= 2):
        raise ServerReplyError("CLUSTER SLOTS gave an entry of an unknown shape")
    host, port = node[:2]
    if not (
        isinstance(low, int)
        and isinstance(high, int)
        and isinstance(port, int)
        and (host is None or isinstance(host, bytes))
    ):
        raise ServerReplyError("CLUSTER SLOTS gave an entry of an unknown shape")
    if not 0 < port <= MAX_PORT:
        raise ServerReplyError(f"CLUSTER SLOTS named a node at port {port}")
    if host is None or host in (b"", b"?"):
        return low, high, "", port
    try:
        return low, high, host.decode("ascii"), port
    except UnicodeDecodeError:
        raise ServerReplyError("CLUSTER SLOTS named a host that is not ASCII") from None


def _read_error(reply: ErrorReply) -> _Status:
    """A GET's error reply: a redirection; a value of another type (planted) is corrupt;
    anything else fails the call."""
    redirect = _redirect(reply)
    if redirect is not None:
        return redirect
    if reply.code == "WRONGTYPE":
        return _CORRUPT
    raise ServerReplyError(reply.message)


def _tls_contexts(credentials: Credentials, where: str) -> TLSContexts:
    try:
        return TLSContexts(credentials)
    except (OSError, ssl.SSLError) as exc:
        raise RemoteTierError(f"remote tier {where}: cannot load the TLS files ({exc})") from None


def _start_error(exc: ConnectError, address: RemoteAddress, where: str) -> RemoteTierError:
    """The one line that says why start-up failed (the password never in it)."""
    message = str(exc)
    if exc.kind == "auth":
        return RemoteTierError(f"remote tier {where}: authentication failed ({message})")
    if exc.kind in ("tls", "tls-refused"):
        has_cert = address.tls_options is not None and address.tls_options.certfile
        refused = exc.kind == "tls-refused" or (
            "alert" in message.lower() and "VERIFY_FAILED" not in message
        )
        hint = ""
        if refused and not has_cert:
            hint = " (if the server asks for a client certificate, give ssl_certfile=)"
        return RemoteTierError(f"remote tier {where}: TLS handshake failed ({message}){hint}")
    if exc.kind in ("server", "resolve"):
        return RemoteTierError(f"remote tier {where}: {message}")
    hint = "" if address.tls else " (if that port speaks TLS, use rediss://)"
    return RemoteTierError(f"remote tier {where} is not reachable: {message}{hint}")
