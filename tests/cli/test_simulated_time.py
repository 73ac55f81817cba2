"""Throughputs (or a trace's tokens and arrivals) whose times pass what the simulated clock
counts are refused before any run, naming the options that make them; the engine's own
refusal came only when its clock got there and named none of them."""

from __future__ import annotations

import pytest
from cli_helpers import one_line_error

from kvoffload.cli import options
from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import block_id_key
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Request, Workload

SMALL = ["--requests", "5", "--no-progress"]
COMMANDS = [["simulate", *SMALL], ["sweep", "--jobs", "1", *SMALL]]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("option", "value", "what"),
    [
        ("--prefill-tokens-per-s", "1e-308", "12,704 prompt tokens"),
        ("--decode-tokens-per-s", "1e-308", "1,436 output tokens"),
        ("--transfer-gb-per-s", "1e-310", "792 blocks of 2 MiB"),
    ],
)
def test_a_throughput_near_zero_is_named_before_any_run(
    command: list[str], option: str, value: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The three said the same "a prefill, decode or transfer throughput is too low", and
    a sweep said it as the failure of its first run."""
    assert main([*command, option, value]) == 1
    err = one_line_error(capsys)
    assert err.startswith("kvoffload: error: the workload's "), err
    assert f"{what} at {option} {value} take more seconds than the simulated clock" in err


def test_throughputs_that_only_together_pass_the_clock_are_both_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1.7e308 s and 1.9e307 s alone, past a float together: both are named."""
    rates = ["--prefill-tokens-per-s", "7.5e-305", "--decode-tokens-per-s", "7.5e-305"]
    assert main([*COMMANDS[0], *rates]) == 1
    err = one_line_error(capsys)
    assert "12,704 prompt tokens at --prefill-tokens-per-s 7.5e-305 and 1,436 output tokens " in err
    assert "at --decode-tokens-per-s 7.5e-305 take" in err


def _workload(last_arrival: float) -> Workload:
    requests = [
        Request(arrival, 10_000, 10, [block_id_key(index)])
        for index, arrival in enumerate((0.0, last_arrival))
    ]
    return Workload("two requests", 16, requests)


def test_late_arrivals_are_named_with_the_throughput_they_pass_the_clock_with() -> None:
    config = SimConfig(gpu_blocks=4, cpu_blocks=0, prefill_tokens_per_s=2e-304)
    with pytest.raises(InvalidArgumentError) as refused:
        options.check_simulated_time(_workload(1.5e308), config, transfers=False)
    assert str(refused.value) == (
        "the workload's arrivals until 1.5e+308 s and 20,000 prompt tokens at "
        "--prefill-tokens-per-s 2e-304 take more seconds than the simulated clock (a float) "
        "can count"
    )


@pytest.mark.parametrize("last_arrival", [0.0, 1e307])
def test_a_run_the_check_lets_through_ends_within_its_bound(last_arrival: float) -> None:
    """The check's premise: the clock ends at most at the last arrival plus every prefill,
    decode and transfer in full; so a run it lets through never overflows."""
    workload = _workload(last_arrival)
    config = SimConfig(gpu_blocks=4, cpu_blocks=4, prefill_tokens_per_s=1e-303, bound=False)
    options.check_simulated_time(workload, config, transfers=True)
    bound = last_arrival + 20_000 / 1e-303 + 20 / 50 + 2 * 1.0
    assert simulate(workload, config).simulated_seconds <= bound
