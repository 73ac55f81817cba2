"""The optimiser inside vLLM 0.33: its what-if figures and chosen rule travel through vLLM's
connector stats to its ``/metrics``, and ``kvoffload.write_budget`` keeps its budget."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import SPEC_CONFIG, create_spec, metrics_frontend
from vllm_scheduler import connector_scheduler
from whatif_calls import record_whatif_calls

from kvoffload import InvalidArgumentError
from kvoffload.admission import OptimisingAdmission, find_admission
from kvoffload.admission.budget import BYTES_PER_S, DWPD, PER_REF
from kvoffload.sim.generators import generate
from kvoffload.sim.workload import Workload

HIT, WRITES, CANDIDATE = (
    "vllm:kvoffload_whatif_hit_ratio",
    "vllm:kvoffload_whatif_writes_per_ref",
    "vllm:kvoffload_admission_candidate",
)
SWITCHES = "vllm:kvoffload_admission_switches"


def _workload() -> Workload:
    return generate({"chat": 1.0}, num_requests=300, seed=0, block_tokens=16, rate=2.0)


def _optimiser(manager: Any) -> OptimisingAdmission:
    layer = find_admission(manager.backing)
    assert isinstance(layer, OptimisingAdmission)
    return layer


def test_whatif_figures_reach_vllms_stats_and_metrics_as_our_exporter_shows_them(
    vllm_modules: dict[str, ModuleType],
) -> None:
    import prometheus_client

    from kvoffload.integrations.vllm.replay import replay
    from kvoffload.observe.metrics import AdmissionCollector

    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 300 * 1024, "kvoffload.admission": "recommended"}
    frontend, registry = metrics_frontend(extra)
    spec = create_spec(extra)
    scheduler = connector_scheduler(spec)
    manager = spec.get_manager()
    workload = _workload()
    replay(manager, workload.requests, workload.block_tokens)
    layer = _optimiser(manager)
    figures = layer.stats().whatif
    assert len(figures) == 12  # three candidates at four capacity factors
    stats = scheduler.get_stats()  # vLLM's connector scheduler asks our manager
    gauges = stats.data["data"]
    for figure in figures:
        labels = (figure.candidate, f"{figure.capacity_factor:g}")
        assert gauges[HIT][labels] == figure.hit_ratio
        assert gauges[WRITES][labels] == figure.writes_per_ref
    assert {k for k, v in gauges[CANDIDATE].items() if v == 1.0} == {(layer.chosen,)}
    frontend.observe(stats.data, 0)
    # Our own exporter (``kvoffload simulate --metrics-port``) on the same layer:
    ours = prometheus_client.CollectorRegistry()
    ours.register(AdmissionCollector(layer.stats))
    compared = 0
    for family in ours.collect():
        for sample in family.samples:
            labels = {**sample.labels, "engine": "0"}
            assert registry.get_sample_value(f"vllm:{sample.name}", labels) == (sample.value)
            compared += 1
    assert compared == 12 + 12 + 3 + 1  # what-if gauges, candidate gauges, switches
    assert registry.get_sample_value(f"{SWITCHES}_total", {"engine": "0"}) == layer.switches >= 1
    text = prometheus_client.generate_latest(registry).decode()
    assert f"# TYPE {HIT} gauge" in text and f"# TYPE {CANDIDATE} gauge" in text
    assert f'{CANDIDATE}{{candidate="{layer.chosen}",engine="0"}} 1.0' in text


def test_switches_reach_metrics_as_increments_across_reports_and_resets(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """A reset builds a new optimiser, whose count starts again; ``/metrics`` keeps the
    total, and a report with no new switch adds nothing."""
    from kvoffload.integrations.vllm.replay import replay

    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 300 * 1024, "kvoffload.admission": "recommended"}
    frontend, registry = metrics_frontend(extra)
    manager = create_spec(extra).get_manager()
    workload = _workload()
    total = 0
    for round_ in range(2):
        replay(manager, workload.requests, workload.block_tokens)
        switches = _optimiser(manager).switches
        assert switches >= 1
        total += switches
        for _ in range(2):
            frontend.observe(manager.get_stats().data, 0)
            assert registry.get_sample_value(f"{SWITCHES}_total", {"engine": "0"}) == total
        if round_ == 0:
            manager.reset_cache()
            assert _optimiser(manager).switches == 0


def test_whatif_gauges_are_declared_only_for_the_optimiser(
    vllm_modules: dict[str, ModuleType],
) -> None:
    from kvoffload.integrations.vllm import KVOffloadSpec

    for name in ("recommended", "optimiser"):
        definitions = KVOffloadSpec.build_metric_definitions({"kvoffload.admission": name})
        assert definitions[HIT].labelnames == ("candidate", "capacity_factor")
        assert definitions[CANDIDATE].labelnames == ("candidate",)
        assert SWITCHES in definitions
    for extra in ({"kvoffload.admission": "feedback"}, {}, {"kvoffload.admission": "bogus"}):
        assert HIT not in KVOffloadSpec.build_metric_definitions(extra)
        assert SWITCHES not in KVOffloadSpec.build_metric_definitions(extra)
    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 8 * 1024, "kvoffload.admission": "feedback"}
    assert HIT not in create_spec(extra).get_manager().get_stats().data["data"]


@pytest.mark.parametrize(
    ("budget", "unit"), [("0.02", PER_REF), (0.02, PER_REF), ("20kB/s", BYTES_PER_S)]
)
def test_the_write_budget_key_reaches_the_optimiser_in_the_tiers_block_size(
    vllm_modules: dict[str, ModuleType], budget: str | float, unit: str
) -> None:
    from kvoffload.integrations.vllm.replay import replay

    extra = {
        "cpu_bytes_to_use": 300 * 1024,
        "kvoffload.admission": "recommended",
        "kvoffload.write_budget": budget,
    }
    manager = create_spec(extra).get_manager()
    credit = _optimiser(manager).write_credit
    assert credit is not None and credit.budget.unit == unit
    assert credit.budget.block_bytes == 1024  # the spec's bytes per block
    if unit == PER_REF:
        workload = _workload()
        result = replay(manager, workload.requests, workload.block_tokens)
        assert 0 < result.written_blocks <= 0.02 * result.refs
    else:
        assert credit.budget.blocks_per_second() == pytest.approx(20_000 / 1024)


def test_drive_writes_per_day_take_the_disk_tiers_size_or_the_drive_key(
    vllm_modules: dict[str, ModuleType],
) -> None:
    extra = {
        "cpu_bytes_to_use": 64 * 1024,
        "kvoffload.admission": "recommended",
        "kvoffload.write_budget": "2dwpd",
        "kvoffload.drive_bytes": "1.92TB",
    }
    credit = _optimiser(create_spec(extra).get_manager()).write_credit
    assert credit is not None and credit.budget.unit == DWPD
    assert credit.budget.bytes_per_second() == pytest.approx(2 * 1.92e12 / 86_400)
    del extra["kvoffload.drive_bytes"]
    with pytest.raises(InvalidArgumentError, match=r"'kvoffload.write_budget': .*drive's size"):
        create_spec(extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvoffload.write_budget": "lots"}, "'kvoffload.write_budget': write budget: expected"),
        ({"kvoffload.write_budget": "-1MB/s"}, "'kvoffload.write_budget': write budget: must"),
        ({"kvoffload.drive_bytes": "big"}, "'kvoffload.drive_bytes': drive size: must be"),
        (
            {"kvoffload.admission": "feedback", "kvoffload.write_budget": "0.1"},
            "needs 'kvoffload.admission' 'recommended'",
        ),
    ],
)
def test_a_bad_write_budget_key_stops_vllm_at_start_up(
    vllm_modules: dict[str, ModuleType], extra: dict[str, Any], message: str
) -> None:
    config = {"cpu_bytes_to_use": 8 * 1024, "kvoffload.admission": "recommended", **extra}
    with pytest.raises(InvalidArgumentError, match=message):
        create_spec(config)


@pytest.mark.parametrize("cpu_admission", ["recommended", "none"])
def test_the_disk_tiers_optimiser_reaches_metrics_labelled_by_tier(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, cpu_admission: str
) -> None:
    """A lower tier's own optimiser (``kvoffload.disk_admission: recommended``) exported
    nothing inside vLLM (and with no CPU optimiser nothing was declared). Its series now
    carry ``tier="disk"``, as ``kvoffload simulate`` labels them; vLLM declares a metric's
    labels once, so the CPU tier's carry ``tier=""`` beside them (Prometheus stores an
    empty label as none)."""
    import prometheus_client

    from kvoffload.integrations.vllm.replay import replay
    from kvoffload.observe.metrics import AdmissionCollector

    extra = {
        **SPEC_CONFIG,
        "cpu_bytes_to_use": 64 * 1024,
        "kvoffload.admission": cpu_admission,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 22,
        "kvoffload.disk_admission": "recommended",
    }
    frontend, registry = metrics_frontend(extra)
    spec = create_spec(extra)
    manager = spec.get_manager()
    workload = _workload()
    replay(manager, workload.requests, workload.block_tokens)
    frontend.observe(manager.get_stats().data, 0)
    tiers = {"disk": spec._stack.disk_admission}
    if cpu_admission != "none":
        tiers[""] = _optimiser(manager)
    for tier, layer in tiers.items():
        assert isinstance(layer, OptimisingAdmission)
        ours = prometheus_client.CollectorRegistry()
        ours.register(AdmissionCollector(layer.stats))
        compared = 0
        for family in ours.collect():
            for sample in family.samples:
                labels = {**sample.labels, "engine": "0", "tier": tier}
                assert registry.get_sample_value(f"vllm:{sample.name}", labels) == sample.value
                compared += 1
        assert compared == 12 + 12 + 3 + 1  # what-if gauges, candidate gauges, switches
    cpu_series = registry.get_sample_value(
        HIT, {"candidate": "filter", "capacity_factor": "1", "engine": "0", "tier": ""}
    )
    assert (cpu_series is None) == (cpu_admission == "none")


def test_without_a_lower_tiers_optimiser_the_whatif_series_have_no_tier_label(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    from kvoffload.integrations.vllm import KVOffloadSpec

    disk = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1 << 22}
    for extra in (
        {"kvoffload.admission": "recommended"},
        {"kvoffload.admission": "recommended", **disk, "kvoffload.disk_admission": "feedback"},
        {"kvoffload.admission": "recommended", "kvoffload.disk_admission": "recommended"},
    ):  # the last: no disk tier, so no disk optimiser (start-up refuses it)
        definitions = KVOffloadSpec.build_metric_definitions(extra)
        assert definitions[HIT].labelnames == ("candidate", "capacity_factor")
        assert definitions[SWITCHES].labelnames == ()
    with_disk = {"kvoffload.admission": "none", **disk, "kvoffload.disk_admission": "optimiser"}
    definitions = KVOffloadSpec.build_metric_definitions(with_disk)
    assert definitions[HIT].labelnames == ("candidate", "capacity_factor", "tier")
    assert definitions[CANDIDATE].labelnames == ("candidate", "tier")
    assert definitions[SWITCHES].labelnames == ("tier",)


def test_each_steps_stats_are_the_optimisers_own_without_computing_the_cumulative_figures(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks for the stats at every engine step. The CPU and disk tiers' optimisers
    report there exactly what their full ``stats()`` give, read after each request and
    again on an idle step; the cumulative what-if figures, which only the simulator's
    report reads, are no longer computed for a step (about 20 us per layer)."""
    from kvoffload.integrations.vllm.adapter import CONTROL_METRIC, METRIC_PREFIX
    from kvoffload.integrations.vllm.replay import replay
    from kvoffload.observe.metrics import whatif_gauges

    extra = {
        **SPEC_CONFIG,
        "cpu_bytes_to_use": 64 * 1024,
        "kvoffload.admission": "recommended",
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 22,
        "kvoffload.disk_admission": "recommended",
    }
    spec = create_spec(extra)
    manager = spec.get_manager()
    layers = {"": _optimiser(manager), "disk": spec._stack.disk_admission}
    whatif = OptimisingAdmission.whatif
    asked = record_whatif_calls(monkeypatch)
    workload = _workload()
    compared = 0
    for request in workload.requests[:150]:
        replay(manager, [request], workload.block_tokens)
        for _ in range(2):  # the step after the request, then an idle one
            asked.clear()
            data = manager.get_stats().data["data"]
            assert asked == [False, False]  # each layer's recent figures, once
            assert data[CONTROL_METRIC][()] == layers[""].stats().control
            for tier, layer in layers.items():
                assert isinstance(layer, OptimisingAdmission)
                full = layer.stats()
                assert layer.step_stats() == replace(full, whatif_total=())
                assert full.whatif_total == tuple(whatif(layer, cumulative=True))
                for name, series in whatif_gauges(full).items():
                    for labels, level in series.items():
                        assert data[f"{METRIC_PREFIX}{name}"][(*labels, tier)] == level
                        compared += 1
    assert compared > 150 * 2 * 2 * 12
    assert layers[""].switches >= 1 and layers[""].stats().whatif_total
