"""Lower layers never import higher ones: every ``kvoffload`` import, parsed with ``ast``.

core -> policies/admission/observe -> managers -> dataplane/tiers -> sim -> integrations/cli.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvoffload

LAYERS = {
    "core": 0,
    "policies": 1,
    "admission": 1,
    "observe": 1,
    "managers": 2,
    "dataplane": 3,
    "tiers": 3,
    "sim": 4,
    "integrations": 5,
    "cli": 5,
}
PACKAGE = Path(kvoffload.__file__).parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [name for name in names if name.startswith("kvoffload.")]


def _violations(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue  # the package's own front door re-exports every layer
        layer = LAYERS[parts[0]]
        for name in _imports(path):
            target = name.split(".")[1]
            if LAYERS.get(target, -1) > layer:
                found.append(f"{'/'.join(parts)} imports {name}")
    return found


def test_no_module_imports_a_higher_layer() -> None:
    assert _violations(PACKAGE) == []


def test_no_tier_imports_the_tiered_manager() -> None:
    """The tier protocol lives in ``core``: tiers implement it without importing the stack
    that calls them (``tiers/stack.py``, the builder, is the one module that assembles it;
    the disk tier keeps its index in a plain CPU manager, which is no part of the stack)."""
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted((PACKAGE / "tiers").glob("*.py"))
        if path.name != "stack.py"
        and any(name.startswith("kvoffload.managers.tiered") for name in _imports(path))
    ]
    assert offenders == []


def test_the_check_finds_a_violation(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("def f():\n    from kvoffload.sim import run\n")
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "fine.py").write_text("import kvoffload.core.keys\n")
    assert _violations(tmp_path) == ["core/bad.py imports kvoffload.sim"]
