"""Fixtures of the engine tests: the engine venv's python and the tiny model (once each)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import HERE, engine_python, run_engine_script


@pytest.fixture(scope="session")
def python_for_engines() -> Path:
    return engine_python()


@pytest.fixture(scope="session")
def tiny_model(python_for_engines: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama and its tokenizer, built once per session (about 6 s)."""
    directory = tmp_path_factory.mktemp("engine") / "tiny-llama"
    log = directory.parent / "tiny_model.log"
    run_engine_script(
        python_for_engines, str(HERE / "tiny_model.py"), str(directory), log=log, timeout=300
    )
    return directory
