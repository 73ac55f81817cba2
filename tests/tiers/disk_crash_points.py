"""Run one disk tier scenario again and again, dying before its 1st, 2nd, ... file call.

    python disk_crash_points.py ROOT FINGERPRINT_HEX FSYNC(0|1) TORN(0|1) [N1,N2,...]

Run by ``test_disk_crashes.py``. For each crash point ``n`` (1, 2, ...) the scenario
runs in a forked child on a directory of its own, ``ROOT/<n>``, through a
:class:`FileLayer` that ends the process with ``os._exit`` just before its ``n``-th
call (every read, write, sync, truncate and stat of the slot file); with ``TORN``, a
write that is the ``n``-th call puts down half its bytes first. One I/O thread keeps
the order of the calls, and so each point, the same from run to run. The first ``n``
the scenario outlives ends the loop; the last line printed is that ``n``. Given points
``N1,N2,...``, it runs in ``ROOT`` itself once per point, each run resuming what the
crash before it left. This driver starts no thread itself, so each fork copies a
process with one thread.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from kvoffload import OffloadKey
from kvoffload.tiers import DiskTier
from kvoffload.tiers.slot_file import FileLayer

SIZE = 5000
"""Not page-aligned: a payload that spans two pages of an 8 KiB slot."""
KEYS = [OffloadKey(bytes([65 + k]) * (3, 36, 200, 1)[k % 4]) for k in range(10)]
"""Keys of several lengths, so that a slot's new header is shorter or longer than its old one."""
FLIPPED = KEYS[4]
"""The key whose payload the scenario flips behind the tier's back: a restart indexes it
(the scan reads headers only), and its first read finds it broken and drops it."""
DIED = 9


def content(key: bytes) -> bytes:
    """A block's bytes, derived from its key alone (a key names its content)."""
    return (key * (SIZE // len(key) + 1))[:SIZE]


class DieBefore(FileLayer):
    """Ends the process just before its ``n``-th call on the slot file, as a kill would;
    ``torn``: a write that is the ``n``-th call first puts down the first half of its bytes,
    as a kill in the middle of a long write (or a power cut in a page) leaves it."""

    def __init__(self, n: int, torn: bool) -> None:
        self.left = n
        self.torn = torn

    def _call(self) -> None:
        self.left -= 1
        if self.left == 0:
            os._exit(DIED)

    def _half_then_die(self, fd: int, data: bytes, offset: int) -> None:
        if self.torn and self.left == 1:
            os.pwrite(fd, data[: len(data) // 2], offset)
            os._exit(DIED)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._call()
        return super().pread(fd, size, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._call()
        return super().preadv(fd, buffers, offset)

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._call()
        return super().preadv_cached(fd, buffers, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        self._half_then_die(fd, bytes(data), offset)
        self._call()
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        self._half_then_die(fd, b"".join(buffers), offset)
        self._call()
        return super().pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self._call()
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self._call()
        super().fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        self._call()
        super().ftruncate(fd, size)

    def fstat(self, fd: int) -> os.stat_result:
        self._call()
        return super().fstat(fd)


def store(tier: DiskTier, keys: list[OffloadKey]) -> None:
    tier.write(keys, [content(key) for key in keys])
    tier.poll(wait=True)


def load(tier: DiskTier, keys: list[OffloadKey]) -> None:
    buffers = [bytearray(SIZE) for _ in keys]
    tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=60)
    tier.poll(wait=True)


def flip_payload_byte(tier: DiskTier, key: OffloadKey) -> None:
    """Behind the tier's back (not through its file layer): a bad sector under a block."""
    start = tier.slot_offset(key)
    assert start is not None
    with open(tier.path, "r+b") as file:
        file.seek(start + 400)
        byte = file.read(1)[0]
        file.seek(start + 400)
        file.write(bytes([byte ^ 0xFF]))


def scenario(directory: str, fingerprint: bytes, fsync: bool, layer: FileLayer) -> None:
    """Stores in batches over keys of several lengths, evictions that reuse slots, reads,
    a block found broken and blanked, then a restart with a smaller capacity (which cuts
    the file) and more stores into it."""
    tier = DiskTier(directory, 4, fingerprint, io_threads=1, fsync=fsync, file_layer=layer)
    store(tier, KEYS[0:3])
    store(tier, KEYS[3:6])  # evicts two of the first
    load(tier, KEYS[2:4])
    flip_payload_byte(tier, FLIPPED)
    load(tier, [FLIPPED])  # corrupt: blanked
    store(tier, [KEYS[0], KEYS[6]])
    tier.close()
    tier = DiskTier(directory, 3, fingerprint, io_threads=1, fsync=fsync, file_layer=layer)
    store(tier, [KEYS[7], KEYS[1]])
    load(tier, KEYS[7:8])
    tier.close()


def run(directory: str, fingerprint: bytes, fsync: bool, torn: bool, n: int) -> bool:
    """Whether the scenario, run on ``directory`` in a forked child, died at crash point ``n``."""
    child = os.fork()
    if child == 0:
        try:
            scenario(directory, fingerprint, fsync, DieBefore(n, torn))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, DIED):
        raise SystemExit(f"the scenario failed at crash point {n} (exit status {code})")
    return code == DIED


def main() -> None:
    root, fingerprint = sys.argv[1], bytes.fromhex(sys.argv[2])
    fsync, torn = sys.argv[3] == "1", sys.argv[4] == "1"
    if len(sys.argv) > 5:  # one directory, crashed at each of the points given in turn
        for n in map(int, sys.argv[5].split(",")):
            run(root, fingerprint, fsync, torn, n)
        return
    n = 1
    while run(os.path.join(root, str(n)), fingerprint, fsync, torn, n):
        n += 1
    print(n, flush=True)


if __name__ == "__main__":
    main()
