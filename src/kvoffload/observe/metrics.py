"""Prometheus metrics of a running manager, read from its counters at scrape time.

A collector rather than counters incremented per call: the hot path keeps
plain integer additions, and a scrape reads a consistent snapshot.
prometheus_client is imported here only.
"""

from __future__ import annotations

import copy
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, RestrictedRegistry

from kvoffload.admission.base import AdmissionStats
from kvoffload.core.errors import InvalidArgumentError, integer_value
from kvoffload.core.tier_protocol import LowerTier
from kvoffload.observe.counters import COUNTER_DOCS, LatencyHistogram, ManagerCounters

PREFIX = "kvoffload_"
RECOVERED_BLOCKS = "tier_recovered_blocks"
DROPPED_BLOCKS = "tier_dropped_blocks"
RECOVERY_DOCS = {
    RECOVERED_BLOCKS: "Blocks a lower tier found intact on start and serves again.",
    DROPPED_BLOCKS: "Slots a lower tier dropped on start, by reason "
    "(torn, foreign, corrupt, duplicate, beyond_capacity).",
}
RECOVERY_LABELS = {RECOVERED_BLOCKS: ("tier",), DROPPED_BLOCKS: ("tier", "reason")}
"""The two recovery gauges, here and on vLLM's ``/metrics`` (``vllm:kvoffload_...``)."""


def recovery_samples(
    counts: Mapping[str, Mapping[str, int]],
) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """``(gauge, label values, value)`` for each tier's ``recovered`` and ``dropped_<reason>``
    counts (``counts`` by tier name): one reading for both ``/metrics`` endpoints."""
    for tier, found in counts.items():
        yield RECOVERED_BLOCKS, (tier,), found["recovered"]
        for name, value in found.items():
            if name.startswith("dropped_"):
                yield DROPPED_BLOCKS, (tier, name.removeprefix("dropped_")), value


TIER_COUNT_DOCS = {
    "tier_hit_blocks": "Blocks a lower tier read back intact.",
    "tier_stored_blocks": "Blocks a lower tier wrote.",
    "tier_failed_blocks": "Blocks a lower tier failed to write or read (an I/O error, a missed "
    "deadline, an open breaker, a write dropped for the backlog).",
    "tier_corrupt_blocks": "Blocks a lower tier read back broken (failing their checksum).",
    "tier_evicted_blocks": "Blocks a lower tier evicted to make room for new ones.",
    "tier_rejected_blocks": "Blocks offered to a lower tier that did not fit.",
    "tier_skipped_backlog_blocks": "Blocks a lower tier dropped unwritten because "
    "max_pending_write_bytes of writes were queued (counted as failed too).",
}
"""Each lower tier's own counters (``kvoffload_<name>_total``, label ``tier``), by name
without prefix: here and on vLLM's ``/metrics``."""


def tier_counts(tiers: Iterable[LowerTier]) -> dict[str, dict[str, int]]:
    """Each tier's counts by tier name (``disk``, ``remote``) and then by
    :data:`TIER_COUNT_DOCS` name: one reading for both ``/metrics`` endpoints. A tier
    without a write backlog to skip for (not the disk or shared tier) reads 0 there."""
    counts = {}
    for tier in tiers:
        stats = tier.stats
        counts[tier.medium.lower()] = {
            "tier_hit_blocks": stats.hit_blocks,
            "tier_stored_blocks": stats.stored_blocks,
            "tier_failed_blocks": stats.failed,
            "tier_corrupt_blocks": stats.corrupt,
            "tier_evicted_blocks": stats.evicted,
            "tier_rejected_blocks": stats.rejected,
            "tier_skipped_backlog_blocks": getattr(tier, "skipped_backlog", 0),
        }
    return counts


WHATIF_HIT_RATIO, WHATIF_WRITES, CANDIDATE = (
    "whatif_hit_ratio",
    "whatif_writes_per_ref",
    "admission_candidate",
)
WHATIF_LABELS = ("candidate", "capacity_factor")
WHATIF_DOCS = {
    WHATIF_HIT_RATIO: "Total hit ratio each admission rule would give at each tier size, recently.",
    WHATIF_WRITES: "Offload writes per block reference of each rule at each tier size, recently.",
    CANDIDATE: "1 for the admission rule the tier follows, 0 for the other candidates.",
}
"""The what-if gauges, by name without prefix: here and on vLLM's ``/metrics``."""
SWITCHES = "admission_switches"
SWITCHES_DOC = (
    "Times the admission optimiser changed the rule the tier follows (each costs a refill)."
)
"""The optimiser's switch counter, by name without prefix: here and on vLLM's ``/metrics``."""


def whatif_gauges(stats: AdmissionStats) -> dict[str, dict[tuple[str, ...], float]]:
    """The what-if gauges' values by label values, as both exporters show them: the hit
    ratio and writes per ``(candidate, capacity_factor)``, and 1 for the candidate followed
    (0 for the others, labelled ``(candidate,)``); empty for a layer without what-if figures.
    A figure not known yet (``None``: nothing sampled) has no series: absent is how
    Prometheus says "no data", where a 0 would read as a rule that never hits or writes."""
    if not stats.whatif:
        return {}
    gauges: dict[str, dict[tuple[str, ...], float]] = {
        WHATIF_HIT_RATIO: {},
        WHATIF_WRITES: {},
        CANDIDATE: {},
    }
    for figure in stats.whatif:
        labels = (figure.candidate, f"{figure.capacity_factor:g}")
        if figure.hit_ratio is not None:
            gauges[WHATIF_HIT_RATIO][labels] = figure.hit_ratio
        if figure.writes_per_ref is not None:
            gauges[WHATIF_WRITES][labels] = figure.writes_per_ref
        gauges[CANDIDATE][(figure.candidate,)] = 1.0 if figure.candidate == stats.candidate else 0.0
    return gauges


LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
"""What Prometheus takes as a label name; one starting ``__`` is reserved for its own use."""


def checked_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    """``labels`` if every name is a Prometheus label name and every value a str; else
    :class:`InvalidArgumentError` naming the label. Taken as it was, a value of another type
    (an int rank) failed every scrape of the endpoint, every collector's metrics with it (a
    500 and a traceback on stderr); an empty name or one starting ``__`` made every scrape
    unparseable, and one with another character (``tier-name``) was exported renamed."""
    checked = dict(labels or {})
    for name, value in checked.items():
        if not (isinstance(name, str) and LABEL_NAME.fullmatch(name)) or name.startswith("__"):
            raise InvalidArgumentError(
                f"metric label {name!r} is no Prometheus label name: letters, digits and "
                "underscores, not starting with a digit nor with two underscores"
            )
        if not isinstance(value, str):
            raise InvalidArgumentError(f"metric label {name!r} must be a str, got {value!r}")
    return checked


class ManagerCollector(Collector):
    """Exports ``counters()`` as ``kvoffload_<name>_total`` counters and ``kvoffload_held_blocks``.

    ``labels`` (e.g. ``{"tier": "cpu", "policy": "lru"}``) tell managers apart
    when one registry holds several; each name must be a Prometheus label name and each
    value a str (:func:`checked_labels`).
    """

    def __init__(
        self, counters: Callable[[], ManagerCounters], labels: dict[str, str] | None = None
    ) -> None:
        self._counters = counters
        self._labels = checked_labels(labels)

    def collect(self) -> Iterator[Metric]:
        values = self._counters().as_dict()
        names, label_values = list(self._labels), list(self._labels.values())
        for name, doc in COUNTER_DOCS.items():
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=names)
            family.add_metric(label_values, values[name])
            yield family
        held = GaugeMetricFamily(
            f"{PREFIX}held_blocks", "Blocks holding a slot in the offload tier.", labels=names
        )
        held.add_metric(label_values, values["held_blocks"])
        yield held


class RecoveryCollector(Collector):
    """Exports what lower tiers found on start: ``kvoffload_tier_recovered_blocks`` and
    ``kvoffload_tier_dropped_blocks`` by ``reason`` (torn, foreign, corrupt, duplicate,
    beyond_capacity).

    ``counts()`` maps a tier name to its ``recovered`` and ``dropped_<reason>`` counts.
    """

    def __init__(self, counts: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=list(RECOVERY_LABELS[name]))
            for name, doc in RECOVERY_DOCS.items()
        }
        for name, labels, value in recovery_samples(self._counts()):
            families[name].add_metric(list(labels), value)
        yield from families.values()


class TierCountsCollector(Collector):
    """Exports what each lower tier did (:data:`TIER_COUNT_DOCS`) as
    ``kvoffload_tier_<count>_blocks_total`` counters labelled ``tier``.

    ``counts()`` is :func:`tier_counts` of the tiers, read at each scrape.
    """

    def __init__(self, counts: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        for name, doc in TIER_COUNT_DOCS.items():
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["tier"])
            for tier, found in counts.items():
                family.add_metric([tier], found[name])
            yield family


class AdmissionCollector(Collector):
    """Exports an admission layer's what-if figures and chosen rule, read from its stats.

    ``kvoffload_whatif_hit_ratio`` and ``kvoffload_whatif_writes_per_ref`` (labels
    ``candidate``, ``capacity_factor``) over recent traffic,
    ``kvoffload_admission_candidate`` (1 for the rule followed, 0 for the others) and
    ``kvoffload_admission_switches_total``. A layer without what-if figures exports nothing.

    ``tier`` names a lower tier's own layer (``disk``, ``remote``): its series carry it as
    a ``tier`` label, as the other per-tier metrics do. The CPU tier's layer has no such
    label (``tier=None``), so the series it always exported stay as they were. A ``tier``
    that is no str is refused as a :class:`ManagerCollector` label is (:func:`checked_labels`).
    """

    def __init__(self, stats: Callable[[], AdmissionStats], tier: str | None = None) -> None:
        self._stats = stats
        self._tier = () if tier is None else (checked_labels({"tier": tier})["tier"],)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        tier_label = ["tier"] if self._tier else []
        for name, series in whatif_gauges(stats).items():
            labels = list(WHATIF_LABELS) if name != CANDIDATE else ["candidate"]
            family = GaugeMetricFamily(
                f"{PREFIX}{name}", WHATIF_DOCS[name], labels=labels + tier_label
            )
            for values, value in series.items():
                family.add_metric([*values, *self._tier], value)
            yield family
        if stats.whatif:
            switches = CounterMetricFamily(f"{PREFIX}{SWITCHES}", SWITCHES_DOC, labels=tier_label)
            switches.add_metric(list(self._tier), stats.switches)
            yield switches


class TransferCollector(Collector):
    """Exports per-direction copy times as the ``kvoffload_transfer_seconds`` histogram."""

    def __init__(self, latency: dict[str, LatencyHistogram]) -> None:
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            f"{PREFIX}transfer_seconds",
            "Seconds each transfer job took to copy, by direction.",
            labels=["direction"],
        )
        for direction, histogram in self._latency.items():
            buckets = [(str(b), c) for b, c in zip(histogram.bounds, histogram.counts, strict=True)]
            buckets.append(("+Inf", histogram.count))
            family.add_metric([direction], buckets, histogram.total)
        yield family


class _NamedSamples(RestrictedRegistry):
    """The samples of the names a scrape asks for (``?name[]=...``), looked for in every
    collector's output."""

    def __init__(self, names: Iterable[str], registry: CollectorRegistry) -> None:
        names = frozenset(names)
        super().__init__(names, registry)
        self._names = names
        self._everything = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._everything.collect():
            samples = [sample for sample in metric.samples if sample.name in self._names]
            if samples:
                kept = copy.copy(metric)
                kept.samples = samples
                yield kept


class _Registry(CollectorRegistry):
    """A registry whose ``?name[]=`` filter finds our collectors' samples, and that shows
    each family once however many collectors yield it.

    prometheus_client's own filter collects only the collectors that ``describe()`` the
    names asked for; ours describe nothing, so that several of one kind (told apart by
    labels) share a registry without clashing, and the filter used to answer nothing.
    """

    def register(self, collector: Collector) -> None:
        """Refuse a collector that exports a series already exported (same name, same
        labels: two managers given the same labels, or one collector added twice). Such a
        scrape showed the series twice, each with its own value, and Prometheus kept only
        one of them, whichever it read first."""
        taken = set(_series(super().collect()))
        clash = [series for series in _series(collector.collect()) if series in taken]
        if clash:
            name, labels = clash[0]
            shown = ",".join(f'{key}="{value}"' for key, value in labels)
            raise InvalidArgumentError(
                f"metric {name}{{{shown}}} is exported already: {_clash_hint(collector)}"
            )
        super().register(collector)

    def restricted_registry(self, names: Iterable[str]) -> RestrictedRegistry:
        return _NamedSamples(names, self)

    def collect(self) -> Iterator[Metric]:
        """Each family once, with the samples of every collector that yields it: each of
        several collectors of one kind printed its own ``# HELP`` and ``# TYPE``, a family
        named twice, which strict parsers (OpenMetrics) refuse."""
        families: dict[str, Metric] = {}
        for metric in super().collect():
            found = families.get(metric.name)
            if found is None:
                families[metric.name] = copy.copy(metric)
            else:
                found.samples = found.samples + metric.samples
        yield from families.values()


def _clash_hint(collector: Collector) -> str:
    """What would tell ``collector``'s series from those served already, in the terms its
    constructor takes: a hint naming labels to a collector that takes none was false, and
    one saying a caller's own labelled metric takes none contradicted the series shown."""
    if isinstance(collector, ManagerCollector):
        return "give each manager's collector labels of its own (e.g. a tier or instance name)"
    if isinstance(collector, AdmissionCollector):
        return "give each lower tier's admission collector a tier of its own"
    if isinstance(collector, RecoveryCollector | TierCountsCollector | TransferCollector):
        return f"a {type(collector).__name__} takes no labels: add one to a server only once"
    # A caller's own collector (a prometheus_client metric): its labels are its own to set.
    return (
        "add each collector to a server once, its series told apart from those served by "
        "name or labels"
    )


def _series(metrics: Iterable[Metric]) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Each sample's name and sorted labels, in order: what a scrape may show once only."""
    return [
        (sample.name, tuple(sorted(sample.labels.items())))
        for metric in metrics
        for sample in metric.samples
    ]


class _ScrapeHandler(WSGIRequestHandler):
    """Answers one scrape, logging nothing; a client silent for the server's
    ``client_timeout_s`` is dropped, not waited for without end, and one that resets its
    connection (a TCP health check) is let go, not reported."""

    server: _ScrapeServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.client_timeout_s)

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            return  # the client sent no request in time: closing its connection is the answer
        except ConnectionError:
            # Gone before its request was read; raised on, socketserver printed a traceback
            # to stderr, amid the command's own output.
            return

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: one line per scrape would flood the log."""


class _ScrapeServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, not joined on close: one that hangs holds up nothing."""

    daemon_threads = True

    def __init__(self, host: str, port: int, client_timeout_s: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.client_timeout_s = client_timeout_s
        super().__init__((host, port), _ScrapeHandler)


def _port(port: object) -> int:
    """``port`` as an int in 0..65535: any integer type (``operator.index``: a NumPy integer
    read from a config array was refused as if out of range), not a bool (True served on
    port 1), a float or a str (each raised a bare ``TypeError``)."""
    number = integer_value(port)
    if number is None or not 0 <= number <= 65535:
        raise InvalidArgumentError(f"metrics port must be an integer in 0..65535, got {port!r}")
    return number


class MetricsServer:
    """An HTTP ``/metrics`` endpoint on 127.0.0.1 for one registry; ``port=0`` picks a free port.

    ``/metrics?name[]=NAME`` (repeatable) serves only the samples so named, e.g.
    ``kvoffload_lookups_total`` or ``kvoffload_transfer_seconds_count``. A connection that
    sends no request within ``client_timeout_s`` is closed: each held a thread and a socket
    for as long as its client kept it open, after :meth:`close` too.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", client_timeout_s: float = 10.0) -> None:
        port = _port(port)
        if not (isinstance(client_timeout_s, int | float) and 0 < client_timeout_s < math.inf):
            raise InvalidArgumentError(
                f"client_timeout_s must be a positive number of seconds, got {client_timeout_s!r}"
            )
        self.registry: CollectorRegistry = _Registry()
        # An IPv6 host as a URL writes it ([::1]) was looked up as a name and refused.
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            self._server = _ScrapeServer(host, port, client_timeout_s)
        except OSError as exc:
            # The host named too: an address not on this machine failed as "port 0".
            shown = f"[{host}]" if ":" in host else host
            raise InvalidArgumentError(f"cannot serve metrics on {shown}:{port}: {exc}") from None
        self._server.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvoffload-metrics", daemon=True
        )
        self._thread.start()
        self.port: int = self._server.server_port

    def add(self, collector: Collector) -> None:
        """Serve ``collector``'s metrics too; :class:`InvalidArgumentError` if one of its
        series (name and labels) is served already, e.g. a second manager's with the same
        labels."""
        self.registry.register(collector)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
