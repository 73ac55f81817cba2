"""The backend's per-tier counters as Prometheus metrics, read at scrape time.

One family per counter, one sample per tier (``tier="disk"`` / ``"remote"``),
so one ``/metrics`` endpoint shows both tiers without repeating a family.
prometheus_client is imported here only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.integrations.sglang.paths import TierPath
from kvoffload.observe.metrics import PREFIX

NAME = f"{PREFIX}l3_"

COUNTER_DOCS = {
    "lookups": "batch_exists calls that reached the tier.",
    "lookup_hit_pages": "Pages the tier held when looked up.",
    "stores_offered": "Pages SGLang's host tier offered for writing.",
    "stores_admitted": "Offered pages the tier's admission layer let in.",
    "stores_skipped": "Offered pages the admission layer held back.",
    "stores_completed": "Pages written to the tier.",
    "stores_failed": "Admitted pages whose write failed.",
    "loads": "Pages read intact into the host pool.",
    "loads_failed": "Pages asked of the tier and not delivered (absent ones included).",
    "bytes_stored": "Bytes written to the tier.",
    "bytes_loaded": "Bytes read from the tier into the host pool.",
    "evictions": "Pages the tier evicted (disk) to make room.",
    "corrupt": "Stored values that failed their checks and were never loaded.",
    "unavailable": "Shared-tier calls refused by the open breaker or failed by the server.",
    "skipped_full": "Shared-tier pages not sent: the server refused a store as full (OOM) or "
    "unable to persist (MISCONF) less than a breaker cool-down ago.",
    "rejected": "Admitted pages that did not fit.",
}


HELD_TIERS = frozenset({"disk"})
"""The tiers whose held pages this process can count: the shared tier's server evicts, and
other instances write the same pages, so what it holds is the server's to say (the pages
this rank wrote there are ``stores_completed``)."""


class TierCollector(Collector):
    """``kvoffload_l3_<name>_total`` per tier, and the disk tier's ``kvoffload_l3_held_pages``
    gauge (:data:`HELD_TIERS`)."""

    def __init__(self, paths: Sequence[TierPath], labels: dict[str, str]) -> None:
        self._paths = list(paths)
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        names = ["tier", *self._labels]
        rows = [(path.name, path.counters().as_dict()) for path in self._paths]
        extra = list(self._labels.values())
        for name, doc in COUNTER_DOCS.items():
            family = CounterMetricFamily(f"{NAME}{name}", doc, labels=names)
            for tier, values in rows:
                family.add_metric([tier, *extra], values[name])
            yield family
        held = GaugeMetricFamily(
            f"{NAME}held_pages", "Pages in the disk tier's slot file.", labels=names
        )
        for tier, values in rows:
            if tier in HELD_TIERS:
                held.add_metric([tier, *extra], values["held_pages"])
        yield held
