"""The figures of one run agree with each other, over random small workloads and
configurations: what an operator reading ``kvoffload simulate`` takes for granted
(docs/simulate.md, "Reading the report"). ``test_identities.py`` replays each run
again; this checks the report alone, lower tiers included."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_workloads import tree_workloads

from kvoffload import block_id_key
from kvoffload.admission import WriteBudget
from kvoffload.cli.main import main
from kvoffload.cli.output import flatten
from kvoffload.core.keys import OffloadKey
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.sim.generators import GENERATORS, generate
from kvoffload.sim.run import RunReport, SimConfig, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.sweep import run_sweep, sweep_configs
from kvoffload.sim.transfers import NullTransferBackend
from kvoffload.sim.workload import Request, Workload
from tier_servers import ValkeyProcess

POLICIES = ["lru", "arc", "s3fifo", "sieve", "slru"]
ADMISSIONS = ["none", "filter", "recommended"]
RATE_BUDGET = WriteBudget.parse("100kB/s")
"""A write budget in bytes per second that binds: 24 blocks of 4 KiB a second."""
BUDGET_BYTES_PER_S = 100_000
SHARES = [0.0, 0.02, 0.1, 0.3, 1.0]
"""Sizes as shares of the workload's distinct blocks: tiers that hold little, some, all."""


@st.composite
def returning_workloads(draw: st.DrawFn) -> Workload:
    """A few prompts of 1 to 4 blocks, some sharing their first block, coming back in a
    random order: reuse distances past a small GPU cache and CPU tier, within a disk tier."""
    prompts = []
    next_id = 0
    for _ in range(draw(st.integers(2, 8))):
        shared = prompts and draw(st.booleans())
        first = prompts[-1][0] if shared else next_id
        length = draw(st.integers(1, 4))
        prompts.append([first, *range(next_id + 1, next_id + length)])
        next_id += length
    order = draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=30))
    gap = draw(st.sampled_from([0.0, 0.001, 0.5]))
    return Workload(
        "returning",
        16,
        [
            Request(i * gap, 16 * len(prompts[p]), 2, [block_id_key(b) for b in prompts[p]])
            for i, p in enumerate(order)
        ],
    )


@st.composite
def synthetic_workloads(draw: st.DrawFn) -> Workload:
    """A few dozen requests of one or two synthetic kinds, in large blocks (few per prompt)."""
    kinds = draw(st.lists(st.sampled_from(sorted(GENERATORS)), min_size=1, max_size=2))
    return generate(
        {kind: 1.0 for kind in kinds},
        draw(st.integers(5, 40)),
        draw(st.integers(0, 9)),
        block_tokens=draw(st.sampled_from([64, 256])),
    )


def blocks_of(count: int) -> str:
    """A count of blocks as the table prints it: "1 block", else "N blocks"."""
    return f"{count:,} block" if count == 1 else f"{count:,} blocks"


def ratio_of(blocks: int, refs: int) -> float:
    return blocks / refs if refs else 0.0


def check_report(report: RunReport, config: SimConfig) -> None:
    """Every identity between the report's figures that needs no second run."""
    r = report
    refs = r.refs
    assert r.gpu_hit_blocks + r.offload_hit_blocks + r.computed_blocks == refs
    assert r.gpu_hit_ratio == pytest.approx(ratio_of(r.gpu_hit_blocks, refs))
    assert r.offload_hit_ratio == pytest.approx(ratio_of(r.offload_hit_blocks, refs))
    assert r.total_hit_ratio == pytest.approx(r.gpu_hit_ratio + r.offload_hit_ratio)
    assert r.writes_per_ref == pytest.approx(ratio_of(r.offload_blocks_written, refs))
    # Blocks and bytes agree through the block size.
    size = r.bytes_per_block
    for blocks, num_bytes in (
        (r.offload_blocks_written, r.offload_bytes_written),
        (r.offload_blocks_read, r.offload_bytes_read),
        (r.gpu_blocks_written, r.gpu_bytes_written),
        (r.gpu_blocks_read, r.gpu_bytes_read),
    ):
        assert num_bytes == blocks * size
    # Read = loaded (hits and failed loads); the GPU receives what it computed and loaded,
    # and gives the tier what is written to it.
    assert r.offload_blocks_read == r.offload_hit_blocks + r.loads_failed
    assert r.gpu_blocks_written == r.computed_blocks + r.offload_blocks_read
    assert r.gpu_blocks_read == r.offload_blocks_written
    assert r.stores_offered >= (
        r.offload_blocks_written + r.stores_skipped_by_admission + r.stores_rejected
    )
    assert r.concurrency == config.concurrency
    assert r.cpu_blocks == config.cpu_blocks and r.gpu_blocks == config.gpu_blocks
    assert r.prefill_seconds_saved <= r.prefill_seconds_baseline * (1 + 1e-9)
    assert r.prefill_seconds_saved - r.prefill_seconds_saved_by_offload >= -1e-12
    check_tiers(r, config)
    check_admission(r)
    check_budgets(r, config)
    check_bound(r, config)


def check_tiers(r: RunReport, config: SimConfig) -> None:
    """The ``tiers`` object against the top-level figures, and each lower tier's flow:
    offered >= admitted (by its threshold and layer) >= stored."""
    size = r.bytes_per_block
    for entry in r.tiers.values():
        assert entry["read_bytes"] == entry["hit_blocks"] * size
        assert entry["written_bytes"] == entry["stored_blocks"] * size
    cpu = r.tiers["cpu"]
    assert cpu["hit_blocks"] == r.offload_hit_blocks
    assert cpu["failed"] == r.stores_failed + r.loads_failed
    assert cpu["rejected"] == r.stores_rejected
    assert cpu["evicted"] == r.offload_evictions
    lower = {name: entry for name, entry in r.tiers.items() if name != "cpu"}
    assert bool(lower) == config.has_lower_tiers
    # The CPU tier stores what the engine wrote plus what it promoted from below. A lower
    # tier's hits are its blocks read (promoted), not blocks loaded: they may exceed the
    # offload read when a parked request's GPU prefix hit changes before its retry, which
    # then does not ask for the promoted blocks (vLLM's scheduler matches it again too).
    promoted = sum(entry["hit_blocks"] for entry in lower.values())
    assert cpu["stored_blocks"] == r.offload_blocks_written + promoted
    for name, entry in lower.items():
        assert entry["failed"] == entry["corrupt"] == 0
        assert entry["admitted_blocks"] <= entry["offered_blocks"]
        if config.tier_store_threshold < 2 and getattr(config, f"{name}_admission") == "none":
            assert entry["admitted_blocks"] == entry["offered_blocks"]
        assert entry["stored_blocks"] <= entry["admitted_blocks"]  # minus those it held
        check_whatif(entry.get("whatif", {}), offers_are_misses=False)
    if "remote" in lower:  # written through: offered each block the CPU tier stored
        assert lower["remote"]["offered_blocks"] == r.offload_blocks_written
    disk = lower.get("disk")
    if disk is not None:  # written back: offered each block the CPU tier evicted
        assert disk["offered_blocks"] == r.offload_evictions
        assert disk["evicted"] <= disk["stored_blocks"] <= config.disk_blocks + disk["evicted"]
        assert disk["recovered"] == 0  # a fresh directory


def check_admission(r: RunReport) -> None:
    """The admission counters: every offer admitted or rejected; the what-if figures."""
    if r.admission == "none" or not r.cpu_blocks:
        assert r.stores_skipped_by_admission == 0
        return
    assert r.admission_offers == r.admission_admitted + r.admission_rejected
    assert r.admission_offers == r.stores_offered
    check_whatif(r.whatif, offers_are_misses=True)


def check_whatif(
    whatif: dict[str, dict[str, dict[str, float | None]]], offers_are_misses: bool
) -> None:
    """What-if figures are ratios of block references (``None``: nothing sampled yet).
    The CPU tier is offered the blocks its references missed: each reference either hits
    or, missed, may be written. A lower tier is offered the CPU tier's evictions (disk)
    or stores (shared tier) instead, not misses of the references reaching it: a block
    promoted and evicted again is offered again (5 writes for 4 references happen)."""
    for by_factor in whatif.values():
        for figures in by_factor.values():
            hit, writes = figures["hit_ratio"], figures["writes_per_ref"]
            assert hit is None or 0.0 <= hit <= 1.0
            assert writes is None or writes >= 0.0
            if offers_are_misses and hit is not None and writes is not None:
                assert hit + writes <= 1.0 + 1e-9


def check_budgets(r: RunReport, config: SimConfig) -> None:
    """A write budget's bucket starts empty, so a tier never writes more than it earned
    (docs/admission.md, the write budget): per block reference, or per second of the
    trace's clock."""
    budget = config.write_budget
    if isinstance(budget, float):
        assert r.offload_blocks_written <= budget * r.refs
    elif budget is not None:
        assert r.offload_bytes_written <= BUDGET_BYTES_PER_S * r.simulated_seconds
    if config.disk_write_budget is not None:
        disk = r.tiers["disk"]["written_bytes"]
        assert disk <= BUDGET_BYTES_PER_S * r.simulated_seconds


def check_bound(r: RunReport, config: SimConfig) -> None:
    """The Belady bound: there only without lower tiers; in blocks (docs: compare ratio x
    refs), at least the run's hits, over the run's own GPU hits."""
    if not config.bounded:
        assert r.belady_total_hit_ratio is r.belady_offload_hit_ratio is None
        return
    assert r.belady_total_hit_ratio is not None and r.belady_offload_hit_ratio is not None
    bound_offload = round(r.belady_offload_hit_ratio * r.refs)
    bound_total = round(r.belady_total_hit_ratio * r.refs)
    assert bound_offload >= r.offload_hit_blocks
    assert bound_total >= r.gpu_hit_blocks + r.offload_hit_blocks
    assert bound_total - bound_offload == r.gpu_hit_blocks


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=st.one_of(
        tree_workloads(max_requests=30, max_depth=6), returning_workloads(), synthetic_workloads()
    ),
    concurrency=st.sampled_from([1, 1, 2, 4]),
    gpu_share=st.sampled_from([0.0, *SHARES[:-1]]),
    cpu_share=st.sampled_from(SHARES),
    disk_share=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
    disk_admission=st.sampled_from(ADMISSIONS),
    tier_store_threshold=st.sampled_from([0, 2]),
    budget=st.sampled_from([None, None, 0.05, 0.3, RATE_BUDGET]),
    partial_block=st.sampled_from(["cache", "drop"]),
)
def test_every_report_agrees_with_itself(
    workload: Workload,
    concurrency: int,
    gpu_share: float,
    cpu_share: float,
    disk_share: float,
    policy: str,
    admission: str,
    disk_admission: str,
    tier_store_threshold: int,
    budget: float | WriteBudget | None,
    partial_block: str,
) -> None:
    unique = len({key for request in workload.requests for key in request.keys})
    cpu_blocks = math.ceil(cpu_share * unique)
    disk_blocks = math.ceil(disk_share * unique)
    longest = max(len(r.keys) for r in workload.requests)
    with_disk = disk_blocks > 0 and cpu_blocks > 0
    with tempfile.TemporaryDirectory(prefix="kvoffload-report-") as disk_dir:
        config = SimConfig(
            max(1, longest + math.ceil(gpu_share * unique)),
            cpu_blocks,
            policy=policy,
            admission=admission,
            concurrency=concurrency,
            layout="tiny",
            prefill_tokens_per_s=1600.0,
            disk_dir=disk_dir if with_disk else None,
            disk_blocks=disk_blocks if with_disk else 0,
            disk_admission=disk_admission if with_disk else "none",
            tier_store_threshold=tier_store_threshold if with_disk else 0,
            write_budget=budget if admission == "recommended" else None,
            partial_block=partial_block,
            disk_write_budget=(
                RATE_BUDGET if with_disk and disk_admission == "recommended" else None
            ),
        )
        report = simulate(workload, config)
    check_report(report, config)


UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_table(table: str) -> dict[str, list[str]]:
    """The table's values by label (nested labels stripped of their indent); a row with
    no label continues the one above it."""
    lines = [line for line in table.splitlines() if line.strip()]
    first = lines[0]
    column = len(first) - len(first.split(maxsplit=1)[1])  # where the values start
    rows: dict[str, list[str]] = {}
    label = ""
    for line in lines:
        label = line[:column].strip() or label
        rows.setdefault(label, []).append(line[column:].strip())
    return rows


def parse_size(text: str) -> float:
    value, unit = text.split()
    return float(value.replace(",", "")) * UNITS[unit]


def assert_size(text: str, num_bytes: int) -> None:
    """A size printed to three significant digits (or whole units from 1,000 on)."""
    assert parse_size(text) == pytest.approx(num_bytes, rel=5e-3, abs=0.5)


def assert_blocks_and_size(value: str, blocks: int, num_bytes: int) -> None:
    match = re.fullmatch(r"([\d,]+) blocks \((.+)\)", value)
    assert match, value
    assert int(match[1].replace(",", "")) == blocks
    assert_size(match[2], num_bytes)


def bound(value: float | None) -> str:
    return "" if value is None else f"   (Belady bound {value:.3f})"


def check_table(table: str, data: dict[str, Any]) -> None:
    """Every figure the table prints is the JSON's, in the table's rounding."""
    rows = parse_table(table)
    d = data
    assert rows["workload"] == [
        d["workload"],
        f"{d['requests']:,} requests, {d['refs']:,} block refs, {d['unique_blocks']:,} unique "
        f"blocks of {d['block_tokens']} tokens",
    ]
    assert rows["concurrency"] == [str(d["concurrency"])]
    assert rows["total hit ratio"] == [
        f"{d['total_hit_ratio']:.3f}{bound(d['belady_total_hit_ratio'])}"
    ]
    assert rows["from GPU cache"] == [f"{d['gpu_hit_ratio']:.3f}"]
    assert rows["from offload tier"] == [
        f"{d['offload_hit_ratio']:.3f}{bound(d['belady_offload_hit_ratio'])}"
    ]
    assert rows["writes per block ref"] == [f"{d['writes_per_ref']:.3f}"]
    (written,) = rows["offload written"]
    assert_blocks_and_size(written, d["offload_blocks_written"], d["offload_bytes_written"])
    (read,) = rows["offload read"]
    assert_blocks_and_size(read, d["offload_blocks_read"], d["offload_bytes_read"])
    assert rows["skipped by admission"] == [blocks_of(d["stores_skipped_by_admission"])]
    assert rows["rejected (tier full)"] == [blocks_of(d["stores_rejected"])]
    assert rows["failed stores / loads"] == [
        f"{d['stores_failed']:,} / {d['loads_failed']:,} blocks"
    ]
    assert rows["offload evictions"] == [blocks_of(d["offload_evictions"])]
    assert rows["prefill time saved"] == [
        f"{d['prefill_seconds_saved']:,.1f} s of {d['prefill_seconds_baseline']:,.1f} s "
        f"(offload tier: {d['prefill_seconds_saved_by_offload']:,.1f} s net of loads)"
    ]
    if d["admission_bytes_per_key"] is not None:
        (admitted,) = rows[f"admission {d['admission']}"]
        assert admitted == (
            f"{d['admission_admitted']:,} of {d['admission_offers']:,} offers admitted, "
            f"{d['admission_ghost_hits']:,} ghost hits"
        )
    for name, cells in d["whatif"].items():
        (printed,) = rows[name]
        expected = [
            "-" if figures[key] is None else f"{figures[key]:.3f}"
            for figures in cells.values()
            for key in ("hit_ratio", "writes_per_ref")
        ]
        assert printed.replace("/", " ").split() == expected
    disk = d["tiers"].get("disk")
    assert ("disk tier" in rows) == (disk is not None)
    if disk is not None:
        line = rows["disk tier"][0]
        match = re.fullmatch(
            r"([\d,]+) blocks hit \((.+), modelled ([\d.]+) s\), ([\d,]+) stored \((.+)\), "
            r"([\d,]+) failed, ([\d,]+) corrupt",
            line,
        )
        assert match, line
        assert int(match[1].replace(",", "")) == disk["hit_blocks"]
        assert_size(match[2], disk["read_bytes"])
        assert match[3] == f"{disk['read_seconds']:.3f}"
        assert int(match[4].replace(",", "")) == disk["stored_blocks"]
        assert_size(match[5], disk["written_bytes"])
        assert (int(match[6]), int(match[7])) == (disk["failed"], disk["corrupt"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.integers(5, 40),
    seed=st.integers(0, 9),
    kind=st.sampled_from(sorted(GENERATORS)),
    gpu_blocks=st.sampled_from([600, 1500]),
    cpu_blocks=st.sampled_from([0, 10, 60, 400]),
    disk_blocks=st.sampled_from([0, 30, 600]),
    concurrency=st.sampled_from([1, 4]),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
)
def test_the_table_prints_the_figures_of_the_json(
    requests: int,
    seed: int,
    kind: str,
    gpu_blocks: int,
    cpu_blocks: int,
    disk_blocks: int,
    concurrency: int,
    policy: str,
    admission: str,
) -> None:
    """``kvoffload simulate``'s table, ``--json`` and ``--csv`` of one run say the same."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-report-") as scratch:
        json_path, csv_path = Path(scratch) / "run.json", Path(scratch) / "run.csv"
        args = [
            "simulate",
            *("--mix", f"{kind}=1", "--requests", str(requests), "--seed", str(seed)),
            *("--block-size", "256"),
            *("--gpu-blocks", str(gpu_blocks), "--cpu-blocks", str(cpu_blocks)),
            *("--concurrency", str(concurrency), "--policy", policy, "--admission", admission),
            *("--layout", "tiny", "--no-progress", "--json", str(json_path)),
            *("--csv", str(csv_path)),
        ]
        if disk_blocks and cpu_blocks:
            args += ["--disk-dir", str(Path(scratch) / "disk"), "--disk-blocks", str(disk_blocks)]
        with contextlib.redirect_stdout(io.StringIO()) as table:
            assert main(args) == 0
        data = json.loads(json_path.read_text())
        (row,) = csv.DictReader(csv_path.read_text().splitlines())
    check_table(table.getvalue(), data)
    assert row == {name: "" if v is None else str(v) for name, v in flatten(data).items()}


TIMING = {"wall_seconds", "refs_per_second", "manager_us_per_block"}


def figures(report: RunReport) -> dict[str, Any]:
    return {name: value for name, value in report.as_dict().items() if name not in TIMING}


@pytest.fixture(scope="module")
def trace_slice(mooncake_trace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Mooncake trace's first 300 requests: its prefix sharing, in a short replay."""
    with mooncake_trace.open(encoding="utf-8") as trace:
        lines = [next(trace) for _ in range(300)]
    path = tmp_path_factory.mktemp("trace") / "mooncake-300.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_sweep_over_a_trace_reports_what_simulate_reports(
    trace_slice: Path, tmp_path: Path, concurrency: int
) -> None:
    """Each row of a sweep (disk tiers included, each in its own directory) is the report
    ``simulate`` gives for its configuration, bound included, and agrees with itself."""
    source = WorkloadSource(trace=str(trace_slice))
    workload = source.load()
    longest = max(len(request.keys) for request in workload.requests)
    base = SimConfig(longest + 20, 0, layout="tiny", concurrency=concurrency)
    grid = sweep_configs(base, [longest // 2, 4 * longest], ["lru", "arc"], [0], ADMISSIONS)
    grid += [
        dataclasses.replace(config, disk_dir=str(tmp_path / f"sweep-{index}"), disk_blocks=3000)
        for index, config in enumerate(grid[:4])
    ]
    reports = run_sweep(source, grid, jobs=1, loaded=workload)
    for index, (report, config) in enumerate(zip(reports, grid, strict=True)):
        config = dataclasses.replace(config, bound=True)
        check_report(report, config)
        if config.disk_dir is not None:
            config = dataclasses.replace(config, disk_dir=str(tmp_path / f"alone-{index}"))
        assert figures(report) == figures(simulate(workload, config))


@pytest.mark.parametrize("concurrency", [1, 4])
def test_runs_on_a_shared_tier_agree_with_themselves(
    own_server: ValkeyProcess, tmp_path: Path, concurrency: int
) -> None:
    """The same run twice against one server, with a disk tier between: the first fills
    the server, the second hits what the first stored."""
    url = own_server.start().url
    workload = generate(num_requests=60, seed=5, block_tokens=64)
    longest = max(len(request.keys) for request in workload.requests)
    reports = []
    for run in ("first", "second"):
        config = SimConfig(
            longest + 50,
            longest,
            layout="tiny",
            concurrency=concurrency,
            disk_dir=str(tmp_path / run),
            disk_blocks=2 * longest,
            remote_url=url,
            remote_admission="recommended",
            remote_blocks=10 * longest,
        )
        report = simulate(workload, config)
        check_report(report, config)
        reports.append(report)
    first, second = (report.tiers["remote"] for report in reports)
    assert first["stored_blocks"] > 0 and second["hit_blocks"] > first["hit_blocks"]


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_the_sweep_table_prints_the_figures_of_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], concurrency: str
) -> None:
    """``kvoffload sweep`` prints one row per run, in the order of its ``--json``, with
    that run's figures: its own bound (overlapping runs) or its capacity's."""
    json_path = tmp_path / "sweep.json"
    args = ["sweep", "--mix", "chat=1,rag=1", "--requests", "60", "--seed", "2"]
    args += ["--gpu-blocks", "900", "--cpu-blocks", "0,100,2000", "--policies", "lru,s3fifo"]
    args += ["--admissions", "none,recommended", "--concurrency", concurrency]
    args += ["--layout", "tiny", "--no-progress", "--json", str(json_path)]
    assert main(args) == 0
    runs = json.loads(json_path.read_text())
    lines = capsys.readouterr().out.splitlines()
    title, rows = lines[0], lines[4:]
    assert title.startswith(f"{runs[0]['workload']}: {runs[0]['refs']:,} block refs; GPU ")
    assert len(rows) == len(runs) == 2 * 2 * 2 * 3  # admissions, policies, thresholds, sizes
    for line, run in zip(rows, runs, strict=True):
        bound = run["belady_total_hit_ratio"]
        assert line.split()[:3] == [run["admission"], run["policy"], str(run["store_threshold"])]
        assert line.split()[5:11] == [
            f"{run['cpu_blocks']:,}",
            f"{run['total_hit_ratio']:.3f}",
            "-" if bound is None else f"{bound:.3f}",
            f"{run['offload_hit_ratio']:.3f}",
            f"{run['writes_per_ref']:.3f}",
            f"{run['stores_skipped_by_admission']:,}",
        ]


class FailingLoads(NullTransferBackend):
    """Every load's copy fails, as a data plane's failed or mismatched job does."""

    def __init__(self) -> None:
        self.loads: set[int] = set()

    def submit_load(
        self, job_id: int, keys: Sequence[OffloadKey], src: LoadStoreSpec, gpu_block_ids: Any
    ) -> None:
        self.loads.add(job_id)

    def finish(self, job_id: int) -> bool:
        return job_id not in self.loads


def test_the_cpu_tiers_entry_counts_failed_loads_alike_with_a_disk_tier(
    make_workload: Callable[..., Workload], tmp_path: Path
) -> None:
    """Its failed loads were counted as CPU hits, and none as failed, once a disk tier
    sat below: that entry came from the manager, which never learns a copy failed."""
    workload = make_workload([1, 2], [3, 4], [5, 6], [1, 2], [3, 4])
    entries = []
    for disk_dir in (None, str(tmp_path / "disk")):
        config = SimConfig(2, 6, layout="tiny", disk_dir=disk_dir, disk_blocks=10)
        report = simulate(workload, config, FailingLoads())
        assert (report.offload_hit_blocks, report.loads_failed) == (0, 4)
        check_report(report, config)
        entries.append({name: report.tiers["cpu"][name] for name in ("hit_blocks", "failed")})
    assert entries == [{"hit_blocks": 0, "failed": 4}] * 2
