"""A garbage collection after every test pins an unclosed socket on the test
that leaked it (warnings are errors), instead of on the end of the session.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_after() -> Iterator[None]:
    yield
    gc.collect()
