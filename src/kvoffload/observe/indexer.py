"""Which instance holds the longest prefix of a request's blocks, learned from KV events.

The question a KV-aware router asks. Each instance's blocks are counted per
hash (a block held on two media, or announced twice, needs two removals),
across every medium: any copy on an instance saves recomputing it there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvoffload.observe.events import AllBlocksCleared, BlockHash, BlockRemoved, KVEventBatch


class PrefixIndex:
    """Per instance, the block hashes it holds, updated batch by batch."""

    def __init__(self) -> None:
        self._held: dict[str, Counter[BlockHash]] = {}

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        held = self._held.setdefault(instance, Counter())
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    count = held[block_hash] - 1
                    if count > 0:
                        held[block_hash] = count
                    else:
                        del held[block_hash]
            else:
                held.update(event.block_hashes)

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
