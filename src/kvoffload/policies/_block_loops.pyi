from collections import OrderedDict
from collections.abc import Container, Iterable, MutableMapping, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, ParkingOrder, Victims

def leading_ready(blocks: dict[OffloadKey, BlockStatus], keys: Iterable[OffloadKey], /) -> int: ...
def pin_all(
    blocks: dict[OffloadKey, BlockStatus], keys: Sequence[OffloadKey], /
) -> tuple[list[int], int] | int: ...
def unpin_all(
    blocks: dict[OffloadKey, BlockStatus], keys: Sequence[OffloadKey], /
) -> list[OffloadKey] | int: ...
def mark_ready(
    blocks: dict[OffloadKey, BlockStatus], keys: Iterable[OffloadKey], /
) -> list[OffloadKey]: ...
def drop_victims(
    blocks: dict[OffloadKey, BlockStatus], victims: Victims, free: list[BlockStatus], /
) -> list[OffloadKey]: ...
def store_pairs(
    mapping: MutableMapping[OffloadKey, BlockStatus],
    keys: Iterable[OffloadKey],
    values: Iterable[BlockStatus],
    /,
) -> None: ...
def claim_pending(blocks: Iterable[BlockStatus], /) -> list[int]: ...
def move_recent(
    order: OrderedDict[OffloadKey, BlockStatus],
    parking: ParkingOrder,
    keys: Iterable[OffloadKey],
    /,
) -> None: ...
def distinct(keys: Iterable[OffloadKey], /) -> list[OffloadKey]: ...
def front_victims(
    order: OrderedDict[OffloadKey, BlockStatus], n: int, protected: Container[OffloadKey], /
) -> Victims | None: ...
