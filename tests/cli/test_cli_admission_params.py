"""``--admission-param key=value`` in ``simulate``: it reaches the rule, and a bad one is an
error naming the key before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import one_line_error

from kvoffload.admission.registry import available_admissions, params_class
from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "120", "--seed", "3", "--no-progress", "--no-bound"]
TIER = ["--gpu-blocks", "1500", "--cpu-blocks", "3000", "--admission", "sketch", "--json", "-"]


def _admitted(capsys: pytest.CaptureFixture[str], *params: str) -> int:
    assert main([*SMALL, *TIER, *[f"--admission-param={p}" for p in params]]) == 0
    return int(json.loads(capsys.readouterr().out)["admission_admitted"])


def test_a_parameter_reaches_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    default = _admitted(capsys)
    assert _admitted(capsys, "threshold=2") == default  # the default, given explicitly
    assert _admitted(capsys, "threshold=1") > default  # stores on first sight
    assert _admitted(capsys, "threshold=1", "threshold=3") < default  # the last one wins


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (["thresold=2"], "--admission-param: unknown admission parameter 'thresold' for 'sketch'"),
        (["threshold=0"], "'threshold' of 'sketch' must be in [1, 15]"),
        (["threshold"], "--admission-param takes key=value, got 'threshold'"),
    ],
)
def test_a_bad_parameter_stops_before_the_run(
    capsys: pytest.CaptureFixture[str], params: list[str], message: str
) -> None:
    assert main([*SMALL, *TIER, *[f"--admission-param={p}" for p in params]]) != 0
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    ("param", "reason"),
    [
        ("threshold=-1e-400", "must be >= 0, got -1e-400"),  # its float, -0.0, passed >= 0
        ("threshold=1e-400", "1e-400 is too small to tell from 0"),  # it ran as 0
        ("threshold=1.00000000000000000001", "must be <= 1, got 1.00000000000000000001"),
    ],
)
def test_a_number_parameter_is_judged_as_written(
    capsys: pytest.CaptureFixture[str], param: str, reason: str
) -> None:
    """As every other number of the command line: its float passed the bounds."""
    tier = ["--gpu-blocks", "1500", "--cpu-blocks", "3000", "--admission", "feedback"]
    argv = [*SMALL, *tier, "--admission-param", param]
    assert main(argv) == 1
    error = one_line_error(capsys)
    assert f"--admission-param: admission parameter 'threshold' of 'feedback': {reason}" in error


def test_the_seed_filter_by_name_is_the_store_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    small = [*SMALL, "--gpu-blocks", "1500", "--cpu-blocks", "3000"]
    assert main([*small, "--admission", "reuse", "--admission-param", "store_threshold=3"]) == 0
    table = capsys.readouterr().out
    assert "admission filter" in table and "offers admitted" not in table
    skipped = [line for line in table.splitlines() if line.startswith("skipped by admission")]
    assert main([*small, "--store-threshold", "3"]) == 0
    assert skipped == [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("skipped by admission")
    ]


@pytest.mark.parametrize(
    ("admission", "param"),
    [
        ("filter", "store_threshold=99999999999999999999"),
        ("recommended", "filter_threshold=9223372036854775808"),
        ("filter", "max_tracker_size=99999999999999999999"),
        ("recommended", "filter_tracker=99999999999999999999"),
    ],
)
def test_a_threshold_beyond_the_compiled_counter_is_refused(
    capsys: pytest.CaptureFixture[str], admission: str, param: str
) -> None:
    """Past a C ``long long``, the compiled counter once raised OverflowError mid-run."""
    key = param.partition("=")[0]
    argv = [*SMALL, "--cpu-blocks", "3000", "--admission", admission, "--admission-param", param]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert f"--admission-param: admission parameter {key!r}" in captured.err
    assert "must be in [" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_the_largest_threshold_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The bound itself is a threshold no block reaches: nothing stored, no overflow."""
    param = f"store_threshold={2**62}"
    argv = [*SMALL, *TIER[:4], "--admission", "filter", "--admission-param", param, "--json", "-"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["offload_blocks_written"] == 0


@pytest.mark.parametrize("rule", available_admissions())
def test_help_lists_every_parameter_of_the_rule_instead_of_a_run(
    capsys: pytest.CaptureFixture[str], rule: str
) -> None:
    """Each parameter carries a line of help that nothing showed: an operator had to find
    docs/admission.md to learn what ``root_groups`` sets or what ``guard`` defaults to."""
    assert main([*SMALL, "--admission", rule, "--admission-param", "help"]) == 0
    listed = capsys.readouterr().out.splitlines()
    defaults = params_class(rule)()
    fields = dataclasses.fields(defaults)
    if not fields:
        assert listed == [f"--admission {rule} takes no parameters"]
        return
    assert len(listed) == 1 + len(fields)  # a heading, then one line each and no report
    for line, field in zip(listed[1:], fields, strict=True):
        name, default, *_ = line.split()
        assert name == field.name and field.metadata["help"] in line
        assert float(default.replace(",", "")) == getattr(defaults, field.name)


def test_help_of_an_unknown_rule_is_the_unknown_rule_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL, "--admission", "bogus", "--admission-param", "help"]) == 1
    captured = capsys.readouterr()
    assert "--admission: unknown admission 'bogus'" in captured.err and captured.out == ""


def test_help_writes_the_widest_bounds_as_the_docs_do(capsys: pytest.CaptureFixture[str]) -> None:
    """2^62 and 2^59 - 1, not 4.61169e+18 or 576460752303423487."""
    assert main([*SMALL, "--admission", "filter", "--admission-param", "help"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "  2 to 2^62  " in listed["store_threshold"]
    assert "  64,000  1 to 2^59 - 1  " in listed["max_tracker_size"]
    assert main([*SMALL, "--admission", "feedback", "--admission-param", "help"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "  1 to 2^20  " in listed["root_groups"] and "  >= 0  " in listed["prior_returns"]


LONG = "9" * 100_000


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--admission", "feedback", "--admission-param", f"threshold={LONG}"], "'threshold'"),
        (["--admission", "feedback", "--admission-param", f"root_groups={LONG}"], "'root_groups'"),
        (["--admission", "feedback", "--admission-param", f"threshold=-{LONG}"], "'threshold'"),
        (["--admission", "recommended", "--write-budget", f"{LONG}x"], "--write-budget"),
        (["--admission", "recommended", "--write-budget", f"{LONG}dwpd"], "--write-budget"),
        (["--admission", "recommended", "--write-budget", f"-{LONG}"], "--write-budget"),
        (
            ["--admission", "recommended", "--write-budget", "1dwpd", "--drive-bytes", f"{LONG}x"],
            "--drive-bytes",
        ),
    ],
)
def test_a_long_bad_value_is_named_in_a_short_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    """The error echoed every character given: a line of 100,000 digits on the terminal (or
    in an engine's log) for one mistyped value."""
    assert main([*SMALL, *argv]) in (1, 2)
    err = one_line_error(capsys)
    assert named in err and "100,00" in err and len(err) < 400, err[:500]


SWEEP = ["sweep", "--requests", "120", "--seed", "3", "--no-progress", "--jobs", "1"]
SWEPT = ["--gpu-blocks", "1500", "--cpu-blocks", "3000", "--policies", "lru", "--thresholds", "0"]


def _swept(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, int]:
    """Each run's admitted blocks, by rule."""
    assert main([*SWEEP, *SWEPT, *args, "--json", "-"]) == 0
    return {
        row["admission"]: row["admission_admitted"] for row in json.loads(capsys.readouterr().out)
    }


def test_sweep_takes_admission_param_for_its_rules_as_simulate_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``sweep`` took ``--admission-param`` only for the lower tiers' rules: the CPU tier's
    rules ran on their defaults. It sets each rule of ``--admissions`` but ``none``."""
    default = _swept(capsys, "--admissions", "none,sketch")
    given = _swept(capsys, "--admissions", "none,sketch", "--admission-param", "threshold=1")
    assert given["sketch"] > default["sketch"]  # stores on first sight
    assert given["none"] == default["none"]
    assert main([*SMALL, *TIER, "--admission-param=threshold=1"]) == 0
    assert json.loads(capsys.readouterr().out)["admission_admitted"] == given["sketch"]


@pytest.mark.parametrize(
    ("admissions", "param", "message"),
    [
        (
            "none",
            "threshold=2",
            "--admission-param: admission 'none' takes no parameters, got threshold",
        ),
        (
            "sketch",
            "thresold=2",
            "--admission-param: unknown admission parameter 'thresold' for 'sketch'",
        ),
        (
            "none,feedback,sketch",
            "threshold=0.4",
            "--admission-param: admission parameter 'threshold' of 'sketch' must be an integer",
        ),
        ("sketch", "threshold", "--admission-param takes key=value, got 'threshold'"),
    ],
)
def test_a_bad_sweep_admission_param_stops_before_the_runs(
    capsys: pytest.CaptureFixture[str], admissions: str, param: str, message: str
) -> None:
    argv = [*SWEEP, *SWEPT, "--admissions", admissions, "--admission-param", param]
    assert main(argv) == 1
    assert message in one_line_error(capsys)


def test_sweep_admission_param_help_lists_each_rule_but_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SWEEP, "--admissions", "none,sketch,reuse", "--admission-param", "help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--admissions sketch: --admission-param KEY=VALUE, one per key")
    assert "\n\n--admissions reuse: --admission-param KEY=VALUE" in out
    assert "--admissions none" not in out
    assert main([*SWEEP, "--admission-param", "help"]) == 0
    assert capsys.readouterr().out == "--admissions none takes no parameters\n"


def test_sweep_sizes_each_rule_with_its_parameters_before_the_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The machine's memory is checked against the rule as the parameters make it: a
    sketch sampled 1,000 tier-fulls deep, not 10 (the default)."""
    argv = [*SWEEP, "--gpu-blocks", "1500", "--cpu-blocks", str(10**8), "--admissions", "sketch"]
    assert main([*argv, "--admission-param", "sample_factor=1000"]) == 1
    error = one_line_error(capsys)
    assert f"--cpu-blocks {10**8} with --admissions sketch: " in error
    assert "sketch of 100,000,000,000 sightings" in error
