"""Our disk and shared tiers as vLLM 0.33 secondary tiers, through vLLM's own tiering classes.

vLLM's ``TieringOffloadingSpec`` builds its CPU tier and loads our tiers out
of tree from the extra config, as in a served engine. Its CPU worker needs
CUDA, so the GPU -> CPU copies are played by writing CPU tensors' bytes into
the CPU tier's shared-memory rows (``TieringReplay.fill``); everything below
the CPU tier (cascades, lookups, promotions) is vLLM's code and ours.
"""

from __future__ import annotations

import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvoffload import block_id_key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyClusterProcesses, ValkeyProcess

torch = pytest.importorskip("torch")

BLOCK_BYTES = 4096
KEYS = [block_id_key(i) for i in range(1, 9)]


def _disk(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    from kvoffload.integrations.vllm.secondary import MODULE_PATH

    return {
        "type": "KVOffloadDiskTier",
        "module_path": MODULE_PATH,
        "disk_dir": str(tmp_path / "disk"),
        "disk_bytes": footprint(64, BLOCK_BYTES),
        **extra,
    }


def _shared(url: str, **extra: Any) -> dict[str, Any]:
    from kvoffload.integrations.vllm.secondary import MODULE_PATH

    return {
        "type": "KVOffloadSharedTier",
        "module_path": MODULE_PATH,
        "url": url,
        "remote_bytes": 64 * BLOCK_BYTES,
        **extra,
    }


class Engine:
    """vLLM's tiering manager over ``tiers``, driven request by request."""

    def __init__(
        self, tiers: list[dict[str, Any]], cpu_blocks: int, model: str, events: bool = False
    ) -> None:
        from kvoffload.integrations.vllm.secondary_replay import TieringReplay, tiering_spec

        self.spec = tiering_spec(
            tiers,
            cpu_blocks * BLOCK_BYTES,
            bytes_per_block=BLOCK_BYTES,
            engine_id=f"test-{uuid.uuid4().hex[:12]}",
            model=model,
            events=events,
        )
        self.manager = self.spec.get_manager()
        self.payloads: dict[OffloadKey, Any] = {}
        self.replay = TieringReplay(self.manager, fill=self._fill)
        self.closed = False

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    def _fill(self, key: OffloadKey, row: memoryview) -> None:
        """The worker's GPU -> CPU copy: a random CPU tensor's bytes into the chunk's row."""
        generator = torch.Generator().manual_seed(int.from_bytes(key[:4], "big"))
        tensor = torch.randint(-128, 128, (len(row),), dtype=torch.int8, generator=generator)
        torch.frombuffer(row, dtype=torch.int8).copy_(tensor)
        self.payloads[key] = tensor

    def loaded(self, keys: list[OffloadKey]) -> list[Any]:
        """Look ``keys`` up as vLLM's scheduler does, then the bytes of their CPU chunks."""
        from vllm.v1.kv_offload.base import ReqContext

        context = ReqContext(req_id=f"load-{uuid.uuid4().hex[:6]}")
        self.manager.on_new_request(context)
        assert self.replay.lookup(keys, context) == len(keys)
        spec = self.manager.prepare_load(keys, context)
        rows = [
            torch.frombuffer(self.replay.row(chunk), dtype=torch.int8).clone()
            for chunk in spec.block_ids.tolist()
        ]
        self.manager.complete_load(keys, context)
        self.manager.on_request_finished(context)
        return rows

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replay.close()
            self.manager.shutdown()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    """Builds engines (fresh engine ids); shuts them down even when a test fails."""
    made: list[Engine] = []

    def make(
        tiers: list[dict[str, Any]], cpu_blocks: int = 4, model: str = "m", events: bool = False
    ) -> Engine:
        engine = Engine(tiers, cpu_blocks, model, events)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_bytes_written_by_one_engine_come_back_in_the_next_from_the_disk_tier(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    first = engines([_disk(tmp_path, admission="none")])
    first.replay.request(KEYS[:4])
    disk = first.tiers[0]
    assert (disk.counters.written_blocks, disk.counters.write_failures) == (4, 0)
    assert disk.counters.bytes_written == 4 * BLOCK_BYTES
    payloads = first.payloads
    first.close()  # the slot file is the only copy now

    second = engines([_disk(tmp_path, admission="none")])
    rows = second.loaded(KEYS[:4])
    for row, key in zip(rows, KEYS[:4], strict=True):
        assert torch.equal(row, payloads[key])
    assert second.tiers[0].counters.loaded_blocks == 4


def test_bytes_round_trip_through_a_real_valkey_and_only_for_the_same_model(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    model = f"shared-{uuid.uuid4().hex[:8]}"
    first = engines([_shared(valkey_server.url, admission="none")], model=model)
    first.replay.request(KEYS[:3])
    assert first.tiers[0].counters.written_blocks == 3

    second = engines([_shared(valkey_server.url, admission="none")], model=model)
    rows = second.loaded(KEYS[:3])
    for row, key in zip(rows, KEYS[:3], strict=True):
        assert torch.equal(row, first.payloads[key])
    shared = second.tiers[0]
    assert (shared.counters.loaded_blocks, shared.counters.bytes_read) == (3, 3 * BLOCK_BYTES)
    other = engines([_shared(valkey_server.url, admission="none")], model="another-model")
    assert other.replay.request(KEYS[:3]) == 0  # another model's blocks are never offered


def test_bytes_round_trip_through_a_three_node_cluster(
    vllm_modules: dict[str, ModuleType],
    valkey_cluster: ValkeyClusterProcesses,
    engines: Callable[..., Engine],
) -> None:
    model = f"cluster-{uuid.uuid4().hex[:8]}"
    first = engines([_shared(valkey_cluster.url, admission="none")], model=model, cpu_blocks=8)
    first.replay.request(KEYS)
    assert first.tiers[0].counters.written_blocks == len(KEYS)
    second = engines([_shared(valkey_cluster.url, admission="none")], model=model, cpu_blocks=8)
    for row, key in zip(second.loaded(KEYS), KEYS, strict=True):
        assert torch.equal(row, first.payloads[key])


def test_a_planted_corrupt_block_is_never_loaded_and_not_asked_for_again(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    model = f"corrupt-{uuid.uuid4().hex[:8]}"
    first = engines([_shared(valkey_server.url, admission="none")], model=model)
    first.replay.request(KEYS[:2])
    second = engines([_shared(valkey_server.url, admission="none")], model=model)
    shared = second.tiers[0]
    name = shared.tier.name(KEYS[0])
    value = valkey_server.client().get(name)
    valkey_server.client().set(name, value[:-1] + bytes([value[-1] ^ 0xFF]))
    # Found on the server, promoted, failed its check: recomputed, never loaded.
    assert second.replay.request(KEYS[:2]) == 0
    assert shared.counters.load_failures >= 1
    assert shared.tier.stats.corrupt == 1
    # Deleted, and the recomputed block (the same bytes: fill is seeded by key) written again.
    assert valkey_server.client().get(name) == value


def test_a_broken_disk_block_fails_its_promotion_and_is_recomputed(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """vLLM's tiering manager takes a failed promotion job (its chunk's primary slot freed)
    where its connector worker would stop the engine for any failed job: the broken block
    is a miss, recomputed, never loaded, and our lookup does not promise it again."""
    from kvoffload.tiers.format import HEADER_BYTES

    engine = engines([_disk(tmp_path, admission="none")], cpu_blocks=2)
    engine.replay.request(KEYS[:2])
    engine.replay.request(KEYS[2:4])  # the 2-chunk CPU tier drops KEYS[:2]; the disk keeps them
    disk = engine.tiers[0]
    start = disk.tier.slot_offset(KEYS[0])
    assert start is not None
    with open(disk.tier.path, "r+b") as file:
        file.seek(start + HEADER_BYTES + len(KEYS[0]) + 7)
        byte = file.read(1)[0]
        file.seek(-1, 1)
        file.write(bytes([byte ^ 0xFF]))
    assert engine.replay.request(KEYS[:2]) == 0
    assert (disk.counters.load_failures, disk.tier.stats.corrupt) == (1, 1)
    # The recomputed block went to the CPU tier and down to the disk again.
    assert engine.replay.request(KEYS[:2]) == 2
    assert disk.tier.held(KEYS[:1]) == [True]


def test_a_lookup_and_a_promotion_go_by_a_disk_write_held_in_its_file_system_call(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request waits on its lookups and promotions, nobody on a cascade: while a cascade's
    disk write is held inside the file system (a slow disk), a block on the disk's other
    stripe is looked up and promoted, its bytes intact. Both waited behind the write, and
    every write queued before it, on the tier's one thread. The order decides, never a
    duration: the write is released only once the load is in."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvoffload.tiers.slot_file import SUPER_BYTES

    stripes = 2
    entry = _disk(tmp_path, admission="none", io_threads=stripes, disk_timeout_ms=300_000)
    engine = engines([entry], cpu_blocks=2)  # a deadline that never ends the held write
    engine.replay.request(KEYS[:2])
    engine.replay.request(KEYS[2:4])  # the 2-chunk CPU tier drops KEYS[:2]; the disk keeps them
    disk = engine.tiers[0].tier
    stride = disk.stride
    assert stride is not None

    def stripe(offset: int | None) -> int:
        assert offset is not None
        return (offset - SUPER_BYTES) // stride % stripes

    gate, holding, entered = _held_disk_writes(monkeypatch)
    manager = engine.manager
    cascade = ReqContext(req_id="cascade")
    manager.on_new_request(cascade)
    output = manager.prepare_store(KEYS[4:5], cascade)
    assert output is not None and list(output.keys_to_store) == KEYS[4:5]
    engine.replay.fill(KEYS[4], engine.replay.row(output.store_spec.block_ids.tolist()[0]))
    manager.complete_store(KEYS[4:5], cascade)  # the cascade to the disk tier
    manager.on_request_finished(cascade)
    try:
        assert holding.wait(30), "the cascade's write never reached the disk"
        # A read on the held write's stripe waits for it by the tier's design (a slot's I/O
        # runs in call order): the other stripe's blocks.
        free = [k for k in KEYS[:2] if stripe(disk.slot_offset(k)) != stripe(entered[0])]
        assert free
        loaded = engine.loaded(free)  # looked up, promoted, loaded from the CPU tier
        assert disk.deadline_misses == 0 and manager.has_pending_work()  # still held
    finally:
        gate.set()
    assert [bytes(row.numpy()) for row in loaded] == [
        bytes(engine.payloads[k].numpy()) for k in free
    ]
    engine.replay.settle()
    assert disk.held(KEYS[4:5]) == [True]
    assert engine.tiers[0].counters.written_blocks == 5


def test_a_lookup_and_a_promotion_go_by_a_shared_write_the_server_holds(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess, engines: Callable[..., Engine]
) -> None:
    """The same with the shared tier: the server holds its writes (``CLIENT PAUSE ...
    WRITE``; reads go on) while a cascade's SET is sent, and a stored block is looked up
    and promoted meanwhile, its bytes intact; the write lands once the server resumes."""
    from vllm.v1.kv_offload.base import ReqContext

    entry = _shared(own_server.start().url_with(300_000), admission="none")
    engine = engines([entry], cpu_blocks=2)  # a deadline that never ends the held write
    engine.replay.request(KEYS[:2])
    engine.replay.request(KEYS[2:4])  # the 2-chunk CPU tier drops KEYS[:2]; the server keeps them
    shared = engine.tiers[0]
    manager = engine.manager
    client = own_server.client()
    client.client_pause(300_000, all=False)
    try:
        cascade = ReqContext(req_id="cascade")
        manager.on_new_request(cascade)
        output = manager.prepare_store(KEYS[4:5], cascade)
        assert output is not None and list(output.keys_to_store) == KEYS[4:5]
        engine.replay.fill(KEYS[4], engine.replay.row(output.store_spec.block_ids.tolist()[0]))
        manager.complete_store(KEYS[4:5], cascade)  # the cascade to the shared tier
        manager.on_request_finished(cascade)
        # One: the cascade's chunk is pinned in the 2-chunk CPU tier until written.
        loaded = engine.loaded(KEYS[:1])  # looked up, promoted, loaded from the CPU tier
        assert manager.has_pending_work() and shared.counters.written_blocks == 4  # held
    finally:
        client.client_unpause()
    assert [bytes(row.numpy()) for row in loaded] == [bytes(engine.payloads[KEYS[0]].numpy())]
    engine.replay.settle()
    assert shared.counters.written_blocks == 5 and shared.counters.write_failures == 0


def _cascade(engine: Engine, key: OffloadKey) -> Any:
    """One request that stores ``key`` into the CPU tier, which cascades it, in an engine step
    of its own (vLLM 0.32 takes the tiers' finished jobs once a step); vLLM's output of the CPU
    tier's ``prepare_store`` (``None``: every chunk pinned, the store refused)."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    manager = engine.manager
    context = ReqContext(req_id=f"cascade-{uuid.uuid4().hex[:6]}")
    manager.on_new_request(context)
    output = manager.prepare_store([key], context)
    if output is not None:
        engine.replay.fill(key, engine.replay.row(output.store_spec.block_ids.tolist()[0]))
        manager.complete_store([key], context)
    manager.on_request_finished(context)
    manager.on_schedule_end(ScheduleEndContext((), ()))
    return output


def test_a_cascade_past_the_pending_bound_is_refused_and_pins_no_chunk(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk slower than the cascade (its write held in the file system): a cascade offered
    while those queued pin ``max_pending_write_bytes`` of the CPU tier is refused at once,
    counted, and vLLM unpins its chunk, so the CPU tier keeps taking stores. Queued behind
    the held write, every cascade kept its chunk pinned: the 2-chunk CPU tier refused the
    third store. Nothing refused is written; once the disk resumes the tier writes again."""
    entry = _disk(tmp_path, admission="none", max_pending_write_bytes=1, disk_timeout_ms=300_000)
    engine = engines([entry], cpu_blocks=2)  # a deadline that never ends the held write
    gate, holding, _ = _held_disk_writes(monkeypatch)
    tier = engine.tiers[0]
    try:
        assert _cascade(engine, KEYS[0]) is not None
        assert holding.wait(30), "the cascade's write never reached the disk"
        assert _cascade(engine, KEYS[1]) is not None  # refused: the first pins the bound
        assert (tier.counters.write_failures, tier.counters.writes_skipped_backlog) == (1, 1)
        third = _cascade(engine, KEYS[2])  # the CPU tier evicts the refused chunk for it
        assert third is not None and list(third.keys_to_store) == KEYS[2:3]
    finally:
        gate.set()
    engine.replay.settle()
    c = tier.counters
    assert (c.written_blocks, c.write_failures, c.writes_skipped_backlog) == (1, 2, 2)
    assert tier.tier.held(KEYS[:3]) == [True, False, False]
    engine.replay.request(KEYS[3:4])  # nothing pending: written again
    assert tier.tier.held(KEYS[3:4]) == [True] and tier.counters.written_blocks == 2


def test_a_shared_cascade_past_the_pending_bound_is_refused_while_the_server_holds_writes(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess, engines: Callable[..., Engine]
) -> None:
    """The same with the shared tier, its server holding writes (``CLIENT PAUSE ... WRITE``)."""
    entry = _shared(
        own_server.start().url_with(300_000), admission="none", max_pending_write_bytes=1
    )
    engine = engines([entry], cpu_blocks=2)  # a deadline that never ends the held write
    tier = engine.tiers[0]
    client = own_server.client()
    client.client_pause(300_000, all=False)
    try:
        assert _cascade(engine, KEYS[0]) is not None
        assert _cascade(engine, KEYS[1]) is not None  # refused: the first pins the bound
        third = _cascade(engine, KEYS[2])  # the CPU tier evicts the refused chunk for it
        assert third is not None and list(third.keys_to_store) == KEYS[2:3]
    finally:
        client.client_unpause()
    engine.replay.settle()
    c = tier.counters
    assert (c.written_blocks, c.write_failures, c.writes_skipped_backlog) == (1, 2, 2)
    assert tier.tier.held(KEYS[:3]) == [True, False, False]


def test_a_refused_cascade_and_a_served_request_are_ended_at_the_admission_layer(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cascade refused at the pending bound, and a request our tier served whole (nothing
    to write), offer nothing: each is begun and ended at the layer, as a written one is, so
    no request of theirs stays open for a later offer ending at the same key to be judged
    against (its prefix and tier hit) until the bounded record drops it."""
    from test_admission_entry_points import record

    first = engines([_disk(tmp_path, admission="none")])
    first.replay.request(KEYS[4:6])
    first.close()
    admits_all = {"admission": "sketch", "admission_params": {"threshold": 1}}
    entry = _disk(tmp_path, max_pending_write_bytes=1, disk_timeout_ms=300_000, **admits_all)
    engine = engines([entry], cpu_blocks=4)
    tier = engine.tiers[0]
    calls = record(tier.layer)
    gate, holding, _ = _held_disk_writes(monkeypatch)
    try:
        assert _cascade(engine, KEYS[0]) is not None
        assert holding.wait(30), "the cascade's write never reached the disk"
        assert _cascade(engine, KEYS[1]) is not None  # refused: the first pins the bound
    finally:
        gate.set()
    engine.replay.settle()
    assert tier.counters.writes_skipped_backlog == 1
    assert engine.replay.request(KEYS[4:6]) == 2  # served whole from our disk tier
    engine.close()  # the tier's thread has run every job
    assert tier.counters.served_blocks == 2
    assert [(name, keys) for name, keys, _ in calls] == [
        ("begin", KEYS[0:1]),
        ("end", KEYS[0:1]),
        ("begin", KEYS[1:2]),
        ("end", KEYS[1:2]),
        ("begin", KEYS[4:6]),
        ("end", KEYS[4:6]),
    ]


def test_a_bad_pending_bound_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    from kvoffload.integrations.vllm.secondary_settings import parse_disk_settings

    entry = _disk(tmp_path, max_pending_write_bytes="512MiB")
    assert parse_disk_settings("KVOffloadDiskTier", entry).max_pending_write_bytes == 2**29
    with pytest.raises(InvalidArgumentError) as caught:
        parse_disk_settings("KVOffloadDiskTier", {**entry, "max_pending_write_bytes": 0})
    assert str(caught.value) == (
        "secondary tier 'KVOffloadDiskTier' key 'max_pending_write_bytes': must be >= 1 byte, got 0"
    )


def test_a_block_whose_promotion_failed_is_judged_and_written_again_when_recomputed(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Our tier answered HIT, its read found the block broken: the request computes it, so its
    offer is judged and, admitted, written. It was taken for a block the tier had served (a
    sighting, never a write), so with any admission layer the broken block stayed unwritten."""
    from kvoffload.tiers.format import HEADER_BYTES

    admits_all = {"admission": "sketch", "admission_params": {"threshold": 1}}
    engine = engines([_disk(tmp_path, **admits_all)], cpu_blocks=2)
    engine.replay.request(KEYS[:2])
    engine.replay.request(KEYS[2:4])  # the 2-chunk CPU tier drops KEYS[:2]; the disk keeps them
    disk = engine.tiers[0]
    start = disk.tier.slot_offset(KEYS[0])
    assert start is not None
    with open(disk.tier.path, "r+b") as file:
        file.seek(start + HEADER_BYTES + len(KEYS[0]) + 7)
        byte = file.read(1)[0]
        file.seek(-1, 1)
        file.write(bytes([byte ^ 0xFF]))
    assert engine.replay.request(KEYS[:2]) == 0
    assert disk.counters.load_failures == 1
    assert disk.tier.held(KEYS[:2]) == [True, True]
    assert disk.counters.written_blocks == 5  # four, then the broken one again
    assert engine.replay.request(KEYS[2:4]) == 2  # the CPU tier has let KEYS[2:4] go
    assert engine.replay.request(KEYS[:2]) == 2  # and now KEYS[:2]: both from the disk


@pytest.mark.parametrize("fault", ["deleted", "server stopped"])
def test_a_shared_block_gone_between_the_hit_and_its_promotion_is_a_miss(
    vllm_modules: dict[str, ModuleType],
    own_server: ValkeyProcess,
    engines: Callable[..., Engine],
    fault: str,
) -> None:
    """Our lookup answered HIT (vLLM then reserved a CPU chunk and queued the promotion);
    the server evicts the block or goes away before the read: a failed promotion job,
    which vLLM's tiering manager turns into a miss."""
    import time

    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    own_server.start()
    model = f"gone-{uuid.uuid4().hex[:8]}"
    engines([_shared(own_server.url, admission="none")], model=model).replay.request(KEYS[:1])
    engine = engines([_shared(own_server.url, admission="none")], model=model)
    manager, shared = engine.manager, engine.tiers[0]
    context = ReqContext(req_id="reader")
    context.set_offload_key_position(KEYS[0], 16)
    manager.on_new_request(context)
    deadline = time.monotonic() + 30

    def step() -> None:
        assert time.monotonic() < deadline, "the tier never answered"
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.005)

    while (answer := manager.lookup(KEYS[0], context)) is LookupResult.RETRY:
        step()
    assert answer is LookupResult.HIT_PENDING  # our HIT: the promotion is queued, not read
    if fault == "deleted":
        own_server.client().delete(shared.tier.name(KEYS[0]))
    else:
        own_server.stop()
    step()  # the step's end submits the promotion
    while manager.has_pending_work():
        step()
    assert manager.lookup(KEYS[0], context) is LookupResult.MISS
    assert shared.counters.load_failures == 1
    manager.on_request_finished(context)


def test_admission_decides_what_the_cascade_writes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    everything = engines([_disk(tmp_path / "a", admission="none")])
    ours = engines([_disk(tmp_path / "b", admission="feedback")])
    blind = engines([_disk(tmp_path / "c", admission="feedback", offer_hits=False)])
    trio = (everything, ours, blind)

    def counts(name: str) -> list[int]:
        return [getattr(engine.tiers[0].counters, name) for engine in trio]

    for engine in trio:
        assert engine.replay.request(KEYS[:4]) == 0
    # vLLM's cascade reaches every tier; ours keeps a first-seen prompt out of the disk tier.
    assert counts("offered_blocks") == [4, 4, 4]
    assert counts("written_blocks") == [4, 0, 0]
    assert counts("skipped_blocks") == [0, 4, 4]
    for engine in trio:
        assert engine.replay.request(KEYS[:4]) == 4  # the CPU tier serves the repeat
    # offer_hits: the repeat is offered whole. No lookup of it reached our tier (the CPU
    # tier served them all), so which of its blocks were served is unknown: all are judged,
    # and ours, seeing the prompt come back, writes it now.
    assert counts("offered_blocks") == [4, 8, 4]
    assert counts("served_blocks") == [0, 0, 0]
    assert counts("written_blocks") == [4, 4, 0]
    for engine in trio:
        engine.replay.request(KEYS[4:8])  # the 4-block CPU tier evicts KEYS[:4]
    # First-seen blocks of its class are now worth writing; without offer_hits the tier
    # never saw the prompt return.
    assert counts("written_blocks") == [8, 8, 0]
    # Back after the CPU tier let it go: the disk serves vLLM's copy and ours; the blind
    # tier recomputes it, and, seen before, writes it now.
    assert [engine.replay.request(KEYS[:4]) for engine in trio] == [4, 4, 0]
    assert counts("served_blocks") == [0, 4, 0]
    assert counts("written_blocks") == [8, 8, 4]
    stats = ours.tiers[0].admission_stats()
    assert stats is not None and stats["admitted"] == 8 and stats["rejected"] == 4


def test_the_disk_tier_publishes_its_stores_and_evictions_as_vllm_kv_events(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from vllm.v1.kv_offload.base import Locality, Medium

    entry = _disk(tmp_path, admission="none", enable_kv_events=True, locality="LOCAL")
    engine = engines(
        [{**entry, "disk_bytes": footprint(4, BLOCK_BYTES)}], cpu_blocks=4, events=True
    )
    engine.replay.request(KEYS[:4])
    engine.replay.request(KEYS[4:6])  # the disk tier holds four: two are evicted
    taken = engine.replay.events + list(engine.manager.take_events())
    events = [e for e in taken if e.medium is Medium.STORAGE]
    assert all(e.locality is Locality.LOCAL for e in events)
    stored = [key for e in events if not e.removed for key in e.keys]
    removed = [key for e in events if e.removed for key in e.keys]
    assert sorted(stored) == sorted(KEYS[:6])
    assert len(removed) == 2 and set(removed) <= set(KEYS[:4])


def test_blocks_a_restarted_disk_tier_recovered_are_published_before_any_job(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """The disk tier announces the blocks it found on opening as stores; vLLM's first event
    poll publishes them, so a router learns what a restarted tier serves at once. They were
    held back until the tier's first cascade or promotion, which an idle engine never has."""
    from vllm.v1.kv_offload.base import Medium

    entry = _disk(tmp_path, admission="none", enable_kv_events=True)
    first = engines([entry], events=True)
    first.replay.request(KEYS[:3])
    first.close()  # the slot file keeps the blocks
    restarted = engines([entry], events=True)
    events = [e for e in restarted.manager.take_events() if e.medium is Medium.STORAGE]
    assert [(sorted(e.keys), e.removed) for e in events] == [(sorted(KEYS[:3]), False)]


def test_an_idle_restarted_engine_steps_until_the_recovered_blocks_are_published(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """vLLM steps an engine with no request only while its connector has pending work, and
    publishes each step's events: the disk tier's events not taken yet are pending work, so
    a restarted engine that gets no request still publishes the blocks its disk recovered
    (a router, not knowing them, would send it none of their prefixes)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash
    from vllm_scheduler import connector_scheduler, end_step

    entry = _disk(tmp_path, admission="none", enable_kv_events=True)
    first = engines([entry], events=True)
    first.replay.request(KEYS[:3])
    first.close()  # the slot file keeps the blocks
    restarted = engines([entry], events=True)
    scheduler = connector_scheduler(restarted.spec)
    published = set()
    for _ in range(100):  # what vLLM's engine asks before each step
        if not scheduler.has_pending_push_work():
            break
        end_step(scheduler)
        published |= {
            (type(event).__name__, event.medium, h)
            for event in scheduler.take_events()
            for h in event.block_hashes
        }
    assert not scheduler.has_pending_push_work()
    assert published == {
        ("BlockStored", "STORAGE", maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))))
        for k in KEYS[:3]
    }


def test_a_second_shutdown_does_nothing(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A retried shutdown, which vLLM's own tiers and CPU tier take, raised from our tier
    (its thread gone): vLLM's manager then raises too, before shutting its CPU tier down
    (it keeps the shared memory of a tier that failed to shut down)."""
    engine = engines([_disk(tmp_path)], cpu_blocks=2)
    engine.replay.request(KEYS[:2])
    engine.replay.close()
    engine.manager.shutdown()
    engine.manager.shutdown()
    engine.closed = True


def test_a_dead_server_is_counted_failures_and_misses_never_an_exception(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess, engines: Callable[..., Engine]
) -> None:
    own_server.start()
    engine = engines([_shared(own_server.url, admission="none")], cpu_blocks=2)
    engine.replay.request(KEYS[:2])
    shared = engine.tiers[0]
    assert shared.counters.written_blocks == 2
    own_server.stop()
    engine.replay.request(KEYS[2:4])  # cascades to a dead server; the CPU tier evicts
    assert shared.counters.write_failures >= 1
    assert shared.counters.written_blocks == 2
    # KEYS[:2] left the CPU tier; the shared tier cannot answer: a miss, recomputed.
    assert engine.replay.request(KEYS[:2]) == 0
    stats = engine.manager.get_stats()
    assert stats is not None


def test_writes_a_full_server_was_not_sent_reach_vllm_s_metrics(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess, engines: Callable[..., Engine]
) -> None:
    """After the server refuses a store as full (OOM), the shared tier drops stores unsent
    for its breaker's cool-down: counted apart, they reach vLLM's stats beside the failures."""
    from kvoffload.integrations.vllm.secondary import METRIC_PREFIX

    own_server.start()
    engine = engines([_shared(own_server.url, admission="none")], cpu_blocks=2)
    shared = engine.tiers[0]
    shared.tier.breaker.cooldown_s = 600.0  # the rest outlasts the test
    engine.replay.request(KEYS[:2])
    own_server.client().config_set("maxmemory", 1)  # full, under the default noeviction
    engine.replay.request(KEYS[2:4])  # refused: OOM
    engine.replay.request(KEYS[4:6])  # not sent
    c = shared.counters
    assert (c.written_blocks, c.write_failures, c.writes_skipped_full) == (2, 4, 2)
    stats = engine.manager.get_stats()
    assert stats is not None
    values = stats.data["data"]
    assert sum(values[f"{METRIC_PREFIX}writes_skipped_full"].values()) == 2
    assert sum(values[f"{METRIC_PREFIX}write_failures"].values()) == 4


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"disk_byte": 1}, "disk_byte"),
        ({"disk_bytes": None}, "disk_bytes"),
        ({"disk_bytes": 100}, "disk_bytes"),
        # A slot file past the largest file size: named after disk_dir, which is fine, before.
        ({"disk_bytes": 2**63, "admission": "none"}, "disk_bytes"),
        ({"disk_timeout_ms": 10**400}, "disk_timeout_ms"),  # an OverflowError before
        ({"admission": "bogus"}, "admission"),
        ({"eviction_policy": "fifo-ish"}, "eviction_policy"),
        ({"offer_hits": "yes"}, "offer_hits"),
        ({"io_threads": 0}, "io_threads"),
        # Digits int() cannot read: its ValueError, not one line, before.
        ({"io_threads": "²"}, "io_threads"),
        ({"disk_bytes": "4" * 5000}, "disk_bytes"),
        # JSON text nested past the decoder's depth: its RecursionError, before.
        ({"admission": "feedback", "admission_params": "[" * 100_000}, "admission_params"),
        ({"locality": "MARS"}, "locality"),
    ],
)
def test_a_bad_disk_entry_stops_start_up_naming_the_key(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    entry: dict[str, Any],
    key: str,
) -> None:
    from kvoffload.integrations.vllm.secondary_replay import tiering_spec

    tier = {k: v for k, v in {**_disk(tmp_path), **entry}.items() if v is not None}
    with pytest.raises(InvalidArgumentError, match=f"key '{key}'"):
        tiering_spec([tier], 4 * BLOCK_BYTES, engine_id=f"bad-{uuid.uuid4().hex[:8]}").get_manager()


def test_a_bad_shared_entry_stops_start_up_naming_the_key(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess
) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvoffload.integrations.vllm.secondary_replay import tiering_spec
    from kvoffload.tiers import RemoteTierError

    url = own_server.url  # never started: nothing listens there
    with pytest.raises(RemoteTierError, match=r"key 'url'.*not reachable"):
        tiering_spec([_shared(url)], 4 * BLOCK_BYTES, engine_id="bad-url").get_manager()
    without_bytes = {k: v for k, v in _shared(url).items() if k != "remote_bytes"}
    # Checked while vLLM builds its metric definitions, before any tier opens.
    with pytest.raises(InvalidArgumentError, match="key 'remote_bytes'"):
        TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [without_bytes]})
    with pytest.raises(InvalidArgumentError, match="key 'url'"):
        TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": [_shared("ftp://nowhere")]}
        )
    with pytest.raises(InvalidArgumentError, match="key 'remote_bytes'"):
        TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": [_shared(url, remote_bytes="²")]}
        )


MOONCAKE_REQUESTS = 1500
"""The trace's first requests: enough for the admission layers to learn, quick enough to test."""


def _replay_mooncake(
    requests: list[Any], admission: str, tmp_path: Path, server: ValkeyProcess
) -> tuple[float, int, int]:
    """Hit ratio and the bytes written to disk and to the server by one replay, sized as
    benchmarks/vllm_secondary.py does: GPU 2%, CPU 5%, disk 10%, server 25% of unique blocks."""
    from kvoffload.integrations.vllm.secondary_replay import TieringReplay, tiering_spec

    unique = len({key for request in requests for key in request.keys})
    gpu = max(unique // 50, max(len(r.keys) for r in requests))
    cpu, disk, remote = unique // 20, unique // 10, unique // 4
    client = server.client()
    client.execute_command("FLUSHALL", "SYNC")  # a lazy flush still counts in used_memory
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + remote * (BLOCK_BYTES + 400))
    client.config_set("maxmemory-policy", "allkeys-lru")
    tiers = [
        {
            **_disk(tmp_path / admission),
            "disk_bytes": footprint(disk, BLOCK_BYTES),
            "admission": admission,
        },
        {**_shared(server.url), "remote_bytes": remote * BLOCK_BYTES, "admission": admission},
    ]
    spec = tiering_spec(
        tiers,
        cpu * BLOCK_BYTES,
        bytes_per_block=BLOCK_BYTES,
        engine_id=f"mc-{uuid.uuid4().hex[:12]}",
    )
    manager = spec.get_manager()
    replay = TieringReplay(manager, gpu_blocks=gpu)
    try:
        result = replay.run(requests)
    finally:
        replay.close()
        manager.shutdown()
    on_disk, on_server = (tier.counters for tier in manager.secondary_tiers)
    assert on_disk.write_failures == on_server.write_failures == 0
    return result.hit_ratio, on_disk.bytes_written, on_server.bytes_written


def test_mooncake_replay_our_admission_cuts_the_cascade_writes_and_keeps_the_hit_ratio(
    vllm_modules: dict[str, ModuleType],
    mooncake_trace: Path,
    tmp_path: Path,
    own_server: ValkeyProcess,
    record_property: Callable[[str, object], None],
) -> None:
    from kvoffload.sim.traces import read_trace

    requests = read_trace(mooncake_trace).requests[:MOONCAKE_REQUESTS]
    own_server.start()
    everything = _replay_mooncake(requests, "none", tmp_path, own_server)
    ours = _replay_mooncake(requests, "recommended", tmp_path, own_server)
    report = (
        f"hit ratio {ours[0]:.3f} vs vLLM's cascade-everything {everything[0]:.3f}; "
        f"bytes written: disk {ours[1] / everything[1]:.2f}x, server {ours[2] / everything[2]:.2f}x"
    )
    record_property("mooncake", report)
    print(report)
    assert ours[1] <= 0.75 * everything[1] and ours[2] <= 0.75 * everything[2], report
    assert ours[0] >= everything[0] - 0.005, report


def test_each_tier_and_its_admission_layer_are_the_stack_builders_parts(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The secondary tiers open what the builder's opener opens and judge with the book it
    builds, from the entry's settings sized in chunks: no tier built on the side."""
    from kvoffload.admission import AdmissionLayer, FeedbackAdmission
    from kvoffload.admission.seen_twice import SketchAdmission
    from kvoffload.integrations.vllm import secondary
    from kvoffload.managers.admit_all import ReuseBook
    from kvoffload.policies.arc import ARCCachePolicy
    from kvoffload.tiers import DiskTier, RemoteTier

    opened: list[tuple[Any, Any]] = []
    books: list[tuple[Any, Any]] = []
    opener, book = secondary.tier_opener, secondary.tier_book

    def recording_opener(config: Any, fingerprint: bytes, **kwargs: Any) -> Any:
        open_tier = opener(config, fingerprint, **kwargs)

        def recording_open() -> Any:
            tier = open_tier()
            opened.append((config, tier))
            return tier

        return recording_open

    def recording_book(config: Any, spec: Any) -> Any:
        layer = book(config, spec)
        books.append((config, layer))
        return layer

    monkeypatch.setattr(secondary, "tier_opener", recording_opener)
    monkeypatch.setattr(secondary, "tier_book", recording_book)
    disk_entry = _disk(
        tmp_path,
        eviction_policy="arc",
        admission="sketch",
        admission_params={"threshold": 3},
        io_threads=3,
        disk_timeout_ms=2500,
    )
    engine = engines(
        [
            disk_entry,
            _shared(valkey_server.url, admission="feedback"),
            _shared(valkey_server.url, admission="filter", remote_bytes=8 * BLOCK_BYTES),
        ]
    )
    assert len(opened) == len(books) == len(engine.tiers) == 3
    for tier, (config, opened_tier), (book_config, layer) in zip(
        engine.tiers, opened, books, strict=True
    ):
        assert config is book_config is tier.tier_config
        assert tier.tier is opened_tier and tier.layer is layer
        assert isinstance(layer, AdmissionLayer) and layer.capacity == config.blocks
        assert opened_tier.fingerprint == tier.fingerprint
    disk, shared, filtered = engine.tiers
    assert isinstance(disk.tier, DiskTier) and isinstance(disk.tier.policy, ARCCachePolicy)
    assert disk.tier.capacity_blocks == disk.tier_config.blocks == 64
    assert disk.tier.deadline_s == 2.5
    assert isinstance(disk.layer, SketchAdmission) and disk.layer.threshold == 3
    assert isinstance(shared.tier, RemoteTier) and isinstance(shared.layer, FeedbackAdmission)
    assert shared.tier_config.blocks == 64
    assert isinstance(filtered.layer, ReuseBook) and filtered.tier_config.blocks == 8
    engine.replay.request(KEYS[:2])  # seen once: the filter's book admits nothing yet
    assert filtered.counters.written_blocks == 0 and filtered.layer.offers > 0


def test_remote_bytes_is_required_only_with_admission() -> None:
    from kvoffload.integrations.vllm.secondary_settings import parse_shared_settings

    entry = {"url": "redis://127.0.0.1:6379/0"}
    with pytest.raises(InvalidArgumentError, match="key 'remote_bytes'"):
        parse_shared_settings("KVOffloadSharedTier", entry)
    unbounded = parse_shared_settings("KVOffloadSharedTier", {**entry, "admission": "none"})
    assert unbounded.capacity_bytes == 0
    with pytest.raises(InvalidArgumentError, match="key 'remote_bytes'"):
        parse_shared_settings("KVOffloadSharedTier", {**entry, "remote_bytes": 0})


def test_a_key_set_to_null_takes_its_default(tmp_path: Path) -> None:
    from kvoffload.integrations.vllm.secondary_settings import (
        parse_disk_settings,
        parse_shared_settings,
    )

    unset = {"locality": None, "offer_hits": None, "write_budget": None, "admission": None}
    url = "redis://127.0.0.1:6379/0"
    shared = parse_shared_settings("KVOffloadSharedTier", {"url": url, "remote_bytes": 1 << 20})
    nulls = {"url": url, "remote_bytes": 1 << 20, **unset}
    assert parse_shared_settings("KVOffloadSharedTier", nulls) == shared
    assert shared.locality == "REMOTE"
    none = {"url": url, "admission": "none"}
    unbounded = parse_shared_settings("KVOffloadSharedTier", {**none, "remote_bytes": None})
    assert unbounded.capacity_bytes == 0
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 1 << 20}
    given = parse_disk_settings("KVOffloadDiskTier", disk)
    nulls = {**disk, **unset, "eviction_policy": None, "disk_timeout_ms": None}
    assert parse_disk_settings("KVOffloadDiskTier", nulls) == given
    with pytest.raises(InvalidArgumentError, match="key 'disk_dir': required"):
        parse_disk_settings("KVOffloadDiskTier", {**disk, "disk_dir": None})


@pytest.mark.parametrize("blank", ["", " ", "\n", "\t "])
def test_a_blank_directory_or_url_is_refused_before_anything_opens(blank: str) -> None:
    """A blank disk_dir named a directory of spaces (or a newline) in vLLM's working directory,
    which no setting meant; refused as an empty one is, and so is a blank url."""
    from kvoffload.integrations.vllm.secondary_settings import (
        parse_disk_settings,
        parse_shared_settings,
    )

    with pytest.raises(InvalidArgumentError, match="key 'disk_dir': must be a non-blank string"):
        parse_disk_settings("KVOffloadDiskTier", {"disk_dir": blank, "disk_bytes": 1 << 20})
    with pytest.raises(InvalidArgumentError, match="key 'url': must be a non-blank string"):
        parse_shared_settings("KVOffloadSharedTier", {"url": blank, "remote_bytes": 1 << 20})


def test_the_cascade_begins_and_ends_every_request_at_the_admission_layer(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    from test_admission_entry_points import record

    engine = engines([_disk(tmp_path, admission="sketch", admission_params={"threshold": 1})])
    layer = engine.tiers[0]._owner.layer
    assert layer is not None and layer.threshold == 1
    calls = record(layer)
    assert engine.replay.request(KEYS[:4]) == 0
    engine.close()  # the tier's thread has run every job
    assert [(name, keys) for name, keys, _ in calls] == [("begin", KEYS[:4]), ("end", KEYS[:4])]
    assert engine.tiers[0].counters.written_blocks == 4  # threshold 1: written on first sight


def test_lookups_out_of_prefix_order_find_every_block_the_tier_holds(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """vLLM asks a sliding-window layer's keys from the newest back: each key is answered
    on its own (a leading-run answer made every key after the newest, absent one a miss)."""
    import time

    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext
    from vllm_helpers import request_context

    first = engines([_disk(tmp_path, admission="none")], cpu_blocks=8)
    first.replay.request(KEYS[:5])
    first.close()
    second = engines([_disk(tmp_path, admission="none")], cpu_blocks=8)
    manager = second.manager
    context = request_context("sliding", KEYS[:6])
    manager.on_new_request(context)
    for _ in range(200):
        answers = [manager.lookup(key, context) for key in reversed(KEYS[:6])]
        if LookupResult.RETRY not in answers:
            break
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.01)
    assert answers[0] is LookupResult.MISS
    assert LookupResult.MISS not in answers[1:]
    manager.on_request_finished(context)
    second.replay.settle()
    counters = second.tiers[0].counters
    assert (counters.lookups, counters.lookup_hits) == (6, 5)


def test_blocks_computed_past_every_lookup_are_judged_and_written(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A turn whose prompt the CPU tier serves whole asks our tier nothing; its decode blocks
    (and a request never looked up) are still judged, and a layer that admits them writes
    them, while the served prompt, held already, is not written again."""
    from vllm_helpers import request_context

    admits_all = {"admission": "sketch", "admission_params": {"threshold": 1}}
    engine = engines([_disk(tmp_path, **admits_all)], cpu_blocks=16)
    manager, disk = engine.manager, engine.tiers[0]
    engine.replay.request(KEYS[:4])
    assert disk.counters.written_blocks == 4

    def store(context: Any, offer: list[OffloadKey]) -> None:
        output = manager.prepare_store(offer, context)
        chunks = output.store_spec.block_ids.tolist()
        for key, chunk in zip(output.keys_to_store, chunks, strict=True):
            engine._fill(key, engine.replay.row(chunk))
        manager.complete_store(output.keys_to_store, context)
        manager.on_request_finished(context)
        engine.replay.settle()

    turn = request_context("turn-2", KEYS[:7])
    manager.on_new_request(turn)
    assert engine.replay.lookup(KEYS[:4], turn) == 4  # all from the CPU tier
    manager.prepare_load(KEYS[:4], turn)
    manager.complete_load(KEYS[:4], turn)
    store(turn, KEYS[:7])  # offered whole: the served prompt, then three decode blocks
    unasked = request_context("short", KEYS[7:8])
    manager.on_new_request(unasked)
    store(unasked, KEYS[7:8])
    assert disk.tier.held(KEYS[:8]) == [True] * 8
    assert disk.counters.written_blocks == 8


def test_the_optimisers_whatif_sizes_count_what_the_tier_served_whole(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """A prompt our disk tier serves whole, turn after turn (the CPU tier evicts it in
    between), is offered back only as a sighting. Its sighting was begun as an offer that
    never came: the optimiser's mini-tiers scored its lookup and never stored it, so at
    every size but the real one (0.5x, 2x, 4x) the what-if figures said no rule would
    ever hit, though the tier served half of every turn's blocks."""
    prompt = [block_id_key(i) for i in range(100, 116)]
    first = engines([_disk(tmp_path, admission="none")], cpu_blocks=32)
    first.replay.request(prompt)
    first.close()
    engine = engines([_disk(tmp_path, admission="recommended")], cpu_blocks=16)
    tier = engine.tiers[0]
    for turn in range(6):
        assert engine.replay.request(prompt) == len(prompt)
        engine.replay.request([block_id_key(1000 + 100 * turn + i) for i in range(16)])
    engine.replay.settle()
    assert tier.counters.served_blocks == 6 * len(prompt)

    figures = tier.layer.stats().whatif
    assert {figure.capacity_factor for figure in figures} == {0.5, 1.0, 2.0, 4.0}
    for figure in figures:
        assert figure.hit_ratio is not None and figure.hit_ratio > 0.3, figure


def test_a_sighting_that_writes_nothing_reports_no_bytes_to_back_pressure(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request our tier served whole is offered back only as a sighting: its job moved no
    bytes, and says so (vLLM's back-pressure counts a job without a byte count as every
    block written, in no time)."""
    first = engines([_disk(tmp_path, admission="none")])
    first.replay.request(KEYS[:4])
    first.close()
    second = engines([_disk(tmp_path, admission="feedback")])
    tier = second.tiers[0]
    results: list[Any] = []
    finished = tier.get_finished_jobs

    def recorded() -> list[Any]:
        done = list(finished())
        results.extend(done)
        return done

    monkeypatch.setattr(tier, "get_finished_jobs", recorded)
    assert second.replay.request(KEYS[:4]) == 4
    assert tier.counters.served_blocks == 4 and tier.counters.written_blocks == 0
    # The promotion's job read four blocks; the sighting's wrote none.
    assert [result.transfer_bytes for result in results] == [4 * BLOCK_BYTES, 0]


def test_blocks_past_a_run_our_tier_served_whole_are_judged(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Every key vLLM asked our tier about was there, so no miss marks where the request's own
    blocks begin: those past the last key asked (its decode blocks) are judged and written,
    the served ones are not written again."""
    from vllm_helpers import request_context

    first = engines([_disk(tmp_path, admission="none")])
    first.replay.request(KEYS[:4])
    first.close()
    admits_all = {"admission": "sketch", "admission_params": {"threshold": 1}}
    engine = engines([_disk(tmp_path, **admits_all)], cpu_blocks=16)
    manager, disk = engine.manager, engine.tiers[0]
    turn = request_context("served", KEYS[:6])
    manager.on_new_request(turn)
    assert engine.replay.lookup(KEYS[:4], turn) == 4  # promoted from our disk tier
    manager.prepare_load(KEYS[:4], turn)
    manager.complete_load(KEYS[:4], turn)
    output = manager.prepare_store(KEYS[:6], turn)
    chunks = output.store_spec.block_ids.tolist()
    for key, chunk in zip(output.keys_to_store, chunks, strict=True):
        engine._fill(key, engine.replay.row(chunk))
    manager.complete_store(output.keys_to_store, turn)
    manager.on_request_finished(turn)
    engine.replay.settle()
    counters = disk.counters
    assert (counters.served_blocks, counters.written_blocks) == (4, 2)
    assert disk.tier.held(KEYS[:6]) == [True] * 6


@pytest.mark.parametrize("chunk", [-1, -2, 4, 2**40])
def test_a_chunk_past_the_cpu_tiers_region_fails_its_job_moving_no_byte(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    chunk: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A memoryview slice clips a row past the region to a short or empty one, and a negative
    start counts from the end (another chunk's bytes): a chunk id the CPU tier does not have
    fails its job, the tier untouched, never a wrong row written or read."""
    import numpy as np
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm_helpers import request_context

    engine = engines([_disk(tmp_path, admission="none")], cpu_blocks=4)
    engine.replay.request(KEYS[:4])
    disk = engine.tiers[0]
    before = [bytes(engine.replay.row(i)) for i in range(4)]
    context = request_context("bad-chunk", KEYS[4:6])
    disk.on_new_request(context)
    chunks = np.array([0, chunk], dtype=np.int64)
    disk.submit_store(TransferJob(901, KEYS[4:6], chunks, False, context))
    disk.submit_load(TransferJob(902, KEYS[:2], chunks, True, context))
    disk.drain_jobs()
    results = {result.job_id: result for result in disk.get_finished_jobs()}
    assert not results[901].success and not results[902].success
    assert not results[901].transfer_bytes and not results[902].transfer_bytes
    assert disk.tier.held(KEYS[4:6]) == [False, False]
    assert [bytes(engine.replay.row(i)) for i in range(4)] == before
    assert (disk.counters.written_blocks, disk.counters.loaded_blocks) == (4, 0)
    assert (disk.counters.write_failures, disk.counters.load_failures) == (2, 2)
    # Failed before any judgement, and `none` holds nothing back: not counted as skipped.
    assert disk.counters.skipped_blocks == 0
    assert f"chunk {chunk} is outside the CPU tier's 4 chunks" in caplog.text


def test_two_entries_naming_one_tier_stop_start_up(
    vllm_modules: dict[str, ModuleType], valkey_server: ValkeyProcess
) -> None:
    """Two identical entries are one tier written twice, and their metrics cannot be told
    apart (vLLM tells a tier no place of its own): refused, before either opens."""
    from kvoffload.integrations.vllm.secondary_replay import tiering_spec

    for second in ({}, {"locality": None, "write_budget": None}):  # a null is an unset key
        tiers = [_shared(valkey_server.url), _shared(valkey_server.url, **second)]
        spec = tiering_spec(tiers, 4 * BLOCK_BYTES, engine_id=f"twice-{uuid.uuid4().hex}")
        with pytest.raises(InvalidArgumentError, match="entries 1 and 2 of secondary_tiers"):
            spec.get_manager()


WHATIF_METRICS = (
    "vllm:kvoffload_whatif_hit_ratio",
    "vllm:kvoffload_whatif_writes_per_ref",
    "vllm:kvoffload_admission_candidate",
    "vllm:kvoffload_admission_switches",
)


def _reports_after_replay(engine: Engine) -> list[dict[str, Any]]:
    """vLLM's two stats reports after a chat workload: a tier's optimiser figures reach the
    report after the one that asked its thread for them (waited for here by a call that
    queues behind that read)."""
    from kvoffload.sim.generators import generate

    workload = generate({"chat": 1.0}, num_requests=300, seed=0, block_tokens=16, rate=2.0)
    engine.replay.run(workload.requests)
    first = engine.manager.get_stats()
    for tier in engine.tiers:
        tier.admission_stats()
    return [first.data, engine.manager.get_stats().data]


def _assert_vllm_shows_our_series(registry: Any, stats: Callable[[], Any], tier: str) -> None:
    """vLLM's ``/metrics`` shows every what-if, candidate and switch sample our own exporter
    shows for the tier labelled ``tier``, with the same value."""
    import prometheus_client

    from kvoffload.observe.metrics import AdmissionCollector

    ours = prometheus_client.CollectorRegistry()
    ours.register(AdmissionCollector(stats, tier))
    compared = 0
    for family in ours.collect():
        for sample in family.samples:
            labels = {**sample.labels, "engine": "0"}
            assert registry.get_sample_value(f"vllm:{sample.name}", labels) == sample.value
            compared += 1
    assert compared == 12 + 12 + 3 + 1  # what-if gauges, candidate gauges, switches


def _whatif_tiers(registry: Any) -> set[str]:
    """The ``tier`` labels of the what-if series vLLM's ``/metrics`` shows."""
    return {
        sample.labels["tier"]
        for family in registry.collect()
        if family.name in WHATIF_METRICS
        for sample in family.samples
    }


@pytest.mark.parametrize("shared_admission", ["recommended", "feedback"])
def test_each_tiers_optimiser_reaches_vllms_metrics_labelled_by_tier(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
    shared_admission: str,
) -> None:
    """A secondary tier's optimiser (``admission: recommended``, the default) exported
    nothing: its what-if figures, chosen rule and switches now reach vLLM's ``/metrics`` as
    the spec's lower tiers' do, labelled with vLLM's ``tier`` of each (``1:KVOffloadDiskTier``,
    ``2:KVOffloadSharedTier``), with the numbers our own exporter shows; a tier with another
    layer exports no what-if series."""
    from vllm_helpers import metrics_frontend

    from kvoffload.admission import OptimisingAdmission
    from kvoffload.integrations.vllm.secondary_replay import tiering_config

    tiers = [
        _disk(tmp_path, admission="recommended", disk_bytes=footprint(256, BLOCK_BYTES)),
        _shared(valkey_server.url, admission=shared_admission, remote_bytes=256 * BLOCK_BYTES),
    ]
    frontend, registry = metrics_frontend(tiering_config(tiers, 64 * BLOCK_BYTES).extra_config)
    engine = engines(tiers, cpu_blocks=64, model=f"whatif-{uuid.uuid4().hex[:8]}")
    for report in _reports_after_replay(engine):
        frontend.observe(report, 0)
    disk, shared = engine.tiers
    optimisers = {"1:KVOffloadDiskTier": disk.layer}
    if shared_admission == "recommended":
        optimisers["2:KVOffloadSharedTier"] = shared.layer
    for tier, layer in optimisers.items():
        assert isinstance(layer, OptimisingAdmission) and len(layer.stats().whatif) == 12
        _assert_vllm_shows_our_series(registry, layer.stats, tier)
        chosen = {"candidate": layer.chosen, "engine": "0", "tier": tier}
        assert registry.get_sample_value(WHATIF_METRICS[2], chosen) == 1.0
    assert _whatif_tiers(registry) == set(optimisers)
    engine.close()
    for tier in engine.tiers:  # vLLM may ask once more: never an exception into the engine
        assert tier.get_stats() is not None


def test_tiers_without_the_optimiser_declare_and_export_no_whatif_series(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    tiers = [
        _disk(tmp_path, admission="feedback", disk_bytes=footprint(256, BLOCK_BYTES)),
        _shared(valkey_server.url, admission="none"),
    ]
    definitions = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": tiers})
    assert not set(WHATIF_METRICS) & set(definitions)
    engine = engines(tiers, cpu_blocks=64, model=f"no-whatif-{uuid.uuid4().hex[:8]}")
    reported = {name for report in _reports_after_replay(engine) for name in report["data"]}
    assert "vllm:kvoffload_secondary_written_blocks" in reported  # the tiers did report
    assert not set(WHATIF_METRICS) & reported


def test_two_tiers_of_one_type_export_series_apart_labelled_as_vllm_labels_them(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, engines: Callable[..., Engine]
) -> None:
    """Two disk tiers both exported ``tier="disk"`` (what-if series) and
    ``tier_type="KVOffloadDiskTier"`` (counters): one series summed or overwritten by the
    other, and never the ``tier`` vLLM gives the same tier (``2:KVOffloadDiskTier``, its
    place in the list and its type), so a join with vLLM's own series matched nothing. Each
    tier's series now carry vLLM's ``tier`` label."""
    from vllm_helpers import metrics_frontend

    from kvoffload.integrations.vllm.secondary import METRIC_PREFIX
    from kvoffload.integrations.vllm.secondary_replay import tiering_config

    tiers = [
        _disk(tmp_path / "a", disk_bytes=footprint(256, BLOCK_BYTES)),
        _disk(tmp_path / "b", disk_bytes=footprint(128, BLOCK_BYTES)),
    ]
    frontend, registry = metrics_frontend(tiering_config(tiers, 64 * BLOCK_BYTES).extra_config)
    engine = engines(tiers, cpu_blocks=64, model=f"twins-{uuid.uuid4().hex[:8]}")
    for report in _reports_after_replay(engine):
        frontend.observe(report, 0)
    vllm_tiers = {
        sample.labels["tier"]
        for family in registry.collect()
        if family.name == "vllm:kv_offload_tiering_write_bytes"
        for sample in family.samples
    }
    tier_labels = ["1:KVOffloadDiskTier", "2:KVOffloadDiskTier"]
    assert set(tier_labels) <= vllm_tiers
    for tier, label in zip(engine.tiers, tier_labels, strict=True):
        written = {"engine": "0", "tier_type": "KVOffloadDiskTier", "tier": label}
        value = registry.get_sample_value(f"{METRIC_PREFIX}written_blocks_total", written)
        assert value == tier.counters.written_blocks > 0
        _assert_vllm_shows_our_series(registry, tier.layer.stats, label)
    assert _whatif_tiers(registry) == set(tier_labels)
    threads = {thread.name.rpartition("_")[0] for thread in threading.enumerate()}
    assert {f"kvoffload-{label}" for label in tier_labels} <= threads  # told apart in a dump


class _Interleaved:
    """One request of the state machine below: its keys, context, hits and whether stored."""

    def __init__(self, context: Any, keys: list[OffloadKey], whole: bool) -> None:
        self.context, self.keys, self.whole = context, keys, whole
        self.hits: int | None = None
        self.stored = False


def _interleaving_machine(disk_dir: Callable[[], str], promoted: list[int]) -> Any:
    """vLLM's tiering manager over our disk tier, requests interleaved as its scheduler may
    (looked up, stored and finished in any order, steps between): every row a hit loads holds
    its key's bytes (a promotion's from our tier), vLLM's own asserts on what a tier reports
    hold, and the work in flight drains. ``promoted``: each example's promoted blocks."""
    import hashlib
    import time

    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
    from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ScheduleEndContext
    from vllm_helpers import request_context

    from kvoffload.integrations.vllm.secondary_replay import tiering_spec

    keys = [block_id_key(i) for i in range(1, 17)]

    def payload(key: OffloadKey, size: int) -> bytes:
        return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]

    class Interleaved(RuleBasedStateMachine):
        @initialize(
            admission=st.sampled_from(["none", "feedback", "sketch"]),
            disk_blocks=st.integers(4, 16),
            # At least a request's chunks: a smaller CPU tier lets one request's promotions
            # evict each other for ever (vLLM's own fs tier too).
            cpu_blocks=st.integers(4, 6),
        )
        def build(self, admission: str, disk_blocks: int, cpu_blocks: int) -> None:
            params = {"admission_params": {"threshold": 1}} if admission == "sketch" else {}
            entry = {
                **_disk(Path(disk_dir())),
                "disk_bytes": footprint(disk_blocks, BLOCK_BYTES),
                "admission": admission,
                **params,
            }
            engine_id = f"interleaved-{uuid.uuid4().hex[:8]}"
            spec = tiering_spec([entry], cpu_blocks * BLOCK_BYTES, engine_id=engine_id)
            self.manager = spec.get_manager()
            view = self.manager.primary_tier.get_kv_memoryview()
            self.rows, self.row_bytes = view.cast("B"), view.strides[0]
            self.live: dict[str, _Interleaved] = {}
            self.count = 0

        def row(self, chunk: int) -> memoryview:
            return self.rows[chunk * self.row_bytes : (chunk + 1) * self.row_bytes]

        def step(self) -> None:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(0.001)

        @rule(start=st.integers(0, 12), length=st.integers(1, 4))
        def arrive(self, start: int, length: int) -> None:
            self.count += 1
            context = request_context(f"r{self.count}", keys[start : start + length])
            policy = self.manager.on_new_request(context).policy
            whole = policy is OffloadPolicy.REQUEST_LEVEL
            self.live[context.req_id] = _Interleaved(context, keys[start : start + length], whole)

        @precondition(lambda self: any(r.hits is None for r in self.live.values()))
        @rule(data=st.data())
        def look_up(self, data: Any) -> None:
            waiting = sorted(name for name, r in self.live.items() if r.hits is None)
            request = self.live[data.draw(st.sampled_from(waiting))]
            deadline = time.monotonic() + 30
            while True:  # as vLLM's scheduler: stop at a miss, ask again next step
                hits, pending = 0, False
                for key in request.keys:
                    answer = self.manager.lookup(key, request.context)
                    if answer is LookupResult.MISS:
                        break
                    if answer is LookupResult.HIT and not pending:
                        hits += 1
                    elif answer is not LookupResult.HIT:
                        pending = True
                if not pending:
                    break
                assert time.monotonic() < deadline, "a lookup never settled"
                self.step()
            request.hits = hits
            if hits:
                served = request.keys[:hits]
                spec = self.manager.prepare_load(served, request.context)
                for key, chunk in zip(served, spec.block_ids.tolist(), strict=True):
                    assert bytes(self.row(chunk)) == payload(key, self.row_bytes), key
                self.manager.complete_load(served, request.context)

        def ready(self) -> list[str]:
            return sorted(n for n, r in self.live.items() if r.hits is not None and not r.stored)

        @precondition(lambda self: bool(self.ready()))
        @rule(data=st.data())
        def store(self, data: Any) -> None:
            request = self.live[data.draw(st.sampled_from(self.ready()))]
            request.stored = True
            # vLLM's connector skips the offload hit only for chunk-level requests.
            skipped = 0 if request.whole else request.hits or 0
            offer = request.keys[skipped:]
            output = self.manager.prepare_store(offer, request.context)
            if output is None or not output.keys_to_store:
                return
            chunks = output.store_spec.block_ids.tolist()
            for key, chunk in zip(output.keys_to_store, chunks, strict=True):
                self.row(chunk)[:] = payload(key, self.row_bytes)
            self.manager.complete_store(output.keys_to_store, request.context)

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data())
        def finish(self, data: Any) -> None:
            request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
            self.manager.on_request_finished(request.context)

        @rule()
        def end_step(self) -> None:
            self.step()

        def teardown(self) -> None:
            if not hasattr(self, "manager"):
                return
            for request in self.live.values():
                self.manager.on_request_finished(request.context)
            deadline = time.monotonic() + 30
            while self.manager.has_pending_work():
                assert time.monotonic() < deadline, "the tiers' work never drained"
                self.step()
            self.rows.release()
            self.manager.shutdown()
            promoted.append(self.manager.secondary_tiers[0].counters.loaded_blocks)

    return Interleaved


def test_interleaved_requests_promote_only_their_own_bytes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    from hypothesis import HealthCheck, settings

    directories = iter(range(10**6))
    loaded: list[int] = []
    machine = _interleaving_machine(lambda: str(tmp_path / f"disk-{next(directories)}"), loaded)
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=80,
        deadline=None,
        derandomize=True,  # the same requests each run: the count of promotions below too
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
    assert sum(loaded) > 0, "no example promoted a block: the machine checked none"


def _held_disk_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event, list[int]]:
    """Hold each disk write in the file system until the gate (first) is set: the second event
    is set once a write is held, the list gets the offsets of those held."""
    from kvoffload.tiers.slot_file import FileLayer

    gate, holding, entered = threading.Event(), threading.Event(), []
    write = FileLayer.pwritev

    def held_write(layer: FileLayer, fd: int, buffers: Any, offset: int) -> int:
        if not gate.is_set():
            entered.append(offset)
            holding.set()
            gate.wait(60)
        return write(layer, fd, buffers, offset)

    monkeypatch.setattr(FileLayer, "pwritev", held_write)
    return gate, holding, entered


def test_the_secondary_counters_dict_holds_every_counter_and_is_a_copy() -> None:
    import dataclasses

    with warnings.catch_warnings():  # vLLM's first import here warns of torch's deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvoffload.integrations.vllm.secondary import SecondaryCounters

    names = [field.name for field in dataclasses.fields(SecondaryCounters)]
    counters = SecondaryCounters(**{name: i + 1 for i, name in enumerate(names)})
    read = counters.as_dict()
    assert list(read.items()) == list(dataclasses.asdict(counters).items())
    read["lookups"] += 100
    assert counters.lookups == 1
    assert counters.minus(SecondaryCounters(lookups=1)).as_dict() == {**read, "lookups": 0}
