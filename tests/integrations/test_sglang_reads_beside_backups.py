"""A disk read of SGLang's never waits for a backup batch's disk writes.

SGLang's prefetch threads look pages up and read them while its backup thread writes
other pages: a request waits on the read, nobody waits on the backup. Here a real disk
tier's writes are held inside the file system call (the project's file-layer hook) while
a look-up and a read go through the same path; the order they finish in decides, never
a duration.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from kvoffload.core.keys import OffloadKey, make_offload_key
from kvoffload.core.manager import OffloadingEvent
from kvoffload.integrations.sglang.paths import TierPath
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import fingerprint_of
from kvoffload.tiers.slot_file import SUPER_BYTES, FileLayer

PAGE = 4096
STRIPES = 2
STALL_S = 30.0
"""Only so that a failing run ends: the order of the threads' finishes decides."""


class HeldWrites(FileLayer):
    """Payload writes that, while :attr:`open` is clear, wait for it inside the call;
    :attr:`entered` holds the offset of the first one held."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered: list[int] = []
        self.holding = threading.Event()

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        if not self.open.is_set():
            self.entered.append(offset)
            self.holding.set()
            self.open.wait()
        return super().pwritev(fd, buffers, offset)


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_a_read_finishes_while_a_backup_batch_is_held_in_its_disk_write(tmp_path: Path) -> None:
    layer = HeldWrites()
    events: list[OffloadingEvent] = []
    fingerprint = fingerprint_of("reads-beside-backups", PAGE)

    def open_tier() -> DiskTier:
        return DiskTier(
            tmp_path,
            16,
            fingerprint,
            io_threads=STRIPES,
            enable_events=True,
            file_layer=layer,
        )

    path = TierPath("disk", open_tier, None, PAGE, events.extend)
    try:
        held = [key(i) for i in range(4)]
        assert path.write(held, [page(i) for i in range(4)]).result == [True] * 4
        tier = path.tier
        assert isinstance(tier, DiskTier) and tier.stride is not None
        stride = tier.stride
        slot_of = {k: ((tier.slot_offset(k) or 0) - SUPER_BYTES) // stride for k in held}

        layer.open.clear()
        written: list[list[bool]] = []
        order: list[str] = []

        def backup() -> None:
            written.append(path.write([key(9)], [page(9)]).result)
            order.append("write")

        writer = threading.Thread(target=backup)
        writer.start()
        assert layer.holding.wait(STALL_S)  # the backup's page is inside its pwritev
        busy_stripe = ((layer.entered[0] - SUPER_BYTES) // stride) % STRIPES
        # Pages on the other stripe: a read queued behind the held write on its own stripe
        # waits for it by the tier's design (a slot's I/O runs in call order).
        free = [k for k in held if slot_of[k] % STRIPES != busy_stripe]
        assert free
        into = [bytearray(PAGE) for _ in free]
        found: list[int] = []
        read: list[list[bool]] = []
        read_done = threading.Event()

        def prefetch() -> None:
            found.append(path.present(free))
            read.append(path.read(free, lambda i: memoryview(into[i])))
            order.append("read")
            read_done.set()

        reader = threading.Thread(target=prefetch)
        reader.start()
        read_done.wait(STALL_S)
        still_held = writer.is_alive()
        layer.open.set()
        writer.join(STALL_S)
        reader.join(STALL_S)
        assert order == ["read", "write"] and still_held
        assert found == [len(free)] and read == [[True] * len(free)]
        assert [bytes(b) for b in into] == [page(held.index(k)) for k in free]
        assert written == [[True]]
        # Nothing lost: every store announced once, every page counted once.
        stored = [k for e in events if not e.removed for k in e.keys]
        assert sorted(stored) == sorted([*held, key(9)])
        counters = path.counters()
        assert counters.stores_completed == 5 and counters.stores_failed == 0
        assert counters.loads == len(free) and counters.held_pages == 5
    finally:
        layer.open.set()
        path.close()
