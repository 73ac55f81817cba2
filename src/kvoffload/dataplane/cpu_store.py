"""The CPU tier's bytes: one allocation, one fixed-size slot per offloaded block.

Slot ``s`` holds ``block_size_factor`` consecutive GPU blocks, and each of
those holds every layer's K and V page, so one offloaded block is one
contiguous byte range: a run of adjacent slots moves in a single DMA, and a
later tier can write a slot out as it is.
"""

from __future__ import annotations

import weakref

import torch

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import KVLayout
from kvoffload.dataplane.allocation import allocate, block_count
from kvoffload.dataplane.pinning import register, unregister, wants_pinning


class CPUBlockStore:
    """``num_blocks`` slots of ``block_size_factor * layout.bytes_per_block`` bytes.

    The memory is pinned when CUDA is available (``pin_memory=None``), exactly
    the store's bytes, so that copies to and from the GPU run asynchronously. It
    is not cleared: the manager never lets a slot be loaded before a store to it
    has completed.
    ``buffer``: memory the caller owns (a shared region's tensor), contiguous
    ``uint8`` of exactly the store's size, used as it is instead of allocating.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size_factor: int = 1,
        pin_memory: bool | None = None,
        buffer: torch.Tensor | None = None,
    ):
        num_blocks = block_count("num_blocks", num_blocks)
        block_size_factor = block_count("block_size_factor", block_size_factor)
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size_factor = block_size_factor
        shape = (num_blocks, block_size_factor, 2 * layout.num_layers, layout.page_bytes)
        if buffer is not None:
            size = num_blocks * self.slot_bytes
            if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or buffer.numel() != size:
                raise InvalidArgumentError(
                    f"the CPU store's buffer must be {size} uint8 bytes on the CPU, got "
                    f"{buffer.numel()} {buffer.dtype} on {buffer.device}"
                )
            if not buffer.is_contiguous():
                # Slots are single byte ranges: every handler built on it would fail in torch.
                raise InvalidArgumentError(
                    f"the CPU store's buffer must be contiguous, got strides {buffer.stride()}"
                )
            self.data = buffer.view(shape)
            return
        pin = wants_pinning(pin_memory, "pin_memory")
        self.data = allocate(shape, torch.uint8, torch.device("cpu"), "the CPU block store")
        if pin:
            # Registered, not allocated pinned: torch's pinned allocator rounds up to a
            # power of two. Unregistered when the store goes, its memory still held.
            weakref.finalize(self, unregister, register(self.data, "the CPU block store"))

    @property
    def slot_bytes(self) -> int:
        return self.block_size_factor * self.layout.bytes_per_block

    def rows(self) -> torch.Tensor:
        """``[num_blocks * factor, 2 * num_layers, page_bytes]``: row ``s * factor + j``
        is sub-block ``j`` of slot ``s``, one page per layer's K and V."""
        return self.data.flatten(0, 1)

    def block(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as ``[factor, 2 * num_layers, page_bytes]`` bytes (a view)."""
        return self.data[slot]
