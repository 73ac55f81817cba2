"""The engine drives the manager in the connector's order (reference section 4.5)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pytest

from kvoffload import block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.sim.engine import EngineConfig, EngineStats, ServingEngine
from kvoffload.sim.transfers import NullTransferBackend
from kvoffload.sim.workload import Workload

Call = tuple[str, list[int]] | tuple[str, list[int], bool]


def ids(keys: Iterable[OffloadKey]) -> list[int]:
    return [int.from_bytes(k[:8], "big") for k in keys]


class RecordingManager(OffloadingManager):
    """A dict-based tier of unlimited size that records every call."""

    def __init__(self, refuse_stores: bool = False) -> None:
        self.calls: list[Call] = []
        self.ready: set[OffloadKey] = set()
        self.pending: set[OffloadKey] = set()
        self.refuse_stores = refuse_stores

    def lookup(self, keys: Iterable[OffloadKey]) -> int:
        keys = list(keys)
        self.calls.append(("lookup", ids(keys)))
        hits = 0
        while hits < len(keys) and keys[hits] in self.ready:
            hits += 1
        return hits

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        keys = list(keys)
        self.calls.append(("prepare_load", ids(keys)))
        return CPULoadStoreSpec(range(len(keys)))

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.calls.append(("touch", ids(keys)))

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.calls.append(("complete_load", ids(keys)))

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        keys = list(keys)
        self.calls.append(("prepare_store", ids(keys)))
        if self.refuse_stores:
            return None
        new = [k for k in keys if k not in self.ready and k not in self.pending]
        self.pending.update(new)
        return PrepareStoreOutput(new, CPULoadStoreSpec(range(len(new))), [])

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        keys = list(keys)
        self.calls.append(("complete_store", ids(keys), success))
        self.pending.difference_update(keys)
        if success:
            self.ready.update(keys)


class FailingBackend(NullTransferBackend):
    """Every transfer reports failure."""

    def finish(self, job_id: int) -> bool:
        return False


Replay = Callable[..., EngineStats]


@pytest.fixture
def replay(make_workload: Callable[..., Workload]) -> Replay:
    def run(
        requests: Sequence[list[int]],
        manager: OffloadingManager,
        gpu_blocks: int = 3,
        backend: NullTransferBackend | None = None,
    ) -> EngineStats:
        config = EngineConfig(gpu_blocks=gpu_blocks, bytes_per_block=1 << 20, block_tokens=16)
        return ServingEngine(config, manager, backend).run(make_workload(*requests).requests)

    return run


def test_call_order_store_then_load_after_gpu_eviction(replay: Replay) -> None:
    manager = RecordingManager()
    stats = replay([[1, 2, 3], [4, 5, 6], [1, 2, 7]], manager)
    assert manager.calls == [
        ("touch", [1, 2, 3]),
        ("lookup", [1, 2, 3]),
        ("prepare_store", [1, 2, 3]),
        ("touch", [1, 2, 3]),
        ("complete_store", [1, 2, 3], True),
        ("touch", [4, 5, 6]),
        ("lookup", [4, 5, 6]),
        ("prepare_store", [4, 5, 6]),
        ("touch", [4, 5, 6]),
        ("complete_store", [4, 5, 6], True),
        ("touch", [1, 2, 7]),
        ("lookup", [1, 2, 7]),
        ("prepare_load", [1, 2]),
        ("complete_load", [1, 2]),
        ("prepare_store", [7]),
        ("touch", [1, 2, 7]),
        ("complete_store", [7], True),
    ]
    assert (stats.refs, stats.gpu_hit_blocks, stats.offload_hit_blocks) == (9, 0, 2)
    assert (stats.computed_blocks, stats.stored_blocks) == (7, 7)


def test_lookup_only_past_the_gpu_hit_and_none_when_all_cached(replay: Replay) -> None:
    manager = RecordingManager()
    stats = replay([[1, 2], [1, 2, 3], [1, 2, 3]], manager, gpu_blocks=4)
    assert manager.calls[5:] == [
        ("touch", [1, 2, 3]),
        ("lookup", [3]),
        ("prepare_store", [3]),
        ("touch", [1, 2, 3]),
        ("complete_store", [3], True),
        ("touch", [1, 2, 3]),
    ]
    assert (stats.gpu_hit_blocks, stats.lookups) == (5, 2)


def test_prepare_store_none_means_not_stored(replay: Replay) -> None:
    manager = RecordingManager(refuse_stores=True)
    stats = replay([[1, 2, 3], [4, 5, 6], [1, 2, 3]], manager)
    names = [call[0] for call in manager.calls]
    assert names == ["touch", "lookup", "prepare_store"] * 3
    assert (stats.stores_rejected, stats.stored_blocks, stats.offload_hit_blocks) == (9, 0, 0)


def test_failed_transfers_unpin_and_recompute(replay: Replay) -> None:
    manager = RecordingManager()
    manager.ready.update([block_id_key(1), block_id_key(2)])
    stats = replay([[1, 2, 3]], manager, backend=FailingBackend())
    assert ("complete_load", [1, 2]) in manager.calls
    assert ("complete_store", [3], False) in manager.calls
    assert (stats.offload_hit_blocks, stats.loads_failed, stats.stores_failed) == (0, 2, 1)
    assert stats.computed_blocks == 3
