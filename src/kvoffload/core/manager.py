"""The scheduler-side offloading manager contract.

A manager decides which blocks are offloaded and where; it never moves bytes.
The engine drives it in this order for each request: ``touch`` and ``lookup``
the request's keys, ``prepare_load`` the hit, ``complete_load`` once loaded,
``prepare_store`` newly computed blocks, ``complete_store`` once written.
Every method accepts any iterable of keys, generators included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.specs import LoadStoreSpec


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided.

    ``keys_to_store`` are the offered keys that need writing, in offer order;
    ``store_spec`` names their destinations in the same order; ``evicted_keys``
    were dropped to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Blocks that became loadable (``removed=False``) or were dropped (``removed=True``)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


class EventLog:
    """The events a manager or tier has to hand out through ``take_events``; with
    ``enabled`` false nothing is kept, so a run without subscribers pays for none."""

    __slots__ = ("_events", "enabled")

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):  # "no" or None is not "off" by accident
            raise InvalidArgumentError(f"enable_events must be true or false, got {enabled!r}")
        self.enabled = enabled
        self._events: list[OffloadingEvent] = []

    def record(self, keys: Iterable[OffloadKey], medium: str, removed: bool) -> None:
        """One event for ``keys`` (copied: the caller may reuse its list)."""
        if self.enabled:
            self._events.append(OffloadingEvent(list(keys), medium, removed))

    def take(self) -> list[OffloadingEvent]:
        """Events since the last call, detached at once: none is lost or replayed."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events


class OffloadingManager(ABC):
    """Decides what the offload tier holds; runs single-threaded in the scheduler."""

    @abstractmethod
    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        """Length of the longest leading run of ``keys`` that is stored and ready.

        ``None`` means "cannot tell yet, ask again later" (asynchronous backends).
        """

    @abstractmethod
    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        """Pin ``keys`` against eviction and return where to read them from."""

    def touch(self, keys: Iterable[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Mark ``keys`` as recently used; the first key becomes the most recent."""

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:  # noqa: B027
        """Release the pins taken by ``prepare_load``."""

    @abstractmethod
    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve room for the offered keys not yet held; ``None`` if there is none.

        A ``None`` leaves the manager exactly as it was.
        """

    def complete_store(  # noqa: B027 - optional hook
        self, keys: Iterable[OffloadKey], success: bool = True
    ) -> None:
        """Make stored keys loadable, or drop them if the write failed."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call; the batch is detached when this is called."""
        return ()


Layer = TypeVar("Layer")


def stack_layers(manager: object) -> Iterator[object]:
    """``manager``, then each manager under it, following the decorators' ``backing``:
    filters, admission layers and observers wrap a tier manager that way."""
    current = manager
    while current is not None:
        yield current
        current = getattr(current, "backing", None)


def find_layer(manager: object, kind: type[Layer]) -> Layer | None:
    """The first layer of ``kind`` in ``manager``'s stack (:func:`stack_layers`), if any."""
    for layer in stack_layers(manager):
        if isinstance(layer, kind):
            return layer
    return None
