"""What the shared regions cost the scheduler: slot snapshots and promotions, per second.

Baseline: the simulator's private CPU store (:class:`StoreSlotBytes`). Against
it, the scheduler's view of the workers' shared regions (:class:`SharedSlotBytes`)
with one rank (reads and fills the mapping directly) and with two ranks
(snapshots concatenate, promotions are staged and copied into place when
they land). Each row is a ratio to the baseline measured in the same run.

    python benchmarks/shared_slots.py [--slot-kib 512] [--slots 64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload.core.layout import KVLayout
from kvoffload.core.tier_protocol import SlotBytes
from kvoffload.dataplane import CPUBlockStore
from kvoffload.dataplane.shared_region import SharedRegion, region_path
from kvoffload.dataplane.shared_slot_bytes import SharedSlotBytes
from kvoffload.dataplane.slot_bytes import StoreSlotBytes


def _best(repeats: int, run: Callable[[], None]) -> float:
    """The fastest of ``repeats`` runs, in seconds (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _measure(slots: SlotBytes, count: int, repeats: int) -> tuple[float, float]:
    """Seconds to snapshot ``count`` slots, and to fill and land them as a promotion."""
    ids = list(range(count))
    payload = bytes(range(256)) * (len(slots.snapshot([0])[0]) // 256)

    def snapshot() -> None:
        slots.snapshot(ids)

    def promote() -> None:
        for slot in ids:
            slots.view(slot)[:] = payload
        slots.landed(ids, [True] * count)

    return _best(repeats, snapshot), _best(repeats, promote)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--slot-kib", type=int, default=512, help="bytes per slot and rank, KiB")
    parser.add_argument("--slots", type=int, default=64, help="slots per snapshot or promotion")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    slot_bytes = args.slot_kib * 1024
    count = args.slots
    rows: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        directory = Path(d)
        layout = KVLayout(1, 1, slot_bytes // 2, "float8", tokens_per_block=1)
        private = StoreSlotBytes(CPUBlockStore(layout, count, pin_memory=False))
        rows["private store (baseline)"] = _measure(private, count, args.repeats)
        for ranks in (1, 2):
            paths = [region_path(directory, "bench", rank) for rank in range(ranks)]
            regions = [SharedRegion(path, count * slot_bytes, pin=False) for path in paths]
            shared = SharedSlotBytes(paths, count, slot_bytes)
            try:
                measured = _measure(shared, count, args.repeats)
                # Per byte of one rank, so rows compare the same work per slot and rank.
                rows[f"shared, {ranks} rank(s)"] = (measured[0] / ranks, measured[1] / ranks)
            finally:
                shared.close()
                for region in regions:
                    region.close()
    base_snap, base_promote = rows["private store (baseline)"]
    gib = count * slot_bytes / 2**30
    print(f"{count} slots of {args.slot_kib} KiB per rank, best of {args.repeats}")
    print(f"{'':28} {'snapshot GiB/s':>15} {'ratio':>6} {'promote GiB/s':>14} {'ratio':>6}")
    for name, (snap, promote) in rows.items():
        print(
            f"{name:28} {gib / snap:15.2f} {base_snap / snap:6.2f} "
            f"{gib / promote:14.2f} {base_promote / promote:6.2f}"
        )


if __name__ == "__main__":
    main()
