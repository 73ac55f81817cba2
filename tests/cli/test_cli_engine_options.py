"""Each engine-model and workload option of ``kvoffload simulate`` changes what it should."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main

BASE = ["simulate", "--requests", "80", "--seed", "5", "--no-progress", "--json", "-"]
SMALL_TIERS = ["--gpu-blocks", "900", "--cpu-blocks", "3000"]


def run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main([*BASE, *SMALL_TIERS, *extra]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_no_bound_skips_only_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with_bound = run(capsys)
    without = run(capsys, "--no-bound")
    assert with_bound["belady_total_hit_ratio"] >= with_bound["total_hit_ratio"]
    assert without["belady_total_hit_ratio"] is None
    assert without["total_hit_ratio"] == with_bound["total_hit_ratio"]


def test_throughputs_scale_the_modelled_times(capsys: pytest.CaptureFixture[str]) -> None:
    base = run(capsys, "--no-bound")
    fast = run(
        capsys,
        "--no-bound",
        "--prefill-tokens-per-s",
        "20000",
        "--decode-tokens-per-s",
        "100",
        "--transfer-gb-per-s",
        "50",
    )
    assert fast["prefill_seconds_baseline"] == pytest.approx(base["prefill_seconds_baseline"] / 2)
    assert fast["store_seconds"] == pytest.approx(base["store_seconds"] / 2)
    assert fast["total_hit_ratio"] == base["total_hit_ratio"]


def test_rate_and_block_size_shape_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    base = run(capsys, "--no-bound")
    spread = run(capsys, "--no-bound", "--rate", "0.5")
    assert spread["simulated_seconds"] > base["simulated_seconds"]
    coarse = run(capsys, "--no-bound", "--block-size", "32")
    assert coarse["block_tokens"] == 32
    assert coarse["refs"] < base["refs"]


def test_tiny_tracker_starves_the_reuse_filter(capsys: pytest.CaptureFixture[str]) -> None:
    roomy = run(capsys, "--no-bound", "--store-threshold", "2")
    starved = run(capsys, "--no-bound", "--store-threshold", "2", "--max-tracker-size", "1")
    assert starved["offload_blocks_written"] < roomy["offload_blocks_written"]
    assert starved["stores_skipped_by_admission"] > roomy["stores_skipped_by_admission"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate"], "it needs --store-threshold 2 or more"),
        (["simulate", "--store-threshold", "1"], "it needs --store-threshold 2 or more"),
        (["sweep", "--thresholds", "0,1"], "it needs a threshold of 2 or more in --thresholds"),
    ],
)
def test_a_tracker_size_without_a_store_filter_is_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It sizes the store filter's table alone: with no filter it was ignored, unsaid."""
    assert main([*args, "--requests", "20", "--no-progress", "--max-tracker-size", "9"]) == 1
    err = one_line_error(capsys)
    assert "--max-tracker-size sizes the store filter's reuse table: " + message in err


def test_a_sweep_with_one_filtered_threshold_takes_a_tracker_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its runs with a store filter get the size; those without have no table to size."""
    args = ["sweep", "--requests", "80", "--seed", "5", "--no-progress", "--json", "-"]
    args += [*SMALL_TIERS, "--thresholds", "0,2", "--policies", "lru", "--jobs", "1"]
    assert main(args) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert main([*args, "--max-tracker-size", "1"]) == 0
    starved = json.loads(capsys.readouterr().out)
    assert starved[0]["offload_blocks_written"] == roomy[0]["offload_blocks_written"]
    assert starved[1]["stores_skipped_by_admission"] > roomy[1]["stores_skipped_by_admission"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("--rate", "0"), ("--transfer-gb-per-s", "-1"), ("--max-tracker-size", "0")],
)
def test_bad_engine_options_are_one_line_errors(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, option, value]) == 2  # a bad command line: usage error status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvoffload: error:")


def test_partial_block_drop_on_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two identical 1,100-token prompts: 3 Mooncake blocks, the last one partial (76 tokens).
    record = '{"timestamp": %d, "input_length": 1100, "output_length": 1, "hash_ids": [7, 8, 9]}'
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(record % t for t in (0, 1000)) + "\n")
    argv = ["simulate", "--trace", str(trace), "--gpu-blocks", "4", "--cpu-blocks", "4"]
    reports = {}
    for mode in ("cache", "drop"):
        assert main([*argv, "--partial-block", mode, "--json", "-", "--no-progress"]) == 0
        reports[mode] = json.loads(capsys.readouterr().out)
    assert reports["cache"]["gpu_hit_blocks"] == 3 and reports["drop"]["gpu_hit_blocks"] == 2
    assert reports["cache"]["offload_blocks_written"] == 3
    assert reports["drop"]["offload_blocks_written"] == 2
    assert reports["drop"]["refs"] == reports["cache"]["refs"] == 6
    assert reports["drop"]["partial_block"] == "drop"


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_bandwidth_past_a_float_in_bytes_names_the_option(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's settings refused it as ``transfer_gb_per_s``, a name the operator never
    typed (and sweep only once the workload was built)."""
    argv = [command, "--requests", "5", "--no-progress", "--transfer-gb-per-s", "1e308"]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert err.startswith("kvoffload: error: --transfer-gb-per-s 1e+308: past what a float"), err
