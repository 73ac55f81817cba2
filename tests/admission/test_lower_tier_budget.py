"""A lower tier's write budget, as the tiered stack charges it: for the blocks its tier
writes, not for the admitted blocks the tier already holds and skips."""

from __future__ import annotations

import random
from pathlib import Path

from kvoffload.admission import BudgetCredit, OptimisingAdmission
from kvoffload.admission.budget import BURST_REFS
from kvoffload.core.keys import block_id_key
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.sim.engine import ServingEngine
from kvoffload.sim.run import SimConfig
from kvoffload.sim.workload import Request
from kvoffload.tiers import DiskTier, build_stack
from kvoffload.tiers.format import FINGERPRINT_BYTES

BUDGET = 0.2
"""Disk writes per block reference reaching the disk tier: fewer than storing everything."""


def requests(prompts: int, blocks: int, count: int) -> list[Request]:
    """Every other request one of ``prompts`` prompts of ``blocks`` blocks, in a seeded
    random order (past the GPU cache and the CPU tier, within the disk tier: its blocks,
    promoted from disk, are evicted from the CPU tier again and offered to a disk that holds
    them), the others a prompt never seen before (more new blocks than the budget writes)."""
    rng = random.Random(7)
    chosen = []
    for i in range(count):
        if i % 4 == 0:  # a new prompt
            chosen.append(prompts + i)
        elif i % 4 == 2 and i >= 42:  # the new prompt of 42 requests ago, back once
            chosen.append(prompts + i - 42)
        else:
            chosen.append(rng.randrange(prompts))
    return [
        Request(i * 0.01, 16 * blocks, 2, [block_id_key(p * blocks + b) for b in range(blocks)])
        for i, p in enumerate(chosen)
    ]


def test_a_disk_budget_is_spent_on_blocks_written_and_never_overspent(tmp_path: Path) -> None:
    """Charged for every admitted block, the budget paid for blocks the disk already held
    and skipped, and went partly unspent (the Mooncake trace at 0.05: 5,145 blocks
    admitted, 4,747 written). Charged for the writes, it is spent to within its bank, and
    after every request the writes stay within what it earned, over any span within that
    span's earnings and the bank."""
    config = SimConfig(
        8,
        16,
        layout="tiny",
        disk_dir=str(tmp_path),
        disk_blocks=2_000,
        disk_admission="recommended",
        disk_write_budget=BUDGET,
    )
    stack = build_stack(config.stack_config(bytes(FINGERPRINT_BYTES)))
    tiered, disk, layer = stack.tiered, stack.disk, stack.disk_admission
    assert isinstance(tiered, TieredOffloadingManager) and isinstance(disk, DiskTier)
    assert isinstance(layer, OptimisingAdmission) and isinstance(layer.write_credit, BudgetCredit)
    engine = ServingEngine(
        config.engine_config(16), stack.manager, holds=stack.holds, admission=stack.admission
    )
    samples: list[tuple[int, float]] = []

    def sample(finished: int, total: int) -> None:
        disk.poll(wait=True)
        samples.append((disk.stats.stored_blocks, BUDGET * tiered.judged_blocks))

    try:
        engine.run(requests(prompts=60, blocks=4, count=3_000), sample)
    finally:
        stack.close()
    written, earned = disk.stats.stored_blocks, BUDGET * tiered.judged_blocks
    bank = BUDGET * BURST_REFS  # what the bucket may hold ahead
    assert all(written <= earned for written, earned in samples)  # it starts empty
    for start in range(0, len(samples), 50):  # and over any span, at most its bank ahead
        first_written, first_earned = samples[start]
        assert all(w - first_written <= e - first_earned + bank for w, e in samples[start:])
    skipped = tiered.admitted_blocks[0] - written  # admitted blocks the disk held
    assert skipped > bank  # what the old charge left unspent is more than the bank
    assert earned - bank <= written <= earned
