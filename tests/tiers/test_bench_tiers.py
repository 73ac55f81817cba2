"""``kvoffload bench tiers`` end to end, tiny sizes: every figure present and positive."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.tiers.bench import measure_tiers
from tier_servers import FakeValkey, ValkeyClusterProcesses, ValkeyProcess


def test_bench_tiers_reports_both_tiers_beside_their_baselines(
    tmp_path: Path, valkey_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "tiers", "--blocks", "8", "--block-mib", "0.25", "--rounds", "1"]
    argv += ["--dir", str(tmp_path), "--remote", valkey_server.url, "--json", str(path)]
    assert main(argv) == 0
    results = json.loads(path.read_text())
    for tier in ("disk", "remote"):
        for figure in ("store_gbps", "load_gbps", "plain_write_gbps", "plain_read_gbps"):
            assert results[f"{tier}_{figure}"] > 0
        assert results[f"{tier}_store_ratio"] == pytest.approx(
            results[f"{tier}_store_gbps"] / results[f"{tier}_plain_write_gbps"]
        )
    lines = capsys.readouterr().out.splitlines()
    figures = ["GB/s", "plain", "ratio", "median"]
    assert lines[0].split() == ["tier", "store", *figures, "load", *figures]
    for row, tier in zip(lines[2:4], ("disk", "remote"), strict=True):
        cells = row.split()
        assert cells[0] == tier
        for cell, figure in zip(cells[3:5], ("store_ratio", "store_ratio_median"), strict=True):
            assert float(cell) == pytest.approx(results[f"{tier}_{figure}"], abs=0.006)
    # One round: its own ratio is the ratio of the best rates.
    assert results["remote_load_ratio_median"] == pytest.approx(results["remote_load_ratio"])
    assert lines[4].startswith("8 blocks of ")
    assert list(tmp_path.iterdir()) == [path]  # scratch files removed
    assert valkey_server.client().keys("kvoffload-bench:*") == []


@pytest.mark.parametrize(
    ("blocks", "block_mib", "rounds"), [(0, 1.0, 1), (1, float("nan"), 1), (1, 1.0, 0)]
)
def test_measure_tiers_rejects_bad_sizes(blocks: int, block_mib: float, rounds: int) -> None:
    with pytest.raises(InvalidArgumentError, match="blocks and rounds must be >= 1"):
        measure_tiers(blocks, block_mib, rounds)


def test_bench_tiers_with_fsync_syncs_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "tiers", "--blocks", "4", "--block-mib", "0.25", "--rounds", "1", "--fsync"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["fsync"] is True and results["disk_store_gbps"] > 0
    assert "remote_store_gbps" not in results
    assert capsys.readouterr().out.splitlines()[-1].endswith("; synced to disk")
    assert list(tmp_path.iterdir()) == [path]


def test_bench_tiers_shows_progress_on_stderr_when_asked(
    tmp_path: Path, valkey_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "tiers", "--blocks", "4", "--block-mib", "0.25", "--rounds", "2"]
    argv += ["--dir", str(tmp_path), "--remote", valkey_server.url, "--json", "-"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal: no bar unless asked
    assert main([*argv, "--progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["remote_store_gbps"] > 0  # stdout holds the JSON alone
    lines = captured.err.splitlines()
    # A plain and a tier half of each round, on each tier, from the start.
    counts = [line.split()[3] for line in lines]
    assert counts == [f"{done}/8" for done in range(9)]
    assert all(line.startswith("bench tiers [") for line in lines)


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_block_too_small_to_hold_a_block_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "tiers", "--blocks", "4", "--block-mib", "0.000001", "--dir", str(tmp_path)]
    assert main(argv) == 1
    assert "--block-mib 1e-06 is a block of 1 bytes: at least 1024" in one_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("die_after", "message"),
    [
        (9, "is not reachable"),  # during the check before the run
        (12, "bench tiers: the server at"),  # as the raw-socket baseline opens its socket
        (16, "failed mid-run"),  # during the raw-socket baseline's loads
        (40, "bench tiers: the shared tier lost 8 of 8 blocks"),  # during the tier's stores
    ],
)
def test_a_server_dying_mid_bench_is_one_line_and_no_scratch_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], die_after: int, message: str
) -> None:
    server = FakeValkey(die_after=die_after)
    try:
        argv = ["bench", "tiers", "--blocks", "8", "--block-mib", "0.01", "--rounds", "1"]
        assert main([*argv, "--dir", str(tmp_path), "--remote", server.url]) == 1
    finally:
        server.stop()
    line = one_line(capsys)
    assert line.startswith("kvoffload: error: ") and message in line
    assert list(tmp_path.iterdir()) == []


def test_sigterm_ends_bench_tiers_and_removes_its_scratch_directories(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kvoffload", "bench", "tiers", "--blocks", "16"]
    argv += ["--block-mib", "1", "--rounds", "100000", "--dir", str(tmp_path)]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130 and err.strip() == "kvoffload: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_the_moment_the_scratch_directory_exists_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM lands as KeyboardInterrupt wherever the main thread is, also just after the
    scratch directory is made: it is removed all the same (it used to be made, and named,
    before the ``try`` that removes it)."""
    made = Path.mkdir

    def mkdir_then_interrupt(self: Path, *args: object, **kwargs: object) -> None:
        made(self, *args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        measure_tiers(4, 0.01, 1, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_bench_tiers_against_a_cluster_measures_a_raw_socket_per_node(
    tmp_path: Path, valkey_cluster: ValkeyClusterProcesses
) -> None:
    path = tmp_path / "bench.json"
    argv = ["bench", "tiers", "--blocks", "12", "--block-mib", "0.05", "--rounds", "2"]
    argv += ["--dir", str(tmp_path), "--remote", valkey_cluster.url, "--json", str(path)]
    assert main(argv) == 0
    results = json.loads(path.read_text())
    assert results["remote_plain_read_gbps"] > 0 and results["remote_load_gbps"] > 0
    for node in valkey_cluster.nodes:
        assert node.client().keys("kvoffload-bench:*") == []
