"""The disk tier's deadline is settable: ``--disk-timeout-ms`` on ``simulate``, ``sweep``
and ``bench tiers``, ``kvoffload.disk_timeout_ms`` in vLLM's extra config. A bad value is
one line; a good one reaches the tier that the run opens (a real one, recorded as built).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.vllm.settings import DISK_TIMEOUT_KEY, parse_settings
from kvoffload.tiers import DiskTier, bench, stack
from kvoffload.tiers.disk import DEFAULT_TIMEOUT_MS, check_timeout_ms

SIMULATE = ["simulate", "--requests", "4", "--no-bound", "--no-progress"]
BAD = ["0", "0.5", "1e-300", "-5", "abc", "nan", "inf", "600001", "1e9"]


class Recorded(DiskTier):
    """A real disk tier that remembers the deadline each instance was given."""

    deadlines: ClassVar[list[float]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Recorded.deadlines.append(kwargs["deadline_s"])


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    Recorded.deadlines = []
    monkeypatch.setattr(stack, "DiskTier", Recorded)
    monkeypatch.setattr(bench, "DiskTier", Recorded)
    return Recorded.deadlines


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("command", [SIMULATE, ["bench", "tiers"], ["sweep"]])
def test_a_bad_disk_timeout_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str], value: str
) -> None:
    argv = [*command, "--disk-timeout-ms", value]
    if command is SIMULATE:
        argv += ["--disk-dir", str(tmp_path), "--disk-blocks", "8"]
    line = one_line_error(capsys, argv)
    assert "--disk-timeout-ms" in line and "milliseconds from 1 to 600000" in line
    assert value in line


def test_a_disk_timeout_without_a_disk_tier_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = one_line_error(capsys, [*SIMULATE, "--disk-timeout-ms", "500"])
    assert "--disk-timeout-ms needs --disk-dir" in line


@pytest.mark.parametrize(("given", "seconds"), [([], DEFAULT_TIMEOUT_MS / 1000), (["250"], 0.25)])
def test_simulate_opens_its_disk_tier_with_the_timeout(
    tmp_path: Path, recorded: list[float], given: list[str], seconds: float
) -> None:
    output = tmp_path / "run.json"
    argv = [*SIMULATE, "--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "16"]
    argv += ["--json", str(output)]
    if given:
        argv += ["--disk-timeout-ms", *given]
    assert main(argv) == 0
    assert recorded == [seconds]
    assert json.loads(output.read_text())["tiers"]["disk"]["failed"] == 0


def test_bench_tiers_opens_its_disk_tiers_with_the_timeout(
    tmp_path: Path, recorded: list[float], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "tiers", "--blocks", "2", "--block-mib", "0.01", "--rounds", "2"]
    argv += ["--dir", str(tmp_path), "--disk-timeout-ms", "1500", "--json", "-"]
    assert main(argv) == 0
    assert recorded == [1.5, 1.5]
    assert json.loads(capsys.readouterr().out)["disk_store_gbps"] > 0


@pytest.mark.parametrize(("value", "expected"), [(250, 250.0), ("2500", 2500.0), (1.5, 1.5)])
def test_the_vllm_key_takes_numbers_and_numeric_strings(value: object, expected: float) -> None:
    extra = {"cpu_bytes_to_use": 4096, "kvoffload.disk_dir": "/tmp/x"}
    extra |= {"kvoffload.disk_bytes": 1 << 20, DISK_TIMEOUT_KEY: value}
    assert parse_settings(extra).disk_timeout_ms == expected


@pytest.mark.parametrize(
    "value", [0, 0.5, 1e-300, -1, "abc", float("nan"), float("inf"), 600_001, True, None]
)
def test_a_bad_vllm_key_is_refused_naming_it(value: object) -> None:
    extra = {"cpu_bytes_to_use": 4096, "kvoffload.disk_dir": "/tmp/x"}
    extra |= {"kvoffload.disk_bytes": 1 << 20, DISK_TIMEOUT_KEY: value}
    with pytest.raises(InvalidArgumentError, match=r"'kvoffload\.disk_timeout_ms' must be"):
        parse_settings(extra)


def test_the_vllm_key_needs_the_disk_tier() -> None:
    with pytest.raises(InvalidArgumentError, match=r"disk_timeout_ms' needs the disk tier"):
        parse_settings({"cpu_bytes_to_use": 4096, DISK_TIMEOUT_KEY: 500})
    assert parse_settings({"cpu_bytes_to_use": 4096}).disk_timeout_ms == DEFAULT_TIMEOUT_MS


def test_the_check_is_the_tier_s_own() -> None:
    assert check_timeout_ms(600_000, "x") == 600_000.0
    with pytest.raises(InvalidArgumentError, match="x must be a number of milliseconds"):
        check_timeout_ms("", "x")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), 600_001.0])
def test_a_library_caller_gets_the_same_check(tmp_path: Path, value: float) -> None:
    """``SimConfig`` (the simulator's API) refuses what the CLI refuses."""
    from kvoffload.sim.run import SimConfig

    with pytest.raises(InvalidArgumentError, match="the disk timeout must be a number"):
        SimConfig(
            gpu_blocks=16,
            cpu_blocks=32,
            disk_dir=str(tmp_path),
            disk_blocks=8,
            disk_timeout_ms=value,
        )
    assert SimConfig(gpu_blocks=16, cpu_blocks=32, disk_timeout_ms=value).disk_dir is None
