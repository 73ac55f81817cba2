"""Where the recommended configuration's writes go: which writes are read, and why not.

Replays a workload of the admission table through the recommended stack
(feedback admission in front of an LRU CPU tier) with a recorder between the
admission layer and the tier. Every write is classed by how it got in: on
first sight (the controller's speculative admission), split by the
controller's classes, or seen before (the sketch had counted the block in an
earlier request; the filter's rule). Per class it prints:

* writes per block reference, and the share that are *rewrites* (the key had
  been written and evicted before);
* the share of writes read at least once before eviction, and reads per write;
* of the writes never read: the share whose key a later request asked for
  while the copy was still in the tier (served by the GPU cache instead), and
  the share whose key came back only after the tier had evicted it (evicted
  too early);
* the share of evictions whose prefix block was no longer in the tier
  (unreachable copies: a lookup stops at the first missing block);
* median lifetimes, in blocks written, of unread and read copies (against
  the tier's size, the ghost's horizon).

    python benchmarks/admission_diagnostics.py [--seed N] rag:0.25 "default mix:0.25" ...

Rows are ``workload:share`` with the workload names of ``admission_table.py``.
The hit ratio and writes printed first equal the table's recommended column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import WORKLOADS
from kvoffload.admission.feedback import FeedbackAdmission, first_seen_class
from kvoffload.admission.sketch import key_hashes
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.sim.engine import ServingEngine
from kvoffload.sim.run import SimConfig

SEEN = "seen before"
FIRST = "first sight"
CLASS_NAMES = (
    "no known prefix",
    "no known prefix, last block",
    "GPU-served prefix",
    "GPU-served prefix, last block",
    "tier-served prefix",
    "tier-served prefix, last block",
)
"""The controller's first-seen classes, by ``first_seen_class``."""


class Copy:
    """One write's life in the tier."""

    __slots__ = ("asked", "origin", "reads", "written_at")

    def __init__(self, origin: str, written_at: int) -> None:
        self.origin = origin
        self.written_at = written_at
        self.reads = 0
        self.asked = 0
        """Later requests that referenced the key while this copy was held."""


class WriteRecorder(OffloadingManager):
    """Passes every call to ``inner`` and records the life of each written copy.

    ``layer`` (set once the admission layer wraps the recorder) tells the
    origin of a write: the layer's own test, a sketch count of at least 2;
    ``offer`` (set by :class:`RecordedFeedback`) the class of a first-seen one.
    """

    def __init__(self, inner: CPUOffloadingManager) -> None:
        self.inner = inner
        self.policy = inner.policy
        self.layer: FeedbackAdmission | None = None
        self.offer: tuple[OffloadKey, int, bool] | None = None
        """The last offer's last key, known prefix length, and whether the tier served it."""
        self.clock = 0
        self.held: dict[OffloadKey, Copy] = {}
        self.parent: dict[OffloadKey, OffloadKey] = {}
        self.gone: dict[OffloadKey, str] = {}
        """Unread evicted copies not yet asked for again, by origin."""
        self.written_keys: set[OffloadKey] = set()
        self.just_written: set[OffloadKey] = set()
        self.request: list[OffloadKey] = []
        self.writes: Counter[str] = Counter()
        self.rewrites: Counter[str] = Counter()
        self.read_once: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.asked_unread: Counter[str] = Counter()
        self.back_after_eviction: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.orphans: Counter[str] = Counter()
        self.life_unread: defaultdict[str, list[int]] = defaultdict(list)
        self.life_read: defaultdict[str, list[int]] = defaultdict(list)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self.request = keys
        fresh, self.just_written = self.just_written, set()
        for key in keys:
            if key in fresh:  # the post-store touch of the request that wrote it
                continue
            copy = self.held.get(key)
            if copy is not None:
                copy.asked += 1
            origin = self.gone.pop(key, None)
            if origin is not None:
                self.back_after_eviction[origin] += 1
        self.inner.touch(keys)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return self.inner.lookup(keys)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        keys = list(keys)
        for key in keys:
            copy = self.held[key]
            if copy.reads == 0:
                self.read_once[copy.origin] += 1
            copy.reads += 1
            self.reads[copy.origin] += 1
        return self.inner.prepare_load(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        keys = list(keys)
        output = self.inner.prepare_store(keys)
        if output is None:
            return None
        for key in output.evicted_keys:
            self._evicted(key)
        stored = output.keys_to_store
        if stored and self.layer is not None:
            seen = self.layer.sketch.estimate(key_hashes(stored)) >= 2
        else:
            seen = [False] * len(stored)
        position = {key: i for i, key in enumerate(self.request)}
        for key, old in zip(stored, seen, strict=True):
            origin = SEEN if old else f"{FIRST}: {self._class_of(key)}"
            self.clock += 1
            self.held[key] = Copy(origin, self.clock)
            self.just_written.add(key)
            self.writes[origin] += 1
            if key in self.written_keys:
                self.rewrites[origin] += 1
            self.written_keys.add(key)
            i = position.get(key, 0)
            if i > 0:
                self.parent[key] = self.request[i - 1]
        return output

    def _class_of(self, key: OffloadKey) -> str:
        if self.offer is None:
            return "unknown"
        last, prefix, tier_served = self.offer
        return CLASS_NAMES[first_seen_class(prefix, key == last, tier_served)]

    def _evicted(self, key: OffloadKey) -> None:
        copy = self.held.pop(key)
        origin = copy.origin
        self.evictions[origin] += 1
        life = self.clock - copy.written_at
        if copy.reads:
            self.life_read[origin].append(life)
        else:
            self.life_unread[origin].append(life)
            self.gone[key] = origin
            if copy.asked:
                self.asked_unread[origin] += 1
        parent = self.parent.pop(key, None)
        if parent is not None and parent not in self.held:
            self.orphans[origin] += 1

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.inner.complete_load(keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self.inner.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.inner.take_events()


class RecordedFeedback(FeedbackAdmission):
    """The recommended layer, telling its recorder the class inputs of each offer."""

    def __init__(self, recorder: WriteRecorder, capacity: int) -> None:
        super().__init__(recorder, capacity)
        self.recorder = recorder
        recorder.layer = self

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        tier_served = self._requests.origin(offered)[1]
        self.recorder.offer = (offered[-1], prefix, tier_served)
        return super()._admit(offered, prefix)


def diagnose(name: str, share: float, seed: int) -> str:
    """One workload at one capacity share, as the admission table sizes it."""
    workload = replace(WORKLOADS[name], seed=seed).load()
    unique = len({key for request in workload.requests for key in request.keys})
    gpu = max(int(0.02 * unique), max(len(r.keys) for r in workload.requests))
    cpu = int(share * unique)
    engine_config = SimConfig(gpu_blocks=gpu, cpu_blocks=cpu).engine_config(workload.block_tokens)
    recorder = WriteRecorder(CPUOffloadingManager(cpu, "lru"))
    layer = RecordedFeedback(recorder, cpu)
    stats = ServingEngine(engine_config, layer).run(workload.requests)
    refs = stats.refs
    hit = (stats.gpu_hit_blocks + stats.offload_hit_blocks) / refs
    lines = [
        f"{name} {share:.0%} ({cpu:,} blocks): hit {hit:.3f}, writes/ref "
        f"{(stats.stored_blocks + stats.stores_failed) / refs:.3f}, "
        f"tier hits/ref {stats.offload_hit_blocks / refs:.3f}"
    ]
    r = recorder
    first = sorted(label for label in r.writes if label.startswith(FIRST))
    groups = [(f"{FIRST} (all)", first), *((label, [label]) for label in first), (SEEN, [SEEN])]
    for title, labels in groups:
        if sum(r.writes[label] for label in labels):
            lines.append(_summary(r, title, labels, refs))
    return "\n".join(lines)


def _summary(r: WriteRecorder, title: str, labels: list[str], refs: int) -> str:
    """One line over the writes classed under ``labels``."""

    def total(counter: Counter[str]) -> int:
        return sum(counter[label] for label in labels)

    written, read = total(r.writes), total(r.read_once)
    unread = max(1, written - read)
    life_unread = [life for label in labels for life in r.life_unread[label]]
    life_read = [life for label in labels for life in r.life_read[label]]
    return (
        f"  {title}: writes/ref {written / refs:.3f}, rewrites {total(r.rewrites) / written:.2f}"
        f", read {read / written:.2f} ({total(r.reads) / written:.2f} reads/write); unread:"
        f" asked while held {total(r.asked_unread) / unread:.2f}, back after eviction"
        f" {total(r.back_after_eviction) / unread:.2f}; orphaned at eviction"
        f" {total(r.orphans) / max(1, total(r.evictions)):.2f}; median life unread"
        f" {_median(life_unread)} / read {_median(life_read)}"
    )


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):,.0f}" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("rows", nargs="+", help="workload:share, e.g. rag:0.25")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workloads")
    args = parser.parse_args()
    for row in args.rows:
        name, _, text = row.rpartition(":")
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        try:
            share = float(text)
        except ValueError:
            share = 0.0
        if not 0.0 < share <= 1.0:
            parser.error(f"share must be a number in (0, 1], got {text!r} in {row!r}")
        print(diagnose(name, share, args.seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
