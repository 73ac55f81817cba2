"""The handlers against a plain reference: every store and load, page by page, in Python.

Random layouts, ``block_size_factor``, one allocation, one per layer or one per layer
with K and V pages alternating block by block (as vLLM's worker hands them over), each copy
path with small scratch and staging buffers, and sequences of stores and loads
(partial first blocks by ``block_indices`` or by default) must leave exactly the
bytes a per-page copy would, in the CPU slots and in the GPU blocks, and nothing
else touched.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS, block_bytes, random_layers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, CPUGPUHandler  # noqa: E402

# (staged, min_run_bytes): staged, direct runs only, scratch only, both by run length.
PATHS = {
    "staged": (True, 0),
    "direct-runs": (False, 0),
    "direct-scratch": (False, 1 << 40),
    "direct-mixed": (False, 64),
}


def run_job(handler: CPUGPUHandler, job_id: int, spec: TransferSpec) -> None:
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    (result,) = handler.get_finished()
    assert (result.job_id, result.success) == (job_id, True)


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_handlers_copy_what_a_per_page_reference_copies(data: st.DataObject) -> None:
    layout = LAYOUTS[data.draw(st.sampled_from(sorted(LAYOUTS)), "layout")]
    factor = data.draw(st.integers(1, 4), "factor")
    num_gpu, num_cpu = data.draw(st.integers(4, 16), "gpu"), data.draw(st.integers(1, 5), "cpu")
    separate, interleaved = data.draw(st.booleans(), "separate"), data.draw(st.booleans())
    seed = data.draw(st.integers(0, 9))
    layers = random_layers(layout, num_gpu, seed, separate=separate, interleaved=interleaved)
    store = CPUBlockStore(layout, num_cpu, factor, pin_memory=False)
    staged, min_run = PATHS[data.draw(st.sampled_from(sorted(PATHS)), "path")]
    options = {
        "staged": staged,
        "min_run_bytes": min_run,
        "scratch_bytes": data.draw(st.sampled_from([1, 100, 1 << 20]), "scratch"),
        "staging_bytes": data.draw(st.sampled_from([1, 300, 1 << 20]), "staging"),
    }
    store_handler = CPUGPUHandler(layers, store, to_cpu=True, **options)
    load_handler = CPUGPUHandler(layers, store, to_cpu=False, **options)
    reference: dict[int, list[torch.Tensor]] = {}  # slot -> its factor GPU blocks' bytes
    for job_id in range(data.draw(st.integers(1, 5), "jobs")):
        if not reference or data.draw(st.booleans(), "store?"):
            count = data.draw(st.integers(0, min(num_cpu, num_gpu // factor)), "slots")
            slots = data.draw(st.permutations(range(num_cpu)))[:count]
            gpu = data.draw(st.permutations(range(num_gpu)))[: count * factor]
            pages = [block_bytes(layers, b).clone() for b in gpu]
            spec = (GPULoadStoreSpec(gpu, [len(gpu)]), CPULoadStoreSpec(slots))
            run_job(store_handler, job_id, spec)
            for i, slot in enumerate(slots):
                reference[slot] = pages[i * factor : (i + 1) * factor]
            # The slot layout is a contract too (lower tiers write slots out as they are).
            for slot, blocks in reference.items():
                assert torch.equal(store.block(slot), torch.stack(blocks)), slot
            continue
        slots = data.draw(st.permutations(sorted(reference)), "load slots")
        slots = slots[: data.draw(st.integers(1, len(slots)))]
        pages = [page for slot in slots for page in reference[slot]]
        skip = data.draw(st.integers(0, min(factor - 1, len(pages) - 1)), "skip")
        count = len(pages) - skip
        if count > num_gpu:
            continue
        by_index = data.draw(st.booleans(), "block_indices?")
        # Without block_indices the load ends on a block boundary: it skips -count % factor.
        first = skip + factor * data.draw(st.integers(0, 3)) if by_index else None
        gpu = data.draw(st.permutations(range(num_gpu)))[:count]
        expected = [block_bytes(layers, b).clone() for b in range(num_gpu)]
        for block, page in zip(gpu, pages[skip:], strict=True):
            expected[block] = page
        indices = None if first is None else [first]
        run_job(
            load_handler,
            job_id,
            (CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu, [count], block_indices=indices)),
        )
        for block in range(num_gpu):
            assert torch.equal(block_bytes(layers, block), expected[block]), block
    store_handler.close()
    load_handler.close()
