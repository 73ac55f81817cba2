"""A script of ``benchmarks/`` loaded as a module, for the tests of its parts, or run as
an operator runs it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import kvoffload

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up while it runs)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_script(
    script: Path, arguments: list[str], cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python script arguments`` in a process of its own, this checkout's package first on
    its path; its status and output, whatever they are."""
    env = dict(os.environ)
    src = str(Path(kvoffload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=False,
    )
