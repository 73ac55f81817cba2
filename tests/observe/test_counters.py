"""The counters' dict form, read by every exporter on every engine step."""

from __future__ import annotations

import dataclasses

from kvoffload.observe.counters import ManagerCounters


def test_as_dict_holds_every_counter_in_field_order_and_is_a_copy() -> None:
    counters = ManagerCounters(
        **{f.name: i + 1 for i, f in enumerate(dataclasses.fields(ManagerCounters))}
    )
    read = counters.as_dict()
    assert list(read.items()) == list(dataclasses.asdict(counters).items())
    read["lookups"] += 100
    assert counters.lookups == 1
    assert counters.minus(ManagerCounters(lookups=1)).as_dict() == {
        **read,
        "lookups": 0,
    }
