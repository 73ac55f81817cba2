"""Which instance holds the longest prefix of a request's blocks, learned from KV events.

The question a KV-aware router asks. Each instance's blocks are counted per
medium and hash (a block held on two media, or announced twice, needs two
removals); a block counts as held on any medium: any copy on an instance saves
recomputing it there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.observe.events import AllBlocksCleared, BlockHash, BlockRemoved, KVEventBatch


class PrefixIndex:
    """Per instance, the block hashes it holds, updated batch by batch.

    ``AllBlocksCleared`` carries no medium, so ``cleared_media`` says which media it
    empties; ``None`` (the default) means every medium. vLLM's engine publishes it from
    its GPU block pool's prefix-cache reset only (``BlockPool.reset_prefix_cache``),
    whether or not its offloading connector was reset too, and the connector's CPU tier
    (vLLM's own and ours) drops its blocks at a reset without a ``BlockRemoved`` each,
    while our disk tier announces what a reset removes and the shared tier keeps its
    blocks. A router over vLLM engines with kvoffload's lower tiers passes
    ``{"GPU", "CPU"}`` and keeps their ``STORAGE`` blocks across a reset; clearing
    every medium forgets blocks the instance still serves. A restarted instance
    (:data:`~kvoffload.observe.subscriber.RESTART_SEQ`) re-announces what its disk tier
    recovered: :meth:`forget` it whole.
    """

    def __init__(self, cleared_media: Iterable[str | None] | None = None) -> None:
        if isinstance(cleared_media, str):  # "GPU" would be the media "G", "P" and "U"
            raise InvalidArgumentError(
                f"cleared_media must be a collection of media, got the string {cleared_media!r}"
            )
        self._cleared_media = None if cleared_media is None else frozenset(cleared_media)
        self._held: dict[str, Counter[BlockHash]] = {}
        """Per instance, each hash's count over all media: what the queries read."""
        self._by_medium: dict[str, dict[str | None, Counter[BlockHash]]] = {}

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        held = self._held.setdefault(instance, Counter())
        media = self._by_medium.setdefault(instance, {})
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for medium in list(media):
                    if self._cleared_media is None or medium in self._cleared_media:
                        held.subtract(media.pop(medium))
                self._held[instance] = held = +held
            elif isinstance(event, BlockRemoved):
                on_medium = media.get(event.medium, Counter())
                for block_hash in event.block_hashes:
                    if block_hash in on_medium:  # a removal from a medium that never held it
                        _decrement(on_medium, block_hash)
                        _decrement(held, block_hash)
            else:
                media.setdefault(event.medium, Counter()).update(event.block_hashes)
                held.update(event.block_hashes)

    def forget(self, instance: str) -> None:
        """Drop everything ``instance`` was announced to hold, on every medium."""
        self._held.pop(instance, None)
        self._by_medium.pop(instance, None)

    def holds(self, instance: str, block_hash: BlockHash) -> bool:
        return block_hash in self._held.get(instance, ())

    def num_blocks(self, instance: str) -> int:
        return len(self._held.get(instance, ()))

    def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> tuple[str | None, int]:
        """The instance holding the longest leading run of ``block_hashes``, and its length.

        ``(None, 0)`` when no instance holds the first block; ties go to the
        instance seen first.
        """
        best: tuple[str | None, int] = (None, 0)
        for instance, held in self._held.items():
            length = 0
            for block_hash in block_hashes:
                if block_hash not in held:
                    break
                length += 1
            if length > best[1]:
                best = (instance, length)
        return best


def _decrement(counts: Counter[BlockHash], block_hash: BlockHash) -> None:
    count = counts[block_hash] - 1
    if count > 0:
        counts[block_hash] = count
    else:
        del counts[block_hash]
