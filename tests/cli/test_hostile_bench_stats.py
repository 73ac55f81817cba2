"""``bench tiers`` and ``trace-stats`` refuse bad numbers on one line, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.bench import tier_table
from kvoffload.cli.main import main

MOONCAKE_LIKE = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-mib", "nan"], "--block-mib: must be a finite number"),
        (["--block-mib", "0"], "--block-mib: must be > 0"),
        (["--blocks", "0"], "--blocks: must be >= 1"),
        (["--blocks", "2.5"], "--blocks: expected an integer"),
        (["--rounds", "-1"], "--rounds: must be >= 1"),
    ],
)
def test_bench_tiers_bad_numbers_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "tiers", *args]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["--blocks-per-job", "0"], "--blocks-per-job: must be >= 1"),
        (["--gpu-blocks", "x"], "--gpu-blocks: expected an integer"),
    ],
)
def test_bench_transfer_bad_numbers_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seed -1`` once reached numpy and ended in its traceback."""
    pytest.importorskip("torch")
    assert main(["bench", "transfer", *args]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("where", "message"),
    [("a-file", "not an existing directory"), ("no/such", "not an existing directory")],
)
def test_bench_tiers_dir_must_be_an_existing_directory(
    where: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error named neither --dir nor the directory given, but the scratch directory
    made in it: "Not a directory: .../a-file/kvoffload-bench-8f96c8a9c3f1f116"."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / where
    assert main(["bench", "tiers", "--blocks", "2", "--rounds", "1", "--dir", str(path)]) == 1
    assert one_line_error(capsys) == f"kvoffload: error: --dir {path}: {message}\n"


@pytest.mark.parametrize(
    ("sglang", "what"), [([], "100000000 blocks"), (["--sglang"], "100000000 SGLang pages")]
)
def test_bench_tiers_larger_than_memory_is_refused_before_allocating(
    sglang: list[str], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error named the benchmark's figures, not the options that set them."""
    if sglang:
        pytest.importorskip("kvoffload.integrations.sglang.bench")
    args = ["bench", "tiers", "--blocks", "100000000", "--block-mib", "1000", *sglang]
    assert main(args) == 1
    message = f"error: --blocks 100000000 --block-mib 1000: {what} of 1000 MiB would need about "
    assert message in one_line_error(capsys)


def test_bench_tiers_block_below_the_least_names_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was "a block of 0.0001 MiB is 104 bytes: ...", naming no option."""
    assert main(["bench", "tiers", "--block-mib", "0.0001"]) == 1
    message = "error: --block-mib 0.0001 is a block of 104 bytes: at least 1024 (0.000976562 MiB)"
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--fsync"], "--fsync is for the plain tier benchmark; --sglang measures"),
        (["--disk-timeout-ms", "5"], "--disk-timeout-ms is for the plain tier benchmark"),
    ],
)
def test_bench_tiers_sglang_refuses_the_plain_benchmarks_disk_options(
    option: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--disk-timeout-ms was ignored with --sglang, unsaid: the backend ran its default."""
    argv = ["bench", "tiers", "--sglang", "v1", "--blocks", "2", "--rounds", "1", "--no-progress"]
    assert main([*argv, "--dir", str(tmp_path), *option]) == 1
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("value", ["1e-300", "0.0625"])
def test_bench_tiers_sglang_pages_of_no_layer_are_refused_naming_the_option(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They ran at one layer a page (128 KiB, 36 KiB for MLA), whatever was asked for."""
    pytest.importorskip("kvoffload.integrations.sglang.bench")
    argv = ["bench", "tiers", "--sglang", "v1", "--blocks", "2", "--rounds", "1"]
    assert main([*argv, "--dir", str(tmp_path), "--block-mib", value, "--no-progress"]) == 1
    assert one_line_error(capsys) == (
        f"kvoffload: error: --block-mib {value}: pages of {value} MiB round to no layer of "
        "128 KiB (an MHA page's): give more than 0.0625 MiB\n"
    )


@pytest.mark.parametrize(
    ("value", "message"), [("0", "must be >= 1"), ("x", "expected an integer")]
)
def test_trace_stats_bad_block_size_is_a_usage_error(
    value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(MOONCAKE_LIKE + "\n")
    assert main(["trace-stats", str(trace), "--block-size", value]) == 2
    assert f"--block-size: {message}" in one_line_error(capsys)


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the benchmark ran before its --json was checked")


def test_bench_json_is_checked_before_the_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unwritable --json once failed only after the whole benchmark had run."""
    import kvoffload.tiers.bench

    monkeypatch.setattr(kvoffload.tiers.bench, "measure_tiers", _never)
    assert main(["bench", "tiers", "--json", "/nonexistent/x.json"]) == 1
    assert "--json /nonexistent/x.json: no such directory" in one_line_error(capsys)
    transfer = pytest.importorskip("kvoffload.dataplane.bench")
    monkeypatch.setattr(transfer, "run_from_args", _never)
    assert main(["bench", "transfer", "--json", "/nonexistent/x.json"]) == 1
    assert "--json /nonexistent/x.json: no such directory" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:1/0", "--remote: remote tier redis://127.0.0.1:1/0 is not reachable"),
        ("garbage://x", "--remote: remote tier URL 'garbage://x' must start with one of"),
    ],
)
@pytest.mark.parametrize("sglang", [[], ["--sglang"]])
def test_bench_tiers_remote_is_checked_before_the_benchmark(
    url: str,
    message: str,
    sglang: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bad --remote was found only once the disk tier's rounds had run, and not named."""
    import kvoffload.tiers.bench

    monkeypatch.setattr(kvoffload.tiers.bench, "measure_tiers", _never)
    if sglang:
        sglang_bench = pytest.importorskip("kvoffload.integrations.sglang.bench")
        monkeypatch.setattr(sglang_bench, "measure_sglang", _never)
    assert main(["bench", "tiers", "--remote", url, *sglang]) == 1
    assert one_line_error(capsys).startswith(f"kvoffload: error: {message}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layout", "gpt-9"], "--layout: unknown KV layout 'gpt-9'; known: "),
        (
            ["--cpu-blocks", "600"],
            "--cpu-blocks 600 of --block-size-factor 1 GPU blocks each take 600 GPU blocks, "
            "more than --gpu-blocks 512",
        ),
        (
            ["--block-size-factor", "2"],
            "--cpu-blocks 512 of --block-size-factor 2 GPU blocks each take 1,024 GPU blocks",
        ),
        (
            ["--gpu-blocks", str(2**40)],
            f"--gpu-blocks {2**40} (a paged KV cache of 1,099,511,627,776 blocks of 2 MiB on "
            "the CPU) would need about ",
        ),
        (
            ["--gpu-blocks", str(2**40), "--cpu-blocks", str(2**40)],
            f"--cpu-blocks {2**40} (a CPU block store of 1,099,511,627,776 blocks of 2 MiB)",
        ),
        (["--device", "gpu0"], "--device gpu0: unknown device 'gpu0'"),
    ],
)
def test_bench_transfer_bad_values_name_the_option_before_the_benchmark(
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The benchmark named its parameters ("600 CPU blocks of 1 GPU blocks do not fit in
    512 GPU blocks"), torch its buffers ("cannot allocate ... for the paged KV cache"), or
    nothing named the option ("unknown KV layout")."""
    transfer = pytest.importorskip("kvoffload.dataplane.bench")
    monkeypatch.setattr(transfer, "run_from_args", _never)
    assert main(["bench", "transfer", *args]) == 1
    assert one_line_error(capsys).startswith(f"kvoffload: error: {message}")


def test_bench_tiers_table_shows_slow_rates_in_figures_not_zeros() -> None:
    """A disk synced each batch stores at a few MB/s: the table read "0.00" GB/s beside a
    ratio of it, and "1 blocks"."""
    results = {"blocks": 1, "block_bytes": 4096, "rounds": 1, "fsync": True}
    figures = {
        "store_gbps": 0.0042,
        "plain_write_gbps": 0.031,
        "store_ratio": 0.135,
        "store_ratio_median": 0.135,
        "load_gbps": 2.5,
        "plain_read_gbps": 3.0,
        "load_ratio": 0.833,
        "load_ratio_median": 0.833,
    }
    results.update({f"disk_{name}": value for name, value in figures.items()})
    _, _, row, note = tier_table(results).splitlines()
    assert row.split() == [
        "disk",
        "0.0042",
        "0.031",
        "0.14",
        "0.14",
        "2.50",
        "3.00",
        "0.83",
        "0.83",
    ]
    assert note.startswith("1 block of 4 KiB;")
