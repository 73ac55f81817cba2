"""The admission layer: a manager decorator that decides which offered blocks are stored.

Subclasses see every request once (``_sighting``) and choose the admitted
subset of each offer (``_admit``); everything else is delegated unchanged to
the backing manager, so a layer composes with any manager and any policy.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.admission.minisim import WhatIf
from kvoffload.admission.requests import RequestTracker
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec


@dataclass(frozen=True)
class AdmissionStats:
    """Counters of one admission layer; ``control`` is its current control value."""

    offers: int
    admitted: int
    rejected: int
    ghost_hits: int
    control: float
    memory_bytes: int
    tracked_keys: int
    """How many keys the fixed-size structures are sized for."""
    candidate: str = ""
    """The rule the layer follows now, for layers that choose among candidates."""
    whatif: tuple[WhatIf, ...] = ()
    """What-if figures (candidate x capacity factor) over recent traffic, for layers that
    simulate them."""
    whatif_total: tuple[WhatIf, ...] = ()
    """The same figures since the layer started."""

    @property
    def bytes_per_tracked_key(self) -> float:
        return self.memory_bytes / self.tracked_keys if self.tracked_keys else 0.0


class AdmissionLayer(OffloadingManager):
    """Wraps ``backing``; ``capacity`` (the tier's blocks) sizes the layer's memory."""

    def __init__(self, backing: OffloadingManager, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(f"admission capacity must be an int >= 1, got {capacity!r}")
        self._backing = backing
        self.capacity = capacity
        self._requests = RequestTracker()
        self.offers = 0
        self.admitted = 0
        self.ghost_hits = 0

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    @abstractmethod
    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        """One request referenced ``keys`` (GPU-held blocks included); counted once."""

    @abstractmethod
    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        """The offered keys to store; ``prefix`` blocks of the request precede them."""

    @abstractmethod
    def stats(self) -> AdmissionStats:
        """Counters and footprint, for reports."""

    def see_request(
        self, keys: Sequence[OffloadKey], will_offer: bool = True, counted: int = 0
    ) -> None:
        """One request's keys in prefix order, from a driver that knows request boundaries.

        For drivers whose lookups and touches are per key or partial (vLLM's
        per-key API) and that therefore send those to :attr:`backing` directly:
        each call counts one sighting. With ``will_offer`` an offer ending at
        the same key learns how many blocks precede it. ``counted``: leading
        keys an earlier call already showed for the same request (a request
        offered in parts), not counted again.
        """
        if not keys:
            return
        if will_offer:
            self._requests.open(keys)
        if counted < len(keys):
            self._sighting(keys[counted:])

    def saw_tier_hit(self, keys: Sequence[OffloadKey]) -> None:
        """The tier served part of the request ``keys`` (as announced to :meth:`see_request`).

        For drivers that send lookups to :attr:`backing` directly: without this
        call such a request counts as one whose prefix only the GPU cache served.
        """
        if keys:
            self._requests.on_hit(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and self._requests.on_touch(keys):
            self._sighting(keys)
        self._backing.touch(keys)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and self._requests.on_lookup(keys):
            self._sighting(keys)
        found = self._backing.lookup(keys)
        if found:
            self.saw_tier_hit(keys)
        return found

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        offered = list(dict.fromkeys(keys))
        if not offered:
            return self._backing.prepare_store(offered)
        admitted = self._admit(offered, self._requests.prefix_length(offered))
        output = self._backing.prepare_store(admitted)
        self.offers += len(offered)
        self.admitted += len(admitted)
        self._requests.on_store(offered, output is not None and bool(output.keys_to_store))
        return output

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self._backing.prepare_load(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.complete_load(keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self._backing.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._backing.take_events()
