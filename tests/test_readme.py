"""The README and the manual say what the code does: their sample output is a fresh run's,
their links lead somewhere, and their usage example runs as written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kvoffload

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

SIMULATE_BLOCK = re.compile(r"^```\n\$ (kvoffload simulate)\n(.*?)^```", re.MULTILINE | re.DOTALL)
"""A sample of the main job on the built-in default workload: the command line, then its output."""

TIMED = re.compile(r"^(manager time|replay) .*$", re.MULTILINE)
"""The only lines of that output that vary between runs: how long the replay took."""

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
    env = dict(os.environ)
    src = str(Path(kvoffload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    runs: dict[str, str] = {}
    samples = _simulate_samples()
    assert samples
    for page, command, shown in samples:
        if command not in runs:
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
            runs[command] = done.stdout
        assert _normalised(runs[command]) == _normalised(shown), (
            f"{page.name}: the sample of `{command}` differs from a fresh run:\n{runs[command]}"
        )


def test_normalising_keeps_everything_but_the_timings() -> None:
    shown = (
        "offload read           47,648 blocks\n"
        "replay                 0.87 s, 642,159 block refs/s\n"
    )
    assert _normalised(shown) == _normalised(shown.replace("0.87", "1.39"))
    assert _normalised(shown) != _normalised(shown.replace("47,648", "47,649"))


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
