"""A manager that holds nothing and admits every offer: the bottom of an admission layer
over a tier that keeps its own index.

Under an engine's own tiering (SGLang's HiCache L3, vLLM's secondary tiers) the tier
below decides residency and eviction itself; the admission layer on top of this manager
then alone decides which offered blocks are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvoffload.admission import (
    AdmissionLayer,
    AdmissionStats,
    FilterReusedOffloadingManager,
    WriteBudget,
    wrap_with_admission,
)
from kvoffload.core.errors import check_integer
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.policies.base import CachePolicy


class AdmitAllManager(OffloadingManager):
    """Finds nothing, admits every offered key whole; ``spec`` names the tier's medium.

    ``policy``: the tier's own eviction policy, which an optimising layer on top models
    (``None``: LRU).
    """

    def __init__(self, spec: LoadStoreSpec, policy: CachePolicy | None = None) -> None:
        self._spec = spec
        self.policy = policy

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return 0

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self._spec

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), self._spec, [])


def admission_book(
    admission: str,
    spec: LoadStoreSpec,
    capacity: int,
    write_budget: float | WriteBudget | None = None,
    policy: CachePolicy | None = None,
    params: object | None = None,
    size_key: str = "",
) -> AdmissionLayer | None:
    """The admission layer ``admission`` over an :class:`AdmitAllManager`, sized for a tier
    of ``capacity`` blocks (``None`` for ``none``: every offer is written); ``params``: the
    rule's parameters (see :func:`~kvoffload.admission.registry.admission_params`);
    ``size_key``: the caller's key of ``capacity``, named by a memory error.

    The one assembly of a tier's own decision book: the tiered stack's lower tiers,
    SGLang's L3 tiers and vLLM's secondary tiers all use it. ``capacity`` is checked
    before it is raised to 1 block: a size read from a config file as text (``"100"``)
    failed there with a ``TypeError`` that named nothing.
    """
    check_integer("capacity", capacity, 0)
    book = AdmitAllManager(spec, policy)
    layer = wrap_with_admission(admission, book, max(1, capacity), write_budget, params, size_key)
    if isinstance(layer, FilterReusedOffloadingManager):
        return ReuseBook(book, max(1, capacity), layer)
    return layer if isinstance(layer, AdmissionLayer) else None


class ReuseBook(AdmissionLayer):
    """The reuse filter's rule (``filter``) as a tier's book.

    The filter counts the lookups that pass through it, but a tier's book sees
    requests (:meth:`~AdmissionLayer.begin_request`), not lookups: here its table
    counts each request's keys once, and an offered key is written once counted
    ``store_threshold`` times. ``rule`` is the filter the registry built, for its
    checked parameters, its table and its ``stores_skipped``.
    """

    def __init__(
        self, backing: OffloadingManager, capacity: int, rule: FilterReusedOffloadingManager
    ) -> None:
        super().__init__(backing, capacity)
        self.rule = rule

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.rule.reuse.count(keys)

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        admitted = self.rule.reuse.at_least(offered, self.rule.store_threshold)
        self.rule.stores_skipped += len(offered) - len(admitted)
        return admitted

    def stats(self) -> AdmissionStats:
        """The table's memory as the table counts it (the optimiser's filter candidates are
        counted so too): the ghost list's bytes per record, used before, reported 160 bytes
        a key where the compiled table takes about 57 and the Python one 120."""
        return self._stats(
            float(self.rule.store_threshold),
            self.rule.reuse.memory_bytes,
            self.rule.max_tracker_size,
        )
