"""A manager wrapper that counts the blocks pinned by loads and the stores still pending,
for tests that check what the engine does while either is outstanding."""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec


class PinProbe(OffloadingManager):
    """Forwards every call to ``inner``; :attr:`pinned` blocks loading, :attr:`pending` keys
    stored but not completed."""

    def __init__(self, inner: OffloadingManager) -> None:
        self.inner = inner
        self.pinned = 0
        self.pending: set[OffloadKey] = set()

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return self.inner.lookup(keys)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        keys = list(keys)
        self.pinned += len(keys)
        return self.inner.prepare_load(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.inner.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self.pinned -= len(keys)
        self.inner.complete_load(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = self.inner.prepare_store(keys)
        if output is not None:
            self.pending.update(output.keys_to_store)
        return output

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        keys = list(keys)
        self.pending.difference_update(keys)
        self.inner.complete_store(keys, success)
