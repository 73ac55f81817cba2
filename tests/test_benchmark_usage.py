"""Every script of ``benchmarks/`` that the manual tells an operator to run answers
``--help``: a script whose option set-up no longer matches the library fails here, not on
the (often GPU) machine it was carried to."""

import re
from pathlib import Path

import pytest

from sim.benchmark_scripts import BENCHMARKS, run_script
from test_docs_commands import parse_script, script_parser, skipped_without_engine

SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if "__main__" in path.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_script_prints_its_usage(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built in this process as ``python benchmarks/<name>.py`` builds it (a process each
    took about 50 s in all; one script still answers in a process of its own, below)."""
    with skipped_without_engine(script.name), monkeypatch.context() as patch:
        usage = script_parser(script.stem, patch).format_help()
    assert usage.startswith(f"usage: {script.name}"), usage
    for choices in re.findall(r"\{([^}]*)\}", usage):
        listed = choices.split(",")
        assert len(set(listed)) == len(listed), f"a usage that reads {{{choices}}} is ambiguous"


def test_a_script_answers_help_in_a_process_of_its_own() -> None:
    done = run_script(BENCHMARKS / "manager.py", ["--help"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: manager.py"), done.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_script_refuses_an_abbreviated_option(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse takes a unique prefix of a long option for it, so a typo could set another
    option, and one added later would change what an abbreviation meant. ``--hel`` probes
    every script alike, parsed in this process by the script's own parser: taken for
    ``--help`` it prints the help and exits 0; refused, it is a usage error (or a missing
    argument's, reported first)."""
    with skipped_without_engine(script.name):
        status, error = parse_script(script.stem, ["--hel"], monkeypatch)
    assert status == 2, f"{script.name} took --hel for --help"
    assert re.search(r"unrecognized arguments: --hel|arguments are required", error), error


def test_the_scripts_are_found() -> None:
    assert any(path.stem == "transfer_cuda" for path in SCRIPTS)


@pytest.mark.parametrize(
    ("script", "arguments", "error"),
    [
        ("manager", ["--policies", "lru,lur"], "argument --policies: unknown policy 'lur'"),
        ("manager", ["--repeat", "0"], "argument --repeat: must be >= 1"),
        ("manager", ["--json", "missing/out.json"], "--json missing/out.json: no such directory"),
        ("tier_admission", ["--workloads", "rag,nope"], "unknown workload 'nope'"),
        ("tier_admission", ["--cpu-share", "0"], "argument --cpu-share"),
        ("tier_admission", ["--disk-share", "-0.25"], "argument --disk-share"),
        ("tier_admission", ["--budget", "-1"], "argument --budget"),
        ("tier_admission", ["--json", "."], "--json .: is a directory"),
        ("vllm_replay", ["--disk-blocks", "-5"], "--disk-blocks must be >= 0"),
        ("vllm_replay", ["--disk-blocks", "9", "--gpu-blocks", "0"], "--gpu-blocks must be >= 1"),
        ("vllm_replay", ["--disk-blocks", "9", "--disk-admission", "x"], "--disk-admission: unkn"),
    ],
)
def test_a_bad_argument_is_one_line_before_the_run(
    tmp_path: Path, script: str, arguments: list[str], error: str
) -> None:
    """A misspelt policy left its rows out of the table without a word, a repeat of 0 or an
    unknown workload stopped the run in a traceback, and ``--json`` was checked only by
    writing it after the whole run."""
    done = run_script(BENCHMARKS / f"{script}.py", arguments, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert error in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""  # refused before the table's first line
