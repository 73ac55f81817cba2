"""What every CLI error test checks: one line on stderr, no traceback."""

from __future__ import annotations

import pytest


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload: error: "), err
    assert "Traceback" not in err
    return err
