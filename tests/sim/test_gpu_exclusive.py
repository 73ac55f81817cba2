"""The GPU-exclusive touch of ``benchmarks/gpu_exclusive.py``: only the blocks past the GPU
prefix hit become recent in the tier, through the engine's call order."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

from kvoffload import block_id_key
from kvoffload.managers import build_manager
from kvoffload.managers.cpu import CPUOffloadingManager

exclusive = load_benchmark("gpu_exclusive")


def test_only_blocks_past_the_gpu_hit_become_recent() -> None:
    keys = [block_id_key(i) for i in range(6)]
    tier = build_manager(8, "lru")
    assert isinstance(tier, CPUOffloadingManager)
    manager = exclusive.GPUExclusiveTouch(tier)
    output = tier.prepare_store(keys)
    assert output is not None
    tier.complete_store(output.keys_to_store)
    other = [block_id_key(10), block_id_key(11)]
    output = tier.prepare_store(other)
    assert output is not None
    tier.complete_store(other)
    # A request the GPU holds the first four blocks of: touch, then a lookup of the rest.
    manager.touch(keys)
    assert manager.lookup(keys[4:]) == 2
    manager.touch(keys)  # the touch after a store: cut at the same place
    # LRU makes a touch's first key the most recent.
    assert list(tier.policy.coldest()) == [*keys[:4], *other, keys[5], keys[4]]


def test_a_request_the_gpu_held_whole_makes_nothing_recent() -> None:
    keys = [block_id_key(i) for i in range(3)]
    tier = build_manager(4, "lru")
    assert isinstance(tier, CPUOffloadingManager)
    manager = exclusive.GPUExclusiveTouch(tier)
    for key in keys:
        output = tier.prepare_store([key])
        assert output is not None
        tier.complete_store([key])
    manager.touch([keys[0]])  # never looked up: the GPU held it
    manager.touch(keys[1:])
    assert manager.lookup(keys[2:]) == 1
    assert list(tier.policy.coldest()) == [keys[0], keys[1], keys[2]]


@pytest.mark.parametrize(
    "row", ["chat:abc", "chat:nan", "chat:-0.1", "chat:inf", "chat:", "chat:1.5"]
)
def test_a_bad_tier_share_stops_with_one_line(row: str) -> None:
    with pytest.raises(SystemExit, match="tier share must be a number in"):
        exclusive.run_row(row)
