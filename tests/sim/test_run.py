"""A run's report: required keys, consistent totals, capacities and configuration errors."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.sim.engine import EngineConfig
from kvoffload.sim.generators import generate
from kvoffload.sim.run import GIB, SimConfig, blocks_for_gib, simulate
from kvoffload.sim.workload import Request, Workload

REQUIRED = [
    "total_hit_ratio",
    "offload_hit_ratio",
    "writes_per_ref",
    "belady_total_hit_ratio",
    "refs",
    "refs_per_second",
]


@pytest.fixture(scope="module")
def small() -> Workload:
    return generate(num_requests=200, seed=1)


def test_report_is_consistent(small: Workload) -> None:
    report = simulate(small, SimConfig(gpu_blocks=1500, cpu_blocks=6000, store_threshold=2))
    assert all(report.as_dict()[name] is not None for name in REQUIRED)
    refs = report.refs
    assert refs == small.num_refs
    assert report.gpu_hit_blocks + report.offload_hit_blocks + report.computed_blocks == refs
    assert report.total_hit_ratio == pytest.approx(report.gpu_hit_ratio + report.offload_hit_ratio)
    assert report.writes_per_ref == pytest.approx(report.offload_blocks_written / refs)
    assert report.offload_bytes_written == report.offload_blocks_written * 2 * 2**20
    assert report.stores_skipped_by_admission > 0
    assert 0 < report.prefill_seconds_saved < report.prefill_seconds_baseline


def test_threshold_below_two_skips_nothing(small: Workload) -> None:
    report = simulate(small, SimConfig(gpu_blocks=1500, cpu_blocks=6000, store_threshold=1))
    assert report.stores_skipped_by_admission == 0


def test_no_tier(small: Workload) -> None:
    report = simulate(small, SimConfig(gpu_blocks=1500, cpu_blocks=0))
    assert report.offload_hit_ratio == report.writes_per_ref == 0
    assert report.total_hit_ratio == report.belady_total_hit_ratio


def test_gib_to_blocks() -> None:
    bytes_per_block = layout_preset("llama-3.1-8b").with_block_size(512).bytes_per_block
    assert bytes_per_block == 64 * 2**20
    assert blocks_for_gib(10, "llama-3.1-8b", 512) == 160
    assert blocks_for_gib(10.01, "llama-3.1-8b", 512) == int(10.01 * GIB // bytes_per_block)


@pytest.mark.parametrize(("gib", "message"), [(True, "finite number"), (1e308, "past any machine")])
def test_a_capacity_in_gb_that_gives_no_block_count_is_refused(gib: float, message: str) -> None:
    """1e308 GB was a bare ValueError ("cannot convert float NaN"), True 1 GB."""
    with pytest.raises(InvalidArgumentError, match=message):
        blocks_for_gib(gib, "llama-3.1-8b", 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "fifo"}, "unknown cache policy 'fifo'"),
        ({"cpu_blocks": -1}, "cpu_blocks"),
        ({"layout": "gpt-5"}, "unknown KV layout"),
        ({"store_threshold": -2}, "threshold"),
        ({"bound": "no"}, "bound"),
        ({"bound": None}, "bound"),
        ({"decode_tokens_per_s": True}, "decode_tokens_per_s"),
        ({"disk_latency_ms": math.nan}, "disk_latency_ms"),
        ({"remote_latency_ms": math.inf}, "remote_latency_ms"),
        ({"disk_gb_per_s": math.inf}, "disk_gb_per_s"),
        # Finite in GB/s, but not in the engine's bytes per second: refused naming it.
        ({"transfer_gb_per_s": 1e300}, "transfer_gb_per_s must be below 1.8e"),
        ({"remote_gb_per_s": None}, "remote_gb_per_s"),
        ({"disk_timeout_ms": None}, "disk_timeout_ms"),
        ({"disk_timeout_ms": "2"}, "disk_timeout_ms"),
        ({"disk_blocks": None}, "disk_blocks"),
        ({"remote_blocks": 1.5}, "remote_blocks"),
        ({"cpu_blocks": 0, "tier_store_threshold": None}, "tier_store_threshold"),
        ({"cpu_blocks": 0, "disk_blocks": 2.5}, "disk_blocks"),
        ({"drive_bytes": b"1TB"}, "drive_bytes"),
        ({"drive_bytes": 0}, "drive_bytes"),
    ],
)
def test_bad_configuration(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"gpu_blocks": 10, "cpu_blocks": 10, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        SimConfig(**arguments)  # type: ignore[arg-type]


def test_request_larger_than_the_gpu(small: Workload) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot fit in a GPU cache of 10 blocks"):
        simulate(small, SimConfig(gpu_blocks=10, cpu_blocks=0))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"arrival_s": math.inf}, "arrival_s"),  # the event loop waited for it for ever
        ({"arrival_s": math.nan}, "arrival_s"),
        ({"arrival_s": None}, "arrival_s"),
        ({"arrival_s": 10**400}, "arrival_s"),  # raised OverflowError from math.isfinite
        ({"arrival_s": True}, "arrival_s"),  # a bool is no time
        ({"input_tokens": math.nan}, "input_tokens"),  # so did a nan prefill time
        ({"input_tokens": 64.0}, "input_tokens"),
        ({"output_tokens": math.inf}, "output_tokens"),
        ({"output_tokens": -5}, "output_tokens"),  # decoding finished before it began
        ({"keys": None}, "keys"),
    ],
)
def test_a_request_the_replay_cannot_time_is_refused_naming_its_field(
    fields: dict[str, Any], named: str
) -> None:
    values: dict[str, Any] = {
        "arrival_s": 0.0,
        "input_tokens": 64,
        "output_tokens": 4,
        "keys": [block_id_key(i) for i in range(4)],
        **fields,
    }
    good = Request(0.0, 64, 4, [block_id_key(i) for i in range(4, 8)])
    workload = Workload("hostile", 16, [good, Request(**values)])
    with pytest.raises(InvalidArgumentError, match=rf"^request 1: {named}"):
        simulate(workload, SimConfig(gpu_blocks=16, cpu_blocks=16, layout="tiny"))


def test_the_config_s_repr_never_shows_the_remote_url_s_password() -> None:
    config = SimConfig(gpu_blocks=100, cpu_blocks=10, remote_url="redis://alice:Hunter2@h:6379/0")
    assert "Hunter2" not in repr(config) and "Hunter2" not in str(config)


def test_requests_out_of_arrival_order_are_refused() -> None:
    # Replayed in list order, the request arriving at 5 s started only at 10 s, unsaid.
    keys = [[block_id_key(i)] for i in range(3)]
    requests = [Request(0.0, 16, 1, keys[0]), Request(10.0, 16, 1, keys[1])]
    requests.append(Request(5.0, 16, 1, keys[2]))
    with pytest.raises(InvalidArgumentError, match=r"^request 2 arrives at 5 s, before request 1"):
        simulate(Workload("unsorted", 16, requests), SimConfig(gpu_blocks=4, cpu_blocks=2))


@pytest.mark.parametrize("name", ["prefill_tokens_per_s", "transfer_bytes_per_s", "lookup_retry_s"])
@pytest.mark.parametrize("value", [True, pytest.param(10**400, id="10**400"), math.nan, 0])
def test_an_engine_rate_that_is_no_finite_positive_number_is_refused_naming_it(
    name: str, value: object
) -> None:
    # A bool passed as 1 per second, and an int past a float's range raised OverflowError.
    with pytest.raises(InvalidArgumentError, match=rf"^{name} must be finite and > 0"):
        EngineConfig(gpu_blocks=4, bytes_per_block=1, block_tokens=16, **{name: value})
