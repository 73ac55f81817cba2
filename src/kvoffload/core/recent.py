"""A bounded record of recently seen keys.

Managers and adapters remember a few things per key for a while (a lookup answered
"retry later", a block whose promotion failed, a page a lookup asked for) and must
not grow without bound when the engine never comes back for it: the record keeps
the newest ``limit`` keys and forgets the oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvoffload.core.keys import OffloadKey


class RecentKeys:
    """At most ``limit`` keys, in the order they were last added; adding past the limit
    drops the least recently added."""

    __slots__ = ("_keys", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a record of recent keys needs room for one key, not {limit}")
        self.limit = limit
        self._keys: OrderedDict[OffloadKey, None] = OrderedDict()

    def add(self, key: OffloadKey) -> None:
        """Remember ``key`` as the newest."""
        keys = self._keys
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.limit:
            keys.popitem(last=False)

    def add_all(self, new_keys: Iterable[OffloadKey]) -> None:
        """Remember each of ``new_keys``, the last of them the newest."""
        keys = self._keys
        for key in new_keys:
            keys[key] = None
            keys.move_to_end(key)
        while len(keys) > self.limit:
            keys.popitem(last=False)

    def discard(self, key: OffloadKey) -> None:
        """Forget ``key`` if it is remembered."""
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
