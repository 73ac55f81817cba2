"""``kvoffload bench tiers``: store and load GB/s of the disk and shared tiers, beside plain I/O.

Each tier is measured against the plainest way to move the same bytes, in
the same run: the disk tier against one sequential file written and read
back with ``write``/``readinto``; the shared tier against a raw socket per
node sending pipelined SETs and GETs and reading each GET reply with
``recv_into`` straight into its destination: what the link and the server
give. A load counts once the
bytes are in a destination buffer, as a promotion puts them in a CPU slot.
Each rate is the best of ``rounds`` and each ratio compares best rates; the
machines are shared and noisy, so the median of the rounds' own ratios
(each tier round against the plain round just before it) comes as well.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.keys import OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.memory import check_fits
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import layout_fingerprint
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.resp import ConnectError
from kvoffload.tiers.slot_file import DEFAULT_DEADLINE_S

MIB = 2**20
MIN_BLOCK_BYTES = 1024

Step = Callable[[], None]
"""Told after each plain or tier half of a round: what a progress bar counts."""


def _no_step() -> None:
    pass


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def shown_figure(value: float) -> str:
    """A rate or ratio of a bench table in two decimals, or two significant digits below
    0.1: a disk synced each batch at a few MB/s read "0.00" GB/s beside a ratio of it that
    the JSON holds and the table did not."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def scratch_path(directory: str | None) -> Path:
    """A fresh name for a benchmark's scratch directory under ``directory`` (default: the
    system's temporary one), not yet made. The caller makes it inside the ``try`` whose
    ``finally`` removes it: ``tempfile.mkdtemp`` makes the directory before it returns its
    name, so an interrupt (SIGTERM) in between left a directory nobody removed."""
    parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    return parent / f"kvoffload-bench-{secrets.token_hex(8)}"


class BenchBlocks:
    """``count`` distinct payloads of ``size`` bytes and one destination buffer for loads."""

    def __init__(self, count: int, size: int, payloads: list[bytes] | None = None) -> None:
        self.size = size
        if payloads is None:
            seed = os.urandom(size)
            payloads = [i.to_bytes(8, "little") + seed[8:] for i in range(count)]
        self.payloads = payloads
        """Given ``payloads`` (``count`` of ``size`` bytes) are benchmarked as they are."""
        self.buffer = bytearray(count * size)
        self.view = memoryview(self.buffer)
        self.total = count * size

    def keys(self, round_index: int) -> list[OffloadKey]:
        return [block_id_key(i, round_index) for i in range(len(self.payloads))]

    def target(self, index: int) -> memoryview:
        return self.view[index * self.size : (index + 1) * self.size]

    def clear(self) -> None:
        self.view[:] = bytes(len(self.buffer))

    def verify(self) -> None:
        for i, payload in enumerate(self.payloads):
            if self.view[i * self.size : (i + 1) * self.size] != payload:
                raise KVOffloadError(f"bench tiers: block {i} did not come back intact")


def measure_disk(
    blocks: BenchBlocks,
    directory: Path,
    rounds: int,
    fsync: bool = False,
    deadline_s: float = DEFAULT_DEADLINE_S,
    step: Step = _no_step,
) -> dict[str, float]:
    """Rounds alternate plain and tier; each round stores, loads, then deletes its bytes.

    With ``fsync`` the tier syncs each batch and the plain file is synced once
    it is written: both stores end when the bytes are durable.
    """
    fingerprint = layout_fingerprint("bench", layout_preset("tiny"), blocks.size)

    def plain(i: int) -> tuple[float, float]:
        path = directory / f"plain-{i}.bin"
        started = time.perf_counter()
        with open(path, "wb", buffering=0) as file:
            for payload in blocks.payloads:
                file.write(payload)
            if fsync:
                os.fsync(file.fileno())
        stored = time.perf_counter()
        with open(path, "rb", buffering=0) as file:
            for j in range(len(blocks.payloads)):
                file.readinto(blocks.target(j))
        loaded = time.perf_counter()
        path.unlink()
        return stored - started, loaded - stored

    def tier(i: int) -> tuple[float, float]:
        disk = DiskTier(
            directory / f"tier-{i}",
            len(blocks.payloads),
            fingerprint,
            fsync=fsync,
            deadline_s=deadline_s,
        )
        keys = blocks.keys(i)
        try:
            started = time.perf_counter()
            disk.write(keys, blocks.payloads)
            disk.poll(wait=True)
            stored = time.perf_counter()
            ok = disk.read(keys, blocks.target).result()
            loaded = time.perf_counter()
        finally:
            disk.close()
            shutil.rmtree(disk.directory, ignore_errors=True)
        if not all(ok):
            raise KVOffloadError("bench tiers: the disk tier lost blocks during the benchmark")
        return stored - started, loaded - stored

    plain_times, tier_times = _alternate(rounds, plain, tier, blocks, step)
    return _figures("disk", blocks.total, tier_times, plain_times)


def measure_remote(
    blocks: BenchBlocks, url: str, rounds: int, step: Step = _no_step
) -> dict[str, float]:
    """As :func:`measure_disk`, against a raw socket per node: pipelined SETs, then pipelined
    GETs each read with ``recv_into`` straight into its destination (no client library)."""
    fingerprint = layout_fingerprint("bench", layout_preset("tiny"), blocks.size)
    remote = RemoteTier(url, fingerprint)
    raw: RawSockets | None = None
    try:
        raw = RawSockets(remote)

        def plain(i: int) -> tuple[float, float]:
            return raw.round(i, blocks)

        def tier(i: int) -> tuple[float, float]:
            keys = blocks.keys(i)
            started = time.perf_counter()
            remote.write(keys, blocks.payloads)
            remote.poll(wait=True)
            stored = time.perf_counter()
            ok = remote.read(keys, blocks.target).result()
            loaded = time.perf_counter()
            remote.delete_all()
            if not all(ok):
                raise KVOffloadError(
                    f"bench tiers: the shared tier lost {ok.count(False)} of {len(ok)} blocks "
                    f"({remote.stats.failed} failed calls): is the server at "
                    f"{remote.address.redacted()} still up?"
                )
            return stored - started, loaded - stored

        plain_times, tier_times = _alternate(rounds, plain, tier, blocks, step)
    except (OSError, ConnectError) as exc:  # ConnectError: a socket opened as it failed
        raise KVOffloadError(
            f"bench tiers: the server at {remote.address.redacted()} failed mid-run ({exc})"
        ) from None
    finally:
        if raw is not None:
            raw.close()
        remote.close()
    return _figures("remote", blocks.total, tier_times, plain_times)


class RawSockets:
    """The baseline: one plain socket per node (opened past TLS and AUTH by the tier),
    the plainest pipelined SET and GET, each reply's length known in advance."""

    TIMEOUT_S = 30.0

    def __init__(self, remote: RemoteTier) -> None:
        self._remote = remote
        self._sockets: dict[tuple[str, int], socket.socket] = {}

    def _socket(self, name: bytes) -> socket.socket:
        where = self._remote.node_address(name)
        if where not in self._sockets:
            sock = self._remote.open_socket(name)
            sock.settimeout(self.TIMEOUT_S)
            self._sockets[where] = sock
        return self._sockets[where]

    def round(self, index: int, blocks: BenchBlocks) -> tuple[float, float]:
        names = [b"kvoffload-bench:plain:%d:%d" % (index, j) for j in range(len(blocks.payloads))]
        by_socket: dict[socket.socket, list[int]] = {}
        for j, name in enumerate(names):
            by_socket.setdefault(self._socket(name), []).append(j)
        started = time.perf_counter()
        for sock, indices in by_socket.items():
            for j in indices:
                name, payload = names[j], blocks.payloads[j]
                sock.sendall(
                    b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, len(payload))
                )
                sock.sendall(payload)
                sock.sendall(b"\r\n")
        for sock, indices in by_socket.items():
            _expect(sock, b"+OK\r\n" * len(indices))
        stored = time.perf_counter()
        for sock, indices in by_socket.items():
            sock.sendall(
                b"".join(
                    b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(names[j]), names[j]) for j in indices
                )
            )
        for sock, indices in by_socket.items():
            for j in indices:
                _expect(sock, b"$%d\r\n" % blocks.size)
                _receive(sock, blocks.target(j))
                _expect(sock, b"\r\n")
        loaded = time.perf_counter()
        for sock, indices in by_socket.items():  # one DEL each: a Cluster node holds many slots
            sock.sendall(
                b"".join(
                    b"*2\r\n$3\r\nDEL\r\n$%d\r\n%b\r\n" % (len(names[j]), names[j]) for j in indices
                )
            )
            _expect(sock, b":1\r\n" * len(indices))
        return stored - started, loaded - stored

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()


def _receive(sock: socket.socket, view: memoryview) -> None:
    done = 0
    while done < len(view):
        got = sock.recv_into(view[done:])
        if not got:
            raise ConnectionError("the server closed the connection")
        done += got


def _expect(sock: socket.socket, reply: bytes) -> None:
    got = bytearray(len(reply))
    _receive(sock, memoryview(got))
    if got != reply:
        raise ConnectionError(f"unexpected reply {bytes(got[:40])!r} to the baseline")


Round = Callable[[int], tuple[float, float]]


Times = list[tuple[float, float]]
"""(store, load) seconds of each round."""


def _alternate(
    rounds: int, plain: Round, tier: Round, blocks: BenchBlocks, step: Step
) -> tuple[Times, Times]:
    """(store, load) seconds of every round of each, interleaved; the tier's loads verified."""
    plain_times: Times = []
    tier_times: Times = []
    for i in range(rounds):
        plain_times.append(plain(i))
        step()
        blocks.clear()
        tier_times.append(tier(i))
        blocks.verify()
        step()
    return plain_times, tier_times


def _figures(name: str, total: int, tier: Times, plain: Times) -> dict[str, float]:
    """Rates of the best rounds and their ratios, and the median of the rounds' own ratios.

    A round of the tier and the plain round before it ran under the same load,
    so the median of their ratios is the steadier figure where one lucky plain
    round sets the best plain rate.
    """
    store, load = (_gbps(total, min(t[k] for t in tier)) for k in (0, 1))
    plain_store, plain_load = (_gbps(total, min(t[k] for t in plain)) for k in (0, 1))
    paired = [(p[0] / t[0], p[1] / t[1]) for t, p in zip(tier, plain, strict=True)]
    return {
        f"{name}_store_gbps": store,
        f"{name}_load_gbps": load,
        f"{name}_plain_write_gbps": plain_store,
        f"{name}_plain_read_gbps": plain_load,
        f"{name}_store_ratio": store / plain_store,
        f"{name}_load_ratio": load / plain_load,
        f"{name}_store_ratio_median": statistics.median(r[0] for r in paired),
        f"{name}_load_ratio_median": statistics.median(r[1] for r in paired),
    }


def measure_tiers(
    blocks: int = 128,
    block_mib: float = 2.0,
    rounds: int = 3,
    directory: str | None = None,
    remote: str | None = None,
    fsync: bool = False,
    disk_timeout_ms: float = DEFAULT_DEADLINE_S * 1000,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Disk figures (in ``directory``, default a temporary one), and remote ones if ``remote``.

    ``progress(done, total)`` is told at the start and after each half round (plain or tier).
    """
    if blocks < 1 or rounds < 1 or not 0 < block_mib < math.inf:
        raise InvalidArgumentError(
            f"blocks and rounds must be >= 1 and block MiB > 0, got {blocks}, {rounds}, {block_mib}"
        )
    size = int(block_mib * MIB)
    if size < MIN_BLOCK_BYTES:
        raise InvalidArgumentError(
            f"a block of {block_mib:g} MiB is {size} bytes: at least {MIN_BLOCK_BYTES} "
            f"({MIN_BLOCK_BYTES / MIB:g} MiB) are needed"
        )
    # The payloads and the load buffer each hold every block.
    check_fits(2 * blocks * block_mib * MIB, f"{blocks} blocks of {block_mib:g} MiB")
    data = BenchBlocks(blocks, size)
    results: dict[str, Any] = {"blocks": blocks, "block_bytes": data.size, "rounds": rounds}
    if fsync:
        results["fsync"] = True
    total = 2 * rounds * (1 if remote is None else 2)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    scratch = scratch_path(directory)
    try:
        scratch.mkdir(mode=0o700)
        results.update(measure_disk(data, scratch, rounds, fsync, disk_timeout_ms / 1000, step))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if remote is not None:
        results.update(measure_remote(data, remote, rounds, step))
    return results
