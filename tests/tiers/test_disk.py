"""The disk tier on real files: round trips, eviction, restart, torn and flipped blocks, ENOSPC."""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kvoffload import OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint

FP = layout_fingerprint("disk-test", layout_preset("tiny"), 64)
KEYS = [block_id_key(i) for i in range(12)]


def payload(key: OffloadKey, size: int = 64) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def read_all(
    tier: DiskTier, keys: list[OffloadKey], size: int = 64
) -> tuple[list[bool], dict[int, bytes]]:
    """Read into one buffer per key; the intact ones by position."""
    buffers = [bytearray(size) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=10)
    tier.poll(wait=True)
    return ok, {i: bytes(buffers[i]) for i, good in enumerate(ok) if good}


def stored(tier: DiskTier, keys: list[OffloadKey], size: int = 64) -> DiskTier:
    tier.write(keys, [payload(key, size) for key in keys])
    tier.poll(wait=True)
    return tier


def test_blocks_round_trip_through_files(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP, enable_events=True), KEYS[:10])
    try:
        assert tier.present(KEYS) == 10 and len(tier) == 10
        ok, got = read_all(tier, KEYS[:10])
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS[:10])}
        assert tier.stats.stored_blocks == 10 and tier.stats.hit_blocks == 10
        assert sorted(p.name for p in tier.directory.iterdir()) == sorted(
            k.hex() + ".kvb" for k in KEYS[:10]
        )
        [event] = tier.take_events()
        assert (event.medium, event.removed, sorted(event.keys)) == ("DISK", False, KEYS[:10])
        stored(tier, KEYS[:3])  # held already: not written again
        assert tier.stats.stored_blocks == 10
    finally:
        tier.close()


def test_the_capacity_holds_and_the_least_recent_block_leaves(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 4, FP, "lru", enable_events=True), KEYS[:4])
    try:
        read_all(tier, [KEYS[0]])
        tier.take_events()
        stored(tier, KEYS[4:6])
        assert len(tier) == 4 and tier.stats.evicted == 2
        assert [tier.present([k]) for k in KEYS[:6]] == [1, 0, 0, 1, 1, 1]
        removed = [e for e in tier.take_events() if e.removed]
        assert [sorted(e.keys) for e in removed] == [[KEYS[1], KEYS[2]]]
    finally:
        tier.close()
    assert not tier.path(KEYS[1]).exists() and tier.path(KEYS[0]).exists()


def test_a_restart_rebuilds_the_index_from_the_files(tmp_path: Path) -> None:
    stored(DiskTier(tmp_path, 20, FP), KEYS[:5]).close()
    again = DiskTier(tmp_path, 20, FP)
    try:
        assert len(again) == 5 and again.present(KEYS) == 5
        ok, got = read_all(again, KEYS[:5])
        assert all(ok) and got[4] == payload(KEYS[4])
    finally:
        again.close()
    other = DiskTier(tmp_path, 20, layout_fingerprint("another-model", layout_preset("tiny"), 64))
    try:
        assert len(other) == 0 and other.present(KEYS) == 0
    finally:
        other.close()


def test_a_restart_drops_torn_broken_and_unfinished_files(tmp_path: Path) -> None:
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:5])
    first.close()
    torn = first.path(KEYS[1])
    torn.write_bytes(torn.read_bytes()[:-10])
    bad_magic = first.path(KEYS[2])
    data = bytearray(bad_magic.read_bytes())
    data[0] ^= 0xFF
    bad_magic.write_bytes(bytes(data))
    misnamed = first.path(KEYS[3])
    misnamed.rename(first.path(KEYS[9]))
    unfinished = first.path(KEYS[6]).with_suffix(".tmp")
    unfinished.write_bytes(b"half a block")
    again = DiskTier(tmp_path, 20, FP)
    try:
        assert len(again) == 2
        assert [again.present([k]) for k in KEYS[:5]] == [1, 0, 0, 0, 1]
        assert again.present([KEYS[9]]) == 0
        assert again.stats.corrupt == 3
        assert not torn.exists() and not bad_magic.exists() and not unfinished.exists()
    finally:
        again.close()


def test_a_flipped_payload_byte_is_never_loaded_and_the_file_goes(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP, enable_events=True), KEYS[:3])
    try:
        tier.take_events()
        path = tier.path(KEYS[1])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
        ok, got = read_all(tier, KEYS[:3])
        assert ok == [True, False, True] and 1 not in got
        assert tier.stats.corrupt == 1 and tier.stats.hit_blocks == 2
        assert not path.exists() and tier.present(KEYS[:3]) == 1
        [event] = tier.take_events()
        assert event.removed and event.keys == [KEYS[1]]
    finally:
        tier.close()


def test_a_vanished_directory_turns_writes_into_counted_failures(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 20, FP)
    try:
        shutil.rmtree(tier.directory)
        stored(tier, KEYS[:4])
        assert tier.stats.failed == 4 and tier.stats.stored_blocks == 0
        assert len(tier) == 0 and tier.present(KEYS) == 0
        ok, _ = read_all(tier, KEYS[:2])
        assert ok == [False, False]
    finally:
        tier.close()


@contextlib.contextmanager
def small_filesystem(path: Path, size_kib: int) -> Iterator[str]:
    """A real ENOSPC from a tiny tmpfs where mounting works (root), else a file size cap.

    The cap (RLIMIT_FSIZE, SIGXFSZ ignored) makes writes past it fail with
    EFBIG, which the tier must treat as it treats a full disk.
    """
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode == 0:
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", str(path)], check=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size_kib * 1024 // 8, hard))
    try:
        yield "rlimit"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_degrades_to_failed_stores(tmp_path: Path) -> None:
    size = 16 * 1024
    with small_filesystem(tmp_path / "small", 64) as kind:
        tier = DiskTier(tmp_path / "small", 100, FP, io_threads=1)
        try:
            small = [payload(k, 100) for k in KEYS[:2]]
            tier.write(KEYS[:2], small)  # small blocks fit either way
            tier.poll(wait=True)
            stored(tier, KEYS[2:], size)
            assert tier.stats.failed > 0, kind
            good = tier.stats.stored_blocks
            assert good >= 2 and good + tier.stats.failed == len(KEYS)
            assert len(tier) == good
            assert not list(tier.directory.glob("*.tmp"))
            ok, got = read_all(tier, KEYS[:2], 100)
            assert ok == [True, True] and got[1] == small[1]
        finally:
            tier.close()


def test_a_target_of_the_wrong_size_fails_that_block_only(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP), KEYS[:3])
    try:
        buffers = [bytearray(64), bytearray(10), bytearray(64)]
        ok = tier.read(KEYS[:3], lambda i: memoryview(buffers[i])).result(timeout=10)
        assert ok == [True, False, True] and bytes(buffers[2]) == payload(KEYS[2])

        def broken(i: int) -> memoryview:
            raise RuntimeError("no slot")

        assert tier.read(KEYS[:2], broken).result(timeout=10) == [False, False]
        assert tier.present(KEYS[:3]) == 3  # the blocks themselves are fine
    finally:
        tier.close()
