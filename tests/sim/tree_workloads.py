"""A hypothesis strategy of small serving workloads on a prefix tree, for the simulator's
property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from kvoffload import block_id_key
from kvoffload.sim.workload import Request, Workload


@st.composite
def tree_workloads(draw: st.DrawFn, max_requests: int = 20, max_depth: int = 5) -> Workload:
    """Requests walking a small prefix tree (three children a node), some empty, some with a
    partial last block or an unkeyed tail (a long prefill), arriving together or apart."""
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    at = 0.0
    for _ in range(draw(st.integers(1, max_requests))):
        at += draw(st.sampled_from([0.0, 0.001, 0.01, 0.5]))
        path = tuple(draw(st.lists(st.integers(0, 2), max_size=max_depth)))
        nodes = [ids.setdefault(path[:end], len(ids)) for end in range(1, len(path) + 1)]
        keys = [block_id_key(node) for node in nodes]
        tokens = max(0, 16 * len(keys) - draw(st.integers(0, 15)))
        tokens += draw(st.sampled_from([0, 0, 0, 150]))
        requests.append(Request(at, tokens, draw(st.integers(0, 8)), keys))
    return Workload("tree", 16, requests)
