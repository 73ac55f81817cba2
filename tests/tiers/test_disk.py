"""The disk tier on a real slot file: round trips, slot reuse, restart, broken slots, ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tier_helpers import flip_byte

from kvoffload import OffloadKey, block_id_key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import layout_preset
from kvoffload.core.tier_protocol import MAX_IO_THREADS
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import (
    MAX_KEY_BYTES,
    SUPER_BYTES,
    FileLayer,
    Recovery,
    encode_superblock,
    slot_stride,
)

FP = layout_fingerprint("disk-test", layout_preset("tiny"), 64)
KEYS = [block_id_key(i) for i in range(12)]
HEAD = HEADER_BYTES + len(KEYS[0])  # where a slot's payload starts


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


def offsets(tier: DiskTier, keys: list[OffloadKey]) -> list[int | None]:
    return [tier.slot_offset(key) for key in keys]


def test_blocks_round_trip_through_the_slot_file(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP, enable_events=True), KEYS[:10])
    try:
        assert tier.present(KEYS) == 10 and len(tier) == 10
        ok, got = read_all(tier, KEYS[:10])
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS[:10])}
        assert tier.stats.stored_blocks == 10 and tier.stats.hit_blocks == 10
        assert sorted(p.name for p in tier.directory.iterdir()) == ["blocks.kvs", "lock"]
        stride = slot_stride(64)
        assert tier.stride == stride == 4096
        assert sorted(offsets(tier, KEYS[:10])) == [SUPER_BYTES + i * stride for i in range(10)]
        assert tier.path.stat().st_size <= SUPER_BYTES + 10 * stride
        [event] = tier.take_events()
        assert (event.medium, event.removed, sorted(event.keys)) == ("DISK", False, KEYS[:10])
        stored(tier, KEYS[:3])  # held already: not written again
        assert tier.stats.stored_blocks == 10
    finally:
        tier.close()


@pytest.mark.parametrize("policy", ["lru", "arc", "slru"])
def test_a_read_keeps_a_requests_head_longest_as_the_cpu_tier_does(
    tmp_path: Path, policy: str
) -> None:
    """A read makes a request's first block the most recent, as vLLM's touch (and our CPU
    tier) does: a tail without its head is never hit. The tier reversed the keys before the
    policy's touch, which reverses them itself, so its tail was kept and its head evicted
    first, breaking the prefix that makes the rest worth reading."""
    tier = stored(DiskTier(tmp_path, 3, FP, policy), KEYS[:3])
    try:
        read_all(tier, KEYS[:3])
        stored(tier, KEYS[3:4])
        assert [tier.present([k]) for k in KEYS[:4]] == [1, 1, 0, 1]
    finally:
        tier.close()


def test_the_capacity_holds_and_an_evicted_slot_takes_the_new_block(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 4, FP, "lru", enable_events=True), KEYS[:4])
    try:
        read_all(tier, [KEYS[0]])
        tier.take_events()
        freed = set(offsets(tier, KEYS[1:3]))
        stored(tier, KEYS[4:6])
        assert len(tier) == 4 and tier.stats.evicted == 2
        assert [tier.present([k]) for k in KEYS[:6]] == [1, 0, 0, 1, 1, 1]
        assert set(offsets(tier, KEYS[4:6])) == freed  # the freed slots, reused
        removed = [e for e in tier.take_events() if e.removed]
        assert [sorted(e.keys) for e in removed] == [[KEYS[1], KEYS[2]]]
        ok, got = read_all(tier, [KEYS[4], KEYS[5], KEYS[1]])
        assert ok == [True, True, False] and got == {0: payload(KEYS[4]), 1: payload(KEYS[5])}
        assert tier.path.stat().st_size <= SUPER_BYTES + 4 * slot_stride(64)
    finally:
        tier.close()


def test_a_restart_rebuilds_the_index_from_the_slots(tmp_path: Path) -> None:
    stored(DiskTier(tmp_path, 20, FP), KEYS[:5]).close()
    again = DiskTier(tmp_path, 20, FP)
    try:
        assert len(again) == 5 and again.present(KEYS) == 5 and again.stats.corrupt == 0
        ok, got = read_all(again, KEYS[:5])
        assert all(ok) and got[4] == payload(KEYS[4])
        stored(again, KEYS[5:7])  # into free slots, not over the old blocks
        ok, got = read_all(again, KEYS[:7])
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS[:7])}
    finally:
        again.close()
    smaller = DiskTier(tmp_path, 3, FP)  # slots beyond the new capacity are cut off
    try:
        assert len(smaller) == 3 and smaller.present(KEYS[:3]) == 3
        assert smaller.path.stat().st_size <= SUPER_BYTES + 3 * slot_stride(64)
    finally:
        smaller.close()
    other = DiskTier(tmp_path, 20, layout_fingerprint("another-model", layout_preset("tiny"), 64))
    try:
        assert len(other) == 0 and other.present(KEYS) == 0
    finally:
        other.close()


def test_a_restart_announces_the_blocks_it_recovered_as_stored(tmp_path: Path) -> None:
    stored(DiskTier(tmp_path, 8, FP), KEYS[:4]).close()
    again = DiskTier(tmp_path, 8, FP, enable_events=True)
    try:  # a router that indexes blocks by medium learns what the restarted tier serves
        [event] = again.take_events()
        assert (event.medium, event.removed) == ("DISK", False)
        assert sorted(event.keys) == sorted(KEYS[:4]) and again.take_events() == []
    finally:
        again.close()
    quiet = DiskTier(tmp_path, 8, FP)
    try:
        assert quiet.recovery.recovered == 4 and quiet.take_events() == []
    finally:
        quiet.close()


def test_blocks_past_a_smaller_capacity_are_counted_as_they_are_cut_off(tmp_path: Path) -> None:
    first = stored(DiskTier(tmp_path, 8, FP), KEYS[:6])
    where = dict(zip(KEYS[:6], offsets(first, KEYS[:6]), strict=True))
    first.close()
    past = SUPER_BYTES + 3 * slot_stride(64)
    with open(first.path, "r+b") as file:  # one of the slots past the cut broken
        file.seek(max(where.values()) + 10)
        file.write(b"\xff")
    smaller = DiskTier(tmp_path, 3, FP)
    try:
        assert smaller.recovery == Recovery(recovered=3, corrupt=1, beyond_capacity=2)
        assert smaller.recovery.as_dict()["dropped_beyond_capacity"] == 2
        assert smaller.present([k for k, at in where.items() if at is not None and at < past]) == 3
    finally:
        smaller.close()
    assert first.path.stat().st_size <= past
    again = DiskTier(tmp_path, 8, FP)
    try:  # cut off: counted once
        assert again.recovery == Recovery(recovered=3)
    finally:
        again.close()


def test_a_restart_drops_torn_and_broken_slots(tmp_path: Path) -> None:
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:6])
    where = dict(zip(KEYS[:6], offsets(first, KEYS[:6]), strict=True))
    first.close()
    last = max(where, key=lambda k: where[k] or 0)
    with open(first.path, "r+b") as file:
        file.seek(where[KEYS[1]] or 0)
        file.write(bytes(HEAD))  # header zeroed over its payload: a reuse cut short
        file.seek(where[KEYS[2]] or 0)
        file.write(b"XXXX")  # bad magic
        file.seek((where[KEYS[3]] or 0) + 10)
        file.write(b"\xff")  # a header field flipped: its CRC fails
        file.truncate((where[last] or 0) + HEAD + 20)  # the last block cut short
    again = DiskTier(tmp_path, 20, FP)
    try:
        expect = {KEYS[0], KEYS[4], KEYS[5]} - {last}
        assert {k for k in KEYS if again.present([k])} == expect
        # Torn: the zeroed header over its payload, the block cut short; corrupt: magic, CRC.
        assert again.recovery == Recovery(recovered=len(expect), torn=2, foreign=0, corrupt=2)
        assert again.stats.corrupt == 0  # the run's own count starts at zero
        ok, got = read_all(again, sorted(expect))
        assert all(ok) and set(got.values()) == {payload(k) for k in expect}
    finally:
        again.close()
    once = DiskTier(tmp_path, 20, FP)  # each dropped slot was blanked: counted once
    try:
        assert once.recovery == Recovery(recovered=len(expect))
    finally:
        once.close()


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEAD - 1], ids=["magic", "header", "key"])
def test_a_header_cut_by_the_end_of_the_file_is_torn(tmp_path: Path, cut: int) -> None:
    """The file ending inside the last slot's header or key is a write cut short, as it is
    inside its payload: torn, not corrupt."""
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:3])
    last = max(offsets(first, KEYS[:3]), key=lambda offset: offset or 0) or 0
    first.close()
    with open(first.path, "r+b") as file:
        file.truncate(last + cut)
    assert recovery_on_restart(tmp_path) == Recovery(recovered=2, torn=1)


def test_a_key_length_past_the_slots_room_is_corrupt_not_torn(tmp_path: Path) -> None:
    """Inside the file, a header announcing a key longer than a slot has room for is bad."""
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:3])
    start = min(offsets(first, KEYS[:3]), key=lambda offset: offset or 0) or 0
    first.close()
    with open(first.path, "r+b") as file:
        file.seek(start + 7)  # the key length's high byte: 256 more
        file.write(b"\x01")
    assert recovery_on_restart(tmp_path) == Recovery(recovered=2, corrupt=1)


@pytest.mark.parametrize("length", [MAX_KEY_BYTES - 1, MAX_KEY_BYTES, MAX_KEY_BYTES + 1])
def test_a_payload_under_a_zeroed_header_is_torn_for_every_key_length(
    tmp_path: Path, length: int
) -> None:
    """A store puts the payload down behind a zeroed header and key, then the header: cut in
    between, the slot is torn, with the longest key too (a start read only the header and
    the longest key's room, all zero under a key of ``MAX_KEY_BYTES``: counted blank). A key
    past that room is never stored."""
    key = OffloadKey(b"k" * length)
    first = stored(DiskTier(tmp_path, 20, FP), [KEYS[0], key])
    where = first.slot_offset(key)
    first.close()
    if length > MAX_KEY_BYTES:
        assert where is None and first.stats.failed == 1
        assert recovery_on_restart(tmp_path) == Recovery(recovered=1)
        return
    assert where is not None
    with open(first.path, "r+b") as file:
        file.seek(where)
        file.write(bytes(HEADER_BYTES + length))  # as the store leaves it before the header
    assert recovery_on_restart(tmp_path) == Recovery(recovered=1, torn=1)
    assert recovery_on_restart(tmp_path) == Recovery(recovered=1)  # blanked: counted once


def recovery_on_restart(directory: Path) -> Recovery:
    """What a tier of 20 blocks finds in ``directory`` when it starts."""
    again = DiskTier(directory, 20, FP)
    try:
        return again.recovery
    finally:
        again.close()


def test_after_a_restart_new_blocks_fill_the_lowest_free_slots(tmp_path: Path) -> None:
    """Found blocks keep their slots; new ones take the gaps first, lowest first."""
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:6])
    where = dict(zip(KEYS[:6], offsets(first, KEYS[:6]), strict=True))
    first.close()
    slot_of = {
        key: ((offset or 0) - SUPER_BYTES) // slot_stride(64) for key, offset in where.items()
    }
    assert sorted(slot_of.values()) == list(range(6))
    dropped = [key for key in KEYS[:6] if slot_of[key] in (1, 2, 4)]
    with open(first.path, "r+b") as file:
        for key in dropped:
            file.seek(where[key] or 0)
            file.write(b"XXXX")
    again = stored(DiskTier(tmp_path, 20, FP), KEYS[6:10])
    try:
        kept = [key for key in KEYS[:6] if key not in dropped]
        assert offsets(again, kept) == [where[key] for key in kept]
        new = sorted(
            ((offset or 0) - SUPER_BYTES) // slot_stride(64)
            for offset in offsets(again, KEYS[6:10])
        )
        assert new == [1, 2, 4, 6]
        ok, got = read_all(again, [*kept, *KEYS[6:10]])
        assert all(ok) and set(got.values()) == {payload(k) for k in [*kept, *KEYS[6:10]]}
    finally:
        again.close()


def test_a_huge_capacity_takes_no_memory_per_slot(tmp_path: Path) -> None:
    """The free slots were once listed up front: ``--disk-blocks 10**20`` ran out of memory.
    The file grows only with the slots written."""
    tracemalloc.start()
    try:
        tier = stored(DiskTier(tmp_path, 10**6, FP), KEYS[:3])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert peak < 2**20, peak
        assert sorted(offsets(tier, KEYS[:3])) == [SUPER_BYTES + i * 4096 for i in range(3)]
    finally:
        tier.close()
    huge = stored(DiskTier(tmp_path, 2**50, FP), KEYS[:3])
    try:
        ok, _ = read_all(huge, KEYS[:3])
        assert all(ok) and huge.path.stat().st_size <= SUPER_BYTES + 3 * 4096
    finally:
        huge.close()


def test_a_capacity_past_the_largest_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="past the largest file size"):
        DiskTier(tmp_path / "d", 10**20, FP)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"capacity_blocks": 4.0}, "capacity"),
        ({"capacity_blocks": "4"}, "capacity"),
        ({"io_threads": True}, "io_threads"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": MAX_IO_THREADS + 1}, "io_threads"),  # each of them was started
        ({"fingerprint": None}, "fingerprint"),
        ({"fingerprint": b"short"}, "fingerprint"),
        ({"deadline_s": None}, "deadline"),
        ({"deadline_s": "1"}, "deadline"),
        ({"deadline_s": 1e-300}, "deadline must be from 0.001 s to 600 s"),
        ({"deadline_s": 0.0005}, "deadline must be from 0.001 s to 600 s"),
        ({"deadline_s": 600.5}, "deadline must be from 0.001 s to 600 s"),
        ({"deadline_s": float("nan")}, "deadline must be from 0.001 s to 600 s"),
        ({"enable_events": "yes"}, "enable_events"),  # its lock was kept for good
        ({"fsync": "yes"}, "fsync"),
        ({"breaker": object()}, "breaker"),  # an AttributeError with three threads left running
        ({"file_layer": object()}, "file_layer"),
    ],
)
def test_a_bad_argument_is_refused_naming_it_before_any_file_or_thread(
    tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    """Not a bare ``TypeError`` from a comparison or ``len``, nor an argument taken."""
    arguments: dict[str, object] = {"capacity_blocks": 4, "fingerprint": FP, **fields}
    threads = threading.active_count()
    with pytest.raises(InvalidArgumentError, match=named):
        DiskTier(tmp_path / "d", **arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists() and threading.active_count() == threads


def test_an_empty_directory_is_refused_not_taken_as_the_working_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``""`` as a path is the working directory: a setting left blank, never meant."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="disk tier directory must be a non-empty"):
        DiskTier("", 4, FP)
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_superblock_starts_the_tier_over(tmp_path: Path) -> None:
    first = stored(DiskTier(tmp_path, 20, FP), KEYS[:3])
    first.close()
    foreign = layout_fingerprint("another-model", layout_preset("tiny"), 64)
    with open(first.path, "r+b") as file:
        file.write(encode_superblock(foreign, slot_stride(64), 64))
    again = DiskTier(tmp_path, 20, FP)
    try:
        assert len(again) == 0 and again.path.stat().st_size == 0
        assert again.recovery == Recovery(foreign=3)  # the other layout's file, all its slots
        stored(again, KEYS[3:5])
        ok, got = read_all(again, KEYS[3:5])
        assert all(ok) and got[1] == payload(KEYS[4])
    finally:
        again.close()
    with open(first.path, "r+b") as file:
        file.seek(26)
        file.write(b"\xff")  # the superblock's stride field: its CRC fails
    broken = DiskTier(tmp_path, 20, FP)
    try:
        assert len(broken) == 0 and broken.recovery == Recovery(corrupt=1)
    finally:
        broken.close()


def test_a_flipped_payload_byte_is_never_loaded_nor_indexed_again(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP, enable_events=True), KEYS[:3])
    try:
        tier.take_events()
        flip_byte(tier, KEYS[1], HEAD + 59)
        ok, got = read_all(tier, KEYS[:3])
        assert ok == [True, False, True] and 1 not in got
        assert tier.stats.corrupt == 1 and tier.stats.hit_blocks == 2
        assert tier.present(KEYS[:3]) == 1 and len(tier) == 2
        [event] = tier.take_events()
        assert event.removed and event.keys == [KEYS[1]]
    finally:
        tier.close()
    again = DiskTier(tmp_path, 20, FP)
    try:
        assert len(again) == 2 and again.present([KEYS[1]]) == 0 and again.stats.corrupt == 0
    finally:
        again.close()


def test_a_read_in_flight_while_its_slot_is_reused_gets_the_old_block(tmp_path: Path) -> None:
    """The read holds the slot's stripe; the write into the reused slot queues behind it."""
    tier = stored(DiskTier(tmp_path, 1, FP), KEYS[:1])
    try:
        entered, release = threading.Event(), threading.Event()
        buffer = bytearray(64)

        def held(_: int) -> memoryview:
            entered.set()
            release.wait(10)
            return memoryview(buffer)

        reading = tier.read(KEYS[:1], held)
        assert entered.wait(10)
        tier.write(KEYS[1:2], [payload(KEYS[1])])  # evicts KEYS[0], reuses its slot
        assert tier.slot_offset(KEYS[1]) == SUPER_BYTES and tier.present(KEYS[:1]) == 0
        release.set()
        assert reading.result(timeout=10) == [True] and bytes(buffer) == payload(KEYS[0])
        tier.poll(wait=True)
        ok, got = read_all(tier, KEYS[:2])
        assert ok == [False, True] and got[1] == payload(KEYS[1])
    finally:
        release.set()
        tier.close()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["write", "read", "poll"]), st.integers(0, 7)),
        max_size=40,
    ),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_reads_never_deliver_another_keys_bytes(
    steps: list[tuple[str, int]], capacity: int, io_threads: int
) -> None:
    """Writes, reads and polls in any order: a read is its key's bytes or a miss."""
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskTier(directory, capacity, FP, io_threads=io_threads)
        reads: list[tuple[OffloadKey, bytearray, Future[list[bool]]]] = []
        try:
            for op, k in steps:
                key = KEYS[k]
                if op == "write":
                    tier.write([key], [payload(key)])
                elif op == "read":
                    buffer = bytearray(64)
                    reads.append((key, buffer, tier.read([key], lambda _, b=buffer: memoryview(b))))
                else:
                    tier.poll(wait=False)
                assert len(tier) <= capacity
            for key, buffer, future in reads:
                [ok] = future.result(timeout=10)
                assert not ok or bytes(buffer) == payload(key)
            tier.poll(wait=True)
            assert tier.stats.corrupt == 0 and tier.stats.failed == 0
        finally:
            tier.close()


WRITER = """
import sys
from kvoffload import block_id_key
from kvoffload.tiers import DiskTier
fp = bytes.fromhex(sys.argv[2])
tier = DiskTier(sys.argv[1], 3, fp)
blocks = [(key * 699051)[:8388608] for key in map(block_id_key, range(6))]
for i in range(100000):
    key = block_id_key(i % 6)
    tier.write([key], [blocks[i % 6]])
    tier.poll(wait=i % 4 == 0)
    if i == 4:
        print("writing", flush=True)
"""


def test_a_process_killed_mid_write_leaves_only_intact_blocks(tmp_path: Path) -> None:
    """Slots are reused all the time; whenever the kill lands, no indexed block is wrong."""
    size = 8388608
    fp = layout_fingerprint("disk-test", layout_preset("tiny"), size)
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), fp.hex()], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"writing\n"
        time.sleep(random.uniform(0.02, 0.2))
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    tier = DiskTier(tmp_path, 3, fp)
    try:
        held = [key for key in (block_id_key(i) for i in range(6)) if tier.present([key])]
        assert held and tier.stats.corrupt == 0
        ok, got = read_all(tier, held, size)
        assert all(ok) and got == {i: payload(key, size) for i, key in enumerate(held)}
    finally:
        tier.close()


def test_a_block_too_large_for_the_slots_is_a_failed_store(tmp_path: Path) -> None:
    tier = stored(DiskTier(tmp_path, 20, FP), KEYS[:1])
    try:
        stored(tier, KEYS[1:3], 8192)  # the stride was fixed by the first write
        assert tier.stats.failed == 2 and tier.stats.stored_blocks == 1 and len(tier) == 1
        long_key = OffloadKey(b"k" * (MAX_KEY_BYTES + 1))
        stored(tier, [long_key])
        assert tier.stats.failed == 3 and tier.present([long_key]) == 0
        stored(tier, KEYS[3:4])
        ok, got = read_all(tier, [KEYS[0], KEYS[3]])
        assert ok == [True, True] and got[1] == payload(KEYS[3])
    finally:
        tier.close()


def test_fsync_keeps_the_same_blocks(tmp_path: Path) -> None:
    stored(DiskTier(tmp_path, 8, FP, fsync=True), KEYS[:4]).close()
    again = DiskTier(tmp_path, 8, FP, fsync=True)
    try:
        ok, got = read_all(again, KEYS[:4])
        assert all(ok) and got[3] == payload(KEYS[3])
    finally:
        again.close()


class WriteOrder(FileLayer):
    """Records the slot file's writes and data syncs, in order, once :attr:`on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[str] = []

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        if self.on:
            self.calls.append("header")
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        if self.on:
            self.calls.append("payload")
        return super().pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        if self.on:
            self.calls.append("sync")
        super().fdatasync(fd)


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_syncs_a_batch_s_payloads_before_its_headers_and_the_headers_after(
    tmp_path: Path, fsync: bool
) -> None:
    """A power cut then leaves a slot's header only over the payload it names, and a
    block reported stored is on the disk: the guarantee ``fsync=True`` gives."""
    layer = WriteOrder()
    tier = DiskTier(tmp_path, 8, FP, io_threads=1, fsync=fsync, file_layer=layer)
    try:
        stored(tier, KEYS[:1])  # the superblock goes down with the first batch
        layer.on = True
        stored(tier, KEYS[1:3])
        if fsync:
            assert layer.calls == ["payload", "payload", "sync", "header", "header", "sync"]
        else:
            assert layer.calls == ["payload", "payload", "header", "header"]
    finally:
        tier.close()


class SyncRecorder(FileLayer):
    """Records what each ``fsync`` synced, as ``(device, inode)``."""

    def __init__(self) -> None:
        self.synced: list[tuple[int, int]] = []

    def fsync(self, fd: int) -> None:
        info = os.fstat(fd)
        self.synced.append((info.st_dev, info.st_ino))
        super().fsync(fd)


def identity(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_makes_the_names_the_tier_created_durable(tmp_path: Path, fsync: bool) -> None:
    root = tmp_path / "made" / "kv"
    layer = SyncRecorder()
    tier = DiskTier(root, 8, FP, fsync=fsync, file_layer=layer)
    try:  # each name lives in the directory above it, up to the first the tier did not make
        names = [tier.directory, root, root.parent, tmp_path]
        assert set(layer.synced) == ({identity(path) for path in names} if fsync else set())
    finally:
        tier.close()
    layer.synced.clear()
    again = DiskTier(root, 8, FP, fsync=fsync, file_layer=layer)
    try:  # nothing made this time: the directories of the slot file and of its directory
        names = [tier.directory, root]
        assert set(layer.synced) == ({identity(path) for path in names} if fsync else set())
    finally:
        again.close()


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


def test_blocks_stored_after_the_file_was_emptied_under_the_tier_survive_a_restart(
    tmp_path: Path,
) -> None:
    tier = stored(DiskTier(tmp_path, 8, FP), KEYS[:4])
    try:
        os.truncate(tier.path, 0)  # another process empties the file, superblock and all
        stored(tier, KEYS[4:8])
        ok, _ = read_all(tier, KEYS[:8])
        assert ok == [False] * 4 + [True] * 4 and tier.stats.corrupt == 4
    finally:
        tier.close()
    again = DiskTier(tmp_path, 8, FP)
    try:
        assert again.recovery == Recovery(recovered=4) and again.present(KEYS[4:8]) == 4
        ok, got = read_all(again, KEYS[4:8])
        assert all(ok) and got == {i: payload(k) for i, k in enumerate(KEYS[4:8])}
    finally:
        again.close()


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
    dont_write_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # a module first imported under the cap would keep a cut .pyc
    resource.setrlimit(resource.RLIMIT_FSIZE, (size_kib * 1024, hard))
    try:
        yield "rlimit"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        sys.dont_write_bytecode = dont_write_bytecode
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_degrades_to_failed_stores(tmp_path: Path) -> None:
    """40 KiB hold the superblock's page and nine one-page slots: the rest fails."""
    size = 1000
    with small_filesystem(tmp_path / "small", 40) as kind:
        tier = DiskTier(tmp_path / "small", 100, FP, io_threads=1)
        try:
            stored(tier, KEYS, size)
            assert tier.stats.failed > 0, kind
            good = tier.stats.stored_blocks
            assert good >= 2 and good + tier.stats.failed == len(KEYS)
            assert len(tier) == good
            ok, got = read_all(tier, KEYS[:2], size)
            assert ok == [True, True] and got[1] == payload(KEYS[1], size)
            tier.close()
            again = DiskTier(tmp_path / "small", 100, FP, io_threads=1)
            tier = again
            assert len(again) == good and again.stats.corrupt == 0  # no half-written slot
        finally:
            tier.close()


class PartlyCached(FileLayer):
    """A page cache holding pieces of the file: every other cached read finds nothing,
    the others at most :attr:`limit` bytes, so a payload arrives partly straight from the
    cache and partly through the stripe's buffer, cut where neither cuts it."""

    limit = 100_003

    def __init__(self) -> None:
        self.asked = 0
        self.served = 0

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self.asked += 1
        if self.asked % 2:
            return 0
        room, trimmed = self.limit, []
        for buffer in buffers:
            trimmed.append(memoryview(buffer)[:room])
            room -= trimmed[-1].nbytes
        got = super().preadv_cached(fd, trimmed, offset)
        self.served += got
        return got


def test_a_payload_read_partly_from_the_cache_and_partly_through_the_buffer_is_whole(
    tmp_path: Path,
) -> None:
    size = 700_001
    fp = layout_fingerprint("disk-test", layout_preset("tiny"), size)
    layer = PartlyCached()
    tier = DiskTier(tmp_path, 4, fp, file_layer=layer)
    try:
        tier.write(KEYS[:2], [payload(key, size) for key in KEYS[:2]])
        tier.poll(wait=True)
        parts = [[bytearray(n) for n in (99_999, 300_001, size - 400_000)] for _ in range(2)]
        ok = tier.read(KEYS[:2], lambda i: [memoryview(p) for p in parts[i]]).result(timeout=10)
        assert ok == [True, True] and 0 < layer.served < 2 * size
        assert [b"".join(p) for p in parts] == [payload(key, size) for key in KEYS[:2]]
        flip_byte(tier, KEYS[1], HEAD + size - 1)  # in the last piece: the sum spans both ways
        assert read_all(tier, KEYS[:2], size)[0] == [True, False]
        assert tier.stats.corrupt == 1
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


def test_a_tier_emptied_on_close_restarts_empty_and_a_failed_truncate_only_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reset empties the tier's file through its own descriptor as it closes."""
    tier = stored(DiskTier(tmp_path, 8, FP), KEYS[:3])
    tier.empty_on_close = True
    tier.close()
    again = DiskTier(tmp_path, 8, FP)
    try:
        assert again.present(KEYS[:3]) == 0 and again.recovery.recovered == 0
    finally:
        again.close()

    class NoTruncate(FileLayer):
        def ftruncate(self, fd: int, size: int) -> None:
            raise OSError(errno.EIO, "injected")

    failing = stored(DiskTier(tmp_path, 8, FP, file_layer=NoTruncate()), KEYS[:2])
    failing.empty_on_close = True
    failing.close()  # no raise: the blocks stay, each intact under its own key
    assert "could not be emptied" in caplog.text


def test_the_start_up_scan_has_the_time_its_slots_take(tmp_path: Path) -> None:
    """Every slot's header is read on start: the scan may take the deadline plus a page per
    slot at the slowest device rate, as a job moving those bytes may, so a large tier (here
    300,000 slots on a deadline of 50 ms) restarts; before, a scan longer than the bare
    deadline refused the start as a file system that did not answer."""
    slots = 300_000
    first = stored(DiskTier(tmp_path, slots, FP), KEYS[:1])
    first.close()
    os.truncate(first.path, SUPER_BYTES + slots * slot_stride(64))  # sparse: no room taken
    again = DiskTier(tmp_path, slots, FP, deadline_s=0.05)
    try:
        assert again.recovery == Recovery(recovered=1)
        ok, got = read_all(again, KEYS[:1])
        assert ok == [True] and got[0] == payload(KEYS[0])
    finally:
        again.close()


class BadSector(FileLayer):
    """Reads at one offset fail with EIO, as from a bad sector; writes there too unless
    ``writable`` (a disk remaps a sector written over)."""

    def __init__(self, offset: int, writable: bool) -> None:
        self.offset = offset
        self.writable = writable

    def _check(self, offset: int) -> None:
        if offset == self.offset:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._check(offset)
        return super().pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        if not self.writable:
            self._check(offset)
        return super().pwrite(fd, data, offset)


@pytest.mark.parametrize("writable", [True, False])
def test_a_header_the_disk_cannot_read_drops_its_slot_not_the_start(
    tmp_path: Path, writable: bool
) -> None:
    """A failing disk fails what it cannot read: one unreadable header is a slot dropped
    as corrupt, the other blocks served; before, it refused the start. Blanked where it
    can be written, so counted once; where not, the next start looks at it again."""
    tier = stored(DiskTier(tmp_path, 8, FP), KEYS[:4])
    bad = tier.slot_offset(KEYS[1])
    tier.close()
    assert bad is not None
    again = DiskTier(tmp_path, 8, FP, file_layer=BadSector(bad, writable))
    try:
        assert again.recovery == Recovery(recovered=3, corrupt=1)
        assert again.present(KEYS[1:2]) == 0
        ok, got = read_all(again, [KEYS[0], KEYS[2], KEYS[3]])
        assert all(ok) and list(got.values()) == [payload(KEYS[k]) for k in (0, 2, 3)]
    finally:
        again.close()
    healed = DiskTier(tmp_path, 8, FP)  # the sector readable again
    try:
        assert healed.recovery == Recovery(recovered=3 if writable else 4)
    finally:
        healed.close()
