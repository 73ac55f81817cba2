"""Numbers past what a float or Python's int parsing holds, and line breaks in arguments,
still end in one line on stderr: never a traceback, a hang or a second line.

In a subprocess with a timeout where the old behaviour was to loop forever.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "5", "--no-progress", "--no-bound"]
REST = '"input_length": 1024, "output_length": 1, "hash_ids": [1, 2]'
"""A record's fields after its timestamp."""
TOO_MANY_DIGITS = "9" * 5000
"""More digits than Python turns into an int (4300 by default)."""


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [f'{{"timestamp": {TOO_MANY_DIGITS}, {REST}}}'],
            ":1: invalid JSON: an integer of more than 4,300 digits",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, '
                f"{TOO_MANY_DIGITS}]}}"
            ],
            ":1: invalid JSON: an integer of more than 4,300 digits",
        ),
        (
            [
                f'{{"timestamp": 0, "input_length": 1024, "output_length": {"9" * 400}, '
                '"hash_ids": [1, 2]}'
            ],
            ":1: field 'output_length' is not a number",
        ),
        ([f'{{"timestamp": "\\u00b2", {REST}}}'], ":1: field 'timestamp' must be a whole number"),
        ([f'{{"timestamp": "--5", {REST}}}'], ":1: field 'timestamp' must be a whole number"),
        (
            [f'{{"timestamp": "{TOO_MANY_DIGITS}", {REST}}}'],
            ":1: field 'timestamp' must be a whole number",
        ),
        (
            [f'{{"timestamp": "{10**400}", {REST}}}', f'{{"timestamp": "1", {REST}}}'],
            ":1: field 'timestamp' must be at most 2**64-1 nanoseconds",
        ),
    ],
)
def test_numbers_python_cannot_convert_are_trace_errors(
    tmp_path: Path, records: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(record + "\n" for record in records))
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 1
    assert message in one_line_error(capsys)
