"""Slot files of other layouts under one disk directory: a model or page size changed
leaves its file behind, and a tier short of room empties those no running tier holds.

The file system's free space is what a :class:`FileLayer` says (a real full disk is not
at hand); everything else is real: slot files, locks, another process holding its tier.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload import OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.slot_file import LOCK_FILE, SLOT_FILE, DiskTierError, FileLayer, footprint

SIZE = 16384
CAPACITY = 8
KEYS = [block_id_key(i) for i in range(CAPACITY)]
FULL = footprint(CAPACITY, SIZE)
"""What a tier of these tests takes on disk when full."""


def fingerprint(model: str) -> bytes:
    return layout_fingerprint(model, layout_preset("tiny"), SIZE)


OURS = fingerprint("now")


class Room(FileLayer):
    """A file system with ``free`` bytes free, whatever the real one has."""

    def __init__(self, free: int) -> None:
        self.free = free

    def free_bytes(self, fd: int) -> int:
        return self.free


def payload(key: OffloadKey) -> bytes:
    return (key * (SIZE // len(key) + 1))[:SIZE]


def filled(root: Path, model: str, layer: FileLayer | None = None) -> DiskTier:
    """A tier of ``model`` under ``root`` holding every key, still open."""
    tier = DiskTier(root, CAPACITY, fingerprint(model), file_layer=layer)
    tier.write(KEYS, [payload(key) for key in KEYS])
    tier.poll(wait=True)
    assert tier.stats.stored_blocks == CAPACITY
    return tier


def left_behind(root: Path, model: str, age_s: float) -> Path:
    """The slot file a closed tier of ``model`` left, last written ``age_s`` ago."""
    tier = filled(root, model)
    tier.close()
    written = tier.path.stat().st_mtime - age_s
    os.utime(tier.path, (written, written))
    return tier.path


def taken(path: Path) -> int:
    return path.stat().st_blocks * 512


def reads_back(tier: DiskTier) -> bool:
    buffers = [bytearray(SIZE) for _ in KEYS]
    ok = tier.read(KEYS, lambda i: memoryview(buffers[i])).result(timeout=30)
    tier.poll(wait=True)
    return all(ok) and [bytes(b) for b in buffers] == [payload(key) for key in KEYS]


def emptied_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "emptied" in r.getMessage()]


def test_left_behind_files_are_emptied_oldest_first_until_the_tier_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three models ran before; the oldest file that no tier holds goes first, and only as
    many go as the new tier's full file needs. A running tier's file is never touched,
    however old."""
    oldest = left_behind(tmp_path, "first", 3 * 3600)
    older = left_behind(tmp_path, "second", 2 * 3600)
    newer = left_behind(tmp_path, "third", 3600)
    running = filled(tmp_path, "running")
    written = running.path.stat().st_mtime - 10 * 3600  # the oldest of all
    os.utime(running.path, (written, written))
    sizes = {path: taken(path) for path in (oldest, older, newer, running.path)}
    short = sizes[oldest] + sizes[older] // 2  # the oldest alone leaves it short
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers.slot_file")
    tier = filled(tmp_path, "now", Room(FULL - short))
    try:
        assert oldest.stat().st_size == older.stat().st_size == 0
        assert taken(newer) == sizes[newer] and taken(running.path) == sizes[running.path]
        assert reads_back(tier) and reads_back(running)
        lines = emptied_lines(caplog)
        assert len(lines) == 2
        for line, path in zip(lines, (oldest, older), strict=True):
            assert str(path) in line and f"freeing {sizes[path]:,} bytes" in line
            assert "\n" not in line
    finally:
        tier.close()
        running.close()
    for path in (oldest, older):  # the directory and its lock stay, the file empty
        assert sorted(os.listdir(path.parent)) == sorted([LOCK_FILE, SLOT_FILE])


def test_nothing_is_touched_while_the_tier_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank not started yet, or a model switched back to, keeps its blocks."""
    before = left_behind(tmp_path, "before", 3600)
    size = taken(before)
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers.slot_file")
    filled(tmp_path, "now", Room(FULL)).close()
    assert taken(before) == size and not emptied_lines(caplog)
    again = DiskTier(tmp_path, CAPACITY, fingerprint("before"))
    try:
        assert again.recovery.recovered == CAPACITY and reads_back(again)
    finally:
        again.close()


HOLDER = """
import sys
from kvoffload.tiers import DiskTier
tier = DiskTier(sys.argv[1], 8, bytes.fromhex(sys.argv[2]))
keys = [bytes([65 + i]) * 36 for i in range(8)]
tier.write(keys, [bytes([i]) * 16384 for i in range(8)])
tier.poll(wait=True)
print("holding", flush=True)
sys.stdin.readline()
tier.close()
"""


def test_live_tiers_sharing_the_directory_are_never_touched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tensor-parallel ranks or several engines in one directory: a tier of this process
    and one of another, each live, one of them with its ``lock`` removed, and no room at
    all: both keep every byte, and the new tier starts all the same."""
    here = filled(tmp_path, "rank-0")
    other = fingerprint("rank-1")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), other.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "holding\n"
        theirs = tmp_path / other.hex() / SLOT_FILE
        (theirs.parent / LOCK_FILE).unlink()  # the slot file's own lock still tells
        sizes = {path: taken(path) for path in (here.path, theirs)}
        caplog.set_level(logging.WARNING, logger="kvoffload.tiers.slot_file")
        tier = filled(tmp_path, "now", Room(0))
        tier.close()
        assert {path: taken(path) for path in sizes} == sizes
        assert not emptied_lines(caplog)
        assert reads_back(here)
    finally:
        here.close()
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert holder.returncode == 0
    again = DiskTier(tmp_path, CAPACITY, other)
    try:
        assert again.recovery.recovered == CAPACITY
    finally:
        again.close()


def test_a_crashed_process_s_file_is_no_longer_held(tmp_path: Path) -> None:
    """The kernel drops a killed holder's locks: its file is one no tier holds."""
    other = fingerprint("crashed")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), other.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline() == "holding\n"
    holder.kill()
    holder.wait(timeout=30)
    holder.stdin.close()
    holder.stdout.close()
    theirs = tmp_path / other.hex() / SLOT_FILE
    assert theirs.stat().st_size > 0
    filled(tmp_path, "now", Room(0)).close()
    assert theirs.stat().st_size == 0


def test_a_restarted_tier_makes_room_as_it_starts(tmp_path: Path) -> None:
    """Its file already has a layout: room is made on start, before any write, for what
    the file may still take (a full file takes no more, and frees nothing)."""
    first = DiskTier(tmp_path, CAPACITY, OURS)
    first.write(KEYS[:2], [payload(key) for key in KEYS[:2]])
    first.close()
    before = left_behind(tmp_path, "before", 3600)
    tier = DiskTier(tmp_path, CAPACITY, OURS, file_layer=Room(0))
    try:
        assert tier.recovery.recovered == 2
        assert before.stat().st_size == 0
    finally:
        tier.close()
    full = DiskTier(tmp_path, CAPACITY, OURS)
    full.write(KEYS, [payload(key) for key in KEYS])
    full.close()
    again = left_behind(tmp_path, "again", 3600)
    DiskTier(tmp_path, CAPACITY, OURS, file_layer=Room(0)).close()
    assert again.stat().st_size


def test_what_is_not_a_left_behind_slot_file_is_never_touched(tmp_path: Path) -> None:
    """Under names a tier would use, with no room at all: a file without a tier's
    superblock, a tier's file under another fingerprint's name, one with a second link,
    and links to a tier's directory and file elsewhere, none followed."""
    root, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    victim = left_behind(elsewhere, "victim", 3600)
    victim_size = taken(victim)
    names = iter(fingerprint(f"planted-{n}").hex() for n in range(6))
    planted: dict[str, Path] = {}

    def slot_file(kind: str) -> Path:
        directory = root / next(names)
        directory.mkdir(parents=True)
        planted[kind] = directory / SLOT_FILE
        return planted[kind]

    slot_file("no superblock").write_bytes(os.urandom(3 * SIZE))
    slot_file("another name").write_bytes(victim.read_bytes())
    os.link(victim, slot_file("second link"))
    slot_file("link to a file").symlink_to(victim)
    link_dir = root / next(names)
    link_dir.symlink_to(victim.parent, target_is_directory=True)
    contents = {kind: path.read_bytes() for kind, path in planted.items()}
    filled(root, "now", Room(0)).close()
    assert {kind: path.read_bytes() for kind, path in planted.items()} == contents
    assert taken(victim) == victim_size


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs filled to the last page by a slot file of another layout that no
    tier holds any more (mounting needs root)."""
    path = tmp_path / "full"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1024k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        earlier = DiskTier(path, 100, fingerprint("earlier"))
        earlier.write([block_id_key(i) for i in range(100)], [payload(KEYS[0])] * 100)
        earlier.poll(wait=True)
        earlier.close()
        assert earlier.stats.failed and os.statvfs(path).f_bavail == 0
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_tier_starts_on_a_disk_full_of_a_left_behind_file_and_empties_it(
    full_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No page free at all: writing the holder's pid in ``lock`` fails, which must not stop
    the start (the lock is the ``flock``, the pid only names its holder: one warning); the
    first write then empties the other layout's file and lands."""
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers.slot_file")
    tier = filled(full_fs, "now")
    try:
        assert reads_back(tier) and len(emptied_lines(caplog)) == 1
        assert "could not write this process's pid" in caplog.text
        with pytest.raises(DiskTierError, match="is in use by process unknown"):
            DiskTier(full_fs, CAPACITY, fingerprint("now"))
    finally:
        tier.close()


@pytest.fixture
def full_ext4() -> Iterator[Path]:
    """An 8 MiB ext4 without blocks reserved for root, filled to the last block by a slot
    file of another layout that no tier holds any more: as a disk with reserved blocks is
    to all users but root, it cannot make a directory, which takes a block (a tmpfs
    directory takes none). Mounting a loop device needs root. Made outside pytest's
    temporary directories, which another pytest run's clean-up may rename under it."""
    scratch = Path(tempfile.mkdtemp(prefix="kvoffload-ext4-"))
    image, path = scratch / "ext4.img", scratch / "full"
    path.mkdir()
    with image.open("wb") as file:
        file.truncate(8 * 2**20)
    try:
        made = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, check=False
        )
        if made.returncode:
            pytest.skip("mkfs.ext4 is not at hand")
        mounted = subprocess.run(
            ["mount", "-o", "loop", str(image), str(path)], capture_output=True, check=False
        )
        if mounted.returncode:
            pytest.skip("mounting a loop device needs root")
        try:
            root = path / "kv"
            earlier = DiskTier(root, 1000, fingerprint("earlier"))
            earlier.write([block_id_key(i) for i in range(1000)], [payload(KEYS[0])] * 1000)
            earlier.poll(wait=True)
            earlier.close()
            assert earlier.stats.failed
            fill(path / "filler")
            assert os.statvfs(path).f_bavail == 0
            with pytest.raises(OSError) as full:
                os.mkdir(path / "probe")
            assert full.value.errno == errno.ENOSPC
            yield root
        finally:
            subprocess.run(["umount", str(path)], check=True)
    finally:
        shutil.rmtree(scratch)


def fill(path: Path) -> None:
    """Take the blocks a slot file's failed writes left (ext4 keeps a few for its own
    metadata, a number that varies), a block at a time, to the last one."""
    with path.open("ab", buffering=0) as file:
        with contextlib.suppress(OSError):
            while True:
                file.write(bytes(1024))
        os.fsync(file.fileno())


def test_a_new_layout_starts_on_an_ext4_full_of_a_left_behind_file_and_empties_it(
    full_ext4: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The start itself empties the other layout's file, to make the new layout's
    directory (a model switched on a disk its predecessor filled); it stopped there."""
    caplog.set_level(logging.WARNING, logger="kvoffload.tiers.slot_file")
    tier = filled(full_ext4, "now")
    try:
        assert reads_back(tier)
        [line] = emptied_lines(caplog)
        assert f"no room left to make {tier.directory}" in line
    finally:
        tier.close()


def test_a_full_ext4_whose_other_layout_a_running_tier_holds_refuses_in_one_line(
    full_ext4: Path,
) -> None:
    earlier = DiskTier(full_ext4, 1000, fingerprint("earlier"))
    held = len(earlier)
    try:
        directory = full_ext4 / OURS.hex()
        with pytest.raises(DiskTierError) as refused:
            DiskTier(full_ext4, CAPACITY, OURS)
        line = str(refused.value)
        assert line.startswith(f"disk tier directory {directory} cannot be created: its file")
        assert "full (No space left on device)" in line and "\n" not in line
        assert "holds no other layout's slot file that no running tier holds" in line
        assert held and len(earlier) == held and not directory.exists()
    finally:
        earlier.close()
    again = DiskTier(full_ext4, 1000, fingerprint("earlier"))
    again.close()
    assert again.recovery.recovered == held


def test_a_disk_directory_a_full_ext4_cannot_make_is_named_in_one_line(full_ext4: Path) -> None:
    """Nothing of ours in it to empty: the line names the directory that could not be made."""
    root = full_ext4 / "models" / "kv"
    with pytest.raises(DiskTierError) as refused:
        DiskTier(root, CAPACITY, OURS)
    line = str(refused.value)
    assert line.startswith(f"disk tier directory {root.parent} cannot be created: its file")
    assert line.endswith(
        "full (No space left on device); free room there, or choose another disk directory"
    )
