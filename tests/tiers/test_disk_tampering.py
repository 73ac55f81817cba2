"""The disk tier's file changed or limited behind its back: cut short at any point while
open, and a file size limit (``RLIMIT_FSIZE``, EFBIG) hit by the superblock and by a
slot, then the process killed. Only whole blocks of their own key are ever loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tier_helpers import content

from kvoffload import OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import SUPER_BYTES, Recovery, footprint

SIZE = 5000
FP = layout_fingerprint("disk-tampering", layout_preset("tiny"), SIZE)
KEYS = [block_id_key(i, 13) for i in range(8)]


def load(tier: DiskTier, keys: list[OffloadKey]) -> list[bool]:
    """Which keys loaded; every one that did holds its own bytes."""
    buffers = [bytearray(SIZE) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=30)
    tier.poll(wait=True)
    assert all(bytes(buffers[i]) == content(k, SIZE) for i, k in enumerate(keys) if ok[i])
    return ok


def store(tier: DiskTier, keys: list[OffloadKey]) -> None:
    tier.write(keys, [content(key, SIZE) for key in keys])
    tier.poll(wait=True)


@pytest.mark.parametrize(
    "where",
    ["in the superblock", "in a header", "in a key", "in a payload", "after a block"],
)
def test_a_file_cut_short_under_the_tier_loses_only_the_blocks_past_the_cut(
    tmp_path: Path, where: str
) -> None:
    """Another process truncates the slot file, anywhere: the blocks the cut reaches read
    as corrupt (counted, dropped), the others load, a store puts the superblock back,
    and a restart finds what is left with nothing to drop."""
    tier = DiskTier(tmp_path, 4, FP, io_threads=1)
    try:
        store(tier, KEYS[:3])
        starts = {key: tier.slot_offset(key) or 0 for key in KEYS[:3]}
        middle = sorted(starts.values())[1]
        cut = {
            "in the superblock": 30,
            "in a header": middle + 10,
            "in a key": middle + HEADER_BYTES + 5,
            "in a payload": middle + 2000,
            "after a block": middle + HEADER_BYTES + len(KEYS[0]) + SIZE,
        }[where]
        os.truncate(tier.path, cut)
        whole = [
            cut > SUPER_BYTES and starts[key] + HEADER_BYTES + len(key) + SIZE <= cut
            for key in KEYS[:3]
        ]
        assert load(tier, KEYS[:3]) == whole
        assert tier.stats.corrupt == whole.count(False) and tier.stats.failed == 0
        assert tier.present(KEYS[:3]) == (whole.index(False) if False in whole else 3)
        store(tier, KEYS[3:5])
        assert load(tier, KEYS[3:5]) == [True, True]
        kept = [key for key in KEYS if tier.present([key])]
    finally:
        tier.close()
    again = DiskTier(tmp_path, 4, FP, io_threads=1)
    try:
        assert again.recovery == Recovery(recovered=len(kept))
        assert [key for key in KEYS if again.present([key])] == kept
        assert load(again, kept) == [True] * len(kept)
    finally:
        again.close()


FILLED_AND_KILLED = """
import json, os, resource, sys
from kvoffload import block_id_key
from kvoffload.tiers import DiskTier
from kvoffload.tiers.slot_file import SUPER_BYTES, slot_stride

directory, fingerprint, size = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
keys = [block_id_key(i, 13) for i in range(8)]
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
tier = DiskTier(directory, 4, fingerprint, io_threads=1)
counts = []
# Smaller than the superblock; then room for it and one slot and a bit of the next.
for limit, batch in ((20, keys[:1]), (SUPER_BYTES + slot_stride(size) + 100, keys[1:5])):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    tier.write(batch, [(k * (size // len(k) + 1))[:size] for k in batch])
    tier.poll(wait=True)
    counts.append([tier.stats.stored_blocks, tier.stats.failed])
print(json.dumps(counts), flush=True)
os._exit(9)  # killed: nothing closed, nothing flushed by the tier
"""


def test_a_file_size_limit_then_a_kill_leaves_only_whole_blocks(tmp_path: Path) -> None:
    """A limit the superblock itself does not fit (every store fails, the superblock is
    written again by the next batch), then one slot fits and the next is cut by the limit
    (EFBIG, a short write): failed stores, no exception, and after the kill a restart
    loads exactly the blocks stored."""
    child = subprocess.run(
        [sys.executable, "-c", FILLED_AND_KILLED, str(tmp_path), FP.hex(), str(SIZE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert child.returncode == 9, child.stderr
    counts = json.loads(child.stdout)
    assert counts[0] == [0, 1]  # the superblock did not fit: nothing stored
    stored, failed = counts[1]
    assert stored == 1 and failed == 1 + 3  # one slot fitted; the one cut and two past it
    tier = DiskTier(tmp_path, 4, FP, io_threads=1)
    try:
        assert os.path.getsize(tier.path) <= footprint(4, SIZE)
        held = [key for key in KEYS if tier.present([key])]
        assert len(held) == stored and tier.recovery.recovered == stored
        assert load(tier, held) == [True] * stored
        store(tier, KEYS[5:8])
        assert load(tier, KEYS[5:8]) == [True] * 3 and tier.stats.failed == 0
    finally:
        tier.close()
