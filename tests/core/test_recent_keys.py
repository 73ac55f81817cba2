"""The bounded record of recent keys that managers and adapters remember per-key facts in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.core.keys import OffloadKey
from kvoffload.core.recent import RecentKeys


def key(n: int) -> OffloadKey:
    return OffloadKey(n.to_bytes(4, "big"))


def test_the_least_recently_added_key_is_forgotten_first() -> None:
    record = RecentKeys(2)
    record.add(key(1))
    record.add(key(2))
    record.add(key(1))  # now the newest
    record.add(key(3))
    assert key(1) in record and key(3) in record and key(2) not in record
    assert len(record) == 2


def test_a_batch_keeps_its_newest_keys_when_it_is_larger_than_the_record() -> None:
    record = RecentKeys(3)
    record.add_all(key(n) for n in range(10))
    assert [n for n in range(10) if key(n) in record] == [7, 8, 9]


def test_a_record_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="room for one key"):
        RecentKeys(0)


@given(
    limit=st.integers(1, 5),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["add", "add_all", "discard"]), st.lists(st.integers(0, 8), max_size=4)
        ),
        max_size=40,
    ),
)
def test_the_record_matches_a_list_of_the_newest_distinct_keys(
    limit: int, steps: list[tuple[str, list[int]]]
) -> None:
    record = RecentKeys(limit)
    model: list[int] = []
    for action, numbers in steps:
        if action == "discard":
            for n in numbers:
                record.discard(key(n))
                if n in model:
                    model.remove(n)
            continue
        if action == "add":
            for n in numbers:
                record.add(key(n))
        else:
            record.add_all(key(n) for n in numbers)
        for n in numbers:
            if n in model:
                model.remove(n)
            model.append(n)
            if action == "add":
                del model[:-limit]
        del model[:-limit]
        assert len(record) == len(model)
        assert all(key(n) in record for n in model)
    assert sorted(n for n in range(9) if key(n) in record) == sorted(model)
