"""Admission layers over the real CPU manager: request inference, decisions, counters, registry."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvoffload import (
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    InvalidArgumentError,
    OffloadKey,
    block_id_key,
)
from kvoffload.admission import (
    FeedbackAdmission,
    OptimisingAdmission,
    RequestTracker,
    SketchAdmission,
    available_admissions,
    find_admission,
    resolve_admission,
    wrap_with_admission,
)
from kvoffload.admission.feedback import first_seen_class, root_group
from kvoffload.admission.worlds import Probe, World
from kvoffload.core.keys import NotAKeyIterableError
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.managers import build_manager
from kvoffload.managers.admit_all import ReuseBook, admission_book
from kvoffload.policies.lru import LRUCachePolicy


def keys(*ids: int) -> list[OffloadKey]:
    return [block_id_key(i) for i in ids]


def serve(
    manager: FeedbackAdmission | SketchAdmission, request: list[OffloadKey]
) -> list[OffloadKey]:
    """One request in the engine's call order, with no GPU cache; returns the stored keys."""
    manager.touch(request)
    hits = manager.lookup(request) or 0
    if hits:
        manager.prepare_load(request[:hits])
        manager.complete_load(request[:hits])
    out = manager.prepare_store(request[hits:]) if hits < len(request) else None
    if out is None or not out.keys_to_store:
        return []
    manager.touch(request)
    manager.complete_store(out.keys_to_store)
    return out.keys_to_store


def test_tracker_counts_each_request_once_in_the_engine_order() -> None:
    tracker = RequestTracker()
    request = keys(1, 2, 3)
    assert tracker.on_touch(request)  # the request starts
    assert not tracker.on_lookup(request[1:])  # lookup past the GPU hit: same request
    assert tracker.prefix_length(request[1:]) == 1
    tracker.on_store(request[1:], stored_any=True)
    assert not tracker.on_touch(request)  # the post-store touch
    assert tracker.on_touch(request)  # the same prompt again: a new request


def test_tracker_counts_a_driver_without_touch_once_per_request() -> None:
    tracker = RequestTracker()
    request = keys(1, 2)
    assert tracker.on_lookup(request)
    assert not tracker.on_lookup(request)  # a re-poll
    tracker.on_store(request, stored_any=True)
    assert tracker.on_lookup(request)


def test_sketch_admission_stores_from_the_second_request_even_if_the_gpu_held_it() -> None:
    layer = SketchAdmission(CPUOffloadingManager(16), capacity=16)
    assert serve(layer, keys(1, 2)) == []
    # The blocks were GPU hits the second time: only touched, never looked up.
    layer.touch(keys(1, 2))
    assert serve(layer, keys(1, 2, 3)) == keys(1, 2)
    stats = layer.stats()
    assert (stats.offers, stats.admitted, stats.rejected) == (5, 2, 3)
    assert stats.ghost_hits == 2  # 1 and 2 were rejected, then seen again
    assert stats.control == 2.0


def test_feedback_stops_writing_a_one_shot_scan() -> None:
    capacity = 64
    layer = FeedbackAdmission(CPUOffloadingManager(capacity), capacity)
    written = [len(serve(layer, keys(*range(i * 8, i * 8 + 8)))) for i in range(200)]
    # The scan never comes back: at most the sketch's rare false "seen before" is written.
    assert sum(written[-100:]) <= 8
    assert layer.controller.class_rate(0) < 0.1  # no known prefix, not the last block
    assert layer.stats().control < 1.0


def test_feedback_keeps_writing_continuations_that_come_back() -> None:
    capacity = 64
    layer = FeedbackAdmission(CPUOffloadingManager(capacity), capacity)
    hits = 0
    for conversation in range(60):
        base = conversation * 1000
        history: list[OffloadKey] = []
        for turn in range(4):
            history = history + keys(*range(base + turn * 4, base + turn * 4 + 4))
            hits += layer.lookup(history) or 0
            serve(layer, history)
    # Each turn extends a prefix the tier served (classes 4 and 5); a conversation with a
    # root never seen before gets its class's pooled decision.
    controller, fresh = layer.controller, root_group(block_id_key(10**6))
    assert controller.admits(controller.tag(first_seen_class(1, False, True), fresh))
    assert controller.admits(controller.tag(first_seen_class(1, True, True), fresh))
    assert hits > 0


def test_feedback_judges_each_root_prefix_on_its_own_traffic() -> None:
    """Two applications behind their own system prompts: one's turns come back, the other's
    questions never do. Both extend a prefix the tier serves (one class), yet only the first
    one's new blocks are written on first sight."""
    capacity = 256
    layer = FeedbackAdmission(CPUOffloadingManager(capacity), capacity)
    chat_root, rag_root = keys(1, 2), keys(500_000, 500_001)
    assert root_group(chat_root[0]) != root_group(rag_root[0])
    written = {"chat": 0, "rag": 0}
    for i in range(300):
        base = 1000 + i * 100
        first_turn = chat_root + keys(base, base + 1, base + 2)
        stored = {"chat": serve(layer, first_turn)}
        serve(layer, first_turn + keys(base + 3, base + 4))
        stored["rag"] = serve(layer, rag_root + keys(base + 50, base + 51, base + 52))
        if i >= 200:
            written = {app: written[app] + len(stored[app]) for app in written}
    assert written["chat"] >= 250  # most first turns of the last 100 written at once
    assert written["rag"] <= 10  # the never-reused questions are not


def test_feedback_stats_report_a_bounded_footprint() -> None:
    small = FeedbackAdmission(CPUOffloadingManager(100), 100).stats()
    large = FeedbackAdmission(CPUOffloadingManager(10_000), 10_000).stats()
    assert small.tracked_keys < large.tracked_keys
    assert 0 < large.bytes_per_tracked_key < 100
    assert large.memory_bytes < 100 * large.tracked_keys


def test_reported_memory_covers_the_open_requests_an_optimiser_world_keeps() -> None:
    """A world's feedback rule is told each request up front and never of the touch or the
    end that closes it: its table of open requests fills (4,096 entries, about 0.7 MB) and
    stays full. The rule's memory once left the table out."""
    rule = FeedbackAdmission(Probe(), 32)
    world = World(32, LRUCachePolicy, rule)
    for i in range(5000):
        world.request(keys(*range(i * 6, i * 6 + 6)), gpu_held=6)  # the GPU held them all
    table = rule._requests._open
    assert len(table) == rule._requests.capacity  # requests long done
    held = sys.getsizeof(table) + sum(sys.getsizeof(entry) for entry in table.values())
    tables = rule.sketch.memory_bytes + rule.ghost.memory_bytes + rule.controller.memory_bytes
    assert rule.stats().memory_bytes - tables >= held


def test_registry_names_aliases_and_errors() -> None:
    assert {"feedback", "filter", "none", "optimiser", "recommended", "reuse", "sketch"} <= set(
        available_admissions()
    )
    assert resolve_admission("recommended") == "optimiser"
    cpu = CPUOffloadingManager(4)
    assert wrap_with_admission("none", cpu, 4) is cpu
    with pytest.raises(InvalidArgumentError) as error:
        wrap_with_admission("tinylfu", cpu, 4)
    assert str(error.value).endswith(f"known: {', '.join(available_admissions())}")
    with pytest.raises(InvalidArgumentError, match="capacity"):
        FeedbackAdmission(cpu, 0)


def test_build_manager_stacks_the_seed_filter_outside_the_admission_layer() -> None:
    manager = build_manager(8, "s3fifo", store_threshold=2, admission="recommended")
    assert isinstance(manager, FilterReusedOffloadingManager)
    layer = find_admission(manager)
    assert isinstance(layer, OptimisingAdmission)
    assert isinstance(layer.backing, CPUOffloadingManager)
    assert find_admission(build_manager(8)) is None


@pytest.mark.parametrize("layer_class", [FeedbackAdmission, SketchAdmission])
def test_memory_stays_bounded_whatever_the_traffic(
    layer_class: type[FeedbackAdmission] | type[SketchAdmission],
) -> None:
    capacity = 32
    layer = layer_class(CPUOffloadingManager(capacity), capacity)
    before = layer.stats()
    for i in range(1500):
        serve(layer, keys(*range(i * 6, i * 6 + 6)))
    after = layer.stats()
    assert (after.memory_bytes, after.tracked_keys) == (before.memory_bytes, before.tracked_keys)
    assert len(layer.ghost) <= capacity
    assert len(layer._requests._open) <= 1  # every request was recognised and closed
    assert layer.sketch.resets > 0  # aged: old sightings do not pile up


def test_the_filter_as_a_tier_s_book_reports_its_table_s_memory() -> None:
    """A lower tier's ``filter`` (vLLM's secondary tiers, SGLang's L3) reported 160 bytes a
    tracked key, the ghost list's figure, for a table that counts its own bytes: 10.2 MB for
    the default 64,000 keys where the compiled table takes 3.7 MB. It reports the table's
    figure now, the one the optimiser's filter candidates report for the same table."""
    book = admission_book("filter", CPULoadStoreSpec([]), 1000, params={"max_tracker_size": 5000})
    assert isinstance(book, ReuseBook)
    stats = book.stats()
    assert stats.memory_bytes == book.rule.reuse.memory_bytes > 0
    assert stats.tracked_keys == 5000
    optimiser = admission_book(
        "recommended", CPULoadStoreSpec([]), 1000, params={"filter_tracker": 5000}
    )
    assert isinstance(optimiser, OptimisingAdmission)
    assert stats.memory_bytes == optimiser.filter.reuse.memory_bytes


@pytest.mark.parametrize("admission", ["none", "filter", "recommended"])
@pytest.mark.parametrize("capacity", ["100", 10.5, None, True, -1])
def test_a_tier_s_book_refuses_a_capacity_that_is_not_a_count(
    admission: str, capacity: object
) -> None:
    """A size read from a config file as text ended in ``'>' not supported between
    instances of 'str' and 'int'`` from inside the book's assembly, naming nothing; one
    line names the argument now, whatever the rule (``none`` builds no layer at all)."""
    with pytest.raises(InvalidArgumentError, match=r"^capacity must be an integer >= 0, got "):
        admission_book(admission, CPULoadStoreSpec([]), capacity)  # type: ignore[arg-type]


def test_a_driver_that_looks_up_past_the_layer_can_report_tier_hits() -> None:
    """vLLM's per-key lookups go to the backing manager directly: the driver announces the
    request and reports that the tier served part of it."""
    capacity = 64
    layer = FeedbackAdmission(CPUOffloadingManager(capacity), capacity)
    request = keys(1, 2, 3)
    layer.begin_request(request)
    assert layer._requests.origin(request[1:]) == (request[0], False)
    layer.begin_request(request, tier_hit=True)
    assert layer._requests.origin(request[1:]) == (request[0], True)


def test_admit_passes_on_what_prepare_store_would_with_the_same_counts() -> None:
    from kvoffload.admission.worlds import Probe

    runs: list[tuple[list[list[OffloadKey]], int, int]] = []
    for direct in (False, True):
        probe = Probe()
        layer = FeedbackAdmission(probe, 64)
        passed: list[list[OffloadKey]] = []
        for start in range(0, 40, 4):
            request = keys(*range(4), *range(100 + start, 108 + start))
            layer.begin_request(request)
            offered = request[4:]
            if direct:
                passed.append(layer.admit(offered))
            else:
                output = layer.prepare_store(offered)
                assert output is not None
                passed.append(list(output.keys_to_store))
        runs.append((passed, layer.offers, layer.admitted))
    assert runs[0] == runs[1]
    assert any(runs[0][0]) and runs[0][2] < runs[0][1]


@pytest.mark.parametrize("layer", [SketchAdmission, FeedbackAdmission, OptimisingAdmission])
@pytest.mark.parametrize(
    ("counted", "gpu_held", "named"),
    [
        (-1, 0, "counted"),
        (0, -2, "gpu_held"),
        (1.0, 0, "counted"),
        (0, True, "gpu_held"),
        (np.True_, 0, "counted"),
        (0, np.int64(-1), "gpu_held"),
        (0, np.float64(1), "gpu_held"),
    ],
)
def test_begin_request_refuses_a_negative_or_non_integer_count(
    layer: type[SketchAdmission | FeedbackAdmission | OptimisingAdmission],
    counted: object,
    gpu_held: object,
    named: str,
) -> None:
    """A driver's bad count is named, and the layer sees no request: the next one counts as
    if the bad call had not been made (a request with no offer after it: the optimiser
    does not take the bad call's offer to follow, and stays a tier that does not mirror)."""
    manager, untouched = layer(CPUOffloadingManager(8), 8), layer(CPUOffloadingManager(8), 8)
    request = keys(1, 2, 3)
    with pytest.raises(InvalidArgumentError, match=named):
        manager.begin_request(request, counted=counted, gpu_held=gpu_held)  # type: ignore[arg-type]
    assert not manager.announced
    assert manager.stats() == untouched.stats()
    for each in (manager, untouched):
        each.begin_request(keys(4, 5), will_offer=False)
    assert manager.stats() == untouched.stats()


@pytest.mark.parametrize("layer", [SketchAdmission, FeedbackAdmission, OptimisingAdmission])
def test_begin_request_takes_a_drivers_numpy_counts_as_the_ints_they_are(
    layer: type[SketchAdmission | FeedbackAdmission | OptimisingAdmission],
) -> None:
    """A count a driver computed with NumPy is an integer: the layer does as with plain ints,
    and keeps plain ints (its stats stay plain numbers)."""
    plain, numpy = layer(CPUOffloadingManager(8), 8), layer(CPUOffloadingManager(8), 8)
    passed: list[list[list[OffloadKey]]] = [[], []]
    for round_ in range(3):
        request = keys(1, 2, 3, 4 + round_)
        for manager, count, out in ((plain, int, passed[0]), (numpy, np.int64, passed[1])):
            manager.begin_request(request, gpu_held=count(1))
            manager.begin_request(request, counted=count(2), gpu_held=count(1))
            output = manager.prepare_store(request[1:])
            assert output is not None
            out.append(list(output.keys_to_store))
            manager.end_request(request)
    assert passed[0] == passed[1]
    assert plain.stats() == numpy.stats()
    assert all(type(value) in (int, float) for value in numpy.stats().numbers().values())


@pytest.mark.parametrize("layer", [SketchAdmission, FeedbackAdmission, OptimisingAdmission])
@pytest.mark.parametrize(
    "call",
    [
        "begin_request",
        "end_request",
        "touch",
        "lookup",
        "prepare_store",
        "prepare_load",
        "complete_load",
    ],
)
def test_a_single_key_where_keys_are_expected_is_refused_changing_nothing(
    layer: type[SketchAdmission | FeedbackAdmission | OptimisingAdmission], call: str
) -> None:
    """One key's bytes iterate as integer "keys": the layer used to count them (or fail deep
    in its hashing with a TypeError about ints) instead of naming the mistake."""
    manager, untouched = layer(CPUOffloadingManager(8), 8), layer(CPUOffloadingManager(8), 8)
    for key in (block_id_key(7), "k7"):
        with pytest.raises(NotAKeyIterableError, match=f"{call} expects an iterable of keys"):
            getattr(manager, call)(key)
    assert not manager.announced
    assert manager.stats() == untouched.stats()
    for each in (manager, untouched):
        serve(each, keys(1, 2, 3))  # type: ignore[arg-type]
    assert manager.stats() == untouched.stats()


@pytest.mark.parametrize("layer", [SketchAdmission, FeedbackAdmission, OptimisingAdmission])
@pytest.mark.parametrize("call", ["begin_request", "end_request"])
@pytest.mark.parametrize(
    "given",
    [
        lambda: (key for key in keys(1, 2)),
        lambda: set(keys(1, 2)),
        lambda: dict.fromkeys(keys(1, 2)).keys(),
        lambda: None,
        lambda: 3,
    ],
    ids=["generator", "set", "dict-keys", "None", "int"],
)
def test_a_request_that_is_no_sequence_of_keys_is_refused_changing_nothing(
    layer: type[SketchAdmission | FeedbackAdmission | OptimisingAdmission],
    call: str,
    given: object,
) -> None:
    """A request's keys are a sequence in prefix order: a generator, a set or an int failed
    with a ``TypeError`` from the request tracker once the layer had switched to announced
    boundaries (the optimiser to mirroring its worlds), and ``None`` switched it silently,
    so that touches and lookups were no longer counted."""
    manager, untouched = layer(CPUOffloadingManager(8), 8), layer(CPUOffloadingManager(8), 8)
    with pytest.raises(InvalidArgumentError, match=f"{call}: keys must be a sequence of keys"):
        getattr(manager, call)(given())  # type: ignore[operator]
    assert not manager.announced
    assert manager.stats() == untouched.stats()
    for each in (manager, untouched):
        serve(each, keys(1, 2, 3))  # type: ignore[arg-type]
    assert manager.stats() == untouched.stats()


@pytest.mark.parametrize("layer_class", [FeedbackAdmission, SketchAdmission])
@pytest.mark.parametrize("params", [{"threshold": 3}, object()])
def test_parameters_of_another_type_are_refused_by_name(
    layer_class: type[FeedbackAdmission] | type[SketchAdmission], params: object
) -> None:
    """A dict (or anything but the rule's own dataclass) once ended in an ``AttributeError``
    at the first field read."""
    with pytest.raises(InvalidArgumentError, match=r"params of '[a-z]+' must be [A-Za-z]+Params"):
        layer_class(CPUOffloadingManager(16), 16, params)  # type: ignore[arg-type]


NAMES = {SketchAdmission: "sketch", FeedbackAdmission: "feedback", OptimisingAdmission: "optimiser"}


@pytest.mark.parametrize("layer", [SketchAdmission, FeedbackAdmission, OptimisingAdmission])
def test_a_capacity_past_a_float_s_range_is_the_capacity_s_error(
    layer: type[SketchAdmission | FeedbackAdmission | OptimisingAdmission],
) -> None:
    """Its memory check divided it into GiB: an ``OverflowError`` from inside the sketch."""
    with pytest.raises(InvalidArgumentError, match=r"admission capacity .* outside a float's"):
        layer(CPUOffloadingManager(8), 10**400)
    with pytest.raises(InvalidArgumentError, match=r"admission capacity .* outside a float's"):
        wrap_with_admission(NAMES[layer], CPUOffloadingManager(8), 10**400)
