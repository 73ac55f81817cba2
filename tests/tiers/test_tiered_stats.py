"""TierStats: one rule for every writer, the scheduler thread and I/O threads alike."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from kvoffload.core.tier_protocol import TierStats


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Threads switch as often as CPython allows: an unlocked ``+=`` then loses counts."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.mark.usefixtures("tiny_switch_interval")
def test_counts_added_from_many_threads_are_never_lost() -> None:
    stats = TierStats()
    rounds, threads = 20_000, 4

    def io_thread() -> None:
        for _ in range(rounds):
            stats.add(hit_blocks=1, failed=2)

    workers = [threading.Thread(target=io_thread) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for _ in range(rounds):  # the scheduler thread, under the same rule
        stats.add(failed=1)
    for worker in workers:
        worker.join()
    assert (stats.hit_blocks, stats.failed) == (rounds * threads, rounds * (2 * threads + 1))


def test_an_unknown_count_is_refused_and_changes_nothing() -> None:
    stats = TierStats(failed=3)
    with pytest.raises(AttributeError, match="no count 'hits'"):
        stats.add(hits=1)
    with pytest.raises(AttributeError):
        stats.add(_lock=1)
    assert stats == TierStats(failed=3)
