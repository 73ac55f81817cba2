"""The transfer benchmark runs end to end on tiny sizes and reports what the CLI expects."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from kvoffload.cli import options  # noqa: E402
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError  # noqa: E402
from kvoffload.dataplane import bench, handlers  # noqa: E402


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_cli_arguments(parser, options.integer)
    return parser.parse_args(list(argv))


def test_run_from_args_reports_rates_and_ratios() -> None:
    args = parse("--layout", "tiny", "--gpu-blocks", "64", "--cpu-blocks", "16")
    args.blocks_per_job, args.rounds, args.block_size_factor = 4, 2, 2
    results = bench.run_from_args(args)
    for name in ("store_gbps", "load_gbps", "copy_gbps", "store_vs_copy", "load_vs_copy"):
        assert isinstance(results[name], float) and results[name] > 0
    assert results["store_vs_copy"] == pytest.approx(
        results["store_gbps"] / results["copy_gbps"], rel=0.05, abs=1e-3
    )
    assert (results["layout"], results["block_size_factor"], results["jobs_per_round"]) == (
        "tiny",
        2,
        4,
    )


def test_defaults_are_the_8b_class_layout() -> None:
    args = parse()
    assert (args.layout, args.gpu_blocks, args.blocks_per_job) == ("llama-3.1-8b", 512, 64)


def test_help_shows_every_options_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench transfer --help`` gave the numbers' defaults but not --layout's nor --device's."""
    from kvoffload.cli.main import main

    assert main(["bench", "transfer", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "--layout LAYOUT KV layout preset, one of" in text
    assert "tiny" in text and "(default: llama-3.1-8b)" in text
    assert "--device DEVICE device of the KV cache (default: cpu)" in text


def test_a_tier_larger_than_the_gpu_cache_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        bench.measure_transfer(layout="tiny", gpu_blocks=8, cpu_blocks=8, block_size_factor=2)


@pytest.mark.parametrize("threads", [0, bench.usable_cpus() + 1, 100_000])
def test_a_thread_count_outside_the_usable_cpus_is_an_input_error(threads: int) -> None:
    """100000 threads once ended in "benchmark job 0 was refused" (or a crash), as torch's
    threads left none for the copy thread."""
    limit = bench.usable_cpus()
    message = rf"threads must be between 1 and {limit} \(the CPUs this process may use\)"
    with pytest.raises(InvalidArgumentError, match=message):
        bench.measure_transfer(layout="tiny", gpu_blocks=8, cpu_blocks=8, threads=threads)


def test_threads_above_the_usable_cpus_are_a_usage_error_naming_the_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("--threads", "100000")
    assert f"--threads: must be <= {bench.usable_cpus()}, got 100000" in capsys.readouterr().err


def test_the_usable_cpus_are_a_thread_count_the_benchmark_runs_with() -> None:
    args = parse("--layout", "tiny", "--gpu-blocks", "8", "--cpu-blocks", "8")
    args.threads = bench.usable_cpus()
    args.rounds = 1
    assert bench.run_from_args(args)["threads"] == bench.usable_cpus()


def test_rates_count_the_bytes_moved_when_the_last_job_is_partial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """17 blocks in jobs of 16 move 17 blocks, not two full jobs' 32."""
    copied: list[list[int]] = []
    run_jobs = bench._timed_jobs

    def one_second_jobs(worker: object, specs: list[object]) -> float:
        run_jobs(worker, specs)  # type: ignore[arg-type]  # run: their bytes are checked
        return 1.0

    monkeypatch.setattr(bench, "_timed_jobs", one_second_jobs)

    def copies(dst: object, src: object, sizes: list[int]) -> float:
        copied.append(sizes)
        return 1.0

    monkeypatch.setattr(bench, "_timed_copies", copies)
    results = bench.measure_transfer(
        layout="tiny", gpu_blocks=64, cpu_blocks=17, blocks_per_job=16, rounds=1
    )
    moved = 17 * results["block_bytes"] / 1e9
    assert results["jobs_per_round"] == 2
    for name in ("store_gbps", "load_gbps", "copy_gbps"):
        assert results[name] == round(moved, 3), name
    assert copied[-1] == [16 * results["block_bytes"], results["block_bytes"]]


def test_the_plain_copy_walks_as_much_distinct_memory_as_the_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plain copy once copied every job into one job-sized buffer: cache-resident on a
    CPU, it ran twice as fast as copying the tier's bytes and made the jobs look slow."""
    copy = bench._timed_copies
    rounds: list[int] = []

    def checked_copies(dst: torch.Tensor, src: torch.Tensor, sizes: list[int]) -> float:
        total = sum(sizes)
        assert dst.is_contiguous() and src.is_contiguous()
        assert dst.numel() >= total and src.numel() >= total, "buffers smaller than the jobs"
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        ranges = [slice(start, start + size) for start, size in zip(starts, sizes, strict=True)]
        assert all(not torch.equal(dst[r], src[r]) for r in ranges)  # each job's bytes new
        seconds = copy(dst, src, sizes)
        assert all(torch.equal(dst[r], src[r]) for r in ranges), "a job's range not copied"
        rounds.append(total)
        return seconds

    monkeypatch.setattr(bench, "_timed_copies", checked_copies)
    results = bench.measure_transfer(
        layout="tiny",
        gpu_blocks=64,
        cpu_blocks=16,
        blocks_per_job=4,
        block_size_factor=2,
        rounds=2,
    )
    assert results["jobs_per_round"] == 4
    assert rounds == [16 * 2 * results["block_bytes"]] * 3  # the tier's bytes, warm-up too


def test_a_job_larger_than_the_tier_is_the_whole_tier() -> None:
    """--blocks-per-job 10000000000 once allocated its plain copy's buffer at that size."""
    results = bench.measure_transfer(
        layout="tiny", gpu_blocks=64, cpu_blocks=16, blocks_per_job=10**10, rounds=1
    )
    assert results["jobs_per_round"] == 1
    assert results["bytes_per_job"] == 16 * results["block_bytes"]


@pytest.mark.parametrize(
    "argv",
    [("--seed", "-1"), ("--blocks-per-job", "0"), ("--cpu-blocks", "0"), ("--threads", "0")],
)
def test_bad_numbers_are_usage_errors(argv: tuple[str, str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def test_a_negative_seed_is_an_input_error() -> None:
    with pytest.raises(InvalidArgumentError, match="seed must be an integer >= 0, got -1"):
        bench.measure_transfer(layout="tiny", seed=-1)


@pytest.mark.parametrize("fails", [False, True])
def test_torch_runs_on_the_callers_threads_again_after_the_benchmark(fails: bool) -> None:
    """measure_transfer(threads=1) once left the whole process on one torch thread."""
    callers = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if fails:  # refused after the threads were set: its GPU cache does not exist
            with pytest.raises(InvalidArgumentError):
                bench.measure_transfer(
                    layout="tiny", gpu_blocks=8, cpu_blocks=8, threads=1, device="cuda:99"
                )
        else:
            results = bench.measure_transfer(
                layout="tiny", gpu_blocks=8, cpu_blocks=8, rounds=1, threads=1
            )
            assert results["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(callers)


@pytest.mark.parametrize("broken", ["store", "load"])
def test_a_phase_that_moves_no_bytes_fails_the_benchmark_instead_of_being_timed(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """Jobs that reported success without moving a byte were timed as fast transfers: the
    GPU cache was all zeros, stored to zeroed slots and loaded back into the blocks it
    came from, so nothing could tell."""
    copy_direct = handlers.copy_direct

    def copy_one_way(*args: object) -> None:
        if args[3] != (broken == "store"):  # to_cpu
            copy_direct(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers, "copy_direct", copy_one_way)
    with pytest.raises(KVOffloadError, match=f"{broken} job 0 reported success but moved other"):
        bench.measure_transfer(layout="tiny", gpu_blocks=32, cpu_blocks=8, blocks_per_job=4)
