"""Trace statistics: hand-checked reuse distances and the public trace's published figures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.sim.trace_stats import PROGRESS_REFS, reuse_distances, trace_stats
from kvoffload.sim.traces import read_trace
from kvoffload.sim.workload import Workload

MakeWorkload = Callable[..., Workload]


def test_reuse_distance_counts_distinct_blocks_in_between(make_workload: MakeWorkload) -> None:
    # Reference stream a b a c b b: a after {b}; b after {a, c}; b right after b.
    workload = make_workload([1, 2], [1, 3], [2], [2])
    assert reuse_distances(workload) == [1, 2, 0]


def test_reuse_distances_report_their_progress_in_references(
    make_workload: MakeWorkload,
) -> None:
    requests = [list(range(start, start + 100)) for start in range(0, 75_000, 50)]  # 150,000 refs
    workload = make_workload(*requests)
    calls: list[tuple[int, int]] = []
    with_progress = trace_stats(workload, lambda *call: calls.append(call))
    assert with_progress == trace_stats(workload)
    refs = with_progress.refs
    assert calls == [(0, refs), (PROGRESS_REFS, refs), (2 * PROGRESS_REFS, refs), (refs, refs)]


def test_summary(make_workload: MakeWorkload) -> None:
    stats = trace_stats(make_workload([1, 2], [1, 3], [2], [2]))
    assert (stats.requests, stats.refs, stats.unique_blocks) == (4, 6, 3)
    assert stats.repeat_fraction == pytest.approx(3 / 6)
    assert stats.one_hit_wonder_fraction == pytest.approx(1 / 3)
    assert (stats.reuse_distance_p50, stats.reuse_distance_p99) == (1, 2)
    assert stats.max_blocks_per_request == 2


def test_a_trace_without_reuse_has_no_reuse_distance(make_workload: MakeWorkload) -> None:
    """Every block used once: the distances were 0, the closest reuse there is."""
    stats = trace_stats(make_workload([1, 2], [3], [4, 5]))
    assert stats.repeat_fraction == 0.0
    distances = (stats.reuse_distance_p50, stats.reuse_distance_p90, stats.reuse_distance_p99)
    assert distances == (None, None, None)


def test_public_trace_figures(mooncake_trace: Path) -> None:
    stats = trace_stats(read_trace(mooncake_trace))
    assert stats.repeat_fraction == pytest.approx(0.640, abs=0.0005)
    assert stats.one_hit_wonder_fraction == pytest.approx(0.584, abs=0.0005)


def test_the_reuse_plot_is_the_hit_ratio_of_an_lru_cache_of_each_size(
    make_workload: MakeWorkload,
) -> None:
    """An operator sizing a cache reads the whole curve, not three percentiles of it."""
    pytest.importorskip("matplotlib")
    from kvoffload.sim.plots import reuse_figure
    from kvoffload.sim.trace_stats import stats_and_distances

    # Reference stream a b a c b b: distances 0 (b after b), 1 (a), 2 (b after a, c).
    workload = make_workload([1, 2], [1, 3], [2], [2])
    stats, distances = stats_and_distances(workload)
    assert stats == trace_stats(workload) and distances == [0, 1, 2]
    [axes] = reuse_figure(distances, stats.refs, stats.unique_blocks, "t").axes
    curve, unbounded = axes.get_lines()
    assert list(curve.get_xdata()) == [1, 2, 3, 3]  # cache sizes in blocks, to every block
    assert list(curve.get_ydata()) == pytest.approx([1 / 6, 2 / 6, 3 / 6, 3 / 6])
    assert list(unbounded.get_ydata()) == pytest.approx([stats.repeat_fraction] * 2)
    [none_reused] = reuse_figure([], 3, 3, "t").axes
    assert set(none_reused.get_lines()[0].get_ydata()) == {0.0}
