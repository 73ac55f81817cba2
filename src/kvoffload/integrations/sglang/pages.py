"""The registered host pool's pages as byte buffers, for both of SGLang's interfaces.

The zero-copy interface (``interface_v1``) names pages by host-pool token
indices; ``get_page_buffer_meta`` turns them into the (pointer, size)
segments each page occupies, which every SGLang host pool implements for
its own layout: two per page for an MHA pool in ``page_first`` (K, V), two
per layer in ``layer_first``, one for an MLA pool in ``page_first``. A page
of one segment is read and written in place; a page of several is gathered
into a staging buffer (kept per thread) to be written, and read into one that
is then scattered. The copy interface hands whole flat page tensors. torch is
imported here; SGLang is not.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kvoffload.core.errors import InvalidArgumentError

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
"""Host-pool layouts whose pages SGLang's pools describe as whole segments in page order
(``page_first_direct`` as ``page_first``); the tests cover ``page_first`` and ``layer_first``."""
GROUP_BYTES = 32 * 2**20
"""Host-pool layouts whose page segments this backend has been checked with."""


def flat_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat run of memory: itself (a view) when it is one, else a copy."""
    return tensor.detach().reshape(-1).contiguous()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a flat contiguous CPU tensor, in place (writable)."""
    return tensor.view(torch.uint8).numpy().data


def _at(pointer: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes of the host pool at ``pointer``."""
    return memoryview((ctypes.c_ubyte * size).from_address(pointer)).cast("B")


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
        self.page_size = int(pool.page_size)
        page = pool.get_dummy_flat_data_page()
        self.dtype = str(page.dtype)
        self.page_bytes = int(page.numel()) * int(page.element_size())
        pointers, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size))
        self.segments_per_page = len(pointers)
        if self.segments_per_page < 1 or sum(sizes) != self.page_bytes:
            raise InvalidArgumentError(
                f"host pool pages of {self.page_bytes} bytes come in segments of {list(sizes)} "
                "bytes; kvoffload cannot map them"
            )
        self._local = threading.local()

    def dummy_page(self) -> torch.Tensor:
        """A fresh flat page tensor (the copy interface's destination when none is given)."""
        page: torch.Tensor = self.pool.get_dummy_flat_data_page()
        return page

    def segments(self, host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page of ``host_indices`` (``page_size`` indices each), its segments in order."""
        pointers, sizes = self.pool.get_page_buffer_meta(host_indices)
        n = self.segments_per_page
        return [
            [_at(p, s) for p, s in zip(pointers[i : i + n], sizes[i : i + n], strict=True)]
            for i in range(0, len(pointers), n)
        ]

    @property
    def group(self) -> int:
        """Pages per part of a batch whose pages need gathering or scattering (0: none do):
        one part is copied while the one before it is on the wire."""
        if self.segments_per_page == 1:
            return 0
        return max(1, GROUP_BYTES // self.page_bytes)

    def parts(self, pages: list[list[memoryview]]) -> Iterator[tuple[int, list[memoryview]]]:
        """The pages' bytes to write, as ``(first page, payloads)`` parts: in place for
        one-segment pages, else gathered part by part into this thread's staging buffer
        (valid until the thread's next call)."""
        if self.group == 0:
            yield 0, [segments[0] for segments in pages]
            return
        staging = self.staging(len(pages))
        size = self.page_bytes
        for start in range(0, len(pages), self.group):
            part = []
            for i in range(start, min(start + self.group, len(pages))):
                offset = i * size
                for segment in pages[i]:
                    staging[offset : offset + segment.nbytes] = segment
                    offset += segment.nbytes
                part.append(staging[i * size : (i + 1) * size])
            yield start, part

    def staging(self, pages: int) -> memoryview:
        """This thread's staging buffer for ``pages`` pages, kept between calls: a fresh
        buffer per call costs its page faults, more than the copy itself."""
        need = pages * self.page_bytes
        buffer: bytearray | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < need:
            buffer = self._local.buffer = bytearray(need)
        return memoryview(buffer)[:need]


class PageTargets:
    """Where a read of pages lands: in place for one-segment pages, else in a staging buffer
    that :meth:`scatter` copies into the segments of a page that arrived intact."""

    def __init__(self, host: HostPages, pages: list[list[memoryview]]) -> None:
        self._pages = pages
        self._page_bytes = host.page_bytes
        self._staging = None if host.segments_per_page == 1 else host.staging(len(pages))

    def view(self, page: int) -> memoryview:
        if self._staging is None:
            return self._pages[page][0]
        return self._staging[page * self._page_bytes : (page + 1) * self._page_bytes]

    def scatter(self, page: int) -> None:
        if self._staging is None:
            return
        offset = page * self._page_bytes
        for segment in self._pages[page]:
            segment[:] = self._staging[offset : offset + segment.nbytes]
            offset += segment.nbytes
