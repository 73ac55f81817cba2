"""What a store costs when the tier's cold end is pinned (vLLM's #46216).

A full CPU tier of ``--blocks`` blocks whose least recent ``--pinned-share`` are
pinned by loads: vLLM's policies walk past every pinned block on every eviction.
Each policy is timed over ``--rounds`` stores of ``--batch`` new blocks (each
evicting as many) in three phases of one run: nothing pinned (the baseline),
the cold end pinned, and right after those loads completed (the blocks pinned
until then are the next victims). Times are per ``prepare_store`` +
``complete_store`` pair; ratios are against the first phase of the same run.

    python benchmarks/pinned_eviction.py [--blocks 50000] [--pinned-share 0.9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.registry import available_policies


class _Stores:
    """New blocks stored one batch at a time into ``manager``, each store timed."""

    def __init__(self, manager: CPUOffloadingManager, first_id: int, batch: int) -> None:
        self.manager, self.next_id, self.batch = manager, first_id, batch

    def per_store_us(self, rounds: int) -> float:
        manager = self.manager
        start = time.perf_counter()
        for _ in range(rounds):
            keys = [block_id_key(self.next_id + i) for i in range(self.batch)]
            self.next_id += self.batch
            out = manager.prepare_store(keys)
            if out is None:
                raise SystemExit("a store was refused: use a smaller --pinned-share")
            manager.complete_store(out.keys_to_store)
        return (time.perf_counter() - start) / rounds * 1e6


def _filled(policy: str, blocks: int) -> tuple[CPUOffloadingManager, list[OffloadKey]]:
    manager = CPUOffloadingManager(blocks, policy)
    keys = [block_id_key(i) for i in range(blocks)]
    for i in range(0, blocks, 1000):
        out = manager.prepare_store(keys[i : i + 1000])
        assert out is not None
        manager.complete_store(out.keys_to_store)
    return manager, keys


def measure(policy: str, blocks: int, pinned: int, batch: int, rounds: int) -> dict[str, float]:
    manager, keys = _filled(policy, blocks)
    stores = _Stores(manager, blocks, batch)
    unpinned = stores.per_store_us(rounds)
    # The blocks least recent now: those the first phase left, then its own.
    coldest = [key for key in keys if manager.block_status(key) is not None][:pinned]
    manager.prepare_load(coldest)
    pinned_us = stores.per_store_us(rounds)
    manager.complete_load(coldest)
    released_us = stores.per_store_us(rounds)
    return {"unpinned_us": unpinned, "pinned_us": pinned_us, "released_us": released_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--pinned-share", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--policies", default=",".join(available_policies()))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pinned = int(args.blocks * args.pinned_share)
    rows = {}
    print(f"{args.blocks:,} blocks, {pinned:,} pinned, stores of {args.batch}, us per store")
    print(f"{'policy':11} {'unpinned':>9} {'pinned':>9} {'x':>6} {'released':>9} {'x':>6}")
    for policy in args.policies.split(","):
        row = measure(policy, args.blocks, pinned, args.batch, args.rounds)
        rows[policy] = row
        base = row["unpinned_us"]
        print(
            f"{policy:11} {base:9.1f} {row['pinned_us']:9.1f} {row['pinned_us'] / base:5.1f}x "
            f"{row['released_us']:9.1f} {row['released_us'] / base:5.1f}x"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
