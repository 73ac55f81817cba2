"""Which of the admission layer's compiled modules this installation runs.

Each is optional (``setup.py``): where the build found no C compiler, the same code
runs in Python, with the same decisions and about twice the optimiser's manager time.
``kvoffload --version`` reports it, for bug reports and for an operator who wonders why.
"""

from __future__ import annotations

from importlib import import_module

COMPILED_MODULES = (
    "_lru_tier",
    "_arc_tier",
    "_s3fifo_tier",
    "_sieve_tier",
    "_slru_tier",
    "_reuse_counts",
    "_ghost",
    "_sketch",
)


def compiled_modules() -> list[str]:
    """The compiled modules that import here (a subset of :data:`COMPILED_MODULES`)."""
    found = []
    for name in COMPILED_MODULES:
        try:
            import_module(f"kvoffload.admission.{name}")
        except ImportError:
            continue
        found.append(name)
    return found


def compiled_summary() -> str:
    """One line: how many compiled modules run, and what that means."""
    found = compiled_modules()
    if len(found) == len(COMPILED_MODULES):
        return f"admission hot paths: compiled ({len(found)} of {len(COMPILED_MODULES)} modules)"
    if not found:
        return (
            "admission hot paths: pure Python (built without a C compiler; same decisions, slower)"
        )
    missing = ", ".join(sorted(set(COMPILED_MODULES) - set(found)))
    return (
        f"admission hot paths: partly compiled ({len(found)} of {len(COMPILED_MODULES)};"
        f" in Python: {missing})"
    )
