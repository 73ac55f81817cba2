"""Every script of ``benchmarks/`` that the manual tells an operator to run answers
``--help``: a script whose option set-up no longer matches the library fails here, not on
the (often GPU) machine it was carried to."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if "__main__" in path.read_text())
OPTIONAL = re.compile(r"ModuleNotFoundError: No module named '(torch|vllm|sglang)[.']")
"""Engines and torch are optional: a script that needs one is skipped where it is absent."""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_script_prints_its_usage(script: Path) -> None:
    env = dict(os.environ)
    src = str(Path(kvoffload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    missing = OPTIONAL.search(done.stderr)
    if missing:
        pytest.skip(f"{script.name} needs {missing.group(1)}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script.name}"), done.stdout
    for choices in re.findall(r"\{([^}]*)\}", done.stdout):
        listed = choices.split(",")
        assert len(set(listed)) == len(listed), f"a usage that reads {{{choices}}} is ambiguous"


def test_the_scripts_are_found() -> None:
    assert any(path.stem == "transfer_cuda" for path in SCRIPTS)
