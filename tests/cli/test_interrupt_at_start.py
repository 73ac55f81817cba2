"""Ctrl-C while the command is still loading (numpy, the simulator: a third of a second)
ends it as a later one does: one line, status 130, no traceback.

Each case starts the command as an operator does, in its own process, whose import of
one module stops until the test interrupts it: where the interrupt lands does not depend
on timing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload.cli.interrupts import INTERRUPTED

ROOT = Path(__file__).resolve().parents[2]

# Loaded by the child at start-up (its directory is first on PYTHONPATH): the import of
# SLOW_MODULE says so in a file and then waits, as a slow disk or a busy machine makes it.
SITECUSTOMIZE = """
import importlib.abc, os, signal, sys, time

# What Python sets at start-up unless Ctrl-C is ignored, as it is in a background job
# (where a test runner may itself run): the child stands for a command in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)


class SlowImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SLOW_MODULE"]:
            open(os.environ["SLOW_MARK"], "w").close()
            time.sleep(120)
        return None


sys.meta_path.insert(0, SlowImport())
"""


def _console_script() -> list[str]:
    """The ``kvoffload`` command as pip writes it from ``[project.scripts]``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^kvoffload = "([\w.]+):(\w+)"$', text, re.MULTILINE)
    assert match is not None, "pyproject.toml names no kvoffload script"
    module, function = match.groups()
    return [sys.executable, "-c", f"import sys\nfrom {module} import {function}\n"
            f"sys.exit({function}())"]  # fmt: skip


ENTRY_POINTS = {
    "script": _console_script(),
    "python -m": [sys.executable, "-m", "kvoffload"],
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize(
    "slow_module",
    [
        "numpy",  # the package's own first heavy import
        "kvoffload.sim.traces",  # deep in the command's
    ],
)
def test_ctrl_c_while_the_command_loads_is_one_line(
    tmp_path: Path, entry: str, slow_module: str
) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mark = tmp_path / "importing"
    src = str(ROOT / "src")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), src, os.environ.get("PYTHONPATH", "")]),
        SLOW_MODULE=slow_module,
        SLOW_MARK=str(mark),
    )
    argv = [*ENTRY_POINTS[entry], "simulate", "--requests", "1"]
    child = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mark.exists(), f"{slow_module} was never imported: {child.communicate()}"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert (child.returncode, err, out) == (130, INTERRUPTED + "\n", "")
