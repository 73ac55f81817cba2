"""The disk tier killed at each of its file calls, deterministically, then reopened.

``disk_crash_points.py`` runs one scenario (batched stores over keys of several lengths,
evictions reusing slots, reads, a block found broken, a restart that cuts the file) in a
forked child per crash point, the child ending itself just before its ``n``-th call on
the slot file (or halfway through it, if it is a write). Each directory left behind
must reopen with only whole blocks of their own key, nothing but the tier's two files, a
slot file within the capacity's footprint, every drop counted once, and a tier that
stores and loads again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from disk_crash_points import FLIPPED, KEYS, SIZE, content
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import OffloadKey
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import (
    LOCK_FILE,
    MAX_KEY_BYTES,
    SLOT_FILE,
    Recovery,
    encode_superblock,
    footprint,
    slot_stride,
)

FP = layout_fingerprint("disk-crashes", layout_preset("tiny"), SIZE)
DRIVER = str(Path(__file__).with_name("disk_crash_points.py"))
CAPACITY = 4
"""The scenario's first capacity, the larger of its two: the file never needs more."""
FRESH = [KEYS[8], KEYS[9]]


def crash(root: Path, fsync: bool, torn: bool, points: list[int] | None = None) -> str:
    """Run the driver on ``root`` (see its docstring); what it printed."""
    arguments = [DRIVER, str(root), FP.hex(), "1" if fsync else "0", "1" if torn else "0"]
    arguments += [",".join(map(str, points))] if points else []
    done = subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def load(tier: DiskTier, keys: list[bytes]) -> tuple[list[bool], list[bytes]]:
    buffers = [bytearray(SIZE) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=30)
    tier.poll(wait=True)
    return ok, [bytes(buffer) for buffer in buffers]


def check_reopens_whole(root: Path, where: str) -> None:
    """What a crash left in ``root`` reopens as whole blocks of their own keys, within
    its files and footprint, and the tier goes on."""
    directory = root / FP.hex()
    assert sorted(os.listdir(root)) == [FP.hex()], where
    assert set(os.listdir(directory)) <= {LOCK_FILE, SLOT_FILE}, where
    tier = DiskTier(root, CAPACITY, FP, io_threads=1)
    try:
        assert os.path.getsize(tier.path) <= footprint(CAPACITY, SIZE), where
        held = [key for key in KEYS if tier.present([key])]
        assert len(tier) == len(held) == tier.recovery.recovered, where
        ok, got = load(tier, held)
        assert [key for key, good in zip(held, ok, strict=True) if not good] in ([], [FLIPPED])
        assert tier.stats.corrupt == ok.count(False), where
        assert all(g == content(k) for k, g, good in zip(held, got, ok, strict=True) if good), where
        tier.write(FRESH, [content(key) for key in FRESH])
        tier.poll(wait=True)
        ok, got = load(tier, FRESH)
        assert ok == [True, True] and got == [content(key) for key in FRESH], where
        assert tier.stats.failed == 0, where
        kept = [key for key in KEYS if tier.present([key])]
        assert FLIPPED not in kept, where
    finally:
        tier.close()
    again = DiskTier(root, CAPACITY, FP, io_threads=1)
    try:  # every drop was blanked: counted once, and nothing is lost by reopening
        assert again.recovery == Recovery(recovered=len(kept)), where
        assert [key for key in KEYS if again.present([key])] == kept, where
    finally:
        again.close()


@pytest.mark.parametrize(
    ("fsync", "torn"),
    [(False, False), (True, False), (False, True)],
    ids=["before-the-call", "before-the-call-fsync", "halfway-through-a-write"],
)
def test_a_crash_at_any_file_call_leaves_only_whole_blocks_of_their_own_key(
    tmp_path: Path, fsync: bool, torn: bool
) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the tier's")
    roots = tmp_path / "roots"
    roots.mkdir()
    points = int(crash(roots, fsync, torn))
    assert points > 40  # the scenario's calls: every one of them a crash point
    for n in range(1, points + 1):
        check_reopens_whole(roots / str(n), f"crash before call {n}")
    assert sorted(os.listdir(tmp_path)) == ["outside", "roots"]
    assert outside.read_bytes() == b"not the tier's"


def test_crash_after_crash_in_one_directory_never_grows_it(tmp_path: Path) -> None:
    """Each run resumes what the crash before it left, restart scans and all: the file
    stays within the footprint and the directory holds the tier's two files."""
    crash(tmp_path, False, True, list(range(3, 60, 4)))
    check_reopens_whole(tmp_path, "after 15 crashes in a row")


SUPER_FIELDS = len(encode_superblock(FP, slot_stride(0), 0))
"""The superblock's fields and CRC: a file cut inside them has no layout to go by."""


@settings(max_examples=150, deadline=None)
@given(
    key_lengths=st.lists(st.integers(1, MAX_KEY_BYTES), min_size=1, max_size=4),
    size=st.integers(0, 600),
    data=st.data(),
)
def test_a_file_cut_at_any_byte_keeps_exactly_the_blocks_before_the_cut(
    key_lengths: list[int], size: int, data: st.DataObject
) -> None:
    """A file cut anywhere (mostly inside its last block: header, key, payload), as a
    crash or a full disk leaves it, reopens with exactly the blocks that end at or before
    the cut, each whole; the one the cut goes through is torn, counted once; the tier
    stores and loads again."""
    keys = [OffloadKey(bytes([65 + n]) * length) for n, length in enumerate(key_lengths)]
    blocks = {key: bytes([n]) * size for n, key in enumerate(keys)}
    with tempfile.TemporaryDirectory() as root:
        tier = DiskTier(root, CAPACITY, FP, io_threads=1)
        tier.write(keys, list(blocks.values()))
        tier.poll(wait=True)
        spans = {}
        for key in keys:
            start = tier.slot_offset(key)
            assert start is not None
            spans[key] = (start, start + HEADER_BYTES + len(key) + size)
        tier.close()
        last_start, end = max(spans.values())
        cut = data.draw(st.one_of(st.integers(last_start, end), st.integers(0, end)), "cut")
        os.truncate(tier.path, cut)
        if cut < SUPER_FIELDS:
            expected = Recovery(corrupt=1 if cut else 0)
            kept: list[OffloadKey] = []
        else:
            kept = [key for key in keys if spans[key][1] <= cut]
            torn = sum(1 for start, stop in spans.values() if start < cut < stop)
            expected = Recovery(recovered=len(kept), torn=torn)
        again = DiskTier(root, CAPACITY, FP, io_threads=1)
        try:
            assert again.recovery == expected
            assert [key for key in keys if again.present([key])] == kept
            buffers = [bytearray(size) for _ in kept]
            ok = again.read(kept, lambda i: memoryview(buffers[i])).result(timeout=30)
            assert all(ok) and [bytes(b) for b in buffers] == [blocks[key] for key in kept]
            fresh = OffloadKey(b"fresh")
            again.write([fresh], [b"\x07" * size])
            again.poll(wait=True)
            buffer = bytearray(size)
            assert again.read([fresh], lambda i: memoryview(buffer)).result(timeout=30) == [True]
            assert buffer == b"\x07" * size
            held = [key for key in [*keys, fresh] if again.present([key])]
        finally:
            again.close()
        once = DiskTier(root, CAPACITY, FP, io_threads=1)
        try:  # every drop was blanked: counted once, nothing lost by reopening
            assert once.recovery == Recovery(recovered=len(held))
            assert os.path.getsize(once.path) <= footprint(CAPACITY, size)
        finally:
            once.close()
