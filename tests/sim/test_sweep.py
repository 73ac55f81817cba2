"""Sweeps: the grid, parallel runs matching in-process runs, bounds attached, plots written."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.run import RunReport, SimConfig, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.sweep import SweepFailed, SweepInterrupted, run_sweep, sweep_configs
from kvoffload.sim.workload import Workload

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

MakeWorkload = Callable[..., Workload]

SOURCE = WorkloadSource(requests=150, seed=4)
TIMING = {"wall_seconds", "refs_per_second", "manager_us_per_block"}


def configs() -> list[SimConfig]:
    return sweep_configs(
        SimConfig(gpu_blocks=1500, cpu_blocks=0), [0, 3000], ["lru", "arc"], [0, 2]
    )


def test_grid_order_and_no_per_run_bound() -> None:
    grid = configs()
    assert [(c.policy, c.store_threshold, c.cpu_blocks) for c in grid][:3] == [
        ("lru", 0, 0),
        ("lru", 0, 3000),
        ("lru", 2, 0),
    ]
    assert len(grid) == 8 and not any(c.bound for c in grid)


def test_parallel_matches_in_process_and_carries_bounds() -> None:
    steps: list[tuple[int, int]] = []
    serial = run_sweep(SOURCE, configs(), jobs=1, progress=lambda d, t: steps.append((d, t)))
    parallel = run_sweep(SOURCE, configs(), jobs=2)
    assert steps[-1] == (10, 10)  # 8 runs and 2 bounds
    strip = [{k: v for k, v in r.as_dict().items() if k not in TIMING} for r in serial]
    assert strip == [{k: v for k, v in r.as_dict().items() if k not in TIMING} for r in parallel]
    for report in serial:
        assert report.belady_total_hit_ratio is not None
        assert report.total_hit_ratio <= report.belady_total_hit_ratio


def test_plots_are_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvoffload.sim.plots import plot_sweep

    paths = plot_sweep(run_sweep(SOURCE, configs(), jobs=1), tmp_path / "plots")
    assert [p.name for p in paths] == ["hit_ratio_vs_capacity.png", "hit_ratio_vs_writes.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("gib", "shown"),
    [
        (24.0, "24 GiB"),
        (999.4, "999 GiB"),
        (1000.0, "1,000 GiB"),
        (0.5, "512 MiB"),
        (2**-17, "8 KiB"),  # two blocks of the tiny layout, which read "7.63e-06 GiB"
        (0.9996 / 2**10, "1 MiB"),  # not "1,024 KiB"
        (256 / 2**30, "256 B"),
    ],
)
def test_the_plot_title_never_shows_an_exponent(gib: float, shown: str) -> None:
    pytest.importorskip("matplotlib")
    from kvoffload.sim.plots import sweep_title

    [report] = run_sweep(SOURCE, configs()[:1], jobs=1)
    report = dataclasses.replace(report, gpu_gib=gib)
    assert sweep_title(report) == f"{report.workload}, GPU {shown}"


def test_interrupted_sweep_keeps_the_finished_runs() -> None:
    def stop_after_three(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(SweepInterrupted, match="after 3 of 8 runs") as stopped:
        run_sweep(SOURCE, configs(), jobs=1, progress=stop_after_three)
    finished = stopped.value.reports
    assert [(r.policy, r.store_threshold, r.cpu_blocks) for r in finished] == [
        ("lru", 0, 0),
        ("lru", 0, 3000),
        ("lru", 2, 0),
    ]
    # The bounds run last, so none had finished.
    assert all(r.belady_total_hit_ratio is None for r in finished)
    complete = run_sweep(SOURCE, configs()[:3], jobs=1)
    strip = [{k: v for k, v in r.as_dict().items() if k not in TIMING} for r in complete]
    assert strip == [
        {k: v for k, v in r.as_dict().items() if k not in TIMING}
        | {"belady_total_hit_ratio": c.belady_total_hit_ratio}
        | {"belady_offload_hit_ratio": c.belady_offload_hit_ratio}
        for r, c in zip(finished, complete, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class KilledInWorkers(WorkloadSource):
    """A workload whose loading kills the worker process that loads it, as the kernel's
    out-of-memory killer would."""

    def load(self, progress: object = None) -> Workload:
        if multiprocessing.parent_process() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().load()


def test_a_killed_worker_fails_its_run_instead_of_hanging() -> None:
    """A process pool replaced a killed worker and waited forever for the task it had: the
    sweep hung until Ctrl-C. The death now fails the sweep, naming the run."""
    stopped: list[BaseException] = []

    def sweep() -> None:
        try:
            run_sweep(KilledInWorkers(requests=20), configs()[:2], jobs=2)
        except BaseException as exc:
            stopped.append(exc)

    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    thread.join(timeout=120)  # generous: the sweep ends in about a second
    assert stopped, "the sweep still waits for its killed workers"
    [failed] = stopped
    assert isinstance(failed, SweepFailed) and failed.reports == [] and failed.total == 2
    assert failed.reason == (
        "its worker process was killed by SIGKILL (as the kernel's out-of-memory killer does)"
    )
    assert failed.failed in (
        "run 1 of 2 (admission none, policy lru, threshold 0, 0 offload blocks)",
        "run 2 of 2 (admission none, policy lru, threshold 0, 3,000 offload blocks)",
    )


def test_a_run_that_raises_stops_the_sweep_with_the_finished_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.sim import sweep as sim_sweep

    def third_fails(workload: Workload, config: SimConfig, is_bound: bool) -> RunReport:
        if config.store_threshold == 2 and config.cpu_blocks == 0:
            raise ZeroDivisionError("division by zero")
        return simulate(workload, config)

    monkeypatch.setattr(sim_sweep, "_run_on", third_fails)
    with pytest.raises(SweepFailed) as stopped:
        run_sweep(SOURCE, configs(), jobs=1)
    assert [(r.store_threshold, r.cpu_blocks) for r in stopped.value.reports] == [(0, 0), (0, 3000)]
    assert str(stopped.value) == (
        "sweep stopped after 2 of 8 runs: run 3 of 8 (admission none, policy lru, threshold 2, "
        "0 offload blocks) failed: ZeroDivisionError: division by zero"
    )
    assert isinstance(stopped.value.__cause__, ZeroDivisionError)


def test_a_failed_run_of_one_offload_block_is_named_in_the_singular(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.sim import sweep as sim_sweep

    def fails(workload: Workload, config: SimConfig, is_bound: bool) -> RunReport:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(sim_sweep, "_run_on", fails)
    one_block = sweep_configs(SimConfig(gpu_blocks=1500, cpu_blocks=0), [1], ["lru"], [0])
    with pytest.raises(SweepFailed) as stopped:
        run_sweep(SOURCE, one_block, jobs=1)
    assert stopped.value.failed == (
        "run 1 of 1 (admission none, policy lru, threshold 0, 1 offload block)"
    )


def test_each_run_gets_the_bound_of_its_gpu_and_partial_block_mode(tmp_path: Path) -> None:
    # A sequential run's bound depends on its GPU cache and partial block mode too: runs
    # differing there all got the first run's bound, which the larger GPU's hits beat.
    trace = tmp_path / "families.jsonl"  # five prefix families; half the prompts end partway
    records = []
    for i in range(60):
        length = 1 + (i * 7) % 4
        ids = [i % 5 * 10 + j for j in range(length)]
        tokens = 512 * length - i % 2 * 100
        record = {"timestamp": i * 1000, "input_length": tokens, "output_length": 1}
        records.append(record | {"hash_ids": ids})
    trace.write_text("".join(json.dumps(record) + "\n" for record in records))
    source = WorkloadSource(trace=str(trace))
    small = SimConfig(gpu_blocks=4, cpu_blocks=3, layout="tiny", bound=False)
    large = dataclasses.replace(small, gpu_blocks=12)
    grid = [small, large, dataclasses.replace(large, partial_block="drop")]
    reports = run_sweep(source, grid, jobs=1)
    for report, config in zip(reports, grid, strict=True):
        alone = simulate(source.load(), dataclasses.replace(config, bound=True))
        assert report.belady_total_hit_ratio == alone.belady_total_hit_ratio
        assert report.belady_offload_hit_ratio == alone.belady_offload_hit_ratio
        assert report.total_hit_ratio <= report.belady_total_hit_ratio
    assert len({report.belady_total_hit_ratio for report in reports}) == 3


def test_overlapping_runs_each_get_their_own_bound() -> None:
    # With requests in flight together a run's GPU hits depend on its timing, so no
    # capacity-wide bound task serves it: each run computes the bound of its own hits.
    source = WorkloadSource(mix=(("chat", 1.0),), requests=120, seed=1, rate=20.0)
    base = SimConfig(gpu_blocks=322, cpu_blocks=0, concurrency=8)
    grid = sweep_configs(base, [2000], ["lru", "arc"], [0])
    steps: list[tuple[int, int]] = []
    reports = run_sweep(source, grid, jobs=1, progress=lambda d, t: steps.append((d, t)))
    assert steps[-1] == (2, 2)  # the runs alone
    for report, config in zip(reports, grid, strict=True):
        alone = simulate(source.load(), dataclasses.replace(config, bound=True))
        assert report.belady_offload_hit_ratio == alone.belady_offload_hit_ratio
        assert report.belady_offload_hit_ratio is not None
        assert report.offload_hit_ratio <= report.belady_offload_hit_ratio


def _small_report(make_workload: MakeWorkload) -> RunReport:
    """A run whose Belady bound (0.5) is far above its hit ratio (0)."""
    workload = make_workload(*[[i % 3, 10 + i % 3] for i in range(12)])
    report = simulate(workload, SimConfig(2, 4, layout="tiny"))
    assert (report.total_hit_ratio, report.belady_total_hit_ratio) == (0.0, 0.5)
    return report


def _figures(
    reports: list[RunReport], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[Figure]:
    """The figures :func:`plot_sweep` writes, capacity plot first, as saved."""
    from matplotlib.figure import Figure

    from kvoffload.sim.plots import plot_sweep

    saved: list[Figure] = []
    savefig = Figure.savefig

    def keep(figure: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(figure)
        savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_sweep(reports, tmp_path)
    return saved


def _bound_lines(
    reports: list[RunReport], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[Line2D]:
    """The lines labelled as the bound in the capacity plot :func:`plot_sweep` writes."""
    [axes] = _figures(reports, tmp_path, monkeypatch)[0].axes
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        line.get_label() for line in axes.get_lines()
    ]
    return [line for line in axes.get_lines() if line.get_label() == "Belady bound"]


def test_a_single_capacity_marks_its_bound(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A line through one point draws nothing: the bound was in the legend, not the plot.
    pytest.importorskip("matplotlib")
    [bound] = _bound_lines([_small_report(make_workload)], tmp_path, monkeypatch)
    assert list(bound.get_ydata()) == [0.5]
    assert bound.get_marker() not in ("", "None", None)


def test_runs_without_a_bound_draw_no_bound(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lower tiers give no bound: no "Belady bound" in the legend with no line behind it.
    pytest.importorskip("matplotlib")
    report = dataclasses.replace(_small_report(make_workload), belady_total_hit_ratio=None)
    wider = dataclasses.replace(report, cpu_blocks=8, cpu_gib=2 * report.cpu_gib)
    assert _bound_lines([report, wider], tmp_path, monkeypatch) == []


def test_the_bound_drawn_covers_every_run_of_its_capacity(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Overlapping runs each get the bound of their own GPU hits: the first line's bound
    # need not cover the next line's points.
    pytest.importorskip("matplotlib")
    lru = _small_report(make_workload)
    arc = dataclasses.replace(lru, policy="arc", total_hit_ratio=0.6, belady_total_hit_ratio=0.7)
    wider = dataclasses.replace(lru, cpu_blocks=8, cpu_gib=2 * lru.cpu_gib)
    [bound] = _bound_lines([lru, wider, arc], tmp_path, monkeypatch)
    assert list(bound.get_xdata()) == [lru.cpu_gib, wider.cpu_gib]
    assert list(bound.get_ydata()) == [0.7, 0.5]


def test_a_long_workload_name_stays_inside_the_plot(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default mix's name ran off both edges of the title, cut in the PNG.
    pytest.importorskip("matplotlib")
    name = "synthetic(agent=0.2+chat=0.4+oneshot=0.15+rag=0.25, seed=0)"
    report = dataclasses.replace(_small_report(make_workload), workload=name)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for figure in _figures([report], tmp_path, monkeypatch):
        [axes] = figure.axes
        extent = axes.title.get_window_extent(FigureCanvasAgg(figure).get_renderer())
        assert extent.x0 >= 0 and extent.x1 <= figure.bbox.width, axes.get_title()
        assert axes.get_title().replace("\n", " ").startswith(name)


def test_the_plots_name_the_tiers_below_the_offload_tier(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk tier's hits count in the total hit ratio, while the capacity axis is the
    offload tier's alone: the plots read as those of a sweep without one."""
    pytest.importorskip("matplotlib")
    from kvoffload.sim.plots import sweep_title

    workload = make_workload(*[[i % 3, 10 + i % 3] for i in range(12)])
    config = SimConfig(2, 4, layout="tiny", disk_dir=str(tmp_path / "disk"), disk_blocks=8)
    report = simulate(workload, config)
    for figure in _figures([report], tmp_path / "plots", monkeypatch):
        [axes] = figure.axes
        assert ", a disk tier below the offload tier" in axes.get_title().replace("\n", " ")
    both = dataclasses.replace(report, tiers={**report.tiers, "remote": {}})
    assert sweep_title(both).endswith("GPU 8 KiB, disk and shared tiers below the offload tier")
    alone = simulate(workload, SimConfig(2, 4, layout="tiny"))
    assert sweep_title(alone) == f"{alone.workload}, GPU 8 KiB"  # not 7.63e-06 GiB


def test_a_legend_says_no_filter_only_where_nothing_judges_the_writes(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "lru, no filter, filter admission" read as the filter being off.
    pytest.importorskip("matplotlib")
    plain = _small_report(make_workload)
    runs = [
        plain,
        dataclasses.replace(plain, admission="filter"),
        dataclasses.replace(plain, store_threshold=2),
        dataclasses.replace(plain, store_threshold=2, admission="feedback"),
    ]
    for figure in _figures(runs, tmp_path, monkeypatch):
        legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        assert legend[:4] == [
            "lru, no filter",
            "lru, filter admission",
            "lru, store threshold 2",
            "lru, store threshold 2, feedback admission",
        ]


def test_tiny_capacities_are_ticked_as_themselves_without_an_offset(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny layout's capacities (about 1e-5 GiB) were ticked 1.0 to 3.0, with ``1e-5``
    alone at the axis's far corner: easy to read as GiB."""
    pytest.importorskip("matplotlib")
    report = _small_report(make_workload)
    assert report.cpu_gib < 1e-4
    wider = dataclasses.replace(report, cpu_blocks=8, cpu_gib=2 * report.cpu_gib)
    for figure in _figures([report, wider], tmp_path, monkeypatch):
        [axes] = figure.axes
        for axis in (axes.xaxis, axes.yaxis):
            assert axis.get_offset_text().get_text() == ""
    [capacity_axes] = _figures([report, wider], tmp_path, monkeypatch)[0].axes
    ticks = [float(label.get_text()) for label in capacity_axes.get_xticklabels()]
    assert max(ticks) < 1e-4  # the capacities themselves, in GiB


def test_plotting_no_run_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvoffload.sim.plots import plot_sweep

    with pytest.raises(InvalidArgumentError, match="at least one run"):
        plot_sweep([], tmp_path)


@pytest.mark.parametrize("name", ["price_$5_to_$6.jsonl", "x$^$y.jsonl"])
def test_a_workload_name_with_dollar_signs_is_plotted_as_written(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Two dollar signs made matplotlib read the trace's name as math: the plot failed with
    # a parser's traceback once the whole sweep had run, and its table was never shown.
    pytest.importorskip("matplotlib")
    report = dataclasses.replace(_small_report(make_workload), workload=name)
    for figure in _figures([report], tmp_path, monkeypatch):
        assert figure.axes[0].get_title().startswith(f"{name}, GPU ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hit_ratio_vs_capacity.png",
        "hit_ratio_vs_writes.png",
    ]


def test_rules_with_the_same_figures_stay_apart_in_the_plots(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rules with the same writes and hits drew one line over the other: the plot
    showed one rule. Each line now has a style and marker of its own, hollow markers."""
    pytest.importorskip("matplotlib")
    plain = _small_report(make_workload)
    runs = [plain, dataclasses.replace(plain, policy="arc")]
    for figure in _figures(runs, tmp_path, monkeypatch):
        lines = [line for line in figure.axes[0].get_lines() if line.get_label() != "Belady bound"]
        assert [line.get_label() for line in lines] == ["lru, no filter", "arc, no filter"]
        assert list(lines[0].get_xydata().flat) == list(lines[1].get_xydata().flat)
        styles = {(line.get_linestyle(), line.get_marker()) for line in lines}
        assert len(styles) == 2
        assert all(line.get_fillstyle() == "none" for line in lines)


@pytest.mark.parametrize("lines", [2, 18, 60])
def test_a_legend_of_many_lines_hides_neither_the_plot_nor_the_title(
    make_workload: MakeWorkload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: int
) -> None:
    """A sweep of three admissions, three policies and two thresholds draws 18 lines: their
    legend, inside the axes, covered the points and the title and ran off the top edge."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    plain = _small_report(make_workload)
    wider = dataclasses.replace(plain, cpu_blocks=8, cpu_gib=2 * plain.cpu_gib)
    runs = [
        dataclasses.replace(run, policy=f"policy{index}", admission="feedback")
        for index in range(lines)
        for run in (plain, wider)
    ]
    for figure in _figures(runs, tmp_path, monkeypatch):
        renderer = FigureCanvasAgg(figure).get_renderer()
        [axes] = figure.axes
        legend = axes.get_legend().get_window_extent(renderer)
        plot = axes.get_window_extent(renderer)
        title = axes.title.get_window_extent(renderer)
        assert len(axes.get_legend().get_texts()) >= lines
        assert legend.x0 >= 0 and legend.y0 >= 0, legend
        assert legend.x1 <= figure.bbox.width and legend.y1 <= figure.bbox.height, legend
        if lines > 2:  # a few entries fit inside the axes, placed where no line runs
            assert not legend.overlaps(plot) and not legend.overlaps(title), (legend, plot)
