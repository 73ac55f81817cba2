"""The package, its CLI and the observe/integration entry points import no optional dependency."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("zmq", "msgspec", "prometheus_client", "rich", "vllm", "torch")


def test_optional_dependencies_load_only_when_used() -> None:
    code = (
        "import sys, kvoffload, kvoffload.cli.main, kvoffload.cli.simulate, kvoffload.observe, "
        "kvoffload.integrations.vllm, kvoffload.sim.run\n"
        f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == ""
