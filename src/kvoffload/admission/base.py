"""The admission layer: a manager decorator that decides which offered blocks are stored.

Subclasses see every request once (``_sighting``) and choose the admitted
subset of each offer (``_admit``); everything else is delegated unchanged to
the backing manager, so a layer composes with any manager and any policy.

Request boundaries: a driver that knows them announces each request with
:meth:`AdmissionLayer.begin_request` and closes it with
:meth:`AdmissionLayer.end_request` (the simulator's engine model, vLLM's
adapter and secondary tiers, SGLang's backend all do). From the first
``begin_request`` on, ``touch`` and ``lookup`` no longer count sightings.
Only a bare seed-style caller that never announces requests gets the
fallback: boundaries guessed from the call order
(:class:`~kvoffload.admission.requests.RequestTracker`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.admission.minisim import WhatIf
from kvoffload.admission.params import is_finite, shown
from kvoffload.admission.requests import RequestTracker
from kvoffload.core.errors import InvalidArgumentError, integer_value
from kvoffload.core.keys import SINGLE_KEY_TYPES, OffloadKey, refuse_single_key
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.policies.loops import distinct


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
    switches: int = 0
    """How many times the layer changed the rule it follows (each switch costs a refill:
    a tier that flaps between rules shows here)."""
    whatif: tuple[WhatIf, ...] = ()
    """What-if figures (candidate x capacity factor) over recent traffic, for layers that
    simulate them."""
    whatif_total: tuple[WhatIf, ...] = ()
    """The same figures since the layer started."""

    @property
    def bytes_per_tracked_key(self) -> float:
        return self.memory_bytes / self.tracked_keys if self.tracked_keys else 0.0

    def numbers(self) -> dict[str, float]:
        """The numeric counters by name, for engines' stats dictionaries (the candidate
        and what-if figures leave through their own metrics)."""
        return {
            "offers": float(self.offers),
            "admitted": float(self.admitted),
            "rejected": float(self.rejected),
            "ghost_hits": float(self.ghost_hits),
            "control": self.control,
            "memory_bytes": float(self.memory_bytes),
            "tracked_keys": float(self.tracked_keys),
            "switches": float(self.switches),
        }


class AdmissionLayer(OffloadingManager):
    """Wraps ``backing``; ``capacity`` (the tier's blocks) sizes the layer's memory."""

    def __init__(self, backing: OffloadingManager, capacity: int) -> None:
        # A float must hold it: the memory checks of the layer's tables divide it into GiB.
        bad = isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        if bad or not is_finite(capacity):
            raise InvalidArgumentError(
                f"admission capacity must be an int >= 1, got {shown(capacity)}"
            )
        self._backing = backing
        self.capacity = capacity
        self._requests = RequestTracker()
        self._announced = False
        """Whether a driver announces request boundaries (no guessing from the call order)."""
        self.offers = 0
        self.admitted = 0
        self.ghost_hits = 0
        self.switches = 0
        """Times the rule this layer follows changed (only a layer that chooses among
        candidate rules changes it)."""

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    @property
    def announced(self) -> bool:
        """Whether a driver announces request boundaries (else they are guessed)."""
        return self._announced

    @abstractmethod
    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        """One request referenced ``keys`` (GPU-held blocks included); counted once."""

    @abstractmethod
    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        """The offered keys to store; ``prefix`` blocks of the request precede them."""

    @abstractmethod
    def stats(self) -> AdmissionStats:
        """Counters and footprint, for reports."""

    def step_stats(self) -> AdmissionStats:
        """:meth:`stats` for an engine's report at every step: a layer may leave out what
        no step reports, where computing it would cost every step (the optimiser leaves
        ``whatif_total`` empty, which only the end-of-run reports read)."""
        return self.stats()

    def _stats(
        self, control: float, memory_bytes: int, tracked_keys: int, ghost_hits: int | None = None
    ) -> AdmissionStats:
        """The layer's offer counters beside its rule's own figures (``ghost_hits``: the
        layer's unless given)."""
        return AdmissionStats(
            offers=self.offers,
            admitted=self.admitted,
            rejected=self.offers - self.admitted,
            ghost_hits=self.ghost_hits if ghost_hits is None else ghost_hits,
            control=control,
            memory_bytes=memory_bytes,
            tracked_keys=tracked_keys,
            switches=self.switches,
        )

    @classmethod
    def from_params(cls, backing: OffloadingManager, capacity: int, params: Any) -> Any:
        """The layer as the registry builds it: ``params`` is its parameters dataclass."""
        return cls(backing, capacity, params=params)  # type: ignore[call-arg]

    def begin_request(
        self,
        keys: Sequence[OffloadKey],
        *,
        lookup_follows: bool = False,
        will_offer: bool = True,
        counted: int = 0,
        tier_hit: bool = False,
        gpu_held: int = 0,
        looked_up: bool = True,
    ) -> None:
        """A request's keys in prefix order (GPU-held blocks included), from a driver that
        knows request boundaries; counts one sighting.

        ``lookup_follows``: the driver sends this request's ``touch`` and ``lookup``
        through the layer next (the engine model); otherwise (per-key drivers: vLLM,
        SGLang) they go to :attr:`backing` directly and ``keys[gpu_held:]`` (the keys
        past the GPU's prefix hit) stand for the lookup too, and ``tier_hit`` says
        whether the tier served part of it. With
        ``will_offer`` an offer ending at the same key learns how many blocks precede it.
        ``counted``: leading keys an earlier call already showed for the same request (a
        request offered in parts), not counted again.
        ``looked_up=False``: the driver did not ask the tier for ``keys[gpu_held:]`` (it
        computed them and offers them next: an offer no look-up covered, as SGLang backs
        up pages it never queried), so they count as missed by every tier, never as hits.
        """
        check_request_keys(keys, "begin_request")
        counted, gpu_held = check_request_counts(counted, gpu_held)
        check_looked_up(tier_hit, looked_up)
        self._announced = True
        if not keys:
            return
        if lookup_follows:
            self._requests.open(keys, touched=True)
        elif will_offer:
            self._requests.open(keys)
        if counted < len(keys):
            self._sighting(keys[counted:])
        if tier_hit:
            self._requests.on_hit(keys)

    def end_request(self, keys: Sequence[OffloadKey]) -> None:
        """The request ``keys`` (as given to :meth:`begin_request`, or its offer: what ends
        at the same key) is done: forget it.

        A request never ended stays open until the bounded tracker drops it (or, for
        drivers without ``lookup_follows``, until its offer)."""
        check_request_keys(keys, "end_request")
        if keys:
            self._requests.close(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "touch")
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and not self._announced and self._requests.on_touch(keys):
            self._sighting(keys)
        self._backing.touch(keys)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and not self._announced and self._requests.on_lookup(keys):
            self._sighting(keys)
        found = self._backing.lookup(keys)
        if found and keys:
            self._requests.on_hit(keys)
        return found

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_store")
        offered = distinct(keys)
        if not offered:
            return self._backing.prepare_store(offered)
        admitted = self._admit(offered, self._requests.prefix_length(offered))
        output = self._backing.prepare_store(admitted)
        self.offers += len(offered)
        self.admitted += len(admitted)
        self._requests.on_store(offered, output is not None and bool(output.keys_to_store))
        return output

    def admit(self, offered: list[OffloadKey]) -> list[OffloadKey]:
        """What :meth:`prepare_store` of ``offered`` (distinct, not empty) passes on, with
        the same counts and request state, for a backing that stores all it is given (the
        optimiser's candidates): no backing call, no copy."""
        admitted = self._admit(offered, self._requests.prefix_length(offered))
        self.offers += len(offered)
        self.admitted += len(admitted)
        self._requests.on_store(offered, bool(admitted))
        return admitted

    def wrote(self, blocks: int) -> None:
        """``blocks`` of what :meth:`admit` passed on were really written (a tier skips the
        blocks it holds): a layer that keeps to a write budget is charged for these."""

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self._backing.prepare_load(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.complete_load(keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self._backing.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._backing.take_events()


def check_request_keys(keys: object, method: str) -> None:
    """Refuse, before any change, a request that is no sequence of keys: one key alone
    iterates as integer "keys", and a generator, a set or an int failed with a
    ``TypeError`` from the request tracker after the layer had switched to announced
    boundaries (``None`` switched it silently). Lists and tuples cost two type tests."""
    if type(keys) is list or type(keys) is tuple:
        return
    if isinstance(keys, SINGLE_KEY_TYPES):
        refuse_single_key(keys, method)
    if not isinstance(keys, Sequence):
        raise InvalidArgumentError(
            f"{method}: keys must be a sequence of keys in prefix order (a list), "
            f"got {type(keys).__name__}"
        )


def check_request_counts(counted: object, gpu_held: object) -> tuple[int, int]:
    """``begin_request``'s ``counted`` and ``gpu_held`` as ints; :class:`InvalidArgumentError`
    unless each is an integer >= 0. Any integer type counts (``operator.index``: a driver's
    NumPy or 0-d tensor count), not a bool; plain ints cost one type test each."""
    if type(counted) is int and type(gpu_held) is int and counted >= 0 and gpu_held >= 0:
        return counted, gpu_held
    return _count("counted", counted), _count("gpu_held", gpu_held)


def check_looked_up(tier_hit: bool, looked_up: bool) -> None:
    """:class:`InvalidArgumentError` for a tier hit in a request the tier was not asked for."""
    if tier_hit and not looked_up:
        raise InvalidArgumentError("begin_request: tier_hit needs looked_up (no look-up, no hit)")


def _count(name: str, value: object) -> int:
    """``value`` as an int >= 0, or :class:`InvalidArgumentError` naming ``name``."""
    number = integer_value(value)
    if number is None or number < 0:
        raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
    return number
