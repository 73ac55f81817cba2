"""Wiring of the data-plane commands: real runs when the data plane is installed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main
from kvoffload.core import memory
from kvoffload.core.layout import KVLayout, layout_preset
from kvoffload.sim.transfers import NullTransferBackend


def test_data_plane_simulation_verifies_every_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kvoffload.sim.dataplane_backend")
    out = tmp_path / "run.json"
    args = ["simulate", "--data-plane", "--requests", "60", "--seed", "2", "--no-progress"]
    args += ["--gpu-blocks", "1200", "--cpu-blocks", "2400", "--concurrency", "4"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mismatched_blocks"] == 0
    assert report["verified_blocks"] == report["offload_blocks_read"] > 0
    assert "data plane" in capsys.readouterr().out


def test_bench_transfer_registers_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kvoffload.dataplane.bench")
    assert main(["bench", "transfer", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


def test_bench_transfer_shows_progress_on_stderr_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Seconds at its defaults, minutes with bigger options, and nothing was shown."""
    pytest.importorskip("kvoffload.dataplane.bench")
    argv = ["bench", "transfer", "--layout", "tiny", "--gpu-blocks", "8", "--cpu-blocks", "8"]
    argv += ["--rounds", "2", "--json", "-"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # stderr is no terminal: no bar unless asked
    assert main([*argv, "--progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rounds"] == 2  # stdout holds the JSON alone
    lines = captured.err.splitlines()
    assert all(line.startswith("bench transfer [") for line in lines)
    assert [line.split()[3] for line in lines] == ["0/3", "1/3", "2/3", "3/3"]  # warm-up too


def test_missing_data_plane_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = importlib.import_module

    def without_data_plane(name: str, package: str | None = None) -> object:
        if name.startswith(("kvoffload.dataplane", "kvoffload.sim.dataplane_backend")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", without_data_plane)
    assert main(["bench", "transfer"]) == 1
    assert main(["simulate", "--data-plane", "--requests", "20"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert all("data plane" in line and "not installed" in line for line in err)


class FakeDataPlane(NullTransferBackend):
    """Stands in for the data plane's backend: records how it was built, reports counters."""

    built: ClassVar[list[tuple[KVLayout, int, int, str]]] = []
    mismatched: ClassVar[int] = 0

    def __init__(self, layout: KVLayout, num_gpu: int, num_cpu: int, device: str = "cpu") -> None:
        self.built.append((layout, num_gpu, num_cpu, device))
        self.verified_blocks = 7
        self.mismatched_blocks = self.mismatched
        self.failed_jobs = 0


@pytest.fixture
def fake_data_plane(monkeypatch: pytest.MonkeyPatch) -> type[FakeDataPlane]:
    module = types.ModuleType("kvoffload.sim.dataplane_backend")
    module.DataPlaneBackend = FakeDataPlane  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvoffload.sim.dataplane_backend", module)
    FakeDataPlane.built = []
    FakeDataPlane.mismatched = 0
    return FakeDataPlane


def test_data_plane_wiring(
    fake_data_plane: type[FakeDataPlane], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--data-plane", "--requests", "40", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["verified_blocks"], report["mismatched_blocks"]) == (7, 0)
    layout, num_gpu, num_cpu, device = fake_data_plane.built[0]
    assert layout == layout_preset("tiny").with_block_size(16)
    assert (num_gpu, num_cpu, device) == (12288, 49152, "cpu")  # the default model's counts
    assert (report["gpu_blocks"], report["cpu_blocks"]) == (num_gpu, num_cpu)


def test_data_plane_mismatch_fails_the_run(
    fake_data_plane: type[FakeDataPlane], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_data_plane.mismatched = 3
    assert main(["simulate", "--data-plane", "--requests", "40", "--gpu-blocks", "3000"]) == 1
    captured = capsys.readouterr()
    assert "3 mismatched" in captured.out
    assert captured.err.startswith("kvoffload: error: data plane: 3 loaded blocks")


@pytest.mark.parametrize("size", [["--cpu-blocks", "0"], ["--cpu-gb", "0"]])
def test_data_plane_without_an_offload_tier_names_the_option(
    size: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The error once came from deep in the data plane: "num_blocks must be >= 1, got 0"."""
    args = ["simulate", "--data-plane", "--requests", "10", "--no-bound", "--no-progress"]
    assert main([*args, *size]) == 1
    message = f"--data-plane moves bytes to an offload tier, and {' '.join(size)} leaves none"
    assert message in one_line_error(capsys)


DATA_PLANE = ["simulate", "--data-plane", "--requests", "10", "--no-bound", "--no-progress"]


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (
            ["--cpu-blocks", str(2**40)],
            f"--cpu-blocks {2**40} with --data-plane (a CPU block store of 1,099,511,627,776 "
            "blocks of 4 KiB) would need about ",
        ),
        (["--cpu-gb", "1e6"], "--cpu-gb 1e+06 with --data-plane (a CPU block store of "),
    ],
)
def test_a_data_plane_tier_beyond_memory_names_the_option(
    size: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The allocation's error named only its buffer: "cannot allocate 4194304.0 GiB for
    the CPU block store on cpu"."""
    pytest.importorskip("kvoffload.sim.dataplane_backend")
    assert main([*DATA_PLANE, *size]) == 1
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            ["--gpu-blocks", "300000", "--cpu-blocks", "10"],
            "--gpu-blocks 300000 with --data-plane (a paged KV cache of 300,000 blocks of "
            "4 KiB on the CPU) would need about 1.1 GiB of memory, more than the 1.0 GiB",
        ),
        (
            ["--gpu-blocks", "200000", "--cpu-blocks", "200000"],
            "--gpu-blocks 200000 and --cpu-blocks 200000 with --data-plane (a paged KV cache "
            "of 200,000 blocks of 4 KiB on the CPU, and a CPU block store of 200,000 blocks",
        ),
        (
            ["--layout", "llama-3.1-8b"],
            "the default offload tier with --data-plane (a CPU block store of 49,152 blocks "
            "of 2 MiB) would need about 96.0 GiB",
        ),
    ],
)
def test_data_plane_buffers_beyond_memory_are_refused_naming_their_options(
    sizes: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Buffers past memory were allocated anyway (the CPU block store is not touched until
    stored to) or refused by torch naming no option."""
    pytest.importorskip("kvoffload.sim.dataplane_backend")
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**30)
    assert main([*DATA_PLANE, *sizes]) == 1
    assert message in one_line_error(capsys)


def test_an_unknown_data_plane_device_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kvoffload.sim.dataplane_backend")
    assert main([*DATA_PLANE, "--device", "gpu0"]) == 1
    assert one_line_error(capsys).startswith("kvoffload: error: --device gpu0: unknown device")


def _bad_trace(tmp_path: Path) -> Path:
    """A trace whose first line is not JSON: an error about it means it was read."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    return trace


def test_a_data_plane_without_torch_is_refused_before_the_workload(tmp_path: Path) -> None:
    """The trace was read first (minutes, for a large one), then torch was found missing."""
    code = (  # torch not installed, as where the extra was left out
        "import sys; sys.modules['torch'] = None; "
        "from kvoffload.cli.main import main; sys.exit(main())"
    )
    argv = ["simulate", "--trace", str(_bad_trace(tmp_path)), "--data-plane", "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "kvoffload: error: --data-plane needs torch; install it with: "
        "pip install 'kvoffload[torch]'\n"
    )


def test_a_data_plane_device_is_checked_before_the_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device cuda`` on a machine without CUDA was refused only once the trace was read."""
    pytest.importorskip("kvoffload.sim.dataplane_backend")
    argv = ["simulate", "--trace", str(_bad_trace(tmp_path)), "--data-plane", "--no-progress"]
    assert main([*argv, "--device", "gpu0"]) == 1
    assert one_line_error(capsys).startswith("kvoffload: error: --device gpu0: unknown device")


TRANSFER_RESULTS = {
    "layout": "llama-3.1-8b",
    "device": "cpu",
    "threads": 2,
    "block_bytes": 2_097_152,
    "block_size_factor": 2,
    "bytes_per_job": 67_108_864,
    "jobs_per_round": 4,
    "rounds": 5,
    "store_gbps": 3.152,
    "load_gbps": 3.301,
    "copy_gbps": 3.22,
    "store_vs_copy": 0.979,
    "load_vs_copy": 1.025,
}


def test_bench_transfer_shows_sizes_and_rates_in_words_and_units(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its table was the JSON's keys and bare numbers (``bytes_per_job  67108864``,
    ``store_vs_copy  0.979``), where ``bench tiers`` shows units and words."""
    transfer = pytest.importorskip("kvoffload.dataplane.bench")
    extra = {**TRANSFER_RESULTS, "verified_jobs": 20}
    monkeypatch.setattr(transfer, "run_from_args", lambda args, progress: extra)
    assert main(["bench", "transfer"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "layout           llama-3.1-8b, 2 MiB per GPU block",
        "device           cpu, 2 torch threads",
        "offloaded block  4 MiB (2 GPU blocks)",
        "job              64 MiB (16 blocks), 4 per round",
        "rounds           median of 5, after one warm-up round",
        "store            3.152 GB/s, 0.979 of a plain copy's",
        "load             3.301 GB/s, 1.025 of a plain copy's",
        "plain copy       3.220 GB/s",
        "verified_jobs    20",
    ]
    unknown = {"store_gbps": 1.5}  # another benchmark's figures: each as it is named
    monkeypatch.setattr(transfer, "run_from_args", lambda args, progress: unknown)
    assert main(["bench", "transfer"]) == 0
    assert capsys.readouterr().out == "store_gbps  1.5\n"
