"""Shared regions: a worker's CPU slots in a file the scheduler maps; naming, locks, cleanup."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvoffload.core.errors import InvalidArgumentError  # noqa: E402
from kvoffload.core.layout import layout_preset  # noqa: E402
from kvoffload.core.tier_protocol import SlotBytesUnavailableError  # noqa: E402
from kvoffload.dataplane import CPUBlockStore  # noqa: E402
from kvoffload.dataplane.shared_region import (  # noqa: E402
    SharedRegion,
    map_live_region,
    region_path,
    sweep_stale_regions,
)
from kvoffload.dataplane.shared_slot_bytes import SharedSlotBytes  # noqa: E402

SLOT = 64


def _age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_names_are_per_launch_and_rank_and_safe(tmp_path: Path) -> None:
    a0, a1 = region_path(tmp_path, "engine/a b", 0), region_path(tmp_path, "engine/a b", 1)
    b0 = region_path(tmp_path, "engine_a_b", 0)  # the same once made readable
    assert len({a0, a1, b0}) == 3 and a0.parent == tmp_path and "/" not in a0.name
    with pytest.raises(InvalidArgumentError, match="launch id"):
        region_path(tmp_path, "", 0)


def test_a_region_is_a_locked_file_the_scheduler_maps_and_the_creator_unlinks(
    tmp_path: Path,
) -> None:
    path = region_path(tmp_path, "launch", 0)
    region = SharedRegion(path, 4 * SLOT, pin=False)
    assert path.stat().st_size == 4 * SLOT and not region.pinned
    assert region.tensor is not None
    region.tensor[SLOT : 2 * SLOT] = torch.arange(SLOT, dtype=torch.uint8)
    mapped = map_live_region(path, 4 * SLOT)
    assert mapped[SLOT : 2 * SLOT] == bytes(range(SLOT))
    mapped[0:3] = b"abc"  # and the worker sees the scheduler's writes
    assert bytes(region.tensor[:3].numpy()) == b"abc"
    with pytest.raises(InvalidArgumentError, match="expected 512"):
        map_live_region(path, 8 * SLOT)
    region.close()
    region.close()
    assert not path.exists()
    assert mapped[SLOT + 1] == 1  # a mapping taken before the unlink stays valid
    mapped.close()
    with pytest.raises(FileNotFoundError):
        map_live_region(path, 4 * SLOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_pinned_region_without_cuda_is_an_input_error_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    path = region_path(tmp_path, "launch", 0)
    with pytest.raises(InvalidArgumentError, match="pin=True needs CUDA"):
        SharedRegion(path, 4 * SLOT, pin=True)
    assert not path.exists()


def test_a_crashed_launchs_file_is_never_mapped_and_is_replaced(tmp_path: Path) -> None:
    path = region_path(tmp_path, "launch", 0)
    path.write_bytes(b"\x07" * 4 * SLOT)  # same name, same size, nobody holds it
    with pytest.raises(InvalidArgumentError, match="no live worker"):
        map_live_region(path, 4 * SLOT)
    region = SharedRegion(path, 4 * SLOT, pin=False)
    try:
        assert region.tensor is not None and not region.tensor.any()  # a new, zeroed file
        with pytest.raises(InvalidArgumentError, match=r"running launch.*engine_id"):
            SharedRegion(path, 4 * SLOT, pin=False)
        assert path.exists()
    finally:
        region.close()


def test_the_sweep_removes_only_old_files_no_live_worker_holds(tmp_path: Path) -> None:
    live = SharedRegion(region_path(tmp_path, "live", 0), SLOT, pin=False)
    try:
        stale = region_path(tmp_path, "crashed", 0)
        young = region_path(tmp_path, "starting", 0)
        other = tmp_path / "not-ours.kv"
        for path in (stale, young, other):
            path.write_bytes(b"x")
        for path in (stale, live.path, other):
            _age(path, 3600)
        assert sweep_stale_regions(tmp_path) == [stale]
        assert live.path.exists() and young.exists() and other.exists()
    finally:
        live.close()


def test_a_store_over_a_region_and_its_buffer_checks(tmp_path: Path) -> None:
    layout = layout_preset("tiny")
    size = 3 * layout.bytes_per_block
    region = SharedRegion(region_path(tmp_path, "store", 0), size, pin=False)
    try:
        assert region.tensor is not None
        store = CPUBlockStore(layout, 3, buffer=region.tensor)
        store.block(2).fill_(9)
        assert region.tensor[2 * layout.bytes_per_block :].eq(9).all()
        with pytest.raises(InvalidArgumentError, match="must be"):
            CPUBlockStore(layout, 4, buffer=region.tensor)
    finally:
        region.close()


def _mapped(path: Path) -> bool:
    """Whether this process still maps ``path`` (``/proc/self/maps`` names it, unlinked too)."""
    return f" {path}" in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_a_region_closed_under_a_store_stays_mapped_until_the_stores_tensors_go(
    tmp_path: Path,
) -> None:
    """The worker's shutdown closes its region while its CPU store and handlers still hold
    tensors over it. ``torch.frombuffer`` holds no buffer of the mapping, so the close
    unmapped it under them: a later read or copy through them (a look at the slots, a job
    queued after the shutdown) touched unmapped memory, a segfault or another mapping's
    bytes."""
    layout = layout_preset("tiny")
    path = region_path(tmp_path, "closed", 0)
    region = SharedRegion(path, 2 * layout.bytes_per_block, pin=False)
    store = CPUBlockStore(layout, 2, buffer=region.tensor)
    store.block(1).fill_(7)
    region.close()
    assert not path.exists()
    assert _mapped(path)  # before reading: unmapped memory would crash the run
    assert store.block(1).eq(7).all() and not store.block(0).any()
    del store
    assert not _mapped(path)  # given back once nothing views it


def test_slot_bytes_map_lazily_and_count_what_they_could_not_move(tmp_path: Path) -> None:
    paths = [region_path(tmp_path, "lazy", rank) for rank in range(2)]
    slots = SharedSlotBytes(paths, 4, SLOT)
    assert slots.slot_bytes == 2 * SLOT
    with pytest.raises(SlotBytesUnavailableError, match="not usable yet"):
        slots.snapshot([0, 1])
    first = SharedRegion(paths[0], 4 * SLOT, pin=False)
    second = None
    try:
        with pytest.raises(SlotBytesUnavailableError):
            slots.view(3)  # rank 1 is still missing
        assert (slots.unavailable, slots.mapped) == (3, False)
        second = SharedRegion(paths[1], 4 * SLOT, pin=False)
        assert first.tensor is not None and second.tensor is not None
        first.tensor[SLOT : 2 * SLOT] = 1
        second.tensor[SLOT : 2 * SLOT] = 2
        assert slots.snapshot([1]) == [b"\x01" * SLOT + b"\x02" * SLOT]
        # A promotion into slot 3 is staged, lands in both ranks only when intact.
        for slot, ok in ((3, True), (2, False)):
            view = slots.view(slot)
            view[:] = b"\x05" * SLOT + b"\x06" * SLOT
            slots.landed([slot], [ok])
        assert first.tensor[3 * SLOT :].eq(5).all() and second.tensor[3 * SLOT :].eq(6).all()
        assert not first.tensor[2 * SLOT : 3 * SLOT].any()
        with pytest.raises(InvalidArgumentError, match="no CPU slot 4"):
            slots.view(4)
        assert slots.unavailable == 3
    finally:
        slots.close()
        first.close()
        if second is not None:
            second.close()


def test_a_look_at_the_new_file_before_its_lock_does_not_fail_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's check for a live owner (a shared lock for an instant) can fall between
    the worker creating its file and locking it: the worker waits it out; and a lock that
    never comes leaves no file behind."""
    import fcntl

    from kvoffload.dataplane import shared_region

    path = region_path(tmp_path, "launch", 0)
    real_flock = fcntl.flock
    looked = []

    def flock_with_a_look(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB and not looked:
            looked.append(fd)
            other = os.open(path, os.O_RDONLY)
            real_flock(other, fcntl.LOCK_SH)
            try:
                real_flock(fd, operation)  # refused: the look holds its shared lock
            finally:
                real_flock(other, fcntl.LOCK_UN)
                os.close(other)
        real_flock(fd, operation)

    monkeypatch.setattr(shared_region.fcntl, "flock", flock_with_a_look)
    region = SharedRegion(path, 4096, pin=False)
    assert looked and path.exists()
    region.close()

    def never(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        real_flock(fd, operation)

    monkeypatch.setattr(shared_region.fcntl, "flock", never)
    monkeypatch.setattr(shared_region, "LOCK_WAIT_S", 0.01)
    with pytest.raises(InvalidArgumentError, match="cannot lock"):
        SharedRegion(path, 4096, pin=False)
    assert not path.exists()


@pytest.mark.parametrize("slot", [-1, 4])
def test_a_snapshot_of_a_slot_the_regions_lack_is_refused_naming_it(
    tmp_path: Path, slot: int
) -> None:
    """One rank's slots are read straight from its region's rows: numpy would read slot -1
    as the last slot (another block's bytes) and fail past the end with an IndexError."""
    path = region_path(tmp_path, "bounds", 0)
    region = SharedRegion(path, 4 * SLOT, pin=False)
    slots = SharedSlotBytes([path], 4, SLOT)
    try:
        assert slots.snapshot([3]) == [bytes(SLOT)]
        with pytest.raises(InvalidArgumentError, match=f"no CPU slot {slot}; the regions have 4"):
            slots.snapshot([0, slot])
    finally:
        slots.close()
        region.close()


def _finishes(action: Callable[[], object], fifos: list[Path]) -> BaseException | None:
    """Run ``action`` on a thread; fail if it is still blocked after 30 s (opening a
    FIFO to read waits for a writer), then free it by opening ``fifos`` to write."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    blocked = thread.is_alive()
    for fifo in fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    thread.join()
    assert not blocked, "blocked opening a FIFO"
    return outcome[0]


def test_a_fifo_among_the_region_files_never_blocks_the_sweep(tmp_path: Path) -> None:
    """Every worker's start sweeps the directory (/dev/shm, writable by anyone): an old FIFO
    of a region's name blocked it for good, opening the FIFO to read until a writer came."""
    fifo = region_path(tmp_path, "planted", 0)
    os.mkfifo(fifo)
    _age(fifo, 3600)
    path = region_path(tmp_path, "launch", 0)
    regions: list[SharedRegion] = []
    assert _finishes(lambda: regions.append(SharedRegion(path, 4096, pin=False)), [fifo]) is None
    regions[0].close()
    assert fifo.exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling symlink", "symlink"])
def test_an_entry_no_worker_made_under_the_regions_name_is_refused_in_one_line(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO there blocked the start for good; a directory raised IsADirectoryError from
    deep inside; a dangling symlink was said to "keep existing"; a symlink was followed
    (its target locked) and removed. None is a file a worker made: each is left alone."""
    path = region_path(tmp_path, "launch", 0)
    target = tmp_path / "target"
    target.write_bytes(b"x")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(target if kind == "symlink" else tmp_path / "missing")
    error = _finishes(lambda: SharedRegion(path, 4096, pin=False), [path])
    assert isinstance(error, InvalidArgumentError), error
    message = str(error)
    assert "\n" not in message and message.startswith(f"cannot replace {path}"), message
    assert "remove it or give this vLLM instance another engine_id" in message
    assert os.path.lexists(path) and target.read_bytes() == b"x"
