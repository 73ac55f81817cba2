"""Prometheus metrics scraped during and after a replay agree with the run's result."""

from __future__ import annotations

import json
import math
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from kvoffload import InvalidArgumentError
from kvoffload.observe import ObservedManager, Observers
from kvoffload.observe.metrics import ManagerCollector, MetricsServer
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.traces import read_trace
from tier_servers import ValkeyProcess


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    metrics: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("kvoffload_"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k != "tier")
            metrics[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return metrics


def _agrees_with(metrics: dict[str, float], report: dict[str, float]) -> None:
    bpb = report["bytes_per_block"]
    completed = report["offload_blocks_written"] - report["stores_failed"]
    assert metrics["kvoffload_lookups_total"] == report["lookups"]
    assert metrics["kvoffload_stores_offered_total"] == report["stores_offered"]
    assert metrics["kvoffload_stores_rejected_total"] == report["stores_rejected"]
    assert metrics["kvoffload_stores_skipped_total"] == report["stores_skipped_by_admission"]
    assert metrics["kvoffload_evictions_total"] == report["offload_evictions"]
    assert metrics["kvoffload_stores_completed_total"] == completed
    assert metrics["kvoffload_loads_total"] == report["offload_blocks_read"]
    assert metrics["kvoffload_bytes_stored_total"] == completed * bpb
    assert metrics["kvoffload_bytes_loaded_total"] == report["offload_bytes_read"]
    assert metrics["kvoffload_held_blocks"] == completed - report["offload_evictions"]


@pytest.mark.parametrize("threshold", [0, 2])
def test_scrapes_during_a_replay_agree_with_its_report(
    mooncake_trace: Path, threshold: int
) -> None:
    workload = read_trace(mooncake_trace)
    config = SimConfig(gpu_blocks=878, cpu_blocks=2196, store_threshold=threshold, bound=False)
    seen: list[float] = []
    with MetricsServer(0) as server:

        def register(observed: ObservedManager) -> None:
            server.add(ManagerCollector(lambda: observed.counters, {"tier": "cpu"}))

        def progress(done: int, total: int) -> None:
            if done % 1000 == 0 and done < total:
                seen.append(scrape(server.port)["kvoffload_stores_offered_total"])

        report = simulate(
            workload, config, progress=progress, observers=Observers(on_manager=[register])
        )
        final = scrape(server.port)
    assert len(seen) >= 2
    assert seen == sorted(seen)
    assert 0 < seen[0] < final["kvoffload_stores_offered_total"]
    _agrees_with(final, report.as_dict())  # type: ignore[arg-type]
    if threshold:
        assert final["kvoffload_stores_skipped_total"] > 0


def test_simulate_serves_metrics_on_the_port(mooncake_trace: Path, tmp_path: Path) -> None:
    from test_events import free_port

    port = free_port()
    result = tmp_path / "run.json"
    command = [
        sys.executable, "-m", "kvoffload", "simulate", "--trace", str(mooncake_trace),
        "--gpu-blocks", "878", "--cpu-blocks", "2196", "--no-bound", "--json", str(result),
        "--metrics-port", str(port), "--serve-after", "5",
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 120
            while not result.exists() and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
            time.sleep(0.2)  # the file is complete once written
            final = scrape(port)
        finally:
            proc.wait(timeout=60)
    assert proc.returncode == 0
    _agrees_with(final, json.loads(result.read_text()))


def scrape_labelled(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every ``kvoffload_`` sample by name and its whole label set (``tier`` kept)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvoffload_")
    }


def _optimiser_series(
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], tier: str | None
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The optimiser's series of one tier: ``tier=None`` those without a ``tier`` label."""
    names = ("kvoffload_whatif_", "kvoffload_admission_candidate", "kvoffload_admission_switch")
    return {
        (name, labels): value
        for (name, labels), value in metrics.items()
        if name.startswith(names) and dict(labels).get("tier") == tier
    }


def _simulate_and_scrape(
    tmp_path: Path, options: list[str]
) -> tuple[dict[tuple[str, frozenset[tuple[str, str]]], float], dict[str, Any]]:
    """``kvoffload simulate`` with ``options``, scraped once its JSON is written: every
    sample (:func:`scrape_labelled`) and the JSON."""
    from test_events import free_port

    port = free_port()
    result = tmp_path / "run.json"
    command = [
        sys.executable, "-m", "kvoffload", "simulate", *options, "--no-bound", "--no-progress",
        "--json", str(result), "--metrics-port", str(port), "--serve-after", "5",
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 120
            while not result.exists() and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
            time.sleep(0.2)  # the file is complete once written
            metrics = scrape_labelled(port)
        finally:
            proc.wait(timeout=60)
    assert proc.returncode == 0
    return metrics, json.loads(result.read_text())


def test_simulate_exports_the_disk_tiers_optimiser_labelled_by_tier(tmp_path: Path) -> None:
    """``--disk-admission recommended`` exported none of the disk tier's optimiser: its
    what-if gauges, chosen rule and switches now carry ``tier="disk"``, and the CPU tier's
    optimiser keeps its series as they were (no ``tier`` label)."""
    metrics, report = _simulate_and_scrape(
        tmp_path,
        [
            "--requests", "300", "--seed", "1", "--gpu-blocks", "2000", "--cpu-blocks", "600",
            "--admission", "recommended", "--disk-dir", str(tmp_path / "disk"),
            "--disk-blocks", "4000", "--disk-admission", "recommended",
        ],
    )  # fmt: skip
    candidates = ("store-all", "filter", "feedback")
    # The CPU tier's figures at the top of the JSON, the disk tier's in its entry.
    for tier, run in ((None, report), ("disk", report["tiers"]["disk"])):
        series = _optimiser_series(metrics, tier)
        extra = () if tier is None else (("tier", tier),)
        for figure in ("hit_ratio", "writes_per_ref"):
            exported = {labels for name, labels in series if name == f"kvoffload_whatif_{figure}"}
            assert exported == {
                frozenset({("candidate", c), ("capacity_factor", f), *extra})
                for c in candidates
                for f in ("0.5", "1", "2", "4")
            }
        for candidate in candidates:
            labels = frozenset({("candidate", candidate), *extra})
            chosen = float(candidate == run["admission_candidate"])
            assert series["kvoffload_admission_candidate", labels] == chosen
        switches = series["kvoffload_admission_switches_total", frozenset(extra)]
        assert switches == run["admission_switches"]
        assert len(series) == 2 * 12 + 3 + 1
    assert not _optimiser_series(metrics, "remote")


def test_simulate_exports_each_lower_tiers_counts_labelled_by_tier(
    tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """The disk and shared tiers' own counts (hits, stores, failures, corrupt blocks,
    evictions, rejections, writes skipped for the backlog) were not exported: an operator
    saw only what the disk tier recovered on start. Each is now a counter labelled by
    ``tier``, equal to the tier's entry in the run's JSON."""
    metrics, report = _simulate_and_scrape(
        tmp_path,
        [
            "--requests", "300", "--seed", "1", "--gpu-blocks", "2000", "--cpu-blocks", "600",
            "--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "1000",
            "--remote", valkey_server.url,
        ],
    )  # fmt: skip
    in_json = {
        "hit": "hit_blocks", "stored": "stored_blocks", "failed": "failed",
        "corrupt": "corrupt", "evicted": "evicted", "rejected": "rejected",
    }  # fmt: skip
    for tier in ("disk", "remote"):
        entry = report["tiers"][tier]
        exported = {
            name: metrics[f"kvoffload_tier_{name}_blocks_total", frozenset({("tier", tier)})]
            for name in [*in_json, "skipped_backlog"]
        }
        assert exported == {name: entry[key] for name, key in in_json.items()} | {
            "skipped_backlog": 0  # the simulator waits for every write
        }
        assert entry["stored_blocks"] > 0 and entry["hit_blocks"] > 0
    assert report["tiers"]["disk"]["evicted"] > 0


def test_the_shared_tiers_optimiser_is_exported_as_tier_remote(
    valkey_server: ValkeyProcess,
) -> None:
    """``--remote-admission recommended``: the shared tier's optimiser as simulate's
    metrics endpoint registers it, labelled ``tier="remote"``, its choice the report's."""
    from kvoffload.cli.observe_options import lower_tier_admissions
    from kvoffload.observe.metrics import AdmissionCollector
    from kvoffload.sim.generators import generate

    workload = generate(num_requests=200, seed=1)
    config = SimConfig(
        gpu_blocks=2000,
        cpu_blocks=600,
        bound=False,
        remote_url=valkey_server.url,
        remote_admission="recommended",
        remote_blocks=4000,
    )
    with MetricsServer(0) as server:

        def register(observed: ObservedManager) -> None:
            for tier, layer in lower_tier_admissions(observed):
                server.add(AdmissionCollector(layer.stats, tier))

        report = simulate(workload, config, observers=Observers(on_manager=[register]))
        metrics = scrape_labelled(server.port)
    entry = report.tiers["remote"]
    series = _optimiser_series(metrics, "remote")
    assert len(series) == 2 * 12 + 3 + 1 == len(metrics)  # the remote tier's alone
    for candidate in ("store-all", "filter", "feedback"):
        labels = frozenset({("candidate", candidate), ("tier", "remote")})
        chosen = float(candidate == entry["admission_candidate"])
        assert series["kvoffload_admission_candidate", labels] == chosen
    switches = frozenset({("tier", "remote")})
    assert series["kvoffload_admission_switches_total", switches] == entry["admission_switches"]


def test_a_bad_port_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kvoffload.cli.main import main

    assert main(["simulate", "--requests", "5", "--metrics-port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "--metrics-port: must be <= 65535, got 70000" in err
    assert "Traceback" not in err


def test_data_plane_copy_times_are_a_histogram_per_direction() -> None:
    pytest.importorskip("torch")
    from kvoffload.core.layout import layout_preset
    from kvoffload.observe.metrics import TransferCollector
    from kvoffload.observe.transfers import ObservedWorker
    from kvoffload.sim.dataplane_backend import DataPlaneBackend
    from kvoffload.sim.generators import generate

    workload = generate(num_requests=60, seed=2)
    config = SimConfig(gpu_blocks=2048, cpu_blocks=4096, layout="tiny", bound=False)
    backend = DataPlaneBackend(
        layout_preset("tiny").with_block_size(workload.block_tokens), 2048, 4096
    )
    watched: list[ObservedWorker] = []
    with MetricsServer(0) as server:

        def register(observed: ObservedWorker) -> None:
            watched.append(observed)
            server.add(TransferCollector(observed.latency))

        report = simulate(workload, config, backend, observers=Observers(on_transfers=[register]))
        backend.close()
        metrics = scrape(server.port)
    assert len(watched) == 1
    assert report.offload_blocks_read > 0
    for direction in ("store", "load"):
        count = metrics[f'kvoffload_transfer_seconds_count{{direction="{direction}"}}']
        assert count == watched[0].latency[direction].count > 0
        assert metrics[f'kvoffload_transfer_seconds_sum{{direction="{direction}"}}'] > 0


def test_the_optimiser_exports_its_what_if_figures_and_chosen_rule() -> None:
    from kvoffload.admission import OptimisingAdmission, find_admission
    from kvoffload.observe.metrics import AdmissionCollector
    from kvoffload.sim.generators import generate

    workload = generate({"chat": 0.6, "rag": 0.4}, num_requests=400, seed=1, rate=4.0)
    layers: list[OptimisingAdmission] = []

    def register(observed: ObservedManager) -> None:
        layer = find_admission(observed)
        assert isinstance(layer, OptimisingAdmission)
        layers.append(layer)

    config = SimConfig(gpu_blocks=400, cpu_blocks=600, admission="recommended", bound=False)
    simulate(workload, config, observers=Observers(on_manager=(register,)))
    with MetricsServer(0) as server:
        server.add(AdmissionCollector(layers[0].stats))
        metrics = scrape(server.port)
    stats = layers[0].stats()
    for figure in stats.whatif:
        labels = f'candidate="{figure.candidate}",capacity_factor="{figure.capacity_factor:g}"'
        assert metrics[f"kvoffload_whatif_hit_ratio{{{labels}}}"] == pytest.approx(figure.hit_ratio)
        assert metrics[f"kvoffload_whatif_writes_per_ref{{{labels}}}"] == pytest.approx(
            figure.writes_per_ref
        )
    chosen = {k: v for k, v in metrics.items() if k.startswith("kvoffload_admission_candidate")}
    assert chosen == {
        f'kvoffload_admission_candidate{{candidate="{name}"}}': float(name == stats.candidate)
        for name in ("store-all", "filter", "feedback")
    }
    assert len(stats.whatif) == 12
    assert metrics["kvoffload_admission_switches_total"] == stats.switches >= 1


def test_a_what_if_figure_not_sampled_yet_has_no_series() -> None:
    """A mini-tier no sampled key has reached once exported writes 0 (a rule that writes
    nothing) and the GPU's share as its hit ratio; its series is absent now."""
    from kvoffload import CPUOffloadingManager, block_id_key
    from kvoffload.admission import OptimisingAdmission
    from kvoffload.observe.metrics import AdmissionCollector
    from kvoffload.sim.engine import EngineConfig, ServingEngine
    from kvoffload.sim.workload import Request

    layer = OptimisingAdmission(CPUOffloadingManager(4096), 4096, bits=8)
    request = [block_id_key(i) for i in (1, 2, 3)]  # none of them among the 1 in 256 sampled
    ServingEngine(EngineConfig(64, 1, 16), layer).run([Request(0.0, 48, 1, request)])
    with MetricsServer(0) as server:
        server.add(AdmissionCollector(layer.stats))
        metrics = scrape(server.port)
    exported = {name for name in metrics if name.startswith("kvoffload_whatif_")}
    known = {f for f in layer.stats().whatif if f.sampling_rate == 1.0}  # the exact worlds
    assert known and exported == {
        f'kvoffload_whatif_{figure}{{candidate="{f.candidate}",capacity_factor="1"}}'
        for f in known
        for figure in ("hit_ratio", "writes_per_ref")
    }


def test_a_scrape_for_some_names_gets_their_samples_from_every_collector() -> None:
    from kvoffload.observe.counters import LatencyHistogram, ManagerCounters
    from kvoffload.observe.metrics import TransferCollector

    latency = {"store": LatencyHistogram()}
    latency["store"].observe(0.003)
    with MetricsServer(0) as server:
        for tier, lookups in (("cpu", 3), ("disk", 5)):
            counters = ManagerCounters(lookups=lookups, held_blocks=lookups + 1)
            server.add(ManagerCollector(lambda c=counters: c, {"tier": tier}))
        server.add(TransferCollector(latency))
        query = "name[]=kvoffload_lookups_total&name[]=kvoffload_transfer_seconds_count"
        url = f"http://127.0.0.1:{server.port}/metrics?{query}"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    samples = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples == {
        ("kvoffload_lookups_total", (("tier", "cpu"),)): 3,
        ("kvoffload_lookups_total", (("tier", "disk"),)): 5,
        ("kvoffload_transfer_seconds_count", (("direction", "store"),)): 1,
    }


def test_collectors_of_one_kind_show_each_family_once() -> None:
    """Each of two collectors of one kind (told apart by labels) printed a family's HELP and
    TYPE: an OpenMetrics parser refuses a family named twice ("Clashing name")."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(0) as server:
        for tier, lookups in (("cpu", 3), ("disk", 5)):
            counters = ManagerCounters(lookups=lookups)
            server.add(ManagerCollector(lambda c=counters: c, {"tier": tier}))
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        openmetrics = urllib.request.Request(
            url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(openmetrics, timeout=5) as response:
            families = {
                family.name: family for family in parse_openmetrics(response.read().decode())
            }
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert len(comments) == len(set(comments))
    lookups = families["kvoffload_lookups"].samples
    assert {(sample.labels["tier"], sample.value) for sample in lookups} == {
        ("cpu", 3),
        ("disk", 5),
    }


def test_a_client_that_sends_nothing_is_dropped_and_scrapes_go_on() -> None:
    """A connection that never sent a request was waited on without end: each held a
    thread and a socket as long as its client kept it open, after ``close`` too."""
    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(0, client_timeout_s=0.2) as server:
        server.add(ManagerCollector(lambda: ManagerCounters(lookups=7), {"tier": "cpu"}))
        with (
            socket.create_connection(("127.0.0.1", server.port)) as silent,
            socket.create_connection(("127.0.0.1", server.port)) as trickling,
        ):
            trickling.sendall(b"GET /met")
            assert scrape(server.port)["kvoffload_lookups_total"] == 7
            for client in (silent, trickling):
                client.settimeout(30)
                assert client.recv(1) == b""  # closed by the server


def _wait_for_scrape_threads(timeout_s: float = 30.0) -> None:
    """Until the server's per-connection threads (not joined on close) have ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        thread.name.endswith("(process_request_thread)") for thread in threading.enumerate()
    ):
        time.sleep(0.01)


def test_a_client_that_resets_its_connection_prints_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A client that reset its connection before its request was read (a TCP health check,
    a port scan) made socketserver print a ``ConnectionResetError`` traceback to stderr,
    one per connection, amid ``kvoffload simulate``'s output."""
    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(0) as server:
        server.add(ManagerCollector(lambda: ManagerCounters(lookups=7), {"tier": "cpu"}))
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as client:
                # No lingering: closing sends a reset, not an orderly end.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        assert scrape(server.port)["kvoffload_lookups_total"] == 7
        _wait_for_scrape_threads()
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("port", [True, np.True_, 8000.5, np.float64(9090), "9090", None])
def test_a_port_that_is_no_integer_is_refused_naming_it(port: object) -> None:
    """``True`` (an int to Python) served on port 1; a float, a str or ``None`` raised a
    bare ``TypeError`` from the comparison or the socket."""
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(f"metrics port must be an integer in 0..65535, got {port!r}"),
    ):
        MetricsServer(port)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 65536, np.int64(70000)])
def test_a_port_out_of_range_is_refused_naming_it(port: object) -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(f"metrics port must be an integer in 0..65535, got {port!r}"),
    ):
        MetricsServer(port)  # type: ignore[arg-type]


@pytest.mark.parametrize("integer", [np.int64, np.uint16, np.int32])
def test_a_numpy_integer_port_is_served(integer: type) -> None:
    """A port read from a NumPy config array (``np.int64(9090)``) was refused with "must be
    in 0..65535, got np.int64(9090)", as if it were out of range; any integer type serves."""
    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(integer(0)) as server:
        server.add(ManagerCollector(lambda: ManagerCounters(lookups=7), {"tier": "cpu"}))
        assert type(server.port) is int
        assert scrape(server.port)["kvoffload_lookups_total"] == 7


def test_a_host_it_cannot_serve_on_is_named_in_the_error() -> None:
    """The error named the port alone (``port 0``) when the host was what failed: here an
    address of no interface of this machine (TEST-NET-1)."""
    with pytest.raises(InvalidArgumentError, match=re.escape("on 192.0.2.1:0: ")):
        MetricsServer(0, host="192.0.2.1")


def test_an_ipv6_host_in_brackets_is_served() -> None:
    """``[::1]``, as a URL writes an IPv6 host, was looked up as a name and refused."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with MetricsServer(0, host="[::1]") as server:
        url = f"http://[::1]:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, math.inf, math.nan, "10", None])
def test_a_client_timeout_that_is_no_positive_time_is_refused(timeout_s: float) -> None:
    with pytest.raises(InvalidArgumentError, match="client_timeout_s"):
        MetricsServer(0, client_timeout_s=timeout_s)


def test_a_second_collector_of_the_same_series_is_refused_naming_it() -> None:
    """Two managers registered with the same labels (or one collector added twice) showed
    each series twice with different values, and Prometheus kept whichever it read first."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    from kvoffload.observe.counters import ManagerCounters

    first, second = ManagerCounters(lookups=3), ManagerCounters(lookups=5)
    with MetricsServer(0) as server:
        collector = ManagerCollector(lambda: first, {"tier": "cpu"})
        server.add(collector)
        refused = 'metric kvoffload_lookups_total{tier="cpu"} is exported already'
        with pytest.raises(InvalidArgumentError, match=re.escape(refused)):
            server.add(ManagerCollector(lambda: second, {"tier": "cpu"}))
        with pytest.raises(InvalidArgumentError, match=re.escape(refused)):
            server.add(collector)
        server.add(ManagerCollector(lambda: second, {"tier": "cpu", "instance": "b"}))
        openmetrics = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        )
        with urllib.request.urlopen(openmetrics, timeout=5) as response:
            families = {f.name: f for f in parse_openmetrics(response.read().decode())}
    lookups = families["kvoffload_lookups"].samples
    assert {(tuple(sorted(sample.labels.items())), sample.value) for sample in lookups} == {
        ((("instance", "b"), ("tier", "cpu")), 5),
        ((("tier", "cpu"),), 3),
    }


def test_a_second_transfer_collector_is_refused_with_a_hint_it_can_follow() -> None:
    """The hint told it to take labels of its own, which a ``TransferCollector`` cannot."""
    from kvoffload.observe.counters import LatencyHistogram
    from kvoffload.observe.metrics import TransferCollector

    with MetricsServer(0) as server:
        server.add(TransferCollector({"store": LatencyHistogram()}))
        with pytest.raises(InvalidArgumentError) as error:
            server.add(TransferCollector({"store": LatencyHistogram()}))
    assert str(error.value).startswith("metric kvoffload_transfer_seconds_bucket{")
    assert str(error.value).endswith(
        "is exported already: a TransferCollector takes no labels: add one to a server only once"
    )


def test_a_second_labelled_prometheus_metric_is_refused_without_a_false_hint() -> None:
    """A collector of the caller's own (a labelled ``prometheus_client`` counter) was told
    it "takes no labels" beside the very labels its clashing series showed."""
    from prometheus_client import Counter

    def counter() -> Counter:
        made = Counter("app_requests", "requests", ["model"], registry=None)
        made.labels("m1").inc()
        return made

    with MetricsServer(0) as server:
        server.add(counter())
        with pytest.raises(InvalidArgumentError) as error:
            server.add(counter())
    assert str(error.value) == (
        'metric app_requests_total{model="m1"} is exported already: add each collector to '
        "a server once, its series told apart from those served by name or labels"
    )


def test_a_label_value_that_is_no_str_is_refused_when_the_collector_is_made() -> None:
    """It was taken, and every scrape of the endpoint failed afterwards, every other
    collector's metrics too: prometheus_client's exposition raised on the int (a 500, a
    traceback on stderr)."""
    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(0) as server:
        refused = "metric label 'rank' must be a str, got 0"
        int_rank: Any = {"tier": "cpu", "rank": 0}
        with pytest.raises(InvalidArgumentError, match=re.escape(refused)):
            server.add(ManagerCollector(ManagerCounters, int_rank))
        server.add(ManagerCollector(ManagerCounters, {"tier": "cpu", "rank": "0"}))
        assert scrape(server.port)['kvoffload_lookups_total{rank="0"}'] == 0


def test_an_admission_collectors_tier_that_is_no_str_is_refused_when_it_is_made() -> None:
    """``AdmissionCollector(stats, tier=1)`` was taken as ``ManagerCollector``'s int label
    was: every scrape of the endpoint then failed, a 500 for the other collectors' metrics
    too, as soon as the optimiser had figures to export."""
    from kvoffload.admission import find_admission
    from kvoffload.managers import StackConfig, build_cpu_stack
    from kvoffload.observe.counters import ManagerCounters
    from kvoffload.observe.metrics import AdmissionCollector

    layer = find_admission(build_cpu_stack(StackConfig(64, admission="recommended")).manager)
    assert layer is not None and layer.stats().whatif
    with MetricsServer(0) as server:
        server.add(ManagerCollector(ManagerCounters, {"tier": "cpu"}))
        int_tier: Any = 1
        refused = "metric label 'tier' must be a str, got 1"
        with pytest.raises(InvalidArgumentError, match=re.escape(refused)):
            server.add(AdmissionCollector(layer.stats, int_tier))
        server.add(AdmissionCollector(layer.stats, "1"))
        metrics = scrape_labelled(server.port)
    assert metrics["kvoffload_lookups_total", frozenset({("tier", "cpu")})] == 0
    assert metrics["kvoffload_admission_switches_total", frozenset({("tier", "1")})] == 0


@pytest.mark.parametrize("name", ["", "__name__", "__meta", "tier-name", "9rank"])
def test_a_label_name_prometheus_refuses_is_refused_when_the_collector_is_made(
    name: str,
) -> None:
    """An empty name or one starting ``__`` (reserved) was taken and made every scrape of
    the endpoint unparseable, every other collector's metrics lost with it; one with a
    character a name may not hold was exported under another name (``tier_name``)."""
    from kvoffload.observe.counters import ManagerCounters

    with MetricsServer(0) as server:
        server.add(ManagerCollector(ManagerCounters, {"tier": "cpu"}))
        with pytest.raises(InvalidArgumentError, match=re.escape(f"metric label {name!r}")):
            server.add(ManagerCollector(ManagerCounters, {"tier": "disk", name: "x"}))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as response:
            families = list(text_string_to_metric_families(response.read().decode()))
        lookups = [f for f in families if f.name == "kvoffload_lookups"]
        assert [sample.labels for sample in lookups[0].samples] == [{"tier": "cpu"}]


def test_every_exported_metric_is_in_the_table_with_its_type() -> None:
    """docs/metrics.md's table lists the simulator's metrics by name, type and labels: one
    added, renamed, retyped or relabelled in the code without the table (or the reverse)
    fails here."""
    from kvoffload.admission.base import AdmissionStats
    from kvoffload.admission.minisim import WhatIf
    from kvoffload.observe.counters import LatencyHistogram, ManagerCounters
    from kvoffload.observe.metrics import (
        TIER_COUNT_DOCS,
        AdmissionCollector,
        RecoveryCollector,
        TierCountsCollector,
        TransferCollector,
    )
    from kvoffload.tiers.slot_file import Recovery

    stats = AdmissionStats(
        offers=1, admitted=1, rejected=0, ghost_hits=0, control=0.0, memory_bytes=0,
        tracked_keys=0, candidate="filter", switches=1,
        whatif=(WhatIf("filter", 1.0, 0.5, 0.25, 64, 1.0),),
    )  # fmt: skip
    collectors = [
        ManagerCollector(ManagerCounters, {"tier": "cpu"}),
        RecoveryCollector(lambda: {"disk": Recovery().as_dict()}),
        TierCountsCollector(lambda: {"disk": {name: 0 for name in TIER_COUNT_DOCS}}),
        AdmissionCollector(lambda: stats),
        TransferCollector({"store": LatencyHistogram()}),
    ]
    families = [family for collector in collectors for family in collector.collect()]
    exported = {
        (family.name + ("_total" if family.type == "counter" else ""), family.type)
        for family in families
    }
    table = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    rows = re.findall(
        r"^\| `(kvoffload_\w+)` \| (counter|gauge|histogram) \| ([^|]*) \|", table, re.MULTILINE
    )
    assert exported == {(name, kind) for name, kind, _ in rows}
    # The labels column names each label in backticks, its values in parentheses (and a
    # lower tier's extra ``tier`` label too, in the switches row: the CPU tier's has none).
    documented_labels = {
        name: set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels)))
        for name, _, labels in rows
    }
    exported_labels = {
        family.name + ("_total" if family.type == "counter" else ""): {
            label for sample in family.samples for label in sample.labels if label != "le"
        }
        for family in families
    }
    assert exported_labels == documented_labels
