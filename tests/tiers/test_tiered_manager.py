"""The tiered manager over a real CPU tier and a real disk tier (and the shared tier)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from tier_helpers import STALL_S, ByteSlots, content, flip_byte

from kvoffload import BlockNotPinnedError, CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.keys import NotAKeyIterableError
from kvoffload.core.layout import layout_preset
from kvoffload.core.tier_protocol import SlotBytesUnavailableError
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import PENDING_STORE
from kvoffload.tiers import DiskTier, RemoteTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import FileLayer
from tier_servers import ValkeyProcess

FP = layout_fingerprint("tiered-test", layout_preset("tiny"), 0)
K = [block_id_key(i) for i in range(10)]


def stack(
    tmp_path: Path, cpu_blocks: int = 2, disk_blocks: int = 8, threshold: int = 0
) -> TieredOffloadingManager:
    cpu = CPUOffloadingManager(cpu_blocks, enable_events=True)
    disk = DiskTier(tmp_path / "disk", disk_blocks, FP, enable_events=True)
    return TieredOffloadingManager(
        cpu, [(disk, TierSettings(False, threshold))], wait_for_tiers=True
    )


def store(m: TieredOffloadingManager, keys: list[OffloadKey], success: bool = True) -> None:
    output = m.prepare_store(keys)
    assert output is not None
    m.complete_store(output.keys_to_store, success)


def test_a_cpu_eviction_falls_to_disk_and_a_disk_hit_is_promoted_first(tmp_path: Path) -> None:
    m = stack(tmp_path)
    try:
        store(m, K[:2])
        store(m, [K[2]])  # evicts K[0] (least recent) to disk
        m.poll()
        assert m.cpu.lookup([K[0]]) == 0 and m.tiers[0].present([K[0]]) == 1
        assert m.lookup([K[0]]) is None  # promotion started
        assert m.promotions_in_flight == 1 and m.lookup([K[0]]) == 1
        spec = m.prepare_load([K[0]])
        assert len(spec.block_ids) == 1
        m.complete_load([K[0]])
        assert m.tiers[0].stats.hit_blocks == 1 and m.promotion_batches == [1]
        media = [(e.medium, e.removed, e.keys) for e in m.take_events()]
        assert ("CPU", True, [K[0]]) in media and ("DISK", False, [K[0]]) in media
        cpu = [event for event in media if event[0] == "CPU"]
        assert cpu[-1] == ("CPU", False, [K[0]])  # loadable again, from the CPU tier
    finally:
        m.close()


def test_a_promotion_never_evicts_the_cpu_blocks_right_after_it(tmp_path: Path) -> None:
    """A request whose head is on disk and whose next blocks the CPU tier still holds:
    the promotion makes room by evicting other blocks, not those, which its hit run reaches
    once it lands (vLLM's scheduler touches none of a request's keys before its lookup, so
    they can be the coldest: they were written down and read back in a second promotion)."""
    m = stack(tmp_path, cpu_blocks=4)
    try:
        store(m, K[:2])
        store(m, K[2:4])
        store(m, K[4:6])  # K0, K1 to disk; the CPU holds K2, K3 (coldest), K4, K5
        request = K[:4]
        assert m.lookup(request) is None  # K0, K1 promoted
        assert m.lookup(request) == 4
        assert m.promotion_batches == [1]
        assert m.tiers[0].present([K[2]]) == 0 and m.tiers[0].present([K[4]]) == 1
    finally:
        m.close()


def test_a_promotion_never_evicts_the_cpu_hits_in_front_of_it(tmp_path: Path) -> None:
    m = stack(tmp_path)
    try:
        store(m, [K[0]])
        store(m, [K[1]])
        store(m, [K[2]])  # K[0] to disk; the CPU holds K[1], K[2]
        m.touch([K[2]])  # K[1], the CPU hit, is now the least recent
        assert m.lookup([K[1], K[0]]) is None
        assert m.lookup([K[1], K[0]]) == 2
        assert m.cpu.lookup([K[2]]) == 0 and m.tiers[0].present([K[2]]) == 1
    finally:
        m.close()


def test_a_failed_promotion_frees_its_slot_and_counts(tmp_path: Path) -> None:
    m = stack(tmp_path)
    try:
        for key in K[:3]:
            store(m, [key])
        m.poll()
        disk = m.tiers[0]
        assert isinstance(disk, DiskTier)
        flip_byte(disk, K[0], HEADER_BYTES + len(K[0]) - 1)  # header-only block: its key
        assert m.lookup([K[0]]) is None
        assert m.lookup([K[0]]) == 0
        assert m.cpu.block_status(K[0]) is None and m.promotions_in_flight == 0
        assert disk.stats.corrupt == 1 and disk.present([K[0]]) == 0
        store(m, [K[0]])  # stored again as new
        assert m.lookup([K[0]]) == 1
    finally:
        m.close()


def test_a_failed_cpu_store_never_reaches_the_lower_tiers(tmp_path: Path) -> None:
    m = stack(tmp_path, cpu_blocks=1)
    try:
        store(m, [K[0]], success=False)
        store(m, [K[1]])
        store(m, [K[2]])
        m.poll()
        disk = m.tiers[0]
        assert disk.present([K[0]]) == 0 and disk.present([K[1]]) == 1
        assert m.cpu_stats.stored_blocks == 2
    finally:
        m.close()


def test_admission_keeps_blocks_seen_once_off_the_disk(tmp_path: Path) -> None:
    m = stack(tmp_path, cpu_blocks=1, threshold=2)
    try:
        m.lookup([K[0]])
        m.lookup([K[0]])
        store(m, [K[0]])
        m.lookup([K[1]])
        store(m, [K[1]])  # K[0], seen twice, falls to disk
        store(m, [K[2]])  # K[1], seen once, is dropped
        m.poll()
        disk = m.tiers[0]
        assert disk.present([K[0]]) == 1 and disk.present([K[1]]) == 0
        assert disk.stats.stored_blocks == 1
    finally:
        m.close()


def test_write_through_shares_blocks_between_two_managers(
    tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    fp = layout_fingerprint("write-through", layout_preset("tiny"), 0)

    def manager() -> TieredOffloadingManager:
        remote = RemoteTier(valkey_server.url, fp, enable_events=True)
        return TieredOffloadingManager(
            CPUOffloadingManager(4),
            [(remote, TierSettings(write_through=True))],
            wait_for_tiers=True,
        )

    first, second = manager(), manager()
    try:
        first.tiers[0].delete_all()  # type: ignore[attr-defined]
        store(first, K[:3])
        first.poll()
        assert [e.medium for e in first.take_events()] == ["REMOTE"]
        assert second.lookup(K[:4]) is None
        assert second.lookup(K[:4]) == 3
        assert second.tiers[0].stats.hit_blocks == 3
    finally:
        first.close()
        second.close()


def test_a_promotion_survives_the_demotion_that_evicts_it_from_a_full_disk(
    tmp_path: Path,
) -> None:
    fp = layout_fingerprint("swap", layout_preset("tiny"), 40)
    slots = ByteSlots(1, 40)
    disk = DiskTier(tmp_path / "disk", 1, fp)
    m = TieredOffloadingManager(CPUOffloadingManager(1), [(disk, TierSettings())], slots)

    def store(key: OffloadKey) -> None:
        output = m.prepare_store([key])
        assert output is not None
        slots.view(0)[:] = content(key, 40)
        m.complete_store([key])

    try:
        store(K[0])
        store(K[1])  # K[0] falls to the one-block disk
        disk.poll(wait=True)
        assert disk.present([K[0]]) == 1
        # Promoting K[0] evicts K[1] from the CPU, whose demotion evicts K[0] from the disk.
        assert m.lookup([K[0]]) is None
        deadline = time.monotonic() + 10
        while (found := m.lookup([K[0]])) is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert found == 1 and bytes(slots.view(0)) == content(K[0], 40)
        disk.poll(wait=True)
        assert disk.present([K[1]]) == 1 and disk.present([K[0]]) == 0
    finally:
        m.close()


def test_only_the_intact_prefix_of_a_promotion_is_reserved(tmp_path: Path) -> None:
    """K0..K2 on disk, K1 with a flipped byte: K0 waits for its caller, K2 is a plain block."""
    fp = layout_fingerprint("torn-run", layout_preset("tiny"), 40)
    disk = DiskTier(tmp_path / "disk", 4, fp)
    disk.write(K[:3], [content(key, 40) for key in K[:3]])
    disk.poll(wait=True)
    flip_byte(disk, K[1], HEADER_BYTES + len(K[1]) + 39)  # the payload's last byte
    slots = ByteSlots(4, 40)
    m = TieredOffloadingManager(
        CPUOffloadingManager(4), [(disk, TierSettings())], slots, wait_for_tiers=True
    )
    try:
        assert m.lookup(K[:3]) is None
        m.poll()  # the promotion lands: K0 and K2 intact, K1 corrupt
        assert m.is_reserved(K[0]) and not m.is_reserved(K[2])
        assert m.cpu.block_status(K[0]).ref_cnt == 1  # type: ignore[union-attr]
        assert m.cpu.block_status(K[2]).ref_cnt == 0 and not m.cpu.holds(K[1])  # type: ignore[union-attr]
        assert disk.stats.corrupt == 1 and disk.stats.hit_blocks == 2
        assert m.lookup(K[:3]) == 1 and m.is_reserved(K[0])  # claimed for the caller's load
        m.prepare_load([K[0]])
        assert not m.is_reserved(K[0])  # the load's pin alone
        assert m.cpu.block_status(K[0]).ref_cnt == 1  # type: ignore[union-attr]
        m.complete_load([K[0]])
        assert m.cpu.block_status(K[0]).ref_cnt == 0  # type: ignore[union-attr]
        assert bytes(slots.view(m.cpu.block_status(K[0]).block_id)) == content(K[0], 40)  # type: ignore[union-attr]
    finally:
        m.close()


@pytest.mark.parametrize(
    ("retry", "hits"),
    [
        (K[2:4], 2),  # the GPU cached K0 and K1 meanwhile: the retry starts past them
        ([K[9], *K[:4]], 0),  # the GPU evicted a head block no tier holds: it starts before
    ],
)
def test_a_retry_that_starts_elsewhere_still_ends_the_reservation(
    tmp_path: Path, retry: list[OffloadKey], hits: int
) -> None:
    """vLLM's scheduler re-matches a parked request's GPU prefix on each try, so the retry
    may not claim the promoted blocks as hits. They stayed pinned for ``reserve_lookups``
    more lookups: on a 200-block CPU tier the whole tier was reserved after 80 lookups and
    the replay rejected 35,668 stores where, without a disk tier, it rejected 20,009."""
    m = stack(tmp_path, cpu_blocks=4)
    try:
        store(m, K[:4])
        store(m, K[4:8])  # K0..K3 fall to disk
        assert m.lookup(K[:4]) is None
        m.poll()
        assert all(m.is_reserved(key) for key in K[:4])
        assert m.lookup(retry) == hits
        if hits:  # claimed for the retry's load, which ends the reservation
            assert all(m.is_reserved(key) for key in K[:4])
            m.prepare_load(retry[:hits])
            m.complete_load(retry[:hits])
        assert not any(m.is_reserved(key) for key in K[:4])
        assert [m.cpu.block_status(key).ref_cnt for key in K[:4]] == [0] * 4  # type: ignore[union-attr]
        store(m, K[4:8])  # and the CPU tier has room again
    finally:
        m.close()


def test_a_lookup_that_waits_on_its_own_promotion_releases_no_reservation(
    tmp_path: Path,
) -> None:
    """Another request of the same prefix, parked on a promotion past it, will hit the
    reserved blocks when it asks again, and so will their requester: released by that
    parked lookup, they could be evicted by the next promotion before either asked."""
    disk = DiskTier(tmp_path / "disk", 8, FP)
    disk.write(K[:3], [b""] * 3)
    disk.poll(wait=True)
    m = TieredOffloadingManager(
        CPUOffloadingManager(4), [(disk, TierSettings())], wait_for_tiers=True
    )
    try:
        assert m.lookup(K[:2]) is None
        m.poll()  # K0 and K1 land, reserved for their requester
        assert m.lookup(K[:3]) is None  # another request: hits K0 K1, waits on K2
        assert m.is_reserved(K[0]) and m.is_reserved(K[1])
        assert m.lookup(K[:2]) == 2  # the requester's retry claims them
    finally:
        m.close()


def scan(m: TieredOffloadingManager, keys: list[OffloadKey]) -> list[int | None]:
    """vLLM 0.33's lookup of a request: one key at a time, on past a ``None``, to a miss."""
    answers: list[int | None] = []
    for key in keys:
        answers.append(m.lookup([key]))
        if answers[-1] == 0:
            break
    return answers


def test_a_request_looked_up_one_key_at_a_time_is_answered_when_the_cpu_tier_is_smaller(
    tmp_path: Path,
) -> None:
    """Three blocks on disk, room for two in the CPU tier. The second scan hits the two
    promoted blocks; released by those one-key hits, they were evicted by the promotion
    its third key started, and every later scan promoted again what the one before had
    evicted: the request was deferred for ever and each of its blocks read again and
    again. Claimed by the hits, they wait for the load and the third key is a miss."""
    disk = DiskTier(tmp_path / "disk", 8, FP)
    disk.write(K[:3], [b""] * 3)
    disk.poll(wait=True)
    m = TieredOffloadingManager(
        CPUOffloadingManager(2), [(disk, TierSettings())], wait_for_tiers=True
    )
    try:
        assert scan(m, K[:3]) == [None, None, 0]
        assert scan(m, K[:3]) == [1, 1, 0]
        assert m.is_reserved(K[0]) and m.is_reserved(K[1])  # until the load
        m.prepare_load(K[:2])
        m.complete_load(K[:2])
        assert not m.is_reserved(K[0]) and not m.is_reserved(K[1])
        assert [m.cpu.block_status(key).ref_cnt for key in K[:2]] == [0, 0]  # type: ignore[union-attr]
        assert disk.stats.hit_blocks == 2 and m.promotion_batches == [2]  # each read once
    finally:
        m.close()


def test_a_scan_longer_than_a_thousand_keys_keeps_its_claims_until_the_load(
    tmp_path: Path,
) -> None:
    """1,200 blocks on disk, room for 1,100 in the CPU tier, asked one key at a time. The
    second scan's first claims expired after 1,024 lookups, before its end: its 1,101st
    key found room, promoted, evicted the first block, and every scan after read again
    what the one before had evicted. By default a reservation now outlives twice the CPU
    tier's blocks in lookups."""
    keys = [block_id_key(i, 12) for i in range(1200)]
    disk = DiskTier(tmp_path / "disk", 1200, FP)
    disk.write(keys, [b""] * len(keys))
    disk.poll(wait=True)
    m = TieredOffloadingManager(
        CPUOffloadingManager(1100), [(disk, TierSettings())], wait_for_tiers=True
    )
    try:
        assert scan(m, keys) == [None] * 1100 + [0]
        assert scan(m, keys) == [1] * 1100 + [0]
        m.prepare_load(keys[:1100])
        m.complete_load(keys[:1100])
        assert disk.stats.hit_blocks == 1100  # each read once
    finally:
        m.close()


class GatedSlots(ByteSlots):
    """Slot bytes that can be made unreachable, as a worker's buffer not mapped yet."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.reachable = True

    def view(self, slot: int) -> memoryview:
        if not self.reachable:
            raise SlotBytesUnavailableError("not mapped")
        return super().view(slot)

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        if not self.reachable:
            raise SlotBytesUnavailableError("not mapped")
        return super().snapshot(slots)


def store_with_bytes(m: TieredOffloadingManager, slots: ByteSlots, key: OffloadKey) -> None:
    """Store ``key`` with its content written into its slot, as a worker would."""
    output = m.prepare_store([key])
    assert output is not None
    slot = int(output.store_spec.block_ids[0])  # type: ignore[attr-defined]
    slots.data[slot * slots.slot_bytes : (slot + 1) * slots.slot_bytes] = content(key, 40)
    m.complete_store([key])


def test_unreachable_slot_bytes_are_counted_failures_and_a_failed_promotion_a_miss(
    tmp_path: Path,
) -> None:
    fp = layout_fingerprint("gated", layout_preset("tiny"), 40)
    disk = DiskTier(tmp_path / "disk", 8, fp)
    slots = GatedSlots(2, 40)
    m = TieredOffloadingManager(
        CPUOffloadingManager(2), [(disk, TierSettings())], slots, wait_for_tiers=True
    )
    try:
        for key in K[:2]:
            store_with_bytes(m, slots, key)
        slots.reachable = False
        # Storing K2 evicts K0, whose bytes cannot be read: nothing is written down.
        store_with_bytes(m, slots, K[2])
        m.poll()
        assert (disk.stats.failed, disk.stats.stored_blocks, disk.present([K[0]])) == (1, 0, 0)
        slots.reachable = True
        store_with_bytes(m, slots, K[3])  # evicts K1 with its bytes
        m.poll()
        assert disk.present([K[1]]) == 1
        slots.reachable = False
        assert m.lookup([K[1]]) is None  # promoting: the read cannot land
        assert m.lookup([K[1]]) == 0  # the failed promotion answers a miss once
        assert m.promotions_in_flight == 0 and not m.cpu.holds(K[1])
        slots.reachable = True
        assert m.lookup([K[1]]) is None  # then it is tried again, and lands
        assert m.lookup([K[1]]) == 1
        assert bytes(slots.view(m.cpu.block_status(K[1]).block_id)) == content(K[1], 40)  # type: ignore[union-attr]
    finally:
        m.close()


class CountingSlots(ByteSlots):
    """Slot bytes that count the slots copied out."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.copied = 0

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        self.copied += len(slots)
        return super().snapshot(slots)


@pytest.mark.parametrize(
    ("settings", "expected_writes"),
    [(TierSettings(write_through=True), 6), (TierSettings(store_threshold=2), 0)],
    ids=["write-through", "write-back-refusing"],
)
def test_a_cpu_eviction_copies_only_the_blocks_a_write_back_tier_takes(
    tmp_path: Path, settings: TierSettings, expected_writes: int
) -> None:
    """An evicted block's bytes are copied out for a write-back tier that writes it down,
    never for a write-through tier (which wrote it when it was stored) nor for one whose
    admission refuses it: the copy is a block's worth of memory traffic per eviction."""
    disk = DiskTier(tmp_path / "disk", 16, layout_fingerprint("copies", layout_preset("tiny"), 40))
    slots = CountingSlots(2, 40)
    m = TieredOffloadingManager(
        CPUOffloadingManager(2), [(disk, settings)], slots, wait_for_tiers=True
    )
    try:
        for key in K[:6]:
            store_with_bytes(m, slots, key)  # the last four evict one block each
        m.poll()
        assert m.cpu_stats.evicted == 4
        assert disk.stats.stored_blocks == expected_writes
        assert slots.copied == expected_writes  # write-through: copied as each was stored
    finally:
        m.close()


class BuggySlots(ByteSlots):
    """Slot bytes whose views raise what no tier expects, once :attr:`broken`: a bug."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.broken = False

    def view(self, slot: int) -> memoryview:
        if self.broken:
            raise RuntimeError("a bug in the slot bytes")
        return super().view(slot)

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        """Copies out as ever: only a read into a slot meets the bug."""
        size = self.slot_bytes
        return [bytes(self.data[slot * size : (slot + 1) * size]) for slot in slots]


def test_a_promotion_whose_read_raises_is_a_miss_never_an_exception_in_the_lookup(
    valkey_server: ValkeyProcess,
) -> None:
    """The shared tier's read runs its target on an I/O thread: whatever the target raises
    is that block's failed read, never an exception the next lookup raises into the
    engine's scheduler."""
    fp = layout_fingerprint("buggy-slots", layout_preset("tiny"), 40)
    remote = RemoteTier(valkey_server.url, fp)
    slots = BuggySlots(2, 40)
    m = TieredOffloadingManager(
        CPUOffloadingManager(2), [(remote, TierSettings())], slots, wait_for_tiers=True
    )
    try:
        for key in K[:3]:
            store_with_bytes(m, slots, key)  # K0 falls to the shared tier
        m.poll()
        assert remote.present([K[0]]) == 1
        slots.broken = True
        assert m.lookup([K[0]]) is None  # promoting: the read raises on its thread
        assert m.lookup([K[0]]) == 0  # a miss
        assert m.promotions_in_flight == 0 and not m.cpu.holds(K[0])
        slots.broken = False
        assert m.lookup([K[0]]) is None  # tried again, and lands
        assert m.lookup([K[0]]) == 1
    finally:
        m.close()


class HeldSlots(ByteSlots):
    """Slot bytes whose views wait for :attr:`release`: a promotion that stays in flight."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(num_slots, slot_bytes)
        self.release = threading.Event()

    def view(self, slot: int) -> memoryview:
        self.release.wait(10)
        return super().view(slot)


def test_completing_a_store_of_a_block_being_promoted_leaves_it_pending(tmp_path: Path) -> None:
    """Neither a success (garbage made loadable) nor a failure (its slot freed) may land it."""
    fp = layout_fingerprint("in-flight", layout_preset("tiny"), 40)
    disk = DiskTier(tmp_path / "disk", 4, fp)
    disk.write(K[:1], [content(K[0], 40)])
    disk.poll(wait=True)
    slots = HeldSlots(2, 40)
    m = TieredOffloadingManager(CPUOffloadingManager(2), [(disk, TierSettings())], slots)
    try:
        assert m.lookup(K[:1]) is None and m.promotions_in_flight == 1
        slot = m.cpu.block_status(K[0]).block_id  # type: ignore[union-attr]
        for success in (True, False):
            m.complete_store(K[:1], success)
            block = m.cpu.block_status(K[0])
            assert block is not None and block.ref_cnt == PENDING_STORE
            assert block.block_id == slot and m.cpu.lookup(K[:1]) == 0
        assert m.cpu_stats.stored_blocks == 0
        slots.release.set()
        deadline = time.monotonic() + 10
        while (found := m.lookup(K[:1])) is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert found == 1 and bytes(slots.view(slot)) == content(K[0], 40)
    finally:
        slots.release.set()
        m.close()


def test_a_key_listed_twice_in_complete_store_is_counted_and_written_once(tmp_path: Path) -> None:
    cpu = CPUOffloadingManager(4, enable_events=True)
    disk = DiskTier(tmp_path / "disk", 8, FP, enable_events=True)
    m = TieredOffloadingManager(
        cpu, [(disk, TierSettings(write_through=True))], wait_for_tiers=True
    )
    try:
        assert m.prepare_store(K[:2]) is not None
        m.complete_store([K[0], K[0], K[1]])
        m.poll()
        assert m.cpu_stats.stored_blocks == 2
        assert m.offered_blocks == [2] and m.admitted_blocks == [2]
        assert disk.stats.stored_blocks == 2
    finally:
        m.close()


def test_a_load_nobody_started_cannot_release_a_reservation(tmp_path: Path) -> None:
    """Taken by a stray ``complete_load``, a reservation's pin made its own release fail in
    the next lookup, which left the other reserved block pinned for good."""
    m = stack(tmp_path, cpu_blocks=4)
    try:
        store(m, K[:4])
        store(m, K[4:6])  # K0 and K1 fall to disk
        assert m.lookup(K[:2]) is None
        m.poll()
        assert m.is_reserved(K[0]) and m.is_reserved(K[1])
        for stray in ([K[0]], [K[0], K[0]], [K[4], K[0]]):
            with pytest.raises(BlockNotPinnedError) as error:
                m.complete_load(stray)
            assert error.value.key == K[0]
        m.prepare_load([K[0], K[0]])  # the engine's own pins beside the reservation
        m.complete_load([K[0], K[0]])
        assert m.lookup(K[:2]) == 2  # claimed: both unpinned
        assert [m.cpu.block_status(key).ref_cnt for key in K[:2]] == [0, 0]  # type: ignore[union-attr]
    finally:
        m.close()


def test_a_single_key_where_keys_are_expected_is_refused_by_every_call(tmp_path: Path) -> None:
    """The CPU tier refused one; the stack's ``lookup`` answered 0 for its bytes as keys,
    and ``complete_store`` completed nothing, leaving the block pending for good."""
    m = stack(tmp_path)
    try:
        assert m.prepare_store(K[:1]) is not None
        calls = (m.lookup, m.touch, m.prepare_load, m.complete_load, m.prepare_store)
        for call in (*calls, m.complete_store):
            with pytest.raises(NotAKeyIterableError, match="got a single bytes"):
                call(K[0])
        m.complete_store(K[:1])
        assert m.lookup(K[:1]) == 1
    finally:
        m.close()


class HungPayloadReads(FileLayer):
    """Payload reads (the tier's reads past a block's header) of the tier's I/O threads wait
    while :attr:`answering` is clear: a file system that hangs mid-promotion."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.answering.set()
        self.stuck = threading.Event()

    def _wait(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.stuck.set()
            self.answering.wait(STALL_S)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._wait()
        return super().preadv(fd, buffers, offset)

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        return 0  # never from the page cache: every payload read takes preadv


def test_a_promotion_past_its_deadline_frees_its_slot_and_its_late_read_lands_nowhere(
    tmp_path: Path,
) -> None:
    """A disk read that outlives its deadline is a failed promotion: its slot is freed at
    once and may be stored into by the next request. When the stuck read returns, its
    bytes must land nowhere (the slot is another block's now)."""
    fp = layout_fingerprint("hung-promotion", layout_preset("tiny"), 40)
    layer = HungPayloadReads()
    disk = DiskTier(tmp_path / "disk", 8, fp, io_threads=1, deadline_s=0.05, file_layer=layer)
    slots = ByteSlots(1, 40)
    m = TieredOffloadingManager(CPUOffloadingManager(1), [(disk, TierSettings())], slots)
    try:
        store_with_bytes(m, slots, K[0])
        store_with_bytes(m, slots, K[1])  # K0 falls to disk
        disk.poll(wait=True)
        assert disk.present([K[0]]) == 1
        layer.answering.clear()
        assert m.lookup([K[0]]) is None  # promoting into K1's slot, the disk hangs
        assert layer.stuck.wait(STALL_S)
        assert m._promotions[0].result.result(timeout=STALL_S) == [False]  # past its deadline
        assert m.lookup([K[0]]) == 0  # the failed promotion lands: a miss, its slot free
        assert not m.cpu.holds(K[0]) and m.promotions_in_flight == 0
        store_with_bytes(m, slots, K[2])  # into the slot the promotion had
        layer.answering.set()  # the stuck read returns and its job ends
        stripes = disk._file.stripes
        give_up = time.monotonic() + STALL_S
        while stripes.stuck and time.monotonic() < give_up:
            time.sleep(0.001)
        assert not stripes.stuck
        assert m.lookup([K[2]]) == 1
        spec = m.prepare_load([K[2]])
        assert slots.view(int(spec.block_ids[0])).tobytes() == content(K[2], 40)  # type: ignore[attr-defined]
        m.complete_load([K[2]])
    finally:
        layer.answering.set()
        m.close()


def _seen_twice_on_disk(m: TieredOffloadingManager) -> None:
    """K0 looked up by two requests, stored, then evicted to disk by K4 and K5 (a 2-block
    CPU tier, a threshold of 2)."""
    for _ in range(2):
        m.lookup([K[0]])
    store(m, [K[0]])
    store(m, [K[4], K[5]])
    m.poll()


def test_a_lookup_retried_after_none_is_not_counted_again_by_a_tier_threshold(
    tmp_path: Path,
) -> None:
    """A request whose head is promoted is asked again: its keys were seen once, so its tail,
    stored and evicted, stays off a tier that wants blocks seen twice (before, the retry
    counted them a second time and one request's blocks were written)."""
    m = stack(tmp_path, cpu_blocks=2, threshold=2)
    disk = m.tiers[0]
    try:
        _seen_twice_on_disk(m)
        assert disk.present([K[0]]) == 1
        assert m.lookup([K[0], K[1]]) is None  # K0 promoting
        assert m.lookup([K[0], K[1]]) == 1  # the retry: K1 is not seen a second time
        m.prepare_load([K[0]])
        m.complete_load([K[0]])
        store(m, [K[1]])
        store(m, [K[6], K[7]])  # K0 and K1 evicted: K1, seen once, is not written
        m.poll()
        assert disk.present([K[1]]) == 0
        assert m.lookup([K[2], K[1]]) == 0  # another request: K1 seen a second time
        store(m, [K[1]])
        store(m, [K[8], K[9]])
        m.poll()
        assert disk.present([K[1]]) == 1
    finally:
        m.close()


def test_a_requester_that_goes_away_releases_its_promotion(tmp_path: Path) -> None:
    """An aborted request's landed promotion stayed pinned for ``reserve_lookups`` lookups
    (1,024 by default): on a 4-block CPU tier every store was refused meanwhile."""
    m = stack(tmp_path, cpu_blocks=4)
    try:
        store(m, K[:4])
        store(m, K[4:8])  # K0..K3 fall to disk
        assert m.lookup(K[:4]) is None
        m.poll()  # landed and reserved; the requester never asks again
        assert all(m.is_reserved(key) for key in K[:4])
        assert m.prepare_store([K[8]]) is None  # the whole tier is reserved
        m.release_reservations(K[:4])
        assert not any(m.is_reserved(key) for key in K[:4])
        store(m, [K[8]])
        assert sum(m.holds(key) for key in K[:4]) == 3  # released, not dropped: one made room
    finally:
        m.close()


def test_releasing_keys_that_reach_no_reservation_changes_nothing(tmp_path: Path) -> None:
    m = stack(tmp_path, cpu_blocks=4)
    try:
        store(m, K[:4])
        store(m, K[4:8])
        assert m.lookup(K[:2]) is None
        m.poll()
        m.release_reservations(K[6:9])
        assert m.is_reserved(K[0]) and m.is_reserved(K[1])
    finally:
        m.close()


def test_a_request_gone_while_it_waited_leaves_its_prompt_countable_by_a_tier_threshold(
    tmp_path: Path,
) -> None:
    """An aborted request's retry never comes: the next request with its prompt is a new
    sighting of its keys (the record kept for the retry hid it, and K1, seen by two
    requests, stayed off a tier that wants blocks seen twice)."""
    m = stack(tmp_path, cpu_blocks=2, threshold=2)
    disk = m.tiers[0]
    try:
        _seen_twice_on_disk(m)
        assert m.lookup([K[0], K[1]], request="gone") is None  # K0 promoting
        m.request_finished("gone")
        assert m.lookup([K[0], K[1]], request="next") == 1  # K1 seen a second time
        m.prepare_load([K[0]])
        m.complete_load([K[0]])
        store(m, [K[1]])
        store(m, [K[6], K[7]])  # K0 and K1 evicted: K1, seen twice, is written
        m.poll()
        assert disk.present([K[1]]) == 1
    finally:
        m.close()


def test_a_request_gone_while_one_like_it_waits_keeps_that_ones_retry_no_new_reference(
    tmp_path: Path,
) -> None:
    """Two requests with one prompt wait for the same promotion and share the record of
    their prompt's retry: the first's abort must not end it, or the second's retry
    reached the disk tier's layer as a new reference."""
    fp = layout_fingerprint("twin-waiters", layout_preset("tiny"), 40)
    layer = HungPayloadReads()
    disk = DiskTier(tmp_path / "disk", 8, fp, io_threads=1, file_layer=layer)
    settings = TierSettings(admission="feedback", capacity=8)
    m = TieredOffloadingManager(CPUOffloadingManager(4), [(disk, settings)], ByteSlots(4, 40))
    try:
        disk.write(K[:3], [content(key, 40) for key in K[:3]])
        disk.poll(wait=True)
        layer.answering.clear()
        assert m.lookup(K[:4], request="first") is None and m.judged_blocks == 4
        assert layer.stuck.wait(STALL_S)
        assert m.lookup(K[:4], request="twin") is None  # the same promotion, still reading
        m.request_finished("first")  # aborted
        layer.answering.set()
        assert m._promotions[0].result.result(timeout=STALL_S) == [True] * 3
        assert m.lookup(K[:4], request="twin") == 3 and m.judged_blocks == 4  # its retry
        m.prepare_load(K[:3])
        m.complete_load(K[:3])
        assert m.lookup(K[:4], request="third") == 3 and m.judged_blocks == 5  # a new one
    finally:
        layer.answering.set()
        m.close()
