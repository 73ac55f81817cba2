"""The compiled admission modules in tests: each beside its Python reference, skipped
with the reason where kvoffload was installed without a C compiler."""

from __future__ import annotations

from typing import Any

import pytest

NOT_BUILT = "kvoffload was installed without a C compiler"


def needs(compiled: object) -> pytest.MarkDecorator:
    """Skip where ``compiled`` (a compiled class or module) was not built."""
    return pytest.mark.skipif(compiled is None, reason=NOT_BUILT)


def python_and_compiled(python: type, compiled: type | None) -> list[Any]:
    """Parameters for a test run on the Python class and on its compiled twin."""
    return [python, pytest.param(compiled, marks=needs(compiled))]
