"""Write budgets in three units: parsing, conversion, and keeping to them in trace time."""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest

from kvoffload import CPUOffloadingManager, InvalidArgumentError, OffloadKey
from kvoffload.admission import (
    Objective,
    OptimisingAdmission,
    WriteBudget,
    attach_clock,
    parse_bytes,
)
from kvoffload.admission.budget import (
    BURST_REFS,
    BURST_SECONDS,
    BYTES_PER_S,
    DWPD,
    PER_REF,
    SECONDS_PER_DAY,
    BudgetCredit,
)
from kvoffload.cli.main import main
from kvoffload.core.manager import PrepareStoreOutput
from kvoffload.managers import build_manager
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.generators import generate
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Workload

MB, MIB = 10**6, 2**20


@pytest.mark.parametrize(
    ("text", "amount", "unit"),
    [
        ("0.2", 0.2, PER_REF),
        (" 0.2 /ref", 0.2, PER_REF),
        ("0", 0.0, PER_REF),
        (0.3, 0.3, PER_REF),
        ("200MB/s", 200 * MB, BYTES_PER_S),
        ("200MiB/s", 200 * MIB, BYTES_PER_S),
        ("1.5 GiB/s", 1.5 * 2**30, BYTES_PER_S),
        ("5e8B/s", 5e8, BYTES_PER_S),
        ("64kb/sec", 64_000, BYTES_PER_S),
        ("1dwpd", 1.0, DWPD),
        ("0.5 DWPD", 0.5, DWPD),
    ],
)
def test_good_budgets_parse_into_their_unit(text: str | float, amount: float, unit: str) -> None:
    budget = WriteBudget.parse(text)
    assert (budget.amount, budget.unit) == (pytest.approx(amount), unit)
    assert WriteBudget.parse(budget) is budget


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nan", "must be a finite number"),
        ("inf", "must be a finite number"),
        ("-0.5", "must be >= 0"),
        ("-1MB/s", "must be >= 0"),
        ("x", "expected writes per block reference (0.2), bytes per second"),
        ("200MB", "expected writes per block reference"),
        ("200 parsecs/s", "expected writes per block reference"),
        ("1dwpd/s", "expected writes per block reference"),
        ("", "expected writes per block reference"),
    ],
)
def test_bad_budgets_are_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match="write budget") as error:
        WriteBudget.parse(text)
    assert message in str(error.value) and "\n" not in str(error.value)


BEYOND_A_FLOAT = 10**400
"""An integer no float holds: ``json.loads`` of a long number in an engine's extra-config."""


@pytest.mark.parametrize(
    "make",
    [
        lambda: WriteBudget.parse(BEYOND_A_FLOAT),
        lambda: WriteBudget(BEYOND_A_FLOAT),
        lambda: BudgetCredit(BEYOND_A_FLOAT),
        lambda: OptimisingAdmission(CPUOffloadingManager(8), 8, write_budget=BEYOND_A_FLOAT),
        lambda: SimConfig(8, 64, admission="recommended", write_budget=BEYOND_A_FLOAT),
        lambda: parse_bytes(BEYOND_A_FLOAT, "drive"),
        lambda: WriteBudget(1.0, DWPD, block_bytes=MB, drive_bytes=BEYOND_A_FLOAT).check(),
        lambda: WriteBudget(1e9, BYTES_PER_S, block_bytes=BEYOND_A_FLOAT).check(),
        lambda: WriteBudget.parse("1e300TB/s"),
        lambda: WriteBudget(1e306, DWPD, block_bytes=1, drive_bytes=10**12).check(),
        lambda: BudgetCredit(WriteBudget(1e306, DWPD, block_bytes=1, drive_bytes=10**12)),
    ],
    ids=[
        "parse",
        "budget",
        "credit",
        "optimiser",
        "sim-config",
        "drive-size",
        "dwpd-drive",
        "block-size",
        "rate-overflow",
        "dwpd-overflow",
        "dwpd-credit",
    ],
)
def test_a_number_past_a_float_s_range_is_one_clear_error(make: object) -> None:
    """A budget or size no float holds was an ``OverflowError`` traceback (``float()`` and
    ``math.isfinite`` of the int), or, for ``1e300TB/s``, an error that showed ``inf``; drive
    writes per day past a float's bytes on their drive were a rate of inf blocks a second,
    no budget at all, unsaid."""
    with pytest.raises(InvalidArgumentError) as error:
        make()  # type: ignore[operator]
    message = str(error.value)
    assert "finite" in message and "\n" not in message and "0000000000" not in message
    assert "got inf" not in message


def test_a_negative_integer_too_long_to_print_is_one_clear_error() -> None:
    """Past 4,300 digits an int cannot be printed: the error that showed it raised
    ``ValueError: Exceeds the limit ... for integer string conversion`` instead."""
    for make in (
        lambda: parse_bytes(-(10**5000), "drive"),
        lambda: WriteBudget(1.0, block_bytes=-(10**5000)),
        lambda: WriteBudget(-(10**5000)),
    ):
        with pytest.raises(InvalidArgumentError, match="got an integer outside a float's range"):
            make()


@pytest.mark.parametrize(
    ("text", "unit"), [("10Gb/s", "Gb"), ("400 Mb/s", "Mb"), ("2Mib/s", "Mib"), ("1Tb/sec", "Tb")]
)
def test_a_rate_written_in_bits_is_refused_not_read_as_bytes(text: str, unit: str) -> None:
    """``10Gb/s``, a 10 Gbit/s link as network gear writes it, was read as 10 GB/s: a
    budget eight times the one meant. Bytes in any case still parse (``64kb/sec``)."""
    with pytest.raises(InvalidArgumentError, match=f"'{unit}' reads as bits; give bytes"):
        WriteBudget.parse(text)
    with pytest.raises(InvalidArgumentError, match=f"drive: '{unit}' reads as bits"):
        parse_bytes(text.partition("/")[0], "drive")
    assert WriteBudget.parse("10GB/s").amount == WriteBudget.parse("10gb/s").amount == 10 * 10**9


def test_sizes_parse_in_decimal_and_binary_units() -> None:
    assert parse_bytes("1.92TB") == 1_920_000_000_000
    assert parse_bytes("2TiB") == 2 * 2**40
    assert parse_bytes(4096) == parse_bytes("4096") == parse_bytes("4kib") == 4096
    for bad in ("0", "1.5 parsecs", "-3GB", "0.1B", "1e300TB"):
        with pytest.raises(InvalidArgumentError, match="drive"):
            parse_bytes(bad, "drive")
    for below_a_byte in ("0", "-0", "-1", "-3GB", "-1e-400", "0.1B"):
        with pytest.raises(InvalidArgumentError, match="drive: must be >= 1 byte"):
            parse_bytes(below_a_byte, "drive")


def test_drive_writes_per_day_convert_through_the_drive_and_block_sizes() -> None:
    drive, block = parse_bytes("1.92TB"), 2 * MIB
    budget = WriteBudget.parse("1dwpd").sized(block, drive)
    assert budget.bytes_per_second() == pytest.approx(1.92e12 / SECONDS_PER_DAY)
    assert budget.blocks_per_second() == pytest.approx(1.92e12 / SECONDS_PER_DAY / block)
    half = WriteBudget.parse("0.5dwpd").sized(block, drive)
    assert half.blocks_per_second() == pytest.approx(budget.blocks_per_second() / 2)
    # A size already given is kept: the drive is not replaced by a later default.
    assert budget.sized(block, 1).drive_bytes == drive
    with pytest.raises(InvalidArgumentError, match="needs the drive's size"):
        WriteBudget.parse("1dwpd").sized(block).check()
    with pytest.raises(InvalidArgumentError, match="needs the tier's block size"):
        WriteBudget.parse("200MB/s").check()


def test_a_per_time_credit_earns_by_the_clock_and_banks_at_most_its_burst() -> None:
    credit = BudgetCredit(WriteBudget.parse("10MB/s").sized(MB))  # 10 blocks per second
    credit.earn(100, now=5.0)
    assert credit.allowance() == 0  # the bucket starts empty
    credit.earn(0, now=5.5)
    assert credit.allowance() == 5
    credit.spend(5)
    credit.earn(100, now=1000.0)
    assert credit.allowance() == 10 * BURST_SECONDS
    # 200 references over 995 s at 10 blocks/s: the budget in writes per reference.
    assert credit.writes_per_ref() == pytest.approx(10 * 995.0 / 200)
    assert BudgetCredit(WriteBudget.parse("1MB/s").sized(MB)).writes_per_ref() == math.inf


def test_a_clock_that_steps_back_earns_each_span_once_and_takes_nothing_back() -> None:
    """Callers may pass times out of order: a step back earns nothing and costs nothing,
    and the time up to the latest ``now`` already seen is not earned a second time."""
    credit = BudgetCredit(WriteBudget.parse("1MB/s").sized(MB))  # 1 block per second
    credit.earn(0, now=0.0)
    credit.earn(0, now=4.0)
    assert credit.allowance() == 4
    credit.earn(0, now=1.0)
    assert credit.allowance() == 4
    credit.earn(0, now=4.0)
    assert credit.allowance() == 4
    credit.earn(0, now=6.0)
    assert credit.allowance() == 6


def test_a_per_reference_credit_is_the_bucket_it_always_was() -> None:
    """Credit ``W`` per reference, at most ``W x BURST_REFS`` banked, spent by writes."""
    credit, expected = BudgetCredit(0.25), 0.0
    for refs, written in [(3, 0), (10, 2), (4000, 100), (7, 300), (1, 0)]:
        credit.earn(refs, now=1e9)  # time plays no part
        expected = min(0.25 * BURST_REFS, expected + 0.25 * refs)
        assert credit.allowance() == int(expected + 1e-9)
        credit.spend(written)
        expected -= written


def test_a_budget_below_one_block_per_burst_still_writes_at_its_rate() -> None:
    """A bank holds at least one block: else a per-reference budget under one block per
    ``BURST_REFS`` references could never bank a whole block and wrote nothing at all."""
    budget = 0.5 / BURST_REFS
    credit, written = BudgetCredit(budget), 0
    for _ in range(8 * BURST_REFS):
        credit.earn(1)
        if credit.allowance():
            credit.spend(1)
            written += 1
    assert written == int(budget * 8 * BURST_REFS)


@pytest.mark.parametrize(
    "budget",
    [
        1e307,
        WriteBudget(1e308, BYTES_PER_S, block_bytes=1),
        WriteBudget(1e296, DWPD, block_bytes=1, drive_bytes=10**12),  # 1e308 bytes a day
    ],
)
def test_a_huge_budget_is_an_allowance_not_an_overflow(budget: float | WriteBudget) -> None:
    """A budget whose bank would overflow to infinity allows a huge number of blocks (a
    bank of infinity once made ``allowance`` raise ``OverflowError``)."""
    clock = iter([0.0, 10.0])
    credit = BudgetCredit(budget, clock=lambda: next(clock))
    credit.earn(10)
    credit.earn(10)
    assert credit.allowance() >= 2**50


def chat(requests: int) -> Workload:
    return generate({"chat": 1.0}, num_requests=requests, seed=0, block_tokens=256, rate=1.0)


def test_writes_per_reference_decide_the_same_whichever_way_they_are_given() -> None:
    workload = chat(500)
    figures = []
    for budget in (0.1, "0.1", "0.1/ref", WriteBudget(0.1)):
        manager = build_manager(
            500, admission="recommended", write_budget=WriteBudget.parse(budget)
        )
        engine = ServingEngine(
            EngineConfig(2 * max(len(r.keys) for r in workload.requests), 1, 256), manager
        )
        stats = engine.run(workload.requests)
        assert isinstance(manager, OptimisingAdmission)
        figures.append((stats.stored_blocks, stats.offload_hit_blocks, manager.chosen))
    assert len(set(figures)) == 1 and figures[0][0] <= 0.1 * engine.stats.refs


class _Timed(OptimisingAdmission):
    """The optimiser, recording the trace time and size of every write it lets through."""

    writes: list[tuple[float, int]]

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys)
        if output is not None and output.keys_to_store:
            assert self.write_credit is not None
            self.writes.append((self.write_credit.clock(), len(output.keys_to_store)))
        return output


def _timed_run(workload: Workload, budget: WriteBudget | None) -> tuple[_Timed, ServingEngine]:
    """A run under ``budget``; ``None``: one write per reference, which never binds."""
    layer = _Timed(CPUOffloadingManager(600), 600, write_budget=budget or 1.0)
    layer.writes = []
    engine = ServingEngine(
        EngineConfig(2 * max(len(r.keys) for r in workload.requests), 1, 256), layer
    )
    assert attach_clock(layer, engine.now) == 1
    engine.run(workload.requests)
    return layer, engine


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_a_bytes_per_second_budget_is_never_exceeded_over_any_window_of_trace_time(
    share: float,
) -> None:
    """From the first reference, writes stay within the budget's seconds; over any span of
    trace time they exceed it by at most the bank (``BURST_SECONDS`` of budget)."""
    workload = chat(600)
    free, engine = _timed_run(workload, None)
    seconds = engine.now() - workload.requests[0].arrival_s
    free_rate = sum(n for _, n in free.writes) / seconds  # blocks per second unbudgeted
    block = 10**6
    budget = WriteBudget(share * free_rate * block, BYTES_PER_S, block_bytes=block)
    layer, _ = _timed_run(workload, budget)
    rate, start = budget.blocks_per_second(), workload.requests[0].arrival_s
    bank = max(rate * BURST_SECONDS, 1.0)
    times = [t for t, _ in layer.writes]
    totals = [0]
    for _, n in layer.writes:
        totals.append(totals[-1] + n)
    for end, t_end in enumerate(times, 1):
        assert totals[end] <= rate * (t_end - start) + 1e-6
        for first in range(max(0, end - 60), end):
            span = t_end - times[first]
            assert totals[end] - totals[first] <= rate * span + bank + 1e-6
    assert totals[-1] >= 0.5 * rate * seconds  # the budget is used, not just kept
    assert totals[-1] < sum(n for _, n in free.writes)


def test_the_simulator_keeps_drive_writes_per_day_on_its_trace_clock() -> None:
    workload = chat(400)
    gpu = 2 * max(len(r.keys) for r in workload.requests)
    base = SimConfig(gpu_blocks=gpu, cpu_blocks=600, admission="recommended", bound=False)
    free = simulate(workload, base)
    drive = int(free.offload_bytes_written / free.simulated_seconds * SECONDS_PER_DAY / 4)
    config = SimConfig(
        gpu_blocks=gpu,
        cpu_blocks=600,
        admission="recommended",
        bound=False,
        write_budget=WriteBudget.parse("1dwpd"),
        drive_bytes=drive,
    )
    report = simulate(workload, config)
    allowed = drive / SECONDS_PER_DAY * report.simulated_seconds
    assert report.offload_bytes_written <= allowed
    assert report.offload_bytes_written < 0.5 * free.offload_bytes_written  # it binds
    with pytest.raises(InvalidArgumentError, match="needs the drive's size"):
        SimConfig(
            gpu_blocks=gpu,
            cpu_blocks=600,
            admission="recommended",
            write_budget=config.write_budget,
        )


def test_a_drive_size_beside_the_shared_tier_s_budget_alone_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The shared tier's drive writes per day count against its own size (``--remote-blocks``,
    as vLLM's ``remote_bytes`` and SGLang's): ``--drive-bytes 2TB`` beside
    ``--remote-write-budget 1dwpd`` alone was accepted and ignored, the budget 1 DWPD of the
    modelled 1,000 blocks. Refused now, before any server is asked."""
    remote = [
        "--remote",
        "redis://127.0.0.1:1",
        "--remote-blocks",
        "1000",
        "--remote-admission",
        "recommended",
        "--remote-write-budget",
        "1dwpd",
    ]
    small = ["simulate", "--requests", "5", "--gpu-blocks", "2000", "--cpu-blocks", "100"]
    assert main([*small, *remote, "--drive-bytes", "2TB"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--drive-bytes is the drive" in err and "--remote-blocks" in err
    config = SimConfig(
        gpu_blocks=100,
        cpu_blocks=100,
        remote_url="redis://127.0.0.1:1",
        remote_blocks=1000,
        remote_admission="recommended",
        remote_write_budget=WriteBudget.parse("1dwpd"),
        drive_bytes=2 * 10**12,
    )
    sized = config.stack_config(bytes_per_block=MIB).remote_write_budget
    assert sized is not None and sized.drive_bytes == 1000 * MIB


def test_a_budget_beside_an_objective_ranks_the_candidates_too() -> None:
    """Given with an objective of the caller's, the budget only capped the writes: the
    objective kept no budget, so the candidates were ranked as if there were none."""
    layer = OptimisingAdmission(
        CPUOffloadingManager(8), 8, write_budget=0.05, objective=Objective()
    )
    assert layer.objective.write_budget == pytest.approx(0.05)
    with pytest.raises(InvalidArgumentError, match="give the write budget once"):
        OptimisingAdmission(
            CPUOffloadingManager(8), 8, write_budget=0.05, objective=Objective(write_budget=0.1)
        )
