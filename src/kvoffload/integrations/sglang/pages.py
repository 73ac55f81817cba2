"""The registered host pool's pages as byte buffers, for both of SGLang's interfaces.

The zero-copy interface (``interface_v1``) names pages by host-pool token
indices; ``get_page_buffer_meta`` turns them into the (pointer, size)
segments each page occupies, which every SGLang host pool implements for
its own layout: two per page for an MHA pool in ``page_first`` (K, V), two
per layer in ``layer_first``, one for an MLA pool in ``page_first``. A page
is its segments, in that order: the tiers write them as the parts of one
value and read a value back into them (:data:`kvoffload.tiers.format.Parts`),
so a page of several segments is never gathered into a staging copy nor
scattered out of one. The copy interface hands whole page tensors, split the
same way where they are not one run of memory. torch is imported here;
SGLang is not.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.tiers.checksum import AddressedParts

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
"""Host-pool layouts whose pages SGLang's pools describe as whole segments in page order
(``page_first_direct`` as ``page_first``); the tests cover ``page_first`` and ``layer_first``."""


def flat_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat run of memory: itself (a view) when it is one, else a copy
    (a read's destination, then returned in its place)."""
    return tensor.detach().reshape(-1).contiguous()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a flat contiguous CPU tensor, in place (writable)."""
    return tensor.view(torch.uint8).numpy().data


def tensor_parts(tensor: torch.Tensor) -> list[memoryview]:
    """The bytes of a CPU tensor in its element order, in place: one view when it is one run
    of memory, else the views of its slices along the first dimension, recursively (an MHA
    page's K and V halves), so no copy joins them."""
    if tensor.dim() == 1 and tensor.is_contiguous() and not tensor.requires_grad:
        # A flat page (what SGLang's copy interface hands): its bytes at once, 2 us against
        # 6 us through the general path, 128 pages a batch.
        return [tensor.view(torch.uint8).numpy().data]
    tensor = tensor.detach()
    if tensor.is_contiguous():
        return [tensor_bytes(tensor.reshape(-1))]
    if tensor.dim() <= 1:
        return [tensor_bytes(tensor.contiguous())]
    return [view for row in tensor.unbind(0) for view in tensor_parts(row)]


@functools.lru_cache(maxsize=64)
def _array_type(size: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """The ctypes array type of ``size`` bytes, made once: making it costs 5-9 us, about ten
    times the view itself, and a ``layer_first`` batch has thousands of segments."""
    return ctypes.c_ubyte * size


def _at(pointer: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes of the host pool at ``pointer``."""
    return memoryview(_array_type(size).from_address(pointer)).cast("B")


class HostPages:
    """Page geometry of ``pool`` (a ``HostKVCache``), checked once at registration."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.layout = str(pool.layout)
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(
                f"kvoffload's HiCache backend supports the host layouts {', '.join(LAYOUTS)}; "
                f"this host pool uses {self.layout!r} (set --hicache-mem-layout)"
            )
        # Host indices are logical: under decode context parallelism (an MLA pool with
        # ``dcp_size`` > 1) a page is ``logical_page_size`` of them and each rank's rows
        # hold its share, ``page_size`` (physical) tokens a page; else the two agree.
        self.page_size = int(getattr(pool, "logical_page_size", pool.page_size))
        """Host indices a page (a key): the page size SGLang's controller hands pages in."""
        size = getattr(pool, "logical_size", getattr(pool, "size", None))
        self.tokens = None if size is None else int(size)
        """The pool's logical token slots (SGLang's ``HostKVCache.logical_size``, its
        ``size`` without DCP), which bound host indices."""
        try:
            page = pool.get_dummy_flat_data_page()
        except NotImplementedError:  # K and V of different head dims: segments only
            page = None
        self.flat = page is not None
        """Whether the pool has flat pages, which SGLang's copy interface moves."""
        pointers, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size))
        if page is None:
            self.dtype = str(pool.dtype)
            self.page_bytes = sum(sizes)
        else:
            self.dtype = str(page.dtype)
            self.page_bytes = int(page.numel()) * int(page.element_size())
        self._region = _region(pool)
        self.segments_per_page = len(pointers)
        if self.segments_per_page < 1 or sum(sizes) != self.page_bytes:
            raise InvalidArgumentError(
                f"host pool pages of {self.page_bytes} bytes come in segments of {list(sizes)} "
                "bytes; kvoffload cannot map them"
            )

    def dummy_page(self) -> torch.Tensor:
        """A fresh flat page tensor (the copy interface's destination when none is given)."""
        page: torch.Tensor = self.pool.get_dummy_flat_data_page()
        return page

    def fits(self, host_indices: Any, pages: int) -> bool:
        """Whether ``host_indices`` names ``pages`` whole pages inside the pool: a 1-D integer
        tensor of ``page_size`` indices a page, each page starting at or past 0 and ending
        inside it. SGLang's pools turn a page's first index into a pointer unchecked, so a
        read into any other would write outside the pool."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            return False
        dtype = host_indices.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return False
        if host_indices.numel() != pages * self.page_size:
            return False
        if pages == 0:
            return True
        starts = host_indices[:: self.page_size]
        if int(starts.min()) < 0:
            return False
        return self.tokens is None or int(starts.max()) + self.page_size <= self.tokens

    def segments(self, host_indices: torch.Tensor) -> list[AddressedParts]:
        """Per page of ``host_indices`` (``page_size`` indices each), its segments in order,
        with their addresses in the pool (so the shared tier hashes them in place)."""
        pointers, sizes = self.pool.get_page_buffer_meta(host_indices)
        n = self.segments_per_page
        region = self._region
        if region is None:
            views = [_at(p, s) for p, s in zip(pointers, sizes, strict=True)]
        else:
            views = region.views(pointers, sizes)
        return [
            AddressedParts(views[i : i + n], pointers[i : i + n]) for i in range(0, len(views), n)
        ]


class _Region:
    """The host pool's one buffer as a byte view: a segment inside it is a slice of the
    view (0.2 us), where a ctypes view of the segment costs 2.5 us; a ``layer_first``
    batch of 128 pages has 2,048 segments."""

    def __init__(self, base: int, whole: memoryview) -> None:
        self.base = base
        self.whole = whole
        self.end = whole.nbytes

    def at(self, pointer: int, size: int) -> memoryview:
        """A writable view of ``size`` bytes at ``pointer`` (outside the buffer: its own)."""
        offset = pointer - self.base
        if offset < 0 or offset + size > self.end:
            return _at(pointer, size)
        return self.whole[offset : offset + size]

    def views(self, pointers: list[int], sizes: list[int]) -> list[memoryview]:
        """:meth:`at` of each segment, in one pass (no call per segment: 2,048 of them in
        a ``layer_first`` batch) where all lie inside the buffer."""
        base, whole = self.base, self.whole
        pairs = list(zip(pointers, sizes, strict=True))
        if pairs and min(pointers) >= base and max(p + s for p, s in pairs) - base <= self.end:
            return [whole[p - base : p - base + s] for p, s in pairs]
        return [self.at(p, s) for p, s in pairs]


def _region(pool: Any) -> _Region | None:
    """The pool's ``kv_buffer`` (SGLang's MHA and MLA host pools keep their pages in one
    CPU tensor) as one byte view, if it is one run of CPU memory."""
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
        return None
    if not buffer.is_contiguous() or buffer.numel() == 0:
        return None
    return _Region(buffer.data_ptr(), tensor_bytes(buffer.reshape(-1)))
