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
from pathlib import Path

import pytest
from disk_crash_points import FLIPPED, KEYS, SIZE, content

from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.slot_file import LOCK_FILE, SLOT_FILE, Recovery, footprint

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
