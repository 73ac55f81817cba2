from collections.abc import Container, Sequence

from kvoffload.core.keys import OffloadKey

class LRUTier:
    """An LRU mini-tier of ``capacity`` keys in C (see ``minisim.LRUMiniTier``)."""

    capacity: int
    hits: float
    writes: float
    total_hits: int
    total_writes: int
    def __new__(cls, capacity: int) -> LRUTier: ...
    def __len__(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    @property
    def held(self) -> Container[OffloadKey]: ...
    def hit_run(self, keys: Sequence[OffloadKey]) -> int: ...
    def touch(self, keys: Sequence[OffloadKey]) -> None: ...
    def store(
        self,
        keys: Sequence[OffloadKey],
        behind_gap: Sequence[bool] = (),
        request: Sequence[OffloadKey] = (),
    ) -> int: ...
    def store_admitted(
        self,
        keys: Sequence[OffloadKey],
        at: Sequence[int],
        keep: Container[OffloadKey] | None,
        gap: int,
        request: Sequence[OffloadKey] = (),
    ) -> int: ...
    def in_order(self) -> list[OffloadKey]: ...
    def unreachable(self, key: OffloadKey) -> bool: ...
