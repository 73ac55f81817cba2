"""The reuse filter (reference section 3.1), over the CPU manager and a recording fake."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvoffload import (
    CPULoadStoreSpec,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    InvalidArgumentError,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    block_id_key,
    build_manager,
)


def keys(*ids: int) -> list[OffloadKey]:
    return [block_id_key(i) for i in ids]


def test_reference_filter_scenario() -> None:
    backing = CPUOffloadingManager(num_blocks=4, cache_policy="lru")
    f = FilterReusedOffloadingManager(backing, store_threshold=2, max_tracker_size=3)
    # 1: seen once, nothing is eligible, but the output is not None.
    assert f.lookup(keys(1, 2)) == 0
    out = f.prepare_store(keys(1, 2))
    assert out is not None and out.keys_to_store == []
    # 2: 1 is seen twice.
    assert f.lookup(keys(1)) == 0
    out = f.prepare_store(keys(1, 2))
    assert out is not None and out.keys_to_store == keys(1)
    # 3: tracker order is 2, 1, 3; adding 4 drops 2.
    f.lookup(keys(3, 4))
    assert keys(2)[0] not in f.counts
    # 4: 2 comes back with count 1, dropping 1.
    f.lookup(keys(2))
    assert f.counts[keys(2)[0]] == 1 and keys(1)[0] not in f.counts
    out = f.prepare_store(keys(2))
    assert out is not None and out.keys_to_store == []
    # 5
    f.complete_store(keys(1))
    assert f.lookup(keys(1)) == 1
    assert f.stores_skipped == 4


def test_every_key_is_counted_per_occurrence_even_after_a_miss() -> None:
    f = FilterReusedOffloadingManager(CPUOffloadingManager(4), store_threshold=3)
    f.lookup(keys(5, 6, 5))
    assert f.counts[keys(5)[0]] == 2 and f.counts[keys(6)[0]] == 1
    f.lookup(iter(keys(5)))
    out = f.prepare_store(iter(keys(6, 5)))
    assert out is not None and out.keys_to_store == keys(5)
    assert f.counts[keys(5)[0]] == 3  # storing resets nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"store_threshold": 1}, "store_threshold must be from 2 to 4611686018427387904, got 1"),
        ({"store_threshold": 0}, "got 0; a threshold of 0 or 1 means no filter"),
        ({"store_threshold": 2**63}, f"store_threshold must be from 2 to .*, got {2**63}"),
        ({"max_tracker_size": 0}, "max_tracker_size must be >= 1, got 0"),
        (
            {"max_tracker_size": 2**59},
            f"FilterReusedOffloadingManager max_tracker_size must be at most .*, got {2**59}",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        FilterReusedOffloadingManager(CPUOffloadingManager(4), **kwargs)


class RecordingManager(OffloadingManager):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        self.calls.append(("lookup", list(keys)))
        return None

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        self.calls.append(("prepare_load", list(keys)))
        return CPULoadStoreSpec([7])

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.calls.append(("touch", list(keys)))

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.calls.append(("complete_load", list(keys)))

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self.calls.append(("prepare_store", list(keys)))
        return None

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self.calls.append(("complete_store", (list(keys), success)))

    def take_events(self) -> Iterable[OffloadingEvent]:
        self.calls.append(("take_events", None))
        return [OffloadingEvent(keys(1), "CPU", removed=True)]


def test_everything_else_is_delegated_unchanged() -> None:
    rec = RecordingManager()
    f = FilterReusedOffloadingManager(rec)
    assert f.lookup(iter(keys(1))) is None  # None from an async backend passes through
    assert f.prepare_store(keys(1, 2)) is None
    assert f.prepare_load(keys(3)).block_ids.tolist() == [7]  # type: ignore[attr-defined]
    f.touch(keys(4))
    f.complete_load(keys(5))
    f.complete_store(keys(6), False)
    assert list(f.take_events()) == [OffloadingEvent(keys(1), "CPU", removed=True)]
    assert rec.calls == [
        ("lookup", keys(1)),
        ("prepare_store", []),
        ("prepare_load", keys(3)),
        ("touch", keys(4)),
        ("complete_load", keys(5)),
        ("complete_store", (keys(6), False)),
        ("take_events", None),
    ]


def test_build_manager_wraps_only_from_threshold_two() -> None:
    assert isinstance(build_manager(8, store_threshold=1), CPUOffloadingManager)
    wrapped = build_manager(8, "arc", store_threshold=3, max_tracker_size=10)
    assert isinstance(wrapped, FilterReusedOffloadingManager)
    assert wrapped.store_threshold == 3 and wrapped.max_tracker_size == 10


def test_tracker_order_survives_the_switch_from_filling_to_full() -> None:
    f = FilterReusedOffloadingManager(CPUOffloadingManager(4), max_tracker_size=4)
    f.lookup(keys(1, 2))
    f.lookup(keys(1, 3))  # still filling: recency 2, 1, 3
    assert list(f.counts) == keys(2, 1, 3)
    f.lookup(keys(4, 5))  # may overflow: 4 fills the table, 5 pushes out 2
    assert list(f.counts.items()) == list(zip(keys(1, 3, 4, 5), [2, 1, 1, 1], strict=True))


@settings(max_examples=200, deadline=None)
@given(
    tracker=st.integers(1, 8),
    calls=st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=25),
)
def test_tracker_is_the_literal_lru_table(tracker: int, calls: list[list[int]]) -> None:
    """Counts and recency order equal the seed's step-by-step OrderedDict, in both phases."""
    f = FilterReusedOffloadingManager(CPUOffloadingManager(4), max_tracker_size=tracker)
    literal: OrderedDict[bytes, int] = OrderedDict()
    for ids in calls:
        for key in keys(*ids):
            if key in literal:
                literal[key] += 1
                literal.move_to_end(key)
            else:
                if len(literal) >= tracker:
                    literal.popitem(last=False)
                literal[key] = 1
        f.lookup(keys(*ids))
        assert list(f.counts.items()) == list(literal.items())


def test_the_vllm_offer_filter_refuses_a_threshold_past_the_counter() -> None:
    """vLLM's offer filter shares the compiled counter, which compares in C ``long long``."""
    from kvoffload.integrations.vllm.offer_filter import OfferCountFilter

    with pytest.raises(InvalidArgumentError, match=f"got {2**63}"):
        OfferCountFilter(2**63)


@pytest.mark.parametrize("threshold", [0, 1, 2**63])
def test_a_filters_threshold_error_says_what_each_layer_accepts(threshold: int) -> None:
    """The filters take 2 and up (the seed's class refuses 1, "no filtering"); a stack takes
    0 and 1 too, meaning no filter: neither message says ``[2, ...]`` alone any more."""
    from kvoffload.integrations.vllm.offer_filter import OfferCountFilter

    no_filter = "a threshold of 0 or 1 means no filter"
    with pytest.raises(InvalidArgumentError, match=f"from 2 to .*, got {threshold}; {no_filter}"):
        OfferCountFilter(threshold)
    with pytest.raises(InvalidArgumentError, match=f"from 2 to .*, got {threshold}; {no_filter}"):
        FilterReusedOffloadingManager(CPUOffloadingManager(4), threshold)
    if threshold < 2:
        build_manager(8, store_threshold=threshold)  # no filter, as in vLLM's configuration
    else:
        with pytest.raises(InvalidArgumentError, match=r"from 0 to .* \(0 or 1: no filter\)"):
            build_manager(8, store_threshold=threshold)
