"""The generator's memory estimate: at least what drawing a workload takes at its peak, for
every kind and block size, so that a workload past the machine is refused before it is
drawn, and not so far above it that one the machine holds is refused."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from kvoffload.core import memory
from kvoffload.core.errors import InsufficientMemoryError
from kvoffload.sim.generators import ChatShape, estimated_bytes, generate

MIB = 2**20


def _peak_bytes(mix: dict[str, float], requests: int, block_tokens: int, shape: ChatShape) -> int:
    """What drawing the workload takes at its peak, as Python's allocator counts it."""
    gc.collect()
    tracemalloc.start()
    try:
        generate(mix, requests, block_tokens=block_tokens, chat_shape=shape)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("mix", "requests", "block_tokens", "shape"),
    [
        ({"longchat": 1.0}, 120, 2, ChatShape()),
        ({"longchat": 1.0}, 400, 16, ChatShape()),
        ({"longchat": 1.0}, 150, 8, ChatShape(one_turn=0.1, extra_turns=8.0)),
        ({"agent": 1.0}, 40, 4, ChatShape()),
        ({"chat": 1.0}, 300, 1, ChatShape()),
        ({"rag": 1.0}, 300, 2, ChatShape()),
        ({"agent": 1.0}, 200, 1, ChatShape()),
        ({"oneshot": 1.0}, 300, 1, ChatShape()),
        ({"chat": 0.4, "rag": 0.25, "agent": 0.2, "oneshot": 0.15}, 2000, 16, ChatShape()),
    ],
)
def test_the_estimate_covers_what_drawing_takes(
    mix: dict[str, float], requests: int, block_tokens: int, shape: ChatShape
) -> None:
    """A flat 8 KiB a request was a fifth of the default mix's and a two-hundredth of
    longchat's at one token per block (1.6 MB a request), whose run the check let through
    to exhaust the machine."""
    peak = _peak_bytes(mix, requests, block_tokens, shape)
    estimate = estimated_bytes(mix, requests, block_tokens, shape)
    assert peak <= estimate <= 3 * peak, (peak, estimate)


def test_a_workload_past_memory_is_refused_before_it_is_drawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 longchat requests of one token per block take some 330 MB to draw."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 150 * MIB)
    with pytest.raises(
        InsufficientMemoryError, match="200 synthetic requests at block_tokens=1 would"
    ):
        generate({"longchat": 1.0}, 200, block_tokens=1)


def test_a_count_past_the_float_range_is_refused_not_overflowed() -> None:
    with pytest.raises(InsufficientMemoryError, match="more memory than a float can count"):
        generate(num_requests=10**400)
