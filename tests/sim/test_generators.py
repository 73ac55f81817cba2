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


def test_progress_counts_the_requests_drawn_and_changes_nothing() -> None:
    calls: list[tuple[int, int]] = []
    workload = generate(num_requests=5000, seed=4, progress=lambda *call: calls.append(call))
    assert fingerprint(workload) == fingerprint(generate(num_requests=5000, seed=4))
    done = [d for d, _ in calls]
    assert len(calls) > 3 and done == sorted(done) and calls[-1] == (5000, 5000)
    assert {total for _, total in calls} == {5000}


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
    with pytest.raises(InvalidArgumentError, match="'chat': expected a number, got 'lots'"):
        parse_mix("chat=lots")
    with pytest.raises(InvalidArgumentError, match="names 'chat' twice"):  # the last one won
        parse_mix("chat=1,rag=1,chat=2")
    with pytest.raises(InvalidArgumentError):
        generate({"chat": 0})


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        ("1e309", "must be a finite number, got '1e309'"),
        ("-inf", "must be a finite number, got '-inf'"),
        ("nan", "must be a finite number, got 'nan'"),
        ("-0.5", "must be >= 0, got -0.5"),
        ("-1e-400", "must be >= 0, got -1e-400"),  # its float, -0.0, is not below 0
        ("1e-400", "1e-400 is too small to tell from 0"),  # its float is 0
    ],
)
def test_a_mix_weight_out_of_range_is_refused_as_typed(weight: str, reason: str) -> None:
    """``chat=1e309`` was refused later, by generate, as "got {'chat': inf}"; ``-1e-400``
    and ``1e-400`` were read as weight 0."""
    with pytest.raises(InvalidArgumentError, match=f"mix weight for 'chat': {reason}"):
        parse_mix(f"rag=1,chat={weight}")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mix": "chat"}, "mix"),  # the text parse_mix reads, not its mapping
        ({"mix": [("chat", 1.0)]}, "mix"),
        ({"mix": {"chat": "1"}}, "mix weights"),
        ({"mix": {"chat": None}}, "mix weights"),
        ({"mix": {"chat": True}}, "mix weights"),
        ({"chat_shape": {"one_turn": 0.5}}, "chat_shape"),
        ({"seed": 0.5}, "seed"),
        ({"seed": None}, "seed"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(fields: dict[str, object], named: str) -> None:
    """Not an ``AttributeError`` from a mix or shape of another type, nor a seed of 0.5
    taken as one of its own."""
    with pytest.raises(InvalidArgumentError, match=named):
        generate(num_requests=4, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", [None, b"chat=1", 3])
def test_a_mix_that_is_no_text_is_refused(text: object) -> None:
    with pytest.raises(InvalidArgumentError, match="a mix is text"):
        parse_mix(text)  # type: ignore[arg-type]


def test_longchat_has_one_root_long_requests_and_mostly_single_use_blocks() -> None:
    """The held-out chat trace's shape: one shared root block, tens of 512-token blocks per
    request, about three quarters of unique blocks used once, reuse minutes apart."""
    from collections import Counter

    workload = generate({"longchat": 1}, num_requests=3000, seed=0, block_tokens=512, rate=3.4)
    requests = workload.requests
    assert len({r.keys[0] for r in requests}) == 1
    lengths = [len(r.keys) for r in requests]
    assert 15 <= sum(lengths) / len(lengths) <= 35 and max(lengths) <= 247
    uses = Counter(key for r in requests for key in set(r.keys))
    once = sum(1 for n in uses.values() if n == 1) / len(uses)
    assert 0.65 <= once <= 0.9
    last: dict[object, float] = {}
    gaps = []
    for r in requests:
        for key in r.keys[1:]:
            if key in last:
                gaps.append(r.arrival_s - last[key])
            last[key] = r.arrival_s
    gaps.sort()
    assert 60 <= gaps[len(gaps) // 2] <= 200


def test_a_chat_shape_changes_what_it_names_and_the_default_is_longchat() -> None:
    """``ChatShape()`` is plain ``longchat``; more one-turn sessions give fewer requests per
    conversation, a longer gap between turns spreads reuse further apart in time."""
    from kvoffload.sim.generators import ChatShape

    def mix(shape: ChatShape | None) -> Workload:
        return generate({"longchat": 1}, 2000, seed=4, block_tokens=512, rate=3.4, chat_shape=shape)

    assert fingerprint(mix(ChatShape())) == fingerprint(mix(None))
    assert mix(None).name == "synthetic(longchat=1, seed=4)"
    assert "turn_gap_s=600" in mix(ChatShape(turn_gap_s=600)).name
    assert ChatShape().mean_session_requests() == 1.82

    def median_reuse_gap(workload: Workload) -> float:
        last: dict[object, float] = {}
        gaps = []
        for r in workload.requests:
            for key in r.keys[1:]:
                if key in last:
                    gaps.append(r.arrival_s - last[key])
                last[key] = r.arrival_s
        return sorted(gaps)[len(gaps) // 2]

    assert median_reuse_gap(mix(ChatShape(turn_gap_s=600))) > 2 * median_reuse_gap(mix(None))

    def reused_share(workload: Workload) -> float:
        keys = [key for r in workload.requests for key in set(r.keys[1:])]
        return 1 - len(set(keys)) / len(keys)

    assert reused_share(mix(ChatShape(one_turn=0.9))) < reused_share(mix(ChatShape(one_turn=0.2)))

    def follow_up_share(workload: Workload) -> float:
        """Requests that extend an earlier one past the system prompt: later turns."""
        seen: set[object] = set()
        later = 0
        for r in workload.requests:
            later += len(r.keys) > 2 and r.keys[2] in seen
            seen.update(r.keys)
        return later / len(workload.requests)

    assert follow_up_share(mix(ChatShape(extra_turns=4))) > follow_up_share(mix(None)) + 0.1

    def mean_blocks(workload: Workload) -> float:
        return sum(len(r.keys) for r in workload.requests) / len(workload.requests)

    for knob in ("paste_tokens", "first_tokens", "follow_up_tokens"):
        longer = ChatShape(**{knob: 4 * getattr(ChatShape(), knob)})
        assert mean_blocks(mix(longer)) > 1.1 * mean_blocks(mix(None)), knob


@pytest.mark.parametrize(
    "field, value",
    [
        ("one_turn", 1.5),
        ("one_turn", -0.1),
        ("one_turn", None),
        ("paste_tokens", 0),
        ("paste_tokens", True),
        ("turn_gap_s", float("nan")),
        ("extra_turns", "2"),
        ("system_tokens", 700.5),
        ("system_tokens", None),
    ],
)
def test_a_bad_chat_shape_is_refused(field: str, value: object) -> None:
    from kvoffload.sim.generators import ChatShape

    with pytest.raises(InvalidArgumentError, match=field):
        ChatShape(**{field: value})
