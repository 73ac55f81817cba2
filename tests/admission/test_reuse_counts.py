"""The one bounded reuse counter against plain models of its two counting rules."""

from __future__ import annotations

from collections import OrderedDict

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from compiled import needs, python_and_compiled
from kvoffload import InvalidArgumentError, block_id_key, build_manager
from kvoffload.admission.reuse_counts import (
    MAX_TRACKED_KEYS,
    CompiledReuseCounts,
    ReuseCounts,
    reuse_counts,
)
from kvoffload.core.errors import InsufficientMemoryError
from kvoffload.core.keys import OffloadKey

TABLES = python_and_compiled(ReuseCounts, CompiledReuseCounts)

KEYS = [block_id_key(i) for i in range(8)]
BATCHES = st.lists(
    st.tuples(st.booleans(), st.lists(st.sampled_from(KEYS), max_size=7)), max_size=12
)


def lru_model(model: list[list[object]], keys: list[OffloadKey], size: int) -> None:
    """The seed filter's rule, key by key: count, make most recent, drop the oldest."""
    for key in keys:
        entry = next((e for e in model if e[0] == key), None)
        if entry is None:
            if len(model) >= size:
                model.pop(0)
            model.append([key, 1])
        else:
            model.remove(entry)
            entry[1] += 1  # type: ignore[operator]
            model.append(entry)


def shielded_model(model: list[list[object]], keys: list[OffloadKey], size: int) -> None:
    """vLLM's offer rule: tracked keys first, then new keys, never pushing out a key the
    batch counted (tracked or new)."""
    tracked = {e[0] for e in model}
    counted: list[OffloadKey] = []
    for key in keys:
        if key in tracked:
            entry = next(e for e in model if e[0] == key)
            model.remove(entry)
            entry[1] += 1  # type: ignore[operator]
            model.append(entry)
            counted.append(key)
    for key in keys:
        if any(e[0] == key for e in model):
            continue
        if len(model) >= size:
            victim = next((e for e in model if e[0] not in counted), None)
            if victim is None:
                continue
            model.remove(victim)
        model.append([key, 1])
        counted.append(key)


@pytest.mark.parametrize("table", TABLES)
@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 6), batches=BATCHES)
def test_both_rules_match_their_models_in_counts_and_order(
    table: type[ReuseCounts], size: int, batches: list[tuple[bool, list[OffloadKey]]]
) -> None:
    """The Python table and the compiled one (where built) against the same models."""
    counter, model = table(size), []  # type: ignore[var-annotated]
    for shielded, keys in batches:
        if shielded:
            counter.count_shielded(keys)
            shielded_model(model, keys, size)
        else:
            counter.count(keys)
            lru_model(model, keys, size)
        assert list(counter.counts.items()) == [(key, count) for key, count in model]
        assert len(counter) <= size
        assert counter.at_least(KEYS, 2) == [k for k in KEYS if counter.get(k) >= 2]
        assert [key in counter.counts for key in KEYS] == [counter.get(key) > 0 for key in KEYS]


@pytest.mark.parametrize("table", TABLES)
def test_a_key_listed_twice_in_one_offer_counts_as_vllm_counts_it(
    table: type[ReuseCounts],
) -> None:
    """vLLM 0.33's ``_record_accesses`` counts every listing of a tracked key (its first
    pass) but enters a new key once (its second pass skips a key already entered)."""
    counter = table(4)
    counter.count_shielded(KEYS[:1])
    counter.count_shielded([KEYS[0], KEYS[1], KEYS[0], KEYS[1]])
    assert list(counter.counts.items()) == [(KEYS[0], 3), (KEYS[1], 1)]


def test_the_table_turns_ordered_only_when_it_could_overflow() -> None:
    counter = ReuseCounts(3)
    counter.count(KEYS[:3])
    assert not isinstance(counter.counts, OrderedDict)
    counter.count(KEYS[3:4])
    assert isinstance(counter.counts, OrderedDict)
    assert list(counter.counts) == KEYS[1:4]


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8", MAX_TRACKED_KEYS + 1, 10**30])
def test_a_table_refuses_a_size_that_is_not_a_positive_int(
    table: type[ReuseCounts], bad: object
) -> None:
    message = f"max tracked keys must be an int from 1 to {MAX_TRACKED_KEYS}, got"
    with pytest.raises(InvalidArgumentError, match=message):
        table(bad)  # type: ignore[arg-type]


def test_the_python_table_takes_the_largest_size_both_tables_allow() -> None:
    # The compiled table sizes its arrays up front, so only the Python one can show that
    # the bound itself is allowed.
    assert ReuseCounts(MAX_TRACKED_KEYS).max_keys == MAX_TRACKED_KEYS


@needs(CompiledReuseCounts)
def test_a_compiled_table_beyond_the_machine_is_refused_before_any_allocation() -> None:
    """Not a bare ``MemoryError``, nor arrays filled until the process is killed; the
    filter, the tiered manager and vLLM's offer filter build their tables this way."""
    with pytest.raises(InsufficientMemoryError, match="reuse count table of 576,460"):
        reuse_counts(MAX_TRACKED_KEYS)
    with pytest.raises(InsufficientMemoryError, match="reuse count table"):
        build_manager(8, store_threshold=2, max_tracker_size=MAX_TRACKED_KEYS)


def test_the_factory_gives_the_compiled_table_where_it_was_built() -> None:
    counter = reuse_counts(4)
    assert type(counter) is (CompiledReuseCounts or ReuseCounts)
    counter.count([KEYS[0], KEYS[1], KEYS[0]])
    assert counter.counts == {KEYS[1]: 1, KEYS[0]: 2} and counter.max_keys == 4
