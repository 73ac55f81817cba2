"""The engine's paged KV cache, and the byte-row views the copies work on.

Each layer is one tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``
(K then V), as vLLM's attention backends keep it. Copies never look at the
dtype: every layer's K and V become a *canonical* tensor of rows, row ``b``
being block ``b``'s bytes, viewed with the widest element type the sizes and
alignments allow, because torch's index kernels move wide elements fastest
(16-byte elements copy about twice as fast as 2-byte ones on CPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import KVLayout
from kvoffload.dataplane.allocation import allocate, block_count, resolve_device

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8": torch.float8_e4m3fn,
}

_WIDE_DTYPES: dict[int, torch.dtype] = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
"""Element type per width; copies are bitwise, so a float type only adds speed."""


class PagedKVCache:
    """One KV tensor per layer, all carved from one zeroed allocation on ``device``.

    One allocation lets a copy move every layer's pages of a block in one
    op (see :func:`page_groups`); engines that allocate layers separately
    work too, with one op per layer's K and V.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        num_blocks = block_count("num_blocks", num_blocks)
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (2, num_blocks, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
        self.buffer = allocate(
            (layout.num_layers, *shape),
            TORCH_DTYPES[layout.dtype],
            resolve_device(device),
            "the paged KV cache",
            zero=True,
        )
        self.layers: list[torch.Tensor] = list(self.buffer.unbind(0))

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def page_groups(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The canonical page tensors (each layer's K, then V) as byte rows.

    When all of them follow each other in one allocation, the result is a
    single ``[num_tensors * num_blocks, page_bytes]`` tensor (row
    ``t * num_blocks + b``), so that one indexed op moves a block's pages of
    every layer at once. Otherwise it is one ``[num_blocks, page_bytes]``
    tensor per canonical tensor, as the reference handles them.
    """
    if not layers:
        raise InvalidArgumentError("at least one KV layer tensor is needed")
    for layer in layers:
        if not isinstance(layer, torch.Tensor) or layer.layout != torch.strided:
            kind = layer.layout if isinstance(layer, torch.Tensor) else type(layer).__name__
            raise InvalidArgumentError(f"KV layer tensors must be dense torch tensors, got {kind}")
    devices = sorted({str(layer.device) for layer in layers})
    if len(devices) > 1 or layers[0].device.type not in ("cpu", "cuda"):
        # Else every copy fails, or on the meta device every load "succeeds" moving nothing.
        raise InvalidArgumentError(
            f"KV layer tensors must all be on one CPU or CUDA device, got {', '.join(devices)}"
        )
    halves: list[torch.Tensor] = []
    for layer in layers:
        if layer.dim() < 3 or layer.shape[0] != 2:
            raise InvalidArgumentError(
                f"KV layer tensors must be [2, num_blocks, ...], got {tuple(layer.shape)}"
            )
        if layer.shape[1] == 0:  # else refused below as "not contiguous", for want of rows
            raise InvalidArgumentError(
                f"KV layer tensors need at least one block, got {tuple(layer.shape)}"
            )
        pages_before = len(halves)
        for half in layer.unbind(0):
            page = _page_rows(half)
            if page is None:
                raise InvalidArgumentError(
                    "each KV block must be contiguous in memory in its logical order, got "
                    f"strides {half.stride()} for shape {tuple(half.shape)}"
                )
            if page.stride(0) < page.shape[1] and page.shape[0] > 1:
                # A load into one block would rewrite part of its neighbours (an expanded
                # tensor: all of them) and still report success.
                raise InvalidArgumentError(
                    f"KV blocks must not overlap in memory, but a block has {page.shape[1]} "
                    f"elements and the next starts {page.stride(0)} elements later "
                    f"(strides {half.stride()} for shape {tuple(half.shape)})"
                )
            halves.append(page.view(torch.uint8))
        key, value = halves[pages_before:]
        if _rows_meet(key, value):
            # A load of V would rewrite K (an expanded tensor: the same bytes), and report success.
            raise InvalidArgumentError(
                "a KV layer's K and V must not share memory, but V starts "
                f"{layer.stride(0)} elements after K (strides {layer.stride()} for shape "
                f"{tuple(layer.shape)})"
            )
    if len({h.shape for h in halves}) != 1:
        raise InvalidArgumentError("all KV layer tensors must have the same block count and shape")
    if all(_follows(a, b) for a, b in itertools.pairwise(halves)):
        num_blocks, page_bytes = halves[0].shape
        return [
            torch.as_strided(halves[0], (len(halves) * num_blocks, page_bytes), (page_bytes, 1))
        ]
    return halves


def _rows_meet(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two byte-row tensors of one shape and row stride (a layer's K and V pages)
    share a byte: a row of one starts within a row's length of a row of the other."""
    rows, length = first.shape
    stride = first.stride(0) if rows > 1 else length
    apart = second.data_ptr() - first.data_ptr()
    # The row offsets k that bring ``apart + k * stride`` nearest zero: either side of it.
    nearest = {-(apart // stride), -apart // stride} if stride else {0}
    return any(abs(apart + k * stride) < length for k in nearest if -(rows - 1) <= k <= rows - 1)


def _page_rows(half: torch.Tensor) -> torch.Tensor | None:
    """``half`` as ``[num_blocks, page elements]`` rows, or ``None`` unless each block
    is contiguous in its logical order.

    Always a view: ``flatten`` would silently copy a permuted layout (such as
    heads before tokens), and loads into that copy would never reach the cache.
    """
    try:
        page = half.view(half.shape[0], -1)
    except RuntimeError:
        return None
    return page if page.stride(-1) == 1 else None


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts where ``a`` ends, both contiguous in one allocation."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel()
    )


def widest_element(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest element type all these byte tensors can be viewed as."""
    width = 16
    for t in tensors:
        for n in (t.shape[-1], t.data_ptr(), *t.stride()[:-1]):
            while n % width:
                width //= 2
    return _WIDE_DTYPES[width]
