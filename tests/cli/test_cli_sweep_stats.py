"""``kvoffload sweep`` writes a table, JSON, CSV and plots; ``trace-stats`` summarises a trace."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import needs_two_cpus, one_line_error

from kvoffload.cli import sweep
from kvoffload.cli.app import build_parser
from kvoffload.cli.main import main
from kvoffload.sim import Workload, plots, read_trace, sources
from tier_servers import ValkeyProcess


def test_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = ["sweep", "--requests", "100", "--gpu-blocks", "1500", "--cpu-blocks", "0,1500,6000"]
    args += ["--policies", "lru", "--thresholds", "0,2", "--jobs", "2", "--no-progress"]
    args += ["--plot-dir", str(tmp_path / "plots"), "--json", str(tmp_path / "s.json")]
    args += ["--csv", str(tmp_path / "s.csv")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Belady" in out and "plot:" in out
    reports = json.loads((tmp_path / "s.json").read_text())
    assert [(r["store_threshold"], r["cpu_blocks"]) for r in reports] == [
        (0, 0),
        (0, 1500),
        (0, 6000),
        (2, 0),
        (2, 1500),
        (2, 6000),
    ]
    assert len(list(csv.DictReader((tmp_path / "s.csv").read_text().splitlines()))) == 6
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["hit_ratio_vs_capacity.png", "hit_ratio_vs_writes.png"]


def test_a_sweep_over_a_disk_tier_says_so_in_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk tier's hits are in "total hit", while "offload" is the CPU tier alone: the
    table read as that of a sweep without one."""
    args = ["sweep", "--requests", "30", "--gpu-blocks", "1500", "--cpu-blocks", "600,1200"]
    args += ["--policies", "lru", "--thresholds", "0", "--jobs", "1", "--no-progress"]
    assert main(args) == 0
    assert "tier below" not in capsys.readouterr().out
    args += ["--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "3000"]
    assert main(args) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title.endswith("; a disk tier below each offload tier")


def test_sweep_rows_carry_the_trace_format_and_one_block_is_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``simulate --json`` does, each row says the format the trace was read in (a
    synthetic mix: null); the title read "(1 blocks)" for a GPU cache of one block."""
    trace = tmp_path / "one.jsonl"
    lines = [
        {"timestamp": t, "input_length": 100, "output_length": 1, "hash_ids": [h]}
        for t, h in ((0, 1), (10, 1), (20, 2))
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["sweep", "--gpu-blocks", "1", "--cpu-blocks", "1", "--policies", "lru"]
    args += ["--thresholds", "0", "--jobs", "1", "--no-progress"]
    assert main([*args, "--trace", str(trace), "--json", str(tmp_path / "t.json")]) == 0
    assert "one.jsonl: 3 block refs; GPU 64 MiB (1 block), layout" in capsys.readouterr().out
    trace.write_text(json.dumps(lines[0]) + "\n")
    assert main([*args, "--trace", str(trace)]) == 0
    assert "one.jsonl: 1 block ref; GPU" in capsys.readouterr().out
    assert [r["trace_format"] for r in json.loads((tmp_path / "t.json").read_text())] == [
        "mooncake"
    ]
    synthetic = ["sweep", "--requests", "20", "--cpu-blocks", "300", "--policies", "lru"]
    synthetic += ["--thresholds", "0", "--jobs", "1", "--no-progress"]
    assert main([*synthetic, "--csv", str(tmp_path / "s.csv")]) == 0
    [row] = csv.DictReader((tmp_path / "s.csv").read_text().splitlines())
    assert row["trace_format"] == ""


def test_sweep_csv_has_every_runs_columns(tmp_path: Path) -> None:
    """The optimiser's row has columns the first row lacks; the header once came from the
    first row alone and the write failed with a traceback."""
    args = ["sweep", "--requests", "50", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    args += ["--policies", "lru", "--thresholds", "0", "--jobs", "1", "--no-progress"]
    args += ["--admissions", "none,recommended", "--csv", str(tmp_path / "s.csv")]
    args += ["--json", str(tmp_path / "s.json")]
    assert main(args) == 0
    reports = json.loads((tmp_path / "s.json").read_text())
    plain, optimiser = csv.DictReader((tmp_path / "s.csv").read_text().splitlines())
    column = "whatif.store-all.1.hit_ratio"  # the optimiser's what-if table, flattened
    assert not reports[0]["whatif"] and plain[column] == ""
    assert float(optimiser[column]) == reports[1]["whatif"]["store-all"]["1"]["hit_ratio"]
    assert next(iter(plain)) == "workload"  # the first row's columns first


def test_sweep_csv_columns_are_in_a_runs_own_order(tmp_path: Path) -> None:
    """A column only a later row has goes where that run's own CSV has it: the optimiser's
    what-if columns came after ``trace_format``, which the docs keep last, when a run without
    them came first, so the sweep's columns were not those of ``simulate --csv``."""
    args = ["sweep", "--requests", "50", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    args += ["--policies", "lru", "--thresholds", "0", "--jobs", "1", "--no-progress"]
    args += ["--admissions", "none,recommended", "--csv", str(tmp_path / "s.csv")]
    assert main(args) == 0
    simulate = ["simulate", "--requests", "50", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    simulate += ["--admission", "recommended", "--no-progress", "--csv", str(tmp_path / "r.csv")]
    assert main(simulate) == 0
    [header] = csv.reader((tmp_path / "s.csv").read_text().splitlines()[:1])
    [own] = csv.reader((tmp_path / "r.csv").read_text().splitlines()[:1])
    assert header[-1] == "trace_format"
    assert header == own


def test_sweep_runs_each_distinct_setting_once(tmp_path: Path) -> None:
    """Thresholds 0 and 1 both mean no filter, and a name given twice is the same run:
    the table once had two identical rows for each."""
    args = ["sweep", "--requests", "30", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    args += ["--policies", "lru,lru", "--thresholds", "1,0,2,2", "--jobs", "1", "--no-progress"]
    args += ["--admissions", "none,none", "--json", str(tmp_path / "s.json")]
    assert main(args) == 0
    reports = json.loads((tmp_path / "s.json").read_text())
    assert [(r["policy"], r["store_threshold"]) for r in reports] == [("lru", 0), ("lru", 2)]


def test_sweep_runs_an_alias_and_its_rule_once(tmp_path: Path) -> None:
    """``recommended`` is the LRU policy, ``reuse`` the filter rule, and a capacity given
    twice is one capacity: the table once had eight identical rows here."""
    args = ["sweep", "--requests", "30", "--gpu-blocks", "1500", "--cpu-blocks", "300,300"]
    args += ["--policies", "lru,recommended", "--thresholds", "0", "--jobs", "1"]
    args += ["--admissions", "reuse,filter", "--no-progress", "--json", str(tmp_path / "s.json")]
    assert main(args) == 0
    reports = json.loads((tmp_path / "s.json").read_text())
    assert [(r["admission"], r["policy"], r["cpu_blocks"]) for r in reports] == [
        ("filter", "lru", 300)
    ]


@pytest.mark.parametrize("jobs", ["1", pytest.param("2", marks=needs_two_cpus)])
def test_a_failed_run_keeps_the_finished_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    """One configuration that raised (its disk tier cannot open) used to end the sweep with
    only its error: the runs already finished, maybe an hour of them, were lost. They are
    written and shown as on Ctrl-C, the error names the configuration, and the status is 1."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "cpu3000-arc-t0-none").write_text("")  # the last run's directory is a file
    out_json, out_csv = tmp_path / "runs.json", tmp_path / "runs.csv"
    args = ["sweep", "--requests", "30", "--cpu-blocks", "1000,3000", "--policies", "lru,arc"]
    args += ["--thresholds", "0", "--disk-dir", str(disk), "--disk-blocks", "100"]
    args += ["--jobs", jobs, "--no-progress", "--json", str(out_json), "--csv", str(out_csv)]
    assert main(args) == 1
    captured = capsys.readouterr()
    reports = json.loads(out_json.read_text())
    finished = [(r["policy"], r["cpu_blocks"]) for r in reports]
    # In order; run 4 starts only once two runs have finished, and fails opening its tier.
    first_three = [("lru", 1000), ("lru", 3000), ("arc", 1000)]
    assert finished == [run for run in first_three if run in finished]
    assert len(finished) == 3 if jobs == "1" else len(finished) >= 2
    assert len(out_csv.read_text().splitlines()) == len(reports) + 1
    assert captured.out.count(" lru ") + captured.out.count(" arc ") == len(reports)
    assert captured.err == (
        f"kvoffload: error: sweep stopped after {len(reports)} of 4 runs: run 4 of 4 "
        "(admission none, policy arc, threshold 0, 3,000 offload blocks) failed: disk tier "
        f"path {disk}/cpu3000-arc-t0-none is not a directory (or is a symbolic link, which "
        "is never followed); refusing to use it; the finished runs were written to "
        f"{out_json} and {out_csv}\n"
    )


def test_trace_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "chat_id,parent_chat_id,timestamp,input_length,output_length,type,turn,hash_ids\n"
        '1,-1,0,32,5,text,1,"[1, 2]"\n'
        '2,1,3,48,5,text,2,"[1, 2, 3]"\n'
    )
    assert main(["trace-stats", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "one-hit-wonder fraction  0.333  (of unique blocks)" in lines
    assert "duration                 3.0 s" in lines
    assert "reuse distance p50       1 block" in lines  # not "1 blocks"
    assert main(["trace-stats", str(trace), "--json", "-"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["requests"], stats["refs"], stats["unique_blocks"]) == (2, 5, 3)
    assert stats["block_tokens"] == 16


def test_trace_stats_says_when_no_block_is_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace with no reuse printed "reuse distance p50 0 blocks", the best figure there is,
    and its JSON held 0; a timestamp of 10^300 ms printed a duration of 298 digits."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1e300, "input_length": 32, "output_length": 1, "hash_ids": [3, 4]}\n'
    )
    argv = ["trace-stats", str(trace), "--block-size", "16"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for percentile in ("p50", "p90", "p99"):
        assert f"reuse distance {percentile}       none (no block reused)" in lines
    assert "duration                 1e+297 s" in lines
    assert main([*argv, "--json", "-"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["repeat_fraction"] == 0.0
    assert [stats[f"reuse_distance_{p}"] for p in ("p50", "p90", "p99")] == [None, None, None]


@pytest.mark.parametrize(
    ("last_ms", "shown"),
    [("30", "30.0 ms"), ("0.0004", "400.0 ns"), ("999.96", "1.0 s"), ("0", "0.0 s")],
)
def test_trace_stats_shows_a_short_span_in_a_unit_it_fills(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], last_ms: str, shown: str
) -> None:
    """A trace of 30 ms read "duration 0.0 s", as if all its requests came at once."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
        f'{{"timestamp": {last_ms}, "input_length": 16, "output_length": 1, "hash_ids": [1]}}\n'
    )
    assert main(["trace-stats", str(trace), "--block-size", "16"]) == 0
    assert f"duration                 {shown}" in capsys.readouterr().out.splitlines()


def test_trace_stats_shows_progress_on_stderr_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace of millions of lines took minutes to read and measure with nothing shown."""
    trace = tmp_path / "t.jsonl"
    record = '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
    trace.write_text(record * 10)
    argv = ["trace-stats", str(trace), "--block-size", "16", "--json", "-"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal: no bar unless asked
    assert main([*argv, "--progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["refs"] == 20  # stdout holds the JSON alone
    reading, measuring = (
        [line for line in captured.err.splitlines() if line.startswith(f"{label} [")]
        for label in ("reading trace", "reuse distances")
    )
    size = trace.stat().st_size  # the bytes read
    assert reading[-1].startswith(f"reading trace [##############################] {size}/{size}")
    assert measuring[-1].startswith("reuse distances [##############################] 20/20")
    assert captured.err.startswith("reading trace [")


@pytest.mark.parametrize(
    ("source", "label"), [([], "generating workload"), (["--trace"], "reading trace")]
)
def test_simulate_and_sweep_show_the_workload_loading(
    tmp_path: Path, source: list[str], label: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The workload is built before the run's bar starts: a large one took minutes unseen."""
    if source:
        trace = tmp_path / "t.jsonl"
        record = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
        trace.write_text(record + "\n")
        source = [*source, str(trace)]
    else:
        source = ["--requests", "50"]
    for command in (["simulate", "--no-bound"], ["sweep", "--cpu-blocks", "0", "--jobs", "1"]):
        argv = [*command, *source, "--json", "-", "--progress"]
        assert main(argv) == 0
        lines = capsys.readouterr().err.splitlines()
        assert lines[0].startswith(f"{label} ["), lines
        assert any(line.startswith(f"{command[0]} [") for line in lines), lines


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_jobs_default_to_the_cpus_this_process_may_run_on() -> None:
    """Under ``taskset`` or a container's cpuset, the machine's CPU count would start more
    workers than there are CPUs to run them, each holding the workload."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        parser, _ = build_parser()
        args = parser.parse_args(["sweep"])
    finally:
        os.sched_setaffinity(0, allowed)
    assert args.jobs == 1


def test_sweep_reads_the_trace_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep read the trace for its bar, then again for its runs: twice the load time."""
    trace = tmp_path / "t.jsonl"
    record = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
    trace.write_text(record + "\n")
    reads: list[str] = []

    def counted_read(path: str, *args: Any) -> Workload:
        reads.append(path)
        return read_trace(path, *args)

    monkeypatch.setattr(sources, "read_trace", counted_read)
    argv = ["sweep", "--trace", str(trace), "--cpu-blocks", "0,4", "--jobs", "1", "--json", "-"]
    assert main([*argv, "--no-progress"]) == 0
    assert reads == [str(trace)]


def test_a_plot_that_cannot_be_written_still_shows_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plots are written after every run: one that fails (here a directory holds its
    name; a full disk alike) said so in one line, and the sweep's table, without ``--json``
    its only record, was never shown."""
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    (plots / "hit_ratio_vs_capacity.png").mkdir(parents=True)
    args = ["sweep", "--requests", "30", "--gpu-blocks", "1500", "--cpu-blocks", "300"]
    args += ["--policies", "lru", "--thresholds", "0", "--jobs", "1", "--no-progress"]
    assert main([*args, "--plot-dir", str(plots)]) == 1
    captured = capsys.readouterr()
    assert "total hit" in captured.out and "plot:" not in captured.out
    assert captured.err == (
        f"kvoffload: error: --plot-dir {plots / 'hit_ratio_vs_capacity.png'}: "
        "cannot write: Is a directory\n"
    )


def test_a_sweep_against_one_server_counts_runs_by_their_blocks(
    own_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two sizes in GiB of one block count are one run, which a shared tier allows; they
    were refused as two."""
    own_server.start()
    sweep = ["sweep", "--requests", "20", "--gpu-blocks", "1500", "--policies", "lru"]
    sweep += ["--thresholds", "0", "--layout", "tiny", "--jobs", "1", "--no-progress"]
    sweep += ["--remote", own_server.url, "--json", "-"]
    assert main([*sweep, "--cpu-gb", "0.001,0.0010000001"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["cpu_blocks"] == 262
    assert main([*sweep, "--cpu-gb", "0.001,0.002"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvoffload: error: --remote: the 2 runs of this sweep would share")


def test_trace_stats_plots_the_hit_ratio_by_cache_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three percentiles were all the table and the JSON gave of the reuse distances."""
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
    )
    plot = tmp_path / "reuse.png"
    assert main(["trace-stats", str(trace), "--block-size", "16", "--plot", str(plot)]) == 0
    assert capsys.readouterr().out.endswith(f"reuse distance p99       1 block\nplot: {plot}\n")
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--plot", "-"], "--plot -: a PNG is not written to standard output; name a file"),
        (["--plot", ""], "argument --plot: must not be empty"),
        (["--plot", "{tmp}/no/r.png"], "--plot {tmp}/no/r.png: no such directory"),
        (["--plot", "{tmp}/r", "--json", "{tmp}/r"], "--json {tmp}/r and --plot {tmp}/r are one"),
        (["--plot", "{tmp}/bad.jsonl"], "--plot {tmp}/bad.jsonl is the trace file being read"),
    ],
)
def test_trace_stats_checks_its_plot_before_reading(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace is bad too: an error naming --plot shows it was checked first."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    argv = [arg.format(tmp=tmp_path) for arg in args]
    assert main(["trace-stats", str(trace), *argv]) == (2 if "empty" in message else 1)
    assert message.format(tmp=tmp_path) in one_line_error(capsys)
    assert trace.read_text() == "{\n"


@pytest.mark.parametrize(("asked", "used"), [("1000", 2), ("2", 2), ("1", 1)])
def test_a_sweep_runs_at_most_one_worker_a_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], asked: str, used: int
) -> None:
    """``--jobs 1000`` on 2 CPUs started a pool of up to 1000 processes, each with its own
    copy of the workload, to take turns on 2 CPUs; it runs on 2 and says so once."""
    real_run_sweep = sweep.run_sweep
    jobs_given: list[int] = []

    def run_here(*args: Any, jobs: int, **kwargs: Any) -> Any:
        jobs_given.append(jobs)
        return real_run_sweep(*args, jobs=1, **kwargs)  # no worker processes in a test

    monkeypatch.setattr(sweep, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sweep, "run_sweep", run_here)
    argv = ["sweep", "--requests", "30", "--cpu-blocks", "100,200,300", "--policies", "lru"]
    assert main([*argv, "--thresholds", "0", "--jobs", asked, "--no-progress"]) == 0
    assert jobs_given == [used]
    note = f"kvoffload: --jobs {asked}: using 2, the CPUs this process may use\n"
    assert capsys.readouterr().err == (note if used < int(asked) else "")


def test_twenty_sweep_lines_each_have_a_style_of_their_own() -> None:
    """Colours came from matplotlib's cycle (10 by default, fewer in some styles) and the
    dash and marker cycles told 12 apart: a sweep of 18 configurations drew lines alike."""
    styles = [plots._line_style(index) for index in range(20)]
    drawn = [(style.get("color"), style["linestyle"], style["marker"]) for style in styles]
    assert len(set(drawn)) == len(drawn), drawn
    for colour in {colour for colour, _, _ in drawn}:
        alike = [(dash, marker) for drawn_colour, dash, marker in drawn if drawn_colour == colour]
        assert len({dash for dash, _ in alike}) == len({m for _, m in alike}) == len(alike), alike
