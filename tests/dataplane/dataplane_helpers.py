"""Small builders shared by the data-plane tests."""

from __future__ import annotations

import torch

from kvoffload.core.layout import KVLayout
from kvoffload.dataplane import PagedKVCache

LAYOUTS = {
    "tiny-f16": KVLayout(
        num_layers=2, kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=4
    ),
    "bf16": KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype="bfloat16", tokens_per_block=4),
    "fp32": KVLayout(num_layers=2, kv_heads=1, head_dim=8, dtype="float32", tokens_per_block=2),
    "fp8-odd": KVLayout(num_layers=2, kv_heads=1, head_dim=3, dtype="float8", tokens_per_block=3),
}
"""fp8-odd has 9-byte pages: the copies fall back to 1-byte elements."""


def random_layers(
    layout: KVLayout, num_blocks: int, seed: int, separate: bool, interleaved: bool = False
) -> list[torch.Tensor]:
    """Layers of random bytes (NaN patterns included): one allocation, or one per layer.

    ``interleaved``: one allocation per layer, K and V pages alternating block by block
    (``[num_blocks, 2, ...]`` seen as ``[2, num_blocks, ...]``, as FlashInfer keeps them
    and as vLLM's worker splits each canonical page into two halves).
    """
    dtype = PagedKVCache(layout, 1).layers[0].dtype
    page = (layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    if interleaved:
        blocks_first = [
            torch.empty((num_blocks, 2, *page), dtype=dtype) for _ in range(layout.num_layers)
        ]
        layers = [layer.transpose(0, 1) for layer in blocks_first]
    elif separate:
        layers = [
            torch.empty((2, num_blocks, *page), dtype=dtype) for _ in range(layout.num_layers)
        ]
    else:
        layers = PagedKVCache(layout, num_blocks).layers
    generator = torch.Generator().manual_seed(seed)
    for layer in layers:
        raw = layer.view(torch.uint8)  # a view of the same strides: fine when interleaved
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return layers


def block_bytes(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    """All pages of GPU block ``block`` as bytes ``[2 * num_layers, page_bytes]``."""
    return torch.stack(
        [half[block].flatten().view(torch.uint8) for layer in layers for half in layer]
    )
