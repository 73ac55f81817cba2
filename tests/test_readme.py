"""The README and the manual say what the code does: their sample output is a fresh run's,
their links lead somewhere, and their usage example runs as written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kvoffload
from kvoffload.admission.compiled import COMPILED_MODULES, compiled_modules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

SIMULATE_BLOCK = re.compile(r"^```\n\$ (kvoffload simulate)\n(.*?)^```", re.MULTILINE | re.DOTALL)
"""A sample of the main job on the built-in default workload: the command line, then its output."""

TIMED = re.compile(r"^(manager time|replay) .*$", re.MULTILINE)
"""The only lines of that output that vary between runs: how long the replay took."""

EXCERPT_BLOCK = re.compile(
    r"^```\n\$ (kvoffload simulate [^\n\\]*)\n\.\.\.\n(.*?)^```", re.MULTILINE | re.DOTALL
)
"""A sample that shows part of a run's output: the command line, then ``...`` and the lines
shown, ``...`` again wherever lines are left out."""

NEEDS_MORE = ("--trace", "--disk-dir", "--remote", "--data-plane")
"""Options whose samples need a trace file, a directory, a server or torch: not run here."""

BUILT = re.compile(r"^(\s*control, memory .*, )[\d.]+( bytes per tracked key)$", re.MULTILINE)
"""The admission layer's memory per key: the samples show the compiled modules' figure,
which a pure-Python build does not print."""

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _normalised(output: str) -> str:
    """The output with the timings' figures blanked and trailing space dropped."""
    output = TIMED.sub(lambda m: re.sub(r"\d[\d,.]*", "N", m.group(0)), output)
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines())


def _simulate_samples() -> list[tuple[Path, str, str]]:
    samples = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for match in SIMULATE_BLOCK.finditer(page.read_text()):
            samples.append((page, match.group(1), match.group(2)))
    return samples


def test_readme_shows_the_main_jobs_output() -> None:
    assert any(page == README for page, _, _ in _simulate_samples()), (
        "README has no `$ kvoffload simulate` sample"
    )


def test_simulate_samples_equal_a_fresh_run() -> None:
    """Run the command each sample shows, with this checkout's kvoffload, and compare."""
    runs: dict[str, str] = {}
    samples = _simulate_samples()
    assert samples
    for page, command, shown in samples:
        if command not in runs:
            runs[command] = _fresh_run(command)
        assert _normalised(runs[command]) == _normalised(shown), (
            f"{page.name}: the sample of `{command}` differs from a fresh run:\n{runs[command]}"
        )


def _fresh_run(command: str) -> str:
    """The standard output of ``command`` (``kvoffload ...``), run with this checkout's
    kvoffload."""
    env = dict(os.environ)
    src = str(Path(kvoffload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    args = shlex.split(command)[1:]
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _excerpts() -> list[tuple[Path, str, list[str]]]:
    """Each runnable excerpt sample: its page, command and the shown runs of lines."""
    samples = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for match in EXCERPT_BLOCK.finditer(page.read_text()):
            command = match.group(1)
            if not any(option in command.split() for option in NEEDS_MORE):
                parts = re.split(r"^\.\.\.\n", match.group(2), flags=re.MULTILINE)
                samples.append((page, command, [part for part in parts if part.strip()]))
    return samples


def test_excerpt_samples_appear_in_a_fresh_run() -> None:
    """Each run of lines an excerpt shows is in the command's output, whole lines and in
    order."""
    samples = _excerpts()
    assert any(page.name == "simulate.md" for page, _, _ in samples)
    compiled = len(compiled_modules()) == len(COMPILED_MODULES)
    for page, command, parts in samples:
        output = "\n" + _as_built(_normalised(_fresh_run(command)), compiled) + "\n"
        at = 0
        for part in parts:
            shown = _as_built(_normalised(part), compiled)
            found = output.find(f"\n{shown}\n", at)
            assert found >= 0, (
                f"{page.name}: the sample of `{command}` shows lines a fresh run does not "
                f"print there:\n{shown}\nThe run:{output}"
            )
            at = found + len(shown) + 1


def _as_built(output: str, compiled: bool) -> str:
    """``output`` with the memory figure blanked where this build cannot print the
    samples' (compiled) one."""
    return output if compiled else BUILT.sub(r"\1N\2", output)


def test_normalising_keeps_everything_but_the_timings() -> None:
    shown = (
        "offload read           47,648 blocks\n"
        "replay                 0.87 s, 642,159 block refs/s\n"
    )
    assert _normalised(shown) == _normalised(shown.replace("0.87", "1.39"))
    assert _normalised(shown) != _normalised(shown.replace("47,648", "47,649"))
    memory = "  control, memory         1.00, 31.9 bytes per tracked key"
    assert _as_built(memory, False) == _as_built(memory.replace("31.9", "82.9"), False)
    assert _as_built(memory, False) != _as_built(memory.replace("1.00", "0.50"), False)
    assert _as_built(memory, True) != _as_built(memory.replace("31.9", "82.9"), True)


def test_relative_links_lead_to_files() -> None:
    """GitHub renders the README's links; mkdocs --strict checks the pages' own."""
    pages = [README, *sorted(DOCS.glob("*.md"))]
    missing = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, missing
    assert LINK.findall(README.read_text()), "README links no page of the manual"


def test_managers_python_example_runs() -> None:
    page = DOCS / "managers.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert blocks, "docs/managers.md has no python example"
    exec(compile(blocks[0], str(page), "exec"), {})


def _pip_installs(text: str) -> list[list[str]]:
    """Each ``.venv/bin/pip install`` in ``text``, its arguments without ``--quiet``."""
    found = re.findall(r"\.venv/bin/pip install ([^&\n]+)", text)
    return [[arg for arg in shlex.split(args) if arg != "--quiet"] for args in found]


def test_ci_installs_what_the_readme_installs() -> None:
    """CI must make the venv the README's set-up makes: the same installs, in the same order,
    with the same flags (``--no-compile`` among them, which the suite's timings count on)."""
    readme = README.read_text()
    setup = readme[readme.index("## Set-up") :]
    setup = setup[: setup.index("```", setup.index("```") + 3)]
    ci = (ROOT / ".ci" / "run").read_text()
    assert _pip_installs(setup), setup
    assert _pip_installs(ci) == _pip_installs(setup)
    assert "bash tests/engine/setup_venv.sh .venv-vllm-cpu" in setup
    assert "tests/engine/setup_venv.sh .venv-vllm-cpu" in ci
