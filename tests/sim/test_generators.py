"""Synthetic workloads: deterministic per seed, and each kind has its reuse shape."""

from __future__ import annotations

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.generators import generate, parse_mix
from kvoffload.sim.workload import Workload


def fingerprint(workload: Workload) -> list[tuple[float, int, int, tuple[bytes, ...]]]:
    return [
        (r.arrival_s, r.input_tokens, r.output_tokens, tuple(r.keys)) for r in workload.requests
    ]


def refs_and_unique(workload: Workload) -> tuple[int, int]:
    keys = [key for req in workload.requests for key in req.keys]
    return len(keys), len(set(keys))


def extends_an_earlier_request(workload: Workload) -> float:
    """Fraction of requests whose keys start with all keys of some earlier request."""
    seen: set[tuple[bytes, ...]] = set()
    extending = 0
    for req in workload.requests:
        keys = tuple(req.keys)
        extending += any(keys[:n] in seen for n in range(1, len(keys) + 1))
        seen.add(keys)
    return extending / len(workload.requests)


def test_same_seed_same_workload_other_seed_differs() -> None:
    assert fingerprint(generate(num_requests=300, seed=3)) == fingerprint(
        generate(num_requests=300, seed=3)
    )
    assert fingerprint(generate(num_requests=300, seed=3)) != fingerprint(
        generate(num_requests=300, seed=4)
    )


def test_exact_count_sorted_arrivals_and_block_size() -> None:
    workload = generate({"chat": 1, "rag": 1}, num_requests=301, block_tokens=32)
    assert len(workload.requests) == 301
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)
    assert all(len(r.keys) == r.input_tokens // 32 for r in workload.requests)


def test_oneshot_has_no_reuse() -> None:
    refs, unique = refs_and_unique(generate({"oneshot": 1}, num_requests=200))
    assert refs == unique > 0


def test_chat_turns_extend_the_conversation() -> None:
    assert extends_an_earlier_request(generate({"chat": 1}, num_requests=300)) > 0.3
    assert extends_an_earlier_request(generate({"oneshot": 1}, num_requests=300)) == 0


def test_agent_requests_share_the_long_tool_prefix() -> None:
    workload = generate({"agent": 1}, num_requests=100)
    prefix = workload.requests[0].keys[: 6000 // 16]
    assert all(r.keys[: len(prefix)] == prefix for r in workload.requests)


def test_rag_documents_are_reused_by_popularity() -> None:
    workload = generate({"rag": 1}, num_requests=400)
    refs, unique = refs_and_unique(workload)
    assert unique < 0.6 * refs
    first_doc_block = [r.keys[19] for r in workload.requests]  # past the 300-token instructions
    most_common = max(first_doc_block.count(k) for k in set(first_doc_block))
    assert most_common > 400 / 50


def test_mix_weights_and_errors() -> None:
    assert parse_mix("chat=2, rag=0.5") == {"chat": 2.0, "rag": 0.5}
    assert parse_mix("agent") == {"agent": 1.0}
    with pytest.raises(InvalidArgumentError, match="unknown workload kind 'video'"):
        generate({"video": 1})
    with pytest.raises(InvalidArgumentError, match="not a number"):
        parse_mix("chat=lots")
    with pytest.raises(InvalidArgumentError):
        generate({"chat": 0})
