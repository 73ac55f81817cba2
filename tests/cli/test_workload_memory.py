"""A workload the machine cannot hold is refused before it is built, on one line that names
the options that size it: a synthetic one's count, mix and block size, and the trace a
sweep's workers each read again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli import sweep
from kvoffload.cli.main import main
from kvoffload.core import memory

MIB = 2**20
QUICK = ["--no-progress", "--gpu-blocks", "130000", "--cpu-blocks", "0", "--no-bound"]
"""Sizes that make a run the check let through short: no tier, no bound."""


def test_longchat_at_one_token_per_block_is_refused_naming_its_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 such requests take some 330 MB to draw; 8 KiB a request said 1.6 MB."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 150 * MIB)
    argv = ["simulate", "--mix", "longchat", "--block-size", "1", "--requests", "200", *QUICK]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert "error: --requests 200 of --mix longchat at --block-size 1 would need about" in err


def test_the_default_workload_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked only with --requests given: the generator refused it, naming no option."""
    monkeypatch.setattr(memory, "available_bytes", lambda: MIB)
    assert main(["sweep", "--jobs", "1", "--no-progress"]) == 1
    err = one_line_error(capsys)
    assert "2,000 synthetic requests of the default mix at 16 tokens per block would" in err


def test_a_request_count_past_the_float_range_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its bytes were divided into GiB as an int: OverflowError, a traceback."""
    assert main(["simulate", "--requests", "1" + "0" * 400, *QUICK]) == 1
    assert "would need more memory than a float can count" in one_line_error(capsys)


def test_a_sweep_counts_the_copy_each_worker_draws(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Some 11 MB a copy: one fits in 40 MiB, five do not; the workers, each drawing its own,
    were killed for memory one by one, and the error named no option."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 40 * MIB)
    monkeypatch.setattr(sweep, "usable_cpus", lambda: 4)  # --jobs 4 is taken as asked
    argv = ["sweep", "--requests", "600", "--no-progress", "--policies", "lru"]
    argv += ["--thresholds", "0", "--cpu-blocks", "100,200,300,400"]
    assert main([*argv, "--jobs", "4"]) == 1
    err = one_line_error(capsys)
    assert "error: --jobs 4: --requests 600 of the default mix at 16 tokens per block, " in err
    assert "drawn by each of 4 workers and here, would need about 0.1 GiB of memory" in err


def test_a_sweep_counts_the_copy_of_the_trace_each_worker_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each worker reads the trace again, at once: some 2.3 MB here, 9 MB for four, more
    than 6 MiB. A trace of 25 MB took 500 MiB in each; nothing checked that they fit."""
    trace = tmp_path / "t.jsonl"
    lines = (
        f'{{"timestamp": {i}, "input_length": 10240, "output_length": 1, '
        f'"hash_ids": {list(range(20 * i, 20 * i + 20))}}}\n'
        for i in range(500)
    )
    trace.write_text("".join(lines))
    monkeypatch.setattr(memory, "available_bytes", lambda: 6 * MIB)
    monkeypatch.setattr(sweep, "usable_cpus", lambda: 4)  # --jobs 4 is taken as asked
    argv = ["sweep", "--trace", str(trace), "--gpu-blocks", "100", "--no-progress"]
    argv += ["--policies", "lru", "--thresholds", "0", "--cpu-blocks", "100,200,300,400"]
    assert main([*argv, "--jobs", "4"]) == 1
    err = one_line_error(capsys)
    assert f"error: --jobs 4: the trace {trace}, read again by each of 4 workers, would " in err
    assert err.endswith("; pass a smaller --jobs (with --jobs 1 the runs use the copy read here)\n")
    assert main([*argv, "--jobs", "1", "--json", "-"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4
