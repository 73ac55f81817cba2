"""A manager that holds nothing and admits every offer: the bottom of an admission layer
over a tier that keeps its own index.

Under an engine's own tiering (SGLang's HiCache L3, vLLM's secondary tiers) the tier
below decides residency and eviction itself; the admission layer on top of this manager
then alone decides which offered blocks are written.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec


class AdmitAllManager(OffloadingManager):
    """Finds nothing, admits every offered key whole; ``spec`` names the tier's medium."""

    def __init__(self, spec: LoadStoreSpec) -> None:
        self._spec = spec

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return 0

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self._spec

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), self._spec, [])
