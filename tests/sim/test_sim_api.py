"""The simulator's public names, pinned so removals are deliberate."""

from __future__ import annotations

import kvoffload.sim


def test_public_names_resolve() -> None:
    for name in kvoffload.sim.__all__:
        assert getattr(kvoffload.sim, name) is not None, name
    assert {"simulate", "SimConfig", "RunReport", "read_trace", "generate"} <= set(
        kvoffload.sim.__all__
    )
