"""A host pool's page segments as byte views: slices of the pool's buffer, else ctypes views."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_helpers import HostPool, torch

from kvoffload.integrations.sglang.pages import HostPages, _region, tensor_parts


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def pages_bytes(pages: HostPages, indices: Any) -> list[bytes]:
    return [b"".join(bytes(s) for s in page) for page in pages.segments(indices)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("mla", [False, True])
def test_segments_are_the_pools_own_bytes_either_way(layout: str, mla: bool) -> None:
    """Slices of the one buffer view and ctypes views name the same memory: the same
    addresses, the pages' bytes, and a write through a segment lands in the pool."""
    pool = HostPool(layout, mla=mla)
    pool.fill(list(range(4)), seed=3)
    sliced, own = HostPages(pool), HostPages(pool)
    own._region = None
    assert sliced._region is not None
    indices = pool.indices([2, 0, 3])
    expected = [pool.page_bytes(p) for p in (2, 0, 3)]
    assert pages_bytes(sliced, indices) == pages_bytes(own, indices)
    if layout == "page_first" or mla:  # MHA layer_first: K and V interleaved by layer
        assert pages_bytes(sliced, indices) == expected
    for a, b in zip(sliced.segments(indices), own.segments(indices), strict=True):
        assert [address(s) for s in a] == [address(s) for s in b]
        # each page's segments carry their own addresses, so they are hashed in place
        assert a.addresses == b.addresses == [address(s) for s in a]
    first = sliced.segments(pool.indices([1]))[0][0]
    first[:] = bytes(first.nbytes)
    assert pool.page_bytes(1).startswith(bytes(first.nbytes))


def test_only_one_contiguous_cpu_buffer_is_sliced() -> None:
    """A ``kv_buffer`` that is not one run of CPU memory (or none) gets no region; a
    pointer outside the region gets its own view at that pointer."""
    whole = torch.arange(64, dtype=torch.int16).reshape(4, 16)
    assert _region(SimpleNamespace(kv_buffer=whole.t())) is None
    assert _region(SimpleNamespace()) is None
    region = _region(SimpleNamespace(kv_buffer=whole))
    assert region is not None and region.base == whole.data_ptr()
    assert bytes(region.at(whole.data_ptr() + 32, 4)) == bytes(whole.numpy().tobytes()[32:36])
    other = bytearray(b"elsewhere")
    outside = region.at(address(memoryview(other)), len(other))
    assert bytes(outside) == b"elsewhere"
    outside[:4] = b"ELSE"
    assert other.startswith(b"ELSE")
    inside = whole.data_ptr() + 8
    views = region.views([inside, address(memoryview(other)), inside + 2], [4, 4, 2])
    assert [bytes(v) for v in views] == [
        whole.numpy().tobytes()[8:12],
        b"ELSE",
        whole.numpy().tobytes()[10:12],
    ]
    assert region.views([], []) == []


def test_a_page_tensors_bytes_are_its_own_memory_in_element_order() -> None:
    """A flat page (the copy interface's) is one view of its memory; one that wants grad,
    a 2-D one and one that is not one run of memory give the same bytes as a copy would."""
    flat = torch.arange(40, dtype=torch.bfloat16)
    (view,) = tensor_parts(flat)
    assert bytes(view) == flat.view(torch.int16).numpy().tobytes()
    view[:4] = bytes(4)  # the first two bfloat16 elements
    assert flat[0].item() == 0.0 and flat[1].item() == 0.0
    graded = torch.arange(40, dtype=torch.float32, requires_grad=True)
    assert b"".join(map(bytes, tensor_parts(graded))) == graded.detach().numpy().tobytes()
    square = torch.arange(64, dtype=torch.int16).reshape(8, 8)
    for tensor in (square, square.t(), square[:, ::2]):
        expected = tensor.contiguous().numpy().tobytes()
        assert b"".join(map(bytes, tensor_parts(tensor))) == expected
