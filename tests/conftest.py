"""Fixtures of the whole suite: the public Mooncake trace (skipped when absent) and
session-wide Valkey servers (standalone and a 3-node Cluster), always stopped; and the
pytest-xdist hooks (``xdist_plan`` says what they do).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tier_servers import ValkeyClusterProcesses, ValkeyProcess
from xdist_plan import ENGINE_FIGURES, auto_workers, engine_tests_last

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    """Let the session write the bytecode of what it imports, in every process it starts.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (as on the project's machines), nothing compiled
    is kept: each xdist worker rewrote the asserts of all 318 test modules again (36.5 s of
    a 3,750-test collection; 11.9 s with the rewritten modules kept), and each of the
    suite's Python processes compiled what it imported again (kvoffload's editable source,
    and the packages that the README's set-up installs with ``--no-compile``). The files go
    to ``__pycache__`` folders inside the clone and its venvs. Set here, before xdist starts
    its workers, so that they and every process they start inherit it. A process that a test
    runs under a file size cap must not write any: Python keeps a ``.pyc`` cut at the cap
    (``tests/cli/test_cli_errors.py``, ``tests/tiers/test_disk.py``)."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_finish() -> None:
    """Freeze what exists once the tests are collected (torch's, vLLM's and SGLang's modules
    among it): a full collection then walks only what the tests made. Measured on
    tests/core and tests/admission: the full collections' time 7.6 s -> 2.9 s, the run
    112 s -> 102 s."""
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The engine tests' measured figures, which they record as user properties."""
    figures = [
        f"[engine] {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
        if name == ENGINE_FIGURES
    ]
    if figures:
        terminalreporter.write_sep("-", "engine figures")
        for line in figures:
            terminalreporter.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers() -> int:
    return auto_workers()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return engine_tests_last(config, log) if config.getvalue("dist") == "loadscope" else None


def shared_dir() -> Path:
    """``$KVOFFLOAD_SHARED``, else the ``shared`` folder beside the repository."""
    env = os.environ.get("KVOFFLOAD_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".." / "shared"


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    path = shared_dir() / "data" / "traces" / TRACE_NAME
    if not path.is_file():
        pytest.skip(f"{TRACE_NAME} not found at {path} (set KVOFFLOAD_SHARED to its shared/ dir)")
    return path


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(tmp_path_factory.mktemp("valkey")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyClusterProcesses]:
    cluster = ValkeyClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ValkeyProcess]:
    """A short-lived server of this test alone (to kill, restart or protect with a password)."""
    server = ValkeyProcess(tmp_path / "own")
    try:
        yield server
    finally:
        server.stop()
