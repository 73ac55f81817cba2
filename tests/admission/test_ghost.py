"""Ghost records against a plain model: a list of (key, tag, clock), oldest first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled import python_and_compiled
from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.admission import GhostRecords
from kvoffload.admission.ghost import CompiledGhostRecords, ghost_records

RECORDS = python_and_compiled(GhostRecords, CompiledGhostRecords)

Op = tuple[str, list[int], int]
OPS = st.tuples(
    st.sampled_from(["add", "add_all", "take_all", "expire"]),
    st.lists(st.integers(0, 12), max_size=8),
    st.integers(0, 5),
)


@pytest.mark.parametrize("records", RECORDS)
@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 6), ops=st.lists(OPS, max_size=40))
def test_ghost_matches_an_ordered_list_of_records(
    records: type[GhostRecords], capacity: int, ops: list[Op]
) -> None:
    """The Python records and the compiled ones (where built) against the same model."""
    ghost = records(capacity)
    model: list[tuple[int, int, int]] = []  # (key id, tag, clock), oldest first
    for clock, (name, ids, tag) in enumerate(ops, start=1):
        if name in ("add", "add_all"):
            ids = ids[:1] if name == "add" else ids
            expected = []
            for i in ids:
                model = [r for r in model if r[0] != i] + [(i, tag, clock)]
                if len(model) > capacity:
                    expected.append(model.pop(0)[1])
            keys = [block_id_key(i) for i in ids]
            if name == "add":
                got = [ghost.add(keys[0], tag, clock)] if keys else []
                assert [t for t in got if t is not None] == expected
            else:
                assert ghost.add_all(keys, tag, clock) == expected
        elif name == "take_all":
            expected = []
            for i in ids:
                found = [r for r in model if r[0] == i]
                if found:
                    expected.append(found[0][1])
                    model.remove(found[0])
            assert ghost.take_all([block_id_key(i) for i in ids]) == expected
        else:
            before = clock - tag
            expected = []
            while model and model[0][2] < before:
                expected.append(model.pop(0)[1])
            assert ghost.expire(before) == expected
        assert len(ghost) == len(model)
        assert all(block_id_key(i) in ghost for i, _, _ in model)
        assert sum(block_id_key(i) in ghost for i in range(13)) == len(model)


@pytest.mark.parametrize("records", RECORDS)
def test_records_refuse_a_capacity_below_one(records: type[GhostRecords]) -> None:
    with pytest.raises(InvalidArgumentError, match="ghost capacity must be >= 1"):
        records(0)


def test_the_factory_gives_the_compiled_records_where_they_were_built() -> None:
    ghost = ghost_records(2)
    assert type(ghost) is (CompiledGhostRecords or GhostRecords)
    assert ghost.add_all([block_id_key(i) for i in range(3)], 5, 1) == [5]
    assert ghost.capacity == 2 and 0 < ghost.memory_bytes <= 2 * 160
