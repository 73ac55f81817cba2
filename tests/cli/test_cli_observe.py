"""``simulate``'s KV-event and metrics options fail with one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "5", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-events-endpoint", "bogus://x"], "'bogus://x': expected tcp://HOST:PORT"),
        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"], "needs --kv-events-endpoint"),
        (["--serve-after", "5"], "--serve-after needs --kv-events-endpoint or --metrics-port"),
    ],
)
def test_bad_observe_options(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*SMALL, *extra]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("missing", "option", "extra"),
    [
        ("prometheus_client", ["--metrics-port", "0"], "metrics"),
        ("zmq", ["--kv-events-endpoint", "tcp://127.0.0.1:0"], "events"),
    ],
)
def test_a_missing_extra_is_refused_before_the_workload_naming_the_option(
    missing: str, option: list[str], extra: str, tmp_path: Path
) -> None:
    """Without the extra, the trace was read (minutes, for a large one) before one line said
    "this option needs prometheus_client", of two options the run may have had."""
    bad_trace = tmp_path / "bad.jsonl"  # an error about it would mean it was read first
    bad_trace.write_text("{\n")
    code = (  # the package not installed, as where the extra was left out
        f"import sys; sys.modules[{missing!r}] = None; "
        "from kvoffload.cli.main import main; sys.exit(main())"
    )
    argv = ["simulate", "--trace", str(bad_trace), "--no-progress", *option]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"kvoffload: error: {option[0]} needs {missing}; install it with: "
        f"pip install 'kvoffload[{extra}]'\n"
    )


def test_endpoints_on_free_ports_leave_the_result_unchanged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("prometheus_client")
    assert main([*SMALL, "--json", "-", "--no-bound"]) == 0
    plain = capsys.readouterr().out
    observed = [
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0", "--metrics-port", "0",
    ]  # fmt: skip
    assert main([*SMALL, "--json", "-", "--no-bound", *observed]) == 0
    drop = ("wall_seconds", "refs_per_second", "manager_us_per_block")
    import json

    a, b = json.loads(plain), json.loads(capsys.readouterr().out)
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }


def test_serve_after_says_why_the_command_has_not_returned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The table was printed and the command then sat silent for --serve-after."""
    pytest.importorskip("prometheus_client")
    argv = [*SMALL, "--no-bound", "--metrics-port", "0", "--serve-after", "0.01"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "the endpoints stay up 0.01 s more (--serve-after; Ctrl-C ends it)" in err, err


@pytest.mark.parametrize("option", ["--kv-events-endpoint", "--kv-events-replay-endpoint"])
def test_metrics_on_an_event_endpoints_port_is_refused_before_the_workload(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    """Each port passed its own trial bind, so the clash showed only once the trace was read
    and the metrics server started ("Address already in use", naming neither option)."""
    pytest.importorskip("zmq")
    pytest.importorskip("prometheus_client")
    with socket.socket() as probe:  # a port free now, closed before the run binds it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    endpoints = {"--kv-events-endpoint": "tcp://127.0.0.1:0", option: endpoint}
    bad_trace = tmp_path / "bad.jsonl"  # an error about it would mean it was read first
    bad_trace.write_text("{\n")
    argv = ["simulate", "--trace", str(bad_trace), "--no-progress", "--metrics-port", str(port)]
    assert main([*argv, *(word for pair in endpoints.items() for word in pair)]) == 1
    assert capsys.readouterr().err == (
        f"kvoffload: error: --metrics-port {port} and {option} {endpoint!r} both bind port "
        f"{port}: give them different ports\n"
    )
