"""What every CLI error test checks: one line on stderr, no traceback; the mark of the
tests that need two CPUs."""

from __future__ import annotations

import pytest

from kvoffload.core.cpus import usable_cpus

needs_two_cpus = pytest.mark.skipif(
    usable_cpus() < 2,
    reason="sweep runs --jobs 2 with one worker where this process may use one CPU",
)
"""For a test of what ``sweep --jobs 2`` does with its two workers."""


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload: error: "), err
    assert "Traceback" not in err
    return err
