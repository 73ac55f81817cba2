"""Which of the compiled modules (the admission layer's, and the real tier's per-key loops
in ``kvoffload.policies``) this installation runs.

Each is optional (``setup.py``): where the build found no C compiler, the same code
runs in Python, with the same decisions and about twice the optimiser's manager time.
``kvoffload --version`` reports it, for bug reports and for an operator who wonders why.
"""

from __future__ import annotations

from importlib import import_module

COMPILED_MODULES = (
    "kvoffload.admission._lru_tier",
    "kvoffload.admission._arc_tier",
    "kvoffload.admission._s3fifo_tier",
    "kvoffload.admission._sieve_tier",
    "kvoffload.admission._slru_tier",
    "kvoffload.admission._reuse_counts",
    "kvoffload.admission._ghost",
    "kvoffload.admission._sketch",
    "kvoffload.policies._block_loops",
)


def compiled_modules() -> list[str]:
    """The compiled modules that import here (a subset of :data:`COMPILED_MODULES`)."""
    found = []
    for name in COMPILED_MODULES:
        try:
            import_module(name)
        except ImportError:
            continue
        found.append(name)
    return found


def compiled_summary() -> str:
    """One line: how many compiled modules run, and what that means."""
    found = compiled_modules()
    if len(found) == len(COMPILED_MODULES):
        return f"hot paths: compiled ({len(found)} of {len(COMPILED_MODULES)} modules)"
    if not found:
        return "hot paths: pure Python (built without a C compiler; same decisions, slower)"
    missing = ", ".join(
        sorted(name.rsplit(".", 1)[1] for name in set(COMPILED_MODULES) - set(found))
    )
    return (
        f"hot paths: partly compiled ({len(found)} of {len(COMPILED_MODULES)};"
        f" in Python: {missing})"
    )
