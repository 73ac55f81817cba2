"""Ctrl-C pressed twice: the first stops the command, the second does not cut its cleanup
short; a third quits at once. Each case runs the command in its own process, whose
signals it sends to itself at a chosen point, so where each lands does not depend on
timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.interrupts import STOPPING as STOPPING_BYTES
from kvoffload.cli.main import main
from kvoffload.tiers import bench

STOPPING = STOPPING_BYTES.decode()

# ``bench tiers`` interrupts itself once its scratch directory holds a file (Ctrl-C during
# the benchmark), and again where ``second`` says: as the scratch is being removed, or as
# the command writes that it was interrupted.
SCRIPT = """
import os, shutil, signal, sys
from kvoffload.cli.main import main
from kvoffload.tiers import bench

signal.signal(signal.SIGINT, {sigint})

def interrupt():
    os.kill(os.getpid(), signal.SIGINT)

def interrupted_measure(data, scratch, *rest):
    (scratch / "payload").write_bytes(b"x")
    interrupt()
    return bench.measure_disk_unpatched(data, scratch, *rest)

def rmtree_interrupted(path, *args, **kwargs):
    if {second!r} in ("cleanup", "cleanup twice"):
        interrupt()
    if {second!r} == "cleanup twice":
        interrupt()
    shutil.rmtree(path, *args, **kwargs)

class InterruptedStderr:
    pending = {second!r} == "message"

    def write(self, text):
        if self.pending:
            InterruptedStderr.pending = False
            interrupt()
        return sys.__stderr__.write(text)

    def __getattr__(self, name):
        return getattr(sys.__stderr__, name)

bench.measure_disk_unpatched = bench.measure_disk
bench.measure_disk = interrupted_measure
bench.shutil = type("Shutil", (), {{"rmtree": staticmethod(rmtree_interrupted)}})
sys.stderr = InterruptedStderr()
sys.exit(main(["bench", "tiers", "--blocks", "2", "--block-mib", "0.01", "--rounds", "1",
               "--dir", sys.argv[1], "--json", sys.argv[2]]))
"""


def _bench(tmp_path: Path, sigint: str, second: str = "") -> subprocess.CompletedProcess[str]:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = SCRIPT.format(sigint=sigint, second=second)
    argv = [sys.executable, "-c", script, str(scratch), str(tmp_path / "bench.json")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("second", ["cleanup", "message"])
def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(tmp_path: Path, second: str) -> None:
    """The second Ctrl-C landed in the first one's unwinding: it cut short the removal of
    the benchmark's scratch directory, which stayed in ``--dir``, or, after the one line,
    escaped as a traceback."""
    result = _bench(tmp_path, "signal.default_int_handler", second)  # a terminal's child
    assert result.returncode == 130
    assert result.stderr == STOPPING + "kvoffload: interrupted\n"
    assert list((tmp_path / "scratch").iterdir()) == []
    assert not (tmp_path / "bench.json").exists()


def test_a_third_ctrl_c_quits_at_once(tmp_path: Path) -> None:
    """The way out of a cleanup that hangs: the scratch is left as it was."""
    result = _bench(tmp_path, "signal.default_int_handler", "cleanup twice")
    assert (result.returncode, result.stderr) == (130, STOPPING)
    (left,) = (tmp_path / "scratch").iterdir()
    assert [path.name for path in left.iterdir()] == ["payload"]


def test_ctrl_c_ignored_by_the_shell_stays_ignored(tmp_path: Path) -> None:
    """A background job (``nohup ... &``) starts with Ctrl-C ignored: the command keeps it so."""
    result = _bench(tmp_path, "signal.SIG_IGN")
    assert (result.returncode, result.stderr) == (0, "")
    assert list((tmp_path / "scratch").iterdir()) == []
    assert (tmp_path / "bench.json").exists()


def test_an_interrupted_command_gives_the_caller_its_handlers_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main`` called in-process (as here, in pytest's own process): an interrupted
    command kept its handlers installed, so the caller's next Ctrl-C only printed that the
    command was cleaning up, and its third ended the caller with status 130."""
    measure = bench.measure_disk

    def interrupted_measure(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "measure_disk", interrupted_measure)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        argv = ["bench", "tiers", "--blocks", "2", "--block-mib", "0.01", "--rounds", "1"]
        assert main([*argv, "--dir", str(tmp_path)]) == 130
        after = {signum: signal.getsignal(signum) for signum in before}
    finally:  # pytest's own Ctrl-C, whatever the command left
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert after == before
