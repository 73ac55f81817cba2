"""``kvoffload simulate`` end to end through ``main``: table, JSON, CSV and capacity options."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli import output
from kvoffload.cli.main import main
from kvoffload.sim import tier_model

SMALL = ["simulate", "--requests", "120", "--seed", "3", "--no-progress"]
REQUIRED = [
    "total_hit_ratio",
    "offload_hit_ratio",
    "writes_per_ref",
    "belady_total_hit_ratio",
    "refs",
    "refs_per_second",
]


def test_table_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, csv_path = tmp_path / "run.json", tmp_path / "run.csv"
    assert main([*SMALL, "--json", str(json_path), "--csv", str(csv_path)]) == 0
    table = capsys.readouterr().out
    assert "total hit ratio" in table and "Belady bound" in table
    report = json.loads(json_path.read_text())
    assert all(name in report for name in REQUIRED)
    assert report["requests"] == 120
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    assert len(rows) == 1
    assert float(rows[0]["total_hit_ratio"]) == pytest.approx(report["total_hit_ratio"])


def test_json_to_stdout_replaces_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--json", "-", "--progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["refs"] > 0
    assert "simulate [" in captured.err  # the bar goes to stderr only


def test_no_offload_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--cpu-blocks", "0", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cpu_blocks"] == report["offload_hit_ratio"] == report["writes_per_ref"] == 0


def test_capacities_in_gib_follow_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--gpu-gb", "4", "--cpu-gb", "10", "--layout", "llama-3.2-1b", "--json", "-"]
    assert main([*SMALL, *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_per_block"] == 512 * 2**10  # 16 layers x 8 heads x 64 x 2 x 2 x 16
    assert (report["gpu_blocks"], report["cpu_blocks"]) == (8192, 20480)


def test_sizes_just_under_the_next_unit_are_not_in_exponent_notation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """From 999.5 to 1023.9 of a unit, three significant digits printed as "1e+03 GiB"."""
    assert main([*SMALL, "--cpu-gb", "1000", "--no-bound"]) == 0
    assert "1,000 GiB (512,000 blocks)" in capsys.readouterr().out
    assert output.size(999.5 * 2**30) == "1,000 GiB"
    assert output.size(1023.9 * 2**10) == "1 MiB"  # as the plots' titles show it
    assert output.size(999.4 * 2**20) == "999 MiB"


def test_sizes_go_on_to_pib_and_eib() -> None:
    """Sizes stopped at TiB: 3 PiB read "3,072.0 TiB", 2**70 bytes "1,073,741,824.0 TiB"."""
    assert output.size(1.5 * 2**40) == "1.5 TiB"
    assert output.size(3 * 2**50) == "3 PiB"
    assert output.size(-3 * 2**50) == "-3 PiB"
    assert output.size(5 * 2**60) == "5 EiB"
    assert output.size(2**70) == "1,024 EiB"
    assert output.size(1e30) == "8.67e+11 EiB"  # not every digit of a count gone wrong


def test_a_table_of_no_rows_is_its_header() -> None:
    """A column's width was the max of its header and its cells: with no cells, a TypeError."""
    assert output.column_table(["policy", "hit"], []) == "policy  hit\n------  ---"


def test_trace_with_policy_threshold_and_concurrency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {
            "timestamp": 10 * i,
            "input_length": 1024,
            "output_length": 2,
            "hash_ids": [i % 3, 100 + i],
        }
        for i in range(30)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--trace", str(trace), "--gpu-blocks", "4", "--cpu-blocks", "8", "--policy", "arc"]
    args += ["--store-threshold", "2", "--concurrency", "4", "--json", "-", "--no-progress"]
    assert main(["simulate", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["refs"], report["block_tokens"], report["policy"]) == (60, 512, "arc")
    assert (report["store_threshold"], report["concurrency"]) == (2, 4)
    assert report["stores_skipped_by_admission"] > 0


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvoffload", "simulate", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert "--cpu-gb" in result.stdout


def test_the_disk_model_options_default_and_apply_with_a_disk_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given without a disk tier they are refused, so their defaults are resolved only here."""

    def disk_seconds(run: str, *model: str) -> tuple[float, float]:
        args = ["simulate", "--requests", "200", "--no-progress", "--no-bound"]
        args += ["--gpu-blocks", "1500", "--cpu-blocks", "300", "--disk-blocks", "3000"]
        args += ["--disk-dir", str(tmp_path / run)]
        assert main([*args, *model, "--json", "-"]) == 0
        disk = json.loads(capsys.readouterr().out)["tiers"]["disk"]
        return disk["read_seconds"], disk["write_seconds"]

    defaults = ["--disk-gb-per-s", str(tier_model.DISK_GB_PER_S)]
    defaults += ["--disk-latency-ms", str(tier_model.DISK_LATENCY_MS)]
    assert disk_seconds("a") == disk_seconds("b", *defaults)
    slow = disk_seconds("c", "--disk-gb-per-s", "0.001", "--disk-latency-ms", "50")
    modelled = disk_seconds("d")
    assert all(given > 100 * default > 0 for given, default in zip(slow, modelled, strict=True))


TRACE_RECORDS = {
    "mooncake": '{"timestamp": 0, "input_length": 1024, "output_length": 9, "hash_ids": [0, 1]}',
    "lmbench": '{"timestamp": "1718000000000000001", "input_length": 1024, "output_length": 9, '
    '"hash_ids": [0, 1]}',
    "qwen": '{"chat_id": 7, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, '
    '"output_length": 12, "type": "text", "turn": 1, "hash_ids": [10, 11]}',
}


@pytest.mark.parametrize("trace_format", sorted(TRACE_RECORDS))
def test_the_report_names_the_trace_format_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace_format: str
) -> None:
    """Read as the format detected (no --format given): the table's workload line and a
    JSON key of its own say which, and ``workload`` stays the file's name."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE_RECORDS[trace_format] + "\n")
    json_path = tmp_path / "run.json"
    assert main(["simulate", "--trace", str(trace), "--no-progress", "--json", str(json_path)]) == 0
    table = capsys.readouterr().out
    assert f"workload               trace.jsonl ({trace_format} trace)\n" in table
    report = json.loads(json_path.read_text())
    assert (report["workload"], report["trace_format"]) == ("trace.jsonl", trace_format)


def test_a_synthetic_workload_has_no_trace_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "run.json"
    assert main([*SMALL, "--no-bound", "--json", str(json_path)]) == 0
    assert "trace)" not in capsys.readouterr().out
    assert json.loads(json_path.read_text())["trace_format"] is None


def test_a_trace_read_through_a_pipe_is_named_a_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trace <(cat t.jsonl)`` reads ``/dev/fd/63``: its workload was named "63"."""
    read_end, write_end = os.pipe()
    os.write(write_end, (TRACE_RECORDS["mooncake"] + "\n").encode())
    os.close(write_end)
    json_path = tmp_path / "run.json"
    try:
        trace = f"/dev/fd/{read_end}"
        assert main(["simulate", "--trace", trace, "--no-progress", "--json", str(json_path)]) == 0
    finally:
        os.close(read_end)
    assert f"workload               pipe {trace} (mooncake trace)\n" in capsys.readouterr().out
    assert json.loads(json_path.read_text())["workload"] == f"pipe {trace}"


def test_a_file_opened_on_a_descriptor_keeps_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trace /dev/fd/3 3<trace.jsonl``: the descriptor holds a named file."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE_RECORDS["mooncake"] + "\n")
    with trace.open() as opened:
        assert (
            main(["simulate", "--trace", f"/proc/self/fd/{opened.fileno()}", "--no-progress"]) == 0
        )
    assert "workload               trace.jsonl (mooncake trace)\n" in capsys.readouterr().out


def test_one_request_one_ref_and_a_one_token_block_are_singular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n')
    argv = ["simulate", "--trace", str(trace), "--block-size", "1", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  1 request, 1 block ref, 1 unique block of 1 token\n" in out
    argv += ["--gpu-blocks", "1", "--cpu-blocks", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(1 block)\n" in out, "the GPU prefix cache's row"
    assert "(1 block), lru," in out, "the offload tier's row"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n'
        '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
    )
    assert main(argv) == 0
    assert "offload evictions      1 block\n" in capsys.readouterr().out
    assert main([*SMALL, "--no-bound"]) == 0  # many of each stay plural
    assert " 120 requests, " in capsys.readouterr().out
