"""Fixtures of the engine tests: the engine venv's python and the tiny model (once each).

The engine tests run last, and their engines start when collection ends, in a thread: they
run beside every other test instead of before them (``engine_helpers`` says why). Under
pytest-xdist (``-n``) one worker alone begins them, and runs the engine tests last
(``xdist_plan`` says how).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import (
    HERE,
    STARTED,
    begin,
    build_tiny_model,
    engine_python,
    engine_python_path,
    keep_engine_files_in,
    stop_engine_scripts,
)

from xdist_plan import ENGINE_WORKER


def _ours(item: pytest.Item) -> bool:
    return item.path.resolve().parent == HERE


def _begins_engines(config: pytest.Config) -> bool:
    """Outside xdist, and on the one worker that runs the engine tests under it."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput is None or workerinput["workerid"] == ENGINE_WORKER


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = [item for item in items if not _ours(item)] + [item for item in items if _ours(item)]


def pytest_collection_finish(session: pytest.Session) -> None:
    modules = {item.path.resolve() for item in session.items if _ours(item)}
    python = engine_python_path()
    if not modules or session.config.option.collectonly or not python.exists():
        return  # the fixtures skip (or fail under CI) where the venv is missing
    if not _begins_engines(session.config):
        return  # another worker's; were one of the tests to come here, it would run its own
    keep_engine_files_in(session.config._tmp_path_factory.mktemp("tmp"))
    begin(python, modules, session.config._tmp_path_factory.mktemp("engine"))


def pytest_sessionfinish() -> None:
    stop_engine_scripts()


@pytest.fixture(scope="session")
def python_for_engines() -> Path:
    return engine_python()


@pytest.fixture(scope="session")
def tiny_model(python_for_engines: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama and its tokenizer, built once per session (about 6 s)."""
    started = STARTED.get(HERE)
    if started is not None:
        model: Path = started.wait()
        return model
    return build_tiny_model(python_for_engines, tmp_path_factory.mktemp("engine") / "tiny-llama")
