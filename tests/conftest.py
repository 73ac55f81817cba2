"""Fixtures of the whole suite: the public Mooncake trace (skipped when absent) and
session-wide Valkey servers (standalone and a 3-node Cluster), always stopped; and the
pytest-xdist hooks (``xdist_plan`` says what they do).
"""

from __future__ import annotations

import compileall
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvoffload
from tier_servers import ValkeyClusterProcesses, ValkeyProcess
from xdist_plan import ENGINE_FIGURES, auto_workers, engine_tests_last

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile kvoffload's own source once, before any worker or child process starts.
    An editable install leaves it uncompiled, and where ``PYTHONDONTWRITEBYTECODE`` is set
    (as on the project's machines) each of the suite's hundreds of Python processes compiled
    it again: 0.4 s of the 1.0 s that ``python -m kvoffload --version`` took. Measured on
    tests/cli under ``-n auto``: 161 s of CPU -> 135 s."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(Path(kvoffload.__file__).parent, quiet=2)


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
