"""``--admission`` in ``simulate`` and ``--admissions`` in ``sweep``: names, JSON fields, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvoffload.admission import available_admissions
from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "120", "--seed", "3", "--no-progress", "--no-bound"]
TIER = ["--gpu-blocks", "1500", "--cpu-blocks", "3000"]


def test_recommended_resolves_and_the_json_carries_admission_and_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*SMALL, *TIER, "--admission", "recommended", "--policy", "recommended", "--json", "-"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["admission"], report["policy"]) == ("optimiser", "lru")
    assert report["admission_offers"] == report["admission_admitted"] + report["admission_rejected"]
    assert report["admission_offers"] == report["stores_offered"]
    assert 0.0 <= report["admission_control"] <= 1.0
    assert report["admission_bytes_per_key"] > 0
    assert report["admission_candidate"] in ("store-all", "filter", "feedback")
    assert isinstance(report["admission_switches"], int) and report["admission_switches"] >= 0
    whatif = report["whatif"]
    assert sorted(whatif) == ["feedback", "filter", "store-all"]
    for by_factor in whatif.values():
        assert sorted(by_factor, key=float) == ["0.5", "1", "2", "4"]
        for figures in by_factor.values():
            assert 0.0 <= figures["hit_ratio"] <= 1.0 and figures["writes_per_ref"] >= 0.0


def test_the_table_shows_the_what_if_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *TIER, "--admission", "recommended"]) == 0
    table = capsys.readouterr().out
    assert "what-if (hit / writes)" in table and "4x" in table
    assert re.search(
        r"following +(store-all|filter|feedback) \((never switched|1 switch|\d+ switches)\)", table
    )
    for candidate in ("store-all", "filter", "feedback"):
        assert f"    {candidate}" in table


def test_the_disk_tiers_own_optimiser_reports_its_choice_and_what_if_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--disk-admission recommended`` reported only its name and offered / admitted
    counts: the disk tier's entry now has its rule, switches and what-if figures, named as
    the CPU tier's are at the top, and the table prints them under the disk tier."""
    args = [*SMALL, *TIER, "--disk-blocks", "4000", "--disk-admission", "recommended"]
    assert main([*args, "--disk-dir", str(tmp_path / "json"), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["whatif"], report["admission_candidate"]) == ({}, "")  # the CPU tier's: none
    entry = report["tiers"]["disk"]
    assert entry["admission"] == "optimiser"
    assert entry["admission_candidate"] in ("store-all", "filter", "feedback")
    assert isinstance(entry["admission_switches"], int) and entry["admission_switches"] >= 0
    assert sorted(entry["whatif"]) == ["feedback", "filter", "store-all"]
    for by_factor in entry["whatif"].values():
        assert sorted(by_factor, key=float) == ["0.5", "1", "2", "4"]
        for figures in by_factor.values():
            assert 0.0 <= figures["hit_ratio"] <= 1.0 and figures["writes_per_ref"] >= 0.0
    assert main([*args, "--disk-dir", str(tmp_path / "table")]) == 0  # the same run
    table = capsys.readouterr().out
    below_disk = table[table.index("disk tier") :]
    assert re.search(rf"\n  following +{entry['admission_candidate']} \(", below_disk)
    assert "what-if (hit / writes)" in below_disk
    for candidate in ("store-all", "filter", "feedback"):
        assert f"    {candidate}" in below_disk


def test_a_disk_tier_without_an_optimiser_reports_no_what_if_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = ["--disk-dir", str(tmp_path), "--disk-blocks", "4000", "--disk-admission", "filter"]
    assert main([*SMALL, *TIER, *disk, "--json", "-"]) == 0
    entry = json.loads(capsys.readouterr().out)["tiers"]["disk"]
    assert entry["admission"] == "filter"
    assert not {"admission_candidate", "admission_switches", "whatif"} & set(entry)


def test_a_disk_tier_s_rule_takes_its_parameters_as_the_cpu_tier_s_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--disk-admission-param`` sets the disk tier's rule as ``--admission-param`` sets the
    CPU tier's: there was no way to, and the rule ran on its defaults. The filter at a
    threshold of 3 writes fewer blocks than at its default, 2; simulate and sweep both
    take it."""
    written = []
    for params in ([], ["--disk-admission-param", "store_threshold=3"]):
        disk_dir = tmp_path / str(len(params))
        disk = ["--disk-dir", str(disk_dir), "--disk-blocks", "4000", "--disk-admission", "filter"]
        assert main([*SMALL, *TIER, *disk, *params, "--json", "-"]) == 0
        written.append(json.loads(capsys.readouterr().out)["tiers"]["disk"]["admitted_blocks"])
    assert written[1] < written[0]
    swept = []
    for params in ([], ["--disk-admission-param", "store_threshold=3"]):
        sweep = ["sweep", "--requests", "120", "--seed", "3", "--no-progress", "--json", "-"]
        disk = ["--disk-dir", str(tmp_path / f"sweep{len(params)}"), "--disk-blocks", "4000"]
        tier = ["--gpu-blocks", "1500", "--cpu-blocks", "3000", *disk, "--policies", "lru"]
        tier += ["--thresholds", "0", "--disk-admission", "filter", *params]
        assert main([*sweep, *tier]) == 0
        rows = json.loads(capsys.readouterr().out)
        swept.append(sum(row["tiers"]["disk"]["admitted_blocks"] for row in rows))
    assert swept[1] < swept[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-admission-param", "threshold=3"], "--disk-admission-param needs --disk-dir"),
        (
            ["--remote-admission-param", "threshold=3"],
            "--remote-admission-param needs --remote",
        ),
        (
            ["--disk-admission", "sketch", "--disk-admission-param", "thresold=3"],
            "--disk-admission-param: unknown admission parameter 'thresold' for 'sketch'; "
            "valid: min_sample, sample_factor, threshold",
        ),
        (
            ["--disk-admission", "sketch", "--disk-admission-param", "threshold=3.5"],
            "--disk-admission-param: admission parameter 'threshold' of 'sketch' must be an "
            "integer, got '3.5'",
        ),
        (
            ["--disk-admission-param", "threshold=3"],
            "--disk-admission-param: admission 'none' takes no parameters, got threshold",
        ),
    ],
)
def test_a_bad_tier_admission_parameter_is_one_line_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    disk = (
        []
        if "--remote-admission-param" in args or "needs" in message
        else [
            "--disk-dir",
            str(tmp_path),
            "--disk-blocks",
            "400",
        ]
    )
    assert main([*SMALL, *TIER, *disk, *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(message), err
    assert not list(tmp_path.iterdir())  # refused before the run made its directory


@pytest.mark.parametrize(
    "args",
    [
        ["--admission", "sketch", "--admission-param", f"{'k' * 100_000}=1"],
        ["--admission", "sketch", "--admission-param", "k" * 100_000],
        ["--admission-param", f"{'k' * 100_000}=1"],
        ["--admission", "k" * 100_000],
    ],
)
def test_a_pasted_key_or_rule_name_is_one_short_line(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """A key or rule name pasted by mistake was echoed whole: one error line as long as it."""
    assert main([*SMALL, *TIER, *args]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "characters)" in err and len(err) < 400, err[:200]


def test_help_lists_a_tier_s_rule_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--disk-admission", "sketch", "--disk-admission-param", "help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--disk-admission sketch: --disk-admission-param KEY=VALUE")
    assert "threshold" in out and "sample_factor" in out


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("nan", "argument --write-budget: must be a finite number"),
        ("-0.5", "argument --write-budget: must be >= 0"),
        ("x", "argument --write-budget: expected writes per block reference (0.2), bytes per"),
        ("200MB", "argument --write-budget: expected writes per block reference"),
        ("1dwpd", "needs the drive's size: --drive-bytes, or a disk tier (--disk-dir), whose"),
    ],
)
def test_bad_write_budgets_are_one_clear_error(
    budget: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *TIER, "--admission", "recommended", "--write-budget", budget]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["--write-budget", "0.1"],
            "a write budget needs --admission recommended (the optimiser), not 'none'",
        ),
        (
            ["--admission", "recommended", "--write-budget", "1dwpd"],
            "a write budget of 1 drive writes per day needs the drive's size",
        ),
    ],
)
def test_a_write_budget_that_cannot_run_is_refused_before_the_workload(
    settings: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused only once the trace had been read (minutes, for a large one), where a lower
    tier's budget without its optimiser was refused at once."""
    bad_trace = tmp_path / "bad.jsonl"  # an error about it would mean it was read first
    bad_trace.write_text("{\n")
    assert main(["simulate", "--trace", str(bad_trace), "--no-progress", *settings]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvoffload: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("settings", "option"),
    [
        (["--admission", "recommended", "--write-budget", "1e308dwpd"], "--write-budget"),
        # Past a float only at the disk tier's bytes: passed the run's settings, refused
        # once the stack was built.
        (["--admission", "recommended", "--write-budget", "1e303dwpd"], "--write-budget"),
        (
            ["--disk-admission", "recommended", "--disk-write-budget", "1e308dwpd"],
            "--disk-write-budget",
        ),
    ],
)
def test_a_budget_past_a_float_on_its_drive_names_its_option(
    settings: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both budgets read "a write budget of 1e+308 drive writes per day comes to more
    bytes a day than a float holds": which of them, it did not say."""
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "1000"]
    assert main([*SMALL, *TIER, *disk, *settings]) == 1
    err = capsys.readouterr().err
    amount = settings[-1].removesuffix("dwpd").replace("e3", "e+3")
    assert err == (
        f"kvoffload: error: {option}: a write budget of {amount} drive writes per day comes "
        "to more bytes a day than a float holds on its drive: give a finite one, or leave it "
        "out for no budget\n"
    )


def test_a_write_budget_needs_the_optimiser_and_keeps_to_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL, *TIER, "--write-budget", "0.1"]) != 0
    err = capsys.readouterr().err
    assert "a write budget needs --admission recommended" in err and "Traceback" not in err
    args = [*SMALL, *TIER, "--admission", "recommended", "--write-budget", "0.01", "--json", "-"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["writes_per_ref"] <= 0.01


def test_budgets_in_bytes_per_second_and_drive_writes_keep_to_trace_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*SMALL, *TIER, "--admission", "recommended", "--json", "-"]
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    per_s = free["offload_bytes_written"] / free["simulated_seconds"] / 4
    drive = per_s * 86_400
    for budget in (f"{per_s:.0f}B/s", f"{per_s / 2**20:.6f}MiB/s", "1dwpd"):
        drive_bytes = ["--drive-bytes", f"{drive:.0f}"] if budget.endswith("dwpd") else []
        assert main([*args, "--write-budget", budget, *drive_bytes]) == 0
        report = json.loads(capsys.readouterr().out)
        assert 0 < report["offload_bytes_written"] <= per_s * report["simulated_seconds"] * 1.0001
    assert main([*args, "--write-budget", "1dwpd", "--drive-bytes", "0"]) != 0
    err = capsys.readouterr().err
    assert "argument --drive-bytes: must be >= 1 byte" in err and len(err.strip().splitlines()) == 1


def test_drive_writes_per_day_count_against_the_disk_tier_without_drive_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = ["--disk-dir", str(tmp_path), "--disk-blocks", "100"]
    args = [*SMALL, *TIER, *disk, "--admission", "recommended", "--json", "-"]
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    assert main([*args, "--write-budget", "1dwpd"]) == 0
    budgeted = json.loads(capsys.readouterr().out)
    drive = 100 * free["bytes_per_block"]
    assert main([*args, "--write-budget", "1dwpd", "--drive-bytes", str(drive)]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert budgeted["offload_bytes_written"] == explicit["offload_bytes_written"]
    assert budgeted["offload_bytes_written"] < free["offload_bytes_written"]


def test_the_table_shows_the_admission_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *TIER, "--admission", "sketch", "--policy", "s3fifo"]) == 0
    table = capsys.readouterr().out
    assert "s3fifo, no store filter, admission sketch" in table
    assert "admission sketch" in table and "bytes per tracked key" in table


def test_without_admission_the_json_says_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *TIER, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["admission"] == "none" and report["admission_control"] is None


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "--admission",
            f"unknown admission 'tiny'; known: {', '.join(available_admissions())}",
        ),
        ("--policy", "unknown cache policy 'tiny'; known: arc, lru, "),
    ],
)
def test_bad_names_list_the_valid_ones(
    option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *TIER, option, "tiny"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    if option == "--policy":
        assert all(name in err for name in ("recommended", "s3fifo", "sieve", "slru"))


def test_sweep_over_admissions(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sweep", "--requests", "100", "--gpu-blocks", "1500", "--cpu-blocks", "1500"]
    args += ["--policies", "lru", "--thresholds", "0", "--admissions", "none,recommended"]
    args += ["--jobs", "1", "--no-progress", "--json", "-"]
    assert main(args) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["admission"] for r in reports] == ["none", "optimiser"]
    assert reports[1]["admission_offers"] > 0
    assert main([*args[:-2], "--admissions", "nope"]) != 0
    assert "unknown admission 'nope'" in capsys.readouterr().err


def test_the_switch_count_reads_as_words() -> None:
    from kvoffload.cli.output import switches

    assert [switches(n) for n in (0, 1, 2, 1234)] == [
        "never switched",
        "1 switch",
        "2 switches",
        "1,234 switches",
    ]


def test_what_if_figures_not_known_yet_are_null_and_dashes_not_zeros(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run no key of which reached the tier (one request shorter than a block) once
    showed every what-if figure as 0.000, a rule that writes nothing."""
    empty = ["simulate", "--requests", "1", "--block-size", "4096", "--no-progress", "--no-bound"]
    args = [*empty, *TIER, "--admission", "recommended"]
    assert main([*args, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["whatif"]["store-all"]["1"]["writes_per_ref"] is None
    assert {
        figure
        for by_factor in report["whatif"].values()
        for figures in by_factor.values()
        for figure in (figures["hit_ratio"], figures["writes_per_ref"])
    } == {None}
    assert main(args) == 0
    table = capsys.readouterr().out
    assert re.search(r"store-all +- / - +- / - +- / - +- / -\n", table)
