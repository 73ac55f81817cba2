"""A garbage collection after every test pins an unclosed socket on the test
that leaked it (warnings are errors), instead of on the end of the session.

What exists before the first of these tests (vLLM's and torch's modules, other folders'
fixtures) is frozen out of the collector's sight, after one full collection: a full
collection over vLLM's objects costs about 0.6 s, and some 300 tests paid it. Each test's
collection still walks everything made since, so a socket a test leaks is still found there.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _freeze_what_came_before() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _collect_after(_freeze_what_came_before: None) -> Iterator[None]:
    yield
    gc.collect()
