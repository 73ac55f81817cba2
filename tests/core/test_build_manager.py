"""``build_manager`` refuses arguments that would otherwise silently mean "no filter"."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload import InvalidArgumentError
from kvoffload.admission import available_admissions
from kvoffload.admission.reuse_counts import MAX_TRACKED_KEYS
from kvoffload.managers import (
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    TieredOffloadingManager,
    build_manager,
)


@pytest.mark.parametrize("threshold", [1.5, 2.0, "2", True, None, -1])
def test_a_non_integer_or_negative_store_threshold_is_refused(threshold: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="store_threshold") as error:
        build_manager(8, store_threshold=threshold)
    assert repr(threshold) in str(error.value) or str(threshold) in str(error.value)


@pytest.mark.parametrize(("threshold", "filtered"), [(0, False), (1, False), (2, True)])
def test_integer_thresholds_keep_their_meaning(threshold: int, filtered: bool) -> None:
    manager = build_manager(8, store_threshold=threshold)
    expected = FilterReusedOffloadingManager if filtered else CPUOffloadingManager
    assert type(manager) is expected


def test_an_unknown_admission_lists_the_valid_names() -> None:
    with pytest.raises(InvalidArgumentError, match="'bogus'") as error:
        build_manager(8, admission="bogus")
    assert all(name in str(error.value) for name in available_admissions())


def test_a_tracker_size_beyond_the_tables_limit_is_refused_by_name() -> None:
    """The reuse table's own refusal named no setting ("max tracked keys ...")."""
    too_big = MAX_TRACKED_KEYS + 1
    expected = f"max_tracker_size must be an integer from 1 to {MAX_TRACKED_KEYS:,}, got {too_big}"
    with pytest.raises(InvalidArgumentError) as error:
        build_manager(8, store_threshold=2, max_tracker_size=too_big)
    assert str(error.value) == expected
    with pytest.raises(InvalidArgumentError) as error:
        TieredOffloadingManager(CPUOffloadingManager(8), max_tracker_size=too_big)
    assert str(error.value) == expected


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
        ({"num_blocks": 8, "cache_policy": "bogus"}, "unknown cache policy 'bogus'"),
    ],
)
def test_a_bad_size_or_policy_is_refused_by_build_managers_own_name(
    arguments: dict[str, Any], expected: str
) -> None:
    """StackConfig's check named its own fields (``cpu_blocks``, ``policy``), which a
    caller of ``build_manager`` never wrote."""
    with pytest.raises(InvalidArgumentError) as error:
        build_manager(**arguments)
    assert str(error.value).startswith(expected)
