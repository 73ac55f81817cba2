"""What a run says about its disk tier: recovery counts (table, JSON, CSV, metrics), fit check."""

from __future__ import annotations

import csv
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.cli.main import main
from kvoffload.cli.tier_options import check_disk_fits
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.slot_file import SLOT_FILE, footprint, slot_stride

SIMULATE = ["simulate", "--requests", "20", "--gpu-blocks", "1500", "--cpu-blocks", "100"]
SIMULATE += ["--layout", "tiny", "--no-bound", "--no-progress", "--disk-blocks", "500"]


def run(disk: Path, result: Path, *extra: str) -> dict[str, int]:
    assert main([*SIMULATE, "--disk-dir", str(disk), "--json", str(result), *extra]) == 0
    entry: dict[str, int] = json.loads(result.read_text())["tiers"]["disk"]
    return entry


def break_one_slot(disk: Path) -> None:
    """Flip a byte in the header of the first slot holding a block."""
    [path] = disk.glob(f"*/{SLOT_FILE}")
    with open(path, "r+b") as file:
        file.seek(4096 + 10)  # slot 0, inside its header's fields
        byte = file.read(1)
        file.seek(4096 + 10)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_a_restart_reports_what_it_recovered_and_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    first = run(disk, tmp_path / "1.json")
    assert first["recovered"] == 0 and first["stored_blocks"] > 0
    second = run(disk, tmp_path / "2.json")
    assert second["recovered"] == first["stored_blocks"]  # 500 blocks hold all of them
    assert (second["dropped_torn"], second["dropped_foreign"], second["dropped_corrupt"]) == (
        0,
        0,
        0,
    )
    break_one_slot(disk)
    capsys.readouterr()
    assert main([*SIMULATE, "--disk-dir", str(disk), "--csv", str(tmp_path / "3.csv")]) == 0
    table = capsys.readouterr().out
    [row] = list(csv.DictReader((tmp_path / "3.csv").read_text().splitlines()))
    assert row["tiers.disk.dropped_corrupt"] == "1"
    recovered = int(row["tiers.disk.recovered"])
    assert recovered == second["recovered"] + second["stored_blocks"] - 1
    assert (
        f"on start: {recovered:,} blocks recovered, dropped 0 torn, 0 foreign, 1 corrupt, "
        "0 duplicate, 0 beyond capacity"
    ) in table


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


@pytest.fixture
def port() -> Iterator[int]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    yield free


def test_the_recovery_counts_are_metrics(tmp_path: Path, port: int) -> None:
    pytest.importorskip("prometheus_client")
    disk = tmp_path / "disk"
    first = run(disk, tmp_path / "1.json")
    break_one_slot(disk)
    result = tmp_path / "2.json"
    argv = [*SIMULATE, "--disk-dir", str(disk), "--json", str(result)]
    argv += ["--metrics-port", str(port), "--serve-after", "3"]
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(main(argv)))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not (result.exists() and result.stat().st_size):
            assert runner.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        metrics = scrape(port)
    finally:
        runner.join()
    assert codes == [0]
    assert metrics["kvoffload_tier_recovered_blocks{tier=disk}"] == first["stored_blocks"] - 1
    assert metrics["kvoffload_tier_dropped_blocks{reason=corrupt,tier=disk}"] == 1
    assert metrics["kvoffload_tier_dropped_blocks{reason=torn,tier=disk}"] == 0
    assert metrics["kvoffload_tier_dropped_blocks{reason=foreign,tier=disk}"] == 0
    assert metrics["kvoffload_tier_dropped_blocks{reason=duplicate,tier=disk}"] == 0
    assert metrics["kvoffload_tier_dropped_blocks{reason=beyond_capacity,tier=disk}"] == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: free space small and known (mounting needs root)."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1024k", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_the_fit_check_counts_slot_strides_against_free_space(small_fs: Path) -> None:
    """4 KiB payloads take 8 KiB slots: 100 fit in 1 MiB, 200 do not, though 200 * 4 KiB would."""
    payload = 4096
    assert slot_stride(payload) == 8192
    nowhere = small_fs / "absent"
    check_disk_fits(str(small_fs), 100, payload, nowhere)
    assert 200 * payload < 1024 * 1024 < footprint(200, payload)
    with pytest.raises(InvalidArgumentError) as error:
        check_disk_fits(str(small_fs / "new"), 200, payload, nowhere)
    message = str(error.value)
    assert "200 blocks takes 1.57 MiB (slots of 8 KiB)" in message and "MiB free" in message


def test_a_rerun_counts_its_own_earlier_file_as_room(small_fs: Path) -> None:
    payload = 4096
    fp = layout_fingerprint("fit", layout_preset("tiny"), payload)
    tier = DiskTier(small_fs, 100, fp)
    keys = [i.to_bytes(8, "big") for i in range(100)]
    tier.write(keys, [b"\x01" * payload] * 100)  # type: ignore[list-item]
    tier.poll(wait=True)
    tier.close()
    assert tier.stats.stored_blocks > 60
    reused = tier.path
    with pytest.raises(InvalidArgumentError):
        check_disk_fits(str(small_fs), 100, payload, small_fs / "another")
    check_disk_fits(str(small_fs), 100, payload, reused)  # the same tier, started again


def test_simulate_refuses_a_disk_tier_larger_than_the_free_space(
    small_fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tiny`` blocks are 4 KiB in 8 KiB slots: 200 of them need 1.57 MiB of a 1 MiB disk."""
    pytest.importorskip("torch")
    argv = ["simulate", "--requests", "5", "--gpu-blocks", "512", "--cpu-blocks", "32"]
    argv += ["--layout", "tiny", "--no-bound", "--no-progress", "--data-plane"]
    assert main([*argv, "--disk-dir", str(small_fs / "d"), "--disk-blocks", "200"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "free in the file system of --disk-dir" in err and "MiB" in err
