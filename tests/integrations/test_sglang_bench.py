"""``kvoffload bench tiers --sglang``: its options, and one tiny run through the real SGLang
classes against the disk tier and real Valkey (figures present, bytes checked by the run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.main import main
from tier_servers import ValkeyProcess

TINY = ["bench", "tiers", "--blocks", "3", "--block-mib", "0.2", "--rounds", "1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sglang", "v3"], "unknown interface 'v3' (choose from v1, copy"),
        (["--sglang", ","], "unknown interface ','"),
        (["--sglang", "--fsync"], "--fsync is for the plain tier benchmark"),
    ],
)
def test_bad_sglang_options_stop_with_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY, *extra]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvoffload: error: bench tiers") and message in lines[0]


def test_sglang_rows_for_every_tier_shape_and_interface(
    sglang: Any,
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "bench.json"
    before = valkey_server.client().dbsize()  # the server is shared with other tests
    argv = [*TINY, "--sglang", "--dir", str(tmp_path), "--remote", valkey_server.url]
    assert main([*argv, "--json", str(path), "--progress"]) == 0
    rows = json.loads(path.read_text())["sglang"]
    combos = {(r["tier"], r["shape"], r["interface"]) for r in rows}
    assert len(rows) == len(combos) == 12
    for row in rows:
        for figure in ("store_gbps", "load_gbps", "plain_store_gbps", "plain_load_gbps"):
            assert row[figure] > 0
        assert row["store_ratio"] == pytest.approx(row["store_gbps"] / row["plain_store_gbps"])
        assert row["load_ratio_median"] == pytest.approx(row["load_ratio"])  # one round
    mha = next(r for r in rows if r["shape"] == "MHA layer_first")
    assert mha["page_bytes"] == 2 * (2 * 32 * 8 * 128 * 2)  # 0.2 MiB: 2 layers of 128 KiB
    captured = capsys.readouterr()
    # Each row as it starts, then the end; a log file gets a line every tenth of the way.
    done = [int(line.split()[4].removesuffix("/12")) for line in captured.err.splitlines()]
    assert done[0] == 0 and done[-1] == 12 and done == sorted(set(done)) and len(done) == 11
    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["tier", "shape", "interface"] and len(lines) == 2 + 12 + 1
    assert lines[-1].startswith("3 pages per batch; plain: disk, the same tier")
    assert "remote, pipelined SET / GET of the same bytes on a plain socket" in lines[-1]
    assert list(tmp_path.iterdir()) == [path]  # scratch removed
    assert valkey_server.client().dbsize() == before  # the backend cleared its pages


def test_reads_beside_backups_gives_each_phases_figures(tmp_path: Path) -> None:
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    from kvoffload.integrations.sglang.bench import measure_reads_beside_backups

    out = measure_reads_beside_backups(
        str(tmp_path), page_mib=0.125, read_pages=2, backup_pages=4, reads=5, rounds=1
    )
    for phase in ("alone", "beside_backups"):
        assert 0 < out[f"{phase}_p50_ms"] <= out[f"{phase}_p99_ms"]
        assert out[f"{phase}_misses"] >= 0
    assert out["backup_pages_per_s"] > 0 and out["page_bytes"] == 128 * 1024
    assert list(tmp_path.iterdir()) == []  # its scratch directory went with it


def test_sglang_rows_show_slow_rates_in_figures_not_zeros() -> None:
    """A tier at a few MB/s (a disk synced each batch) read "0.00" GB/s in the table beside
    the ratio of it the JSON held, as ``bench tiers`` did."""
    from kvoffload.integrations.sglang.bench import table_rows

    figures = {
        "store_gbps": 0.0034,
        "plain_store_gbps": 0.028,
        "store_ratio": 0.12,
        "store_ratio_median": 0.125,
        "load_gbps": 1.5,
        "plain_load_gbps": 1.6,
        "load_ratio": 0.94,
        "load_ratio_median": 0.93,
    }
    row = {"tier": "disk", "shape": "mha", "interface": "v1", "page_bytes": 4096, **figures}
    _, rows, _ = table_rows({"sglang": [row], "rounds": 3, "pages": 8})
    assert rows == [
        [
            "disk",
            "mha",
            "v1",
            "4",
            "0.0034",
            "0.028",
            "0.12",
            "0.12",
            "1.50",
            "1.60",
            "0.94",
            "0.93",
        ]
    ]
