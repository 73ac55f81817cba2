"""The compiled tables under keys whose hashing and comparisons run Python code.

Offload keys are bytes, hashed and compared in C; any other hashable key runs its
``__hash__`` and ``__eq__`` mid-call, as do a store's gap flags. A table must stay whole
whatever that code does: raise (a node left in the table but on no list was later
unlinked at index -1, out of bounds), or call the table again (a node added with none
free, scratch arrays reallocated under the call that was reading them), change the list
the call reads, or refer back to the table (a cycle the collector must see). The sampling
helper beside them refuses arguments it could only wrap.
"""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled import NOT_BUILT, needs
from kvoffload.admission.compiled import compiled_modules
from kvoffload.admission.ghost import CompiledGhostRecords, GhostRecords
from kvoffload.admission.minisim import (
    CompiledARCMiniTier,
    CompiledLRUMiniTier,
    CompiledS3FIFOMiniTier,
    CompiledSIEVEMiniTier,
    CompiledSLRUMiniTier,
    LRUMiniTier,
    MiniTier,
    S3FIFOMiniTier,
    sampled_positions,
)
from kvoffload.admission.reuse_counts import CompiledReuseCounts, ReuseCounts
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.sieve import SIEVECachePolicy
from kvoffload.policies.slru import SLRUCachePolicy


class ComparisonError(Exception):
    """What an armed :class:`Touchy` key raises."""


class Touchy:
    """A key with the same hash as every other ``Touchy``, so that a table compares them;
    while ``armed``, comparing it with another key raises."""

    armed = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        if Touchy.armed and other is not self:
            raise ComparisonError(f"{self.name} compared with {other!r}")
        return other is self

    def __repr__(self) -> str:
        return f"Touchy({self.name!r})"


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    """Every test starts and ends with comparisons that succeed."""
    Touchy.armed = False
    yield
    Touchy.armed = False


MINI_TIERS = [
    pytest.param(factory, marks=needs(factory), id=name)
    for name, factory in [
        ("lru", CompiledLRUMiniTier),
        ("s3fifo", CompiledS3FIFOMiniTier),
        ("arc", CompiledARCMiniTier),
        ("sieve", CompiledSIEVEMiniTier),
        ("slru", CompiledSLRUMiniTier),
    ]
]


@pytest.mark.parametrize("factory", MINI_TIERS)
def test_a_mini_tier_evicts_without_comparing_the_victim(factory: Callable[[int], Any]) -> None:
    """``b`` sits behind ``a`` in the table's probe sequence and is the victim (``a``
    was touched): finding ``b``'s slot to drop it compared it with ``a``, and a raise
    there left ``b`` in the table on no list. The slot is found by index now."""
    tier = factory(2)
    a, b = Touchy("a"), Touchy("b")
    tier.store([a])
    tier.store([b])
    tier.touch([a])
    Touchy.armed = True
    assert tier.store([b"n"]) == 1
    Touchy.armed = False
    assert tier.held_among([a, b, b"n"]) == [a, b"n"]
    assert len(tier) == 2


@needs(CompiledReuseCounts)
def test_the_reuse_counter_evicts_without_comparing_the_victim() -> None:
    """As for the mini-tiers: ``b``, counted after ``a`` but least recently, leaves."""
    assert CompiledReuseCounts is not None
    counts = CompiledReuseCounts(2)
    a, b = Touchy("a"), Touchy("b")
    counts.count([a, b, a])
    Touchy.armed = True
    counts.count([b"n"])
    Touchy.armed = False
    assert counts.counts == {a: 2, b"n": 1}


@needs(CompiledGhostRecords)
def test_ghost_records_push_out_without_comparing_the_victim() -> None:
    """As for the mini-tiers: ``b``, recorded after ``a`` but least recently, leaves."""
    assert CompiledGhostRecords is not None
    ghost = CompiledGhostRecords(2)
    a, b = Touchy("a"), Touchy("b")
    ghost.add_all([a, b, a], 1)
    Touchy.armed = True
    assert ghost.add_all([b"n"], 2) == [1]
    Touchy.armed = False
    assert ghost.take_all([a, b, b"n"]) == [1, 2]


@needs(CompiledS3FIFOMiniTier)
def test_an_s3fifo_victim_whose_ghost_comparison_fails_stays_held() -> None:
    """The small queue's victim ``b`` is compared with ``a`` in the ghost: where that
    raises, ``b`` stays on the small queue (it was taken off first and left in the table),
    and the next evictions find every held key on a queue."""
    assert CompiledS3FIFOMiniTier is not None
    tier = CompiledS3FIFOMiniTier(2)
    a, b = Touchy("a"), Touchy("b")
    tier.store([a])
    tier.store([b])
    tier.store([b"c"])  # a leaves for the ghost
    Touchy.armed = True
    with pytest.raises(ComparisonError):
        tier.store([b"d"])
    Touchy.armed = False
    assert tier.held_among([b, b"c"]) == [b, b"c"]
    assert tier.store([b"e", b"f"]) == 2
    assert tier.held_among([a, b, b"c", b"d", b"e", b"f"]) == [b"e", b"f"]
    assert len(tier) == 2


@needs(CompiledARCMiniTier)
def test_an_arc_t2_victim_whose_ghost_comparison_fails_stays_held() -> None:
    """T2's victim ``b`` is compared with ``a`` in B2: where that raises, ``b`` stays on
    T2 (it was taken off first and left in the table), and later evictions find it."""
    assert CompiledARCMiniTier is not None
    tier = CompiledARCMiniTier(2, False)
    a, b = Touchy("a"), Touchy("b")
    for key in (a, b):
        tier.store([key])
        tier.touch([key])  # on to T2
    tier.store([b"c"])  # a leaves T2 for B2
    Touchy.armed = True
    with pytest.raises(ComparisonError):
        tier.store([b"d", b"e"])  # c leaves T1, then b is compared in B2
    Touchy.armed = False
    assert tier.held_among([a, b, b"c"]) == [b]
    assert tier.store([b"f", b"g"]) == 2
    assert tier.held_among([a, b, b"c", b"d", b"e", b"f", b"g"]) == [b"f", b"g"]
    assert len(tier) == 2


class CallsBack:
    """A key whose ``__hash__`` first runs ``action`` (once): Python code inside a call."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.action: Callable[[], object] | None = action

    def __hash__(self) -> int:
        action, self.action = self.action, None
        if action is not None:
            action()
        return 11


def some_keys(count: int) -> list[bytes]:
    """``count`` distinct bytes keys."""
    return [i.to_bytes(2, "big") for i in range(count)]


AGAIN = "called again from inside one of its calls"


@pytest.mark.parametrize("factory", MINI_TIERS)
def test_a_mini_tier_refuses_a_call_from_inside_its_store(factory: Callable[[int], Any]) -> None:
    """A key of a store stores other keys into the same tier while the store runs: refused,
    and the tier takes the next store whole."""
    tier = factory(4)
    tier.store([b"a", b"b"])
    key = CallsBack(lambda: tier.store(some_keys(8)))
    with pytest.raises(RuntimeError, match=AGAIN):
        tier.store([b"c", key])
    assert tier.store([b"d"]) == 1
    assert len(tier) == len(tier.held_among([b"a", b"b", b"c", b"d", *some_keys(8)]))


@pytest.mark.parametrize("factory", MINI_TIERS)
def test_a_mini_tier_refuses_a_call_from_a_gap_flag(factory: Callable[[int], Any]) -> None:
    """A store's gap flag stores thousands of keys into the same tier while it is read (it
    grew the scratch array the flags were being written to, freeing it): refused."""
    tier = factory(4)

    class Flag:
        def __bool__(self) -> bool:
            tier.store(some_keys(5000))
            return True

    with pytest.raises(RuntimeError, match=AGAIN):
        tier.store([b"a", b"b"], [False, Flag()])
    assert tier.store([b"c"]) == 1
    assert tier.held_among([b"a", b"b", b"c"]) == [b"c"]


@needs(CompiledReuseCounts)
def test_the_reuse_counter_refuses_a_call_from_inside_its_count() -> None:
    """As for the mini-tiers: a key counts other keys while the count runs."""
    assert CompiledReuseCounts is not None
    counts = CompiledReuseCounts(4)
    counts.count([b"a", b"b"])
    key = CallsBack(lambda: counts.count(some_keys(8)))
    with pytest.raises(RuntimeError, match=AGAIN):
        counts.count([b"c", key])
    counts.count([b"d"])
    assert len(counts) == len(counts.counts) <= 4


@needs(CompiledGhostRecords)
def test_ghost_records_refuse_a_call_from_inside_their_add() -> None:
    """As for the mini-tiers: a key records other keys while the records are added."""
    assert CompiledGhostRecords is not None
    ghost = CompiledGhostRecords(4)
    ghost.add_all([b"a", b"b"], 1)
    key = CallsBack(lambda: ghost.add_all(some_keys(8), 2))
    with pytest.raises(RuntimeError, match=AGAIN):
        ghost.add_all([b"c", key], 3)
    ghost.add_all([b"d"], 4)
    assert len(ghost) == len(ghost.records()) <= 4


class ComparesBack:
    """A key with the same hash as every other, whose ``__eq__`` first runs ``action``
    (once, where given): Python code inside a comparison the table makes."""

    def __init__(self) -> None:
        self.action: Callable[[], object] | None = None

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        action, self.action = self.action, None
        if action is not None:
            action()
        return other is self


@needs(CompiledS3FIFOMiniTier)
def test_an_s3fifo_tier_refuses_a_call_from_a_ghost_comparison() -> None:
    """The small queue's victim ``b`` is compared with ``a`` in the ghost, and from there
    two stores refill the ghost that the eviction had made room in (it then added a record
    with no free node, out of bounds): refused, and the tier takes the next store whole."""
    assert CompiledS3FIFOMiniTier is not None
    tier = CompiledS3FIFOMiniTier(2)
    a, b = ComparesBack(), ComparesBack()
    tier.store([a])
    tier.store([b])
    tier.store([b"c"])  # a leaves for the ghost
    a.action = lambda: (tier.store([b"x", b"y"]), tier.store([b"z", b"w"]))
    with pytest.raises(RuntimeError, match=AGAIN):
        tier.store([b"d"])
    assert tier.store([b"e", b"f"]) == 2
    assert tier.held_among([a, b, b"c", b"d", b"e", b"f"]) == [b"e", b"f"]


@pytest.mark.parametrize("factory", MINI_TIERS)
def test_a_mini_tier_whose_call_fails_takes_the_next_one(factory: Callable[[int], Any]) -> None:
    """A call that raises (an unhashable key, a gap flag or ``keep`` that raises, a bad
    argument) ends its call: the next one is not refused as called from inside it."""
    tier = factory(4)

    class Raises:
        def __bool__(self) -> bool:
            raise ComparisonError("a gap flag")

        def __contains__(self, key: object) -> bool:
            raise ComparisonError("keep")

    failing: list[Callable[[], object]] = [
        lambda: tier.store([b"a", []]),
        lambda: tier.store([b"a"], [Raises()]),
        lambda: tier.store([b"a"], [True, True]),
        lambda: tier.store_admitted([b"a", b"b"], [0, 0], Raises(), 0),
        lambda: tier.touch([{}]),
        lambda: tier.hit_run(5),
        lambda: tier.held_among([[]]),
        lambda: tier.leading_held([[]]),
        lambda: [] in tier,
    ]
    for call in failing:
        with pytest.raises((TypeError, ValueError, ComparisonError)):
            call()
        assert tier.store([b"c"]) in (0, 1)
        assert tier.hit_run([b"c"]) == 1 and b"c" in tier


@needs(CompiledReuseCounts)
@needs(CompiledGhostRecords)
def test_a_ghost_or_counter_whose_call_fails_takes_the_next_one() -> None:
    """As for the mini-tiers: a failed call is over once it raised."""
    assert CompiledReuseCounts is not None and CompiledGhostRecords is not None
    ghost, counts = CompiledGhostRecords(4), CompiledReuseCounts(4)
    failing: list[Callable[[], object]] = [
        lambda: ghost.add_all([[]], 1),
        lambda: ghost.take_all([[]]),
        lambda: ghost.expire("later"),  # type: ignore[arg-type]
        lambda: [] in ghost,
        lambda: counts.count([[]]),
        lambda: counts.count_shielded([[]]),
        lambda: counts.at_least([b"a"], "twice"),  # type: ignore[arg-type]
        lambda: [] in counts,
    ]
    for call in failing:
        with pytest.raises(TypeError):
            call()
        ghost.add_all([b"a"], 1)
        counts.count([b"a"])
        assert b"a" in ghost and counts.counts[b"a"] >= 1


class Colliding:
    """A key whose hash it shares with a third of the others: long probe runs, wrapped past
    the table's end, that the removal of a node by its index must keep whole."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return self.value % 3

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Colliding) and other.value == self.value

    def __repr__(self) -> str:
        return f"Colliding({self.value})"


UNIVERSE = [Colliding(value) for value in range(24)]
SOME_KEYS = st.lists(st.sampled_from(UNIVERSE), max_size=8)
FLAGS = st.lists(st.booleans(), min_size=1, max_size=8)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["touch", "hit_run", "held", "store", "store_admitted"]),
        SOME_KEYS,
        FLAGS,
        st.integers(0, 9),
    ),
    max_size=120,
)


def generic_tier(policy: type[Any]) -> Callable[[int], MiniTier]:
    """The generic tier over ``policy``: ARC's, SIEVE's and SLRU's reference."""
    return lambda capacity: MiniTier(capacity, policy)


TWINS = [
    pytest.param(reference, compiled, marks=needs(compiled), id=name)
    for name, reference, compiled in [
        ("lru", LRUMiniTier, CompiledLRUMiniTier),
        ("s3fifo", S3FIFOMiniTier, CompiledS3FIFOMiniTier),
        ("arc", generic_tier(ARCCachePolicy), CompiledARCMiniTier),
        ("sieve", generic_tier(SIEVECachePolicy), CompiledSIEVEMiniTier),
        ("slru", generic_tier(SLRUCachePolicy), CompiledSLRUMiniTier),
    ]
]


@pytest.mark.parametrize(("reference", "compiled"), TWINS)
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 20), steps=STEPS)
def test_a_mini_tier_over_colliding_keys_decides_as_its_python_twin(
    reference: Callable[[int], Any],
    compiled: Callable[[int], Any],
    capacity: int,
    steps: list[tuple[str, list[Colliding], list[bool], int]],
) -> None:
    """Keys that share their hashes, stored, touched and evicted in long runs: the same
    answers and held keys as the Python tier after every step."""
    python, table = reference(capacity), compiled(capacity)
    for action, keys, flags, number in steps:
        marks = [flags[i % len(flags)] for i in range(len(keys))]
        if action == "touch":
            python.touch(keys)
            table.touch(keys)
        elif action == "hit_run":
            assert python.hit_run(keys) == table.hit_run(keys)
        elif action == "held":
            assert python.held_among(UNIVERSE) == table.held_among(UNIVERSE)
            assert python.leading_held(keys) == table.leading_held(keys)
        elif action == "store":
            assert python.store(keys, marks) == table.store(keys, marks)
        else:
            at = [number if mark else -1 for mark in marks]
            keep = {key for key, mark in zip(keys, marks, strict=True) if not mark}
            assert python.store_admitted(keys, at, keep, number) == table.store_admitted(
                keys, at, keep, number
            )
        assert len(python) == len(table)
        assert [key in python for key in UNIVERSE] == [key in table for key in UNIVERSE]
    assert (python.total_hits, python.total_writes) == (table.total_hits, table.total_writes)


@needs(CompiledReuseCounts)
@needs(CompiledGhostRecords)
@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 20),
    steps=st.lists(st.tuples(st.integers(0, 5), SOME_KEYS, st.integers(0, 9)), max_size=120),
)
def test_ghost_records_and_counts_over_colliding_keys_decide_as_their_python_twins(
    capacity: int, steps: list[tuple[int, list[Colliding], int]]
) -> None:
    """As for the mini-tiers: records pushed out, taken and expired, keys counted and
    evicted, all over keys that share their hashes."""
    assert CompiledReuseCounts is not None and CompiledGhostRecords is not None
    ghost, ghost_table = GhostRecords(capacity), CompiledGhostRecords(capacity)
    counts, counts_table = ReuseCounts(capacity), CompiledReuseCounts(capacity)
    for clock, (action, keys, number) in enumerate(steps):
        if action == 0:
            assert ghost.add_all(keys, number, clock) == ghost_table.add_all(keys, number, clock)
        elif action == 1:
            assert ghost.take_all(keys) == ghost_table.take_all(keys)
        elif action == 2:
            assert ghost.expire(clock - number) == ghost_table.expire(clock - number)
        elif action == 3:
            counts.count(keys)
            counts_table.count(keys)
        elif action == 4:
            counts.count_shielded(keys)
            counts_table.count_shielded(keys)
        else:
            assert counts.at_least(keys, number % 4) == counts_table.at_least(keys, number % 4)
        assert len(ghost) == len(ghost_table)
        assert [key in ghost for key in UNIVERSE] == [key in ghost_table for key in UNIVERSE]
        assert list(counts.counts.items()) == list(counts_table.counts.items())


CHANGES_ITS_LIST = """
import sys
from kvoffload.admission.ghost import CompiledGhostRecords
from kvoffload.admission.minisim import (
    CompiledARCMiniTier, CompiledLRUMiniTier, CompiledS3FIFOMiniTier,
    CompiledSIEVEMiniTier, CompiledSLRUMiniTier,
)
from kvoffload.admission.reuse_counts import CompiledReuseCounts


class Empties:
    # Empties the list it is in (once) from its __hash__, __bool__ or __contains__.
    def __init__(self, position):
        self.position, self.items = position, None

    def within(self, items):
        items.insert(self.position if self.position >= 0 else len(items), self)
        self.items = items
        return items

    def empty(self):
        items, self.items = self.items, None
        if items is not None:
            items[:] = [None] * 3

    def __hash__(self):
        self.empty()
        return 5

    def __bool__(self):
        self.empty()
        return True

    def __contains__(self, key):
        self.empty()
        return True


def keys(position):
    # N keys that only the list holds, and the key that empties it.
    return Empties(position).within([i.to_bytes(2, "big") * 20 for i in range(N)])


def flags(position):
    return Empties(position).within([False] * N)


factories = {
    "lru": CompiledLRUMiniTier, "s3fifo": CompiledS3FIFOMiniTier, "arc": CompiledARCMiniTier,
    "sieve": CompiledSIEVEMiniTier, "slru": CompiledSLRUMiniTier,
}
name = sys.argv[1]
# Held in place on the stack (200) and in an array of the call's own (700).
for N, position in ((200, 0), (200, -1), (700, 0), (700, -1)):
    if name == "ghost":
        ghost = CompiledGhostRecords(N + 100)
        assert ghost.add_all(keys(position), 1) == []
        assert ghost.take_all(keys(position)) == [1] * N
    elif name == "counts":
        counts = CompiledReuseCounts(N + 100)
        counts.count(keys(position))
        counts.count_shielded(keys(position))
        assert len(counts.at_least(keys(position), 2)) == N
    else:
        tier = factories[name](N + 100)
        assert tier.store(keys(position)) == N + 1
        tier.touch(keys(position))
        assert len(tier.held_among(keys(position))) == N
        assert tier.leading_held(keys(position)) == (0 if position == 0 else N)
        tier = factories[name](N + 100)
        assert tier.store(keys(-1)[:N + 1], flags(position)) == N + 1
        at = Empties(position).within([0] * N)
        assert tier.store_admitted(keys(-1)[:N], at, at.pop(position), 0) == 0
        if name == "lru":
            full = factories[name](N)
            assert full.store(keys(-1)[:N]) == N
            assert full.store([b"new"], (), keys(position)) == 1
            admitted = Empties(position).within(keys(-1)[:N * 3 // 4])
            assert 0 <= full.store_offer(keys(position), admitted, keys(position)) <= N * 3 // 4 + 1
print("whole")
"""


@pytest.mark.parametrize(
    ("name", "compiled"),
    [
        ("lru", CompiledLRUMiniTier),
        ("s3fifo", CompiledS3FIFOMiniTier),
        ("arc", CompiledARCMiniTier),
        ("sieve", CompiledSIEVEMiniTier),
        ("slru", CompiledSLRUMiniTier),
        ("ghost", CompiledGhostRecords),
        ("counts", CompiledReuseCounts),
    ],
)
def test_a_table_reads_the_list_it_was_given_though_a_key_empties_it(
    name: str, compiled: object
) -> None:
    """A key's ``__hash__`` (a gap flag's ``__bool__``, ``keep``'s ``__contains__``) empties
    the list the call is reading: the call read the list's own item array, freed by then,
    and kept its keys borrowed (a crash). It reads what it was given; in a child process,
    which that crash killed."""
    if compiled is None:
        pytest.skip(NOT_BUILT)
    child = subprocess.run(
        [sys.executable, "-c", CHANGES_ITS_LIST, name], capture_output=True, text=True, timeout=120
    )
    assert (child.returncode, child.stdout.strip()) == (0, "whole"), child.stderr[-2000:]


def holding_itself(factory: Any, push_out: bool = False) -> Callable[[], Any]:
    """A table of ``factory`` that holds a key ``(table,)``, which refers back to it; with
    ``push_out``, pushed from the held keys into the tier's ghost table (S3-FIFO's, ARC's
    B1) by later stores."""

    def make() -> Any:
        table = factory(2)
        key = (table,)
        if isinstance(table, GhostRecords):
            table.add_all([key], 1)
        elif isinstance(table, ReuseCounts):
            table.count([key])
        else:
            table.store([key])
        if push_out:
            table.store([b"a"])
            table.store([b"b", b"c"])
            assert key not in table
        return table

    return make


CYCLES = [
    pytest.param(holding_itself(factory, push_out), marks=needs(factory), id=name)
    for name, factory, push_out in [
        ("lru", CompiledLRUMiniTier, False),
        ("s3fifo", CompiledS3FIFOMiniTier, False),
        ("s3fifo-ghost", CompiledS3FIFOMiniTier, True),
        ("arc", CompiledARCMiniTier, False),
        ("arc-b1", CompiledARCMiniTier, True),
        ("sieve", CompiledSIEVEMiniTier, False),
        ("slru", CompiledSLRUMiniTier, False),
        ("ghost", CompiledGhostRecords, False),
        ("counts", CompiledReuseCounts, False),
    ]
]


@pytest.mark.parametrize("make", CYCLES)
def test_a_table_whose_key_refers_back_to_it_is_collected(make: Callable[[], Any]) -> None:
    """A table and its key ``(table,)`` refer to each other. A tuple has no clear of its
    own, so only the table's breaks the cycle: tables the collector did not know of were
    never freed, with every key they held."""
    gone = weakref.ref(make())
    gc.collect()
    assert gone() is None


@needs(sampled_positions)
@pytest.mark.parametrize("mask", [-1, 2**64, 2**64 + 1])
def test_sampling_refuses_a_mask_beyond_64_bits(mask: int) -> None:
    """A mask of no 64-bit value was wrapped into one (-1 into every bit, 2**64 + 1 into
    1), and other keys sampled than the numpy path, which refuses it, would take."""
    assert sampled_positions is not None
    hashes = np.array([0, 1, 2, 2**63], dtype=np.uint64)
    assert sampled_positions(hashes, (0, 1, 2**64 - 1)) == [[0, 1, 2, 3], [0, 2, 3], [0]]
    with pytest.raises(OverflowError):
        sampled_positions(hashes, (0, mask))


@needs(sampled_positions)
def test_sampling_refuses_hashes_that_are_not_64_bits_each() -> None:
    """A buffer of 12 bytes was read as one hash, its last 4 bytes dropped unseen."""
    assert sampled_positions is not None
    with pytest.raises(ValueError, match="not 64-bit hashes"):
        sampled_positions(np.zeros(3, dtype=np.uint32), (0,))


def test_the_stubs_declare_each_compiled_signature() -> None:
    """mypy reads the ``.pyi`` stubs, not the C: stubs that named positional-only
    parameters let ``ghost.expire(before=3)`` pass the type check and raise TypeError in C.
    stubtest holds each stub to the signature its C docstring declares; the mini-tiers'
    operations are declared once, in the Python classes the compiled ones mix in."""
    stubtest = pytest.importorskip("mypy.stubtest")
    modules = compiled_modules()
    if not modules:
        pytest.skip(NOT_BUILT)
    options = ["--concise", "--ignore-missing-stub"]
    if hasattr(stubtest.parse_options([]), "ignore_disjoint_bases"):
        # PEP 800's mark, which newer mypy asks of a C type's stub, is no signature.
        options.append("--ignore-disjoint-bases")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *modules, *options],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


ARGUMENT_REFUSALS = ("takes no keyword arguments", "invalid keyword argument", "missing required")
"""CPython's words where a C method's argument parsing refuses a keyword."""


@pytest.mark.parametrize("factory", MINI_TIERS)
def test_a_mini_tier_declares_each_method_as_its_c_takes_it(factory: type) -> None:
    """A compiled mini-tier's methods are declared in the Python classes it mixes in, and
    mypy reads those declarations: ``tier.touch(keys=...)`` passed the type check and the
    C then raised TypeError (``touch`` takes no keyword arguments). Each C method is called
    here as every Python declaration of it allows, each parameter it lets a caller name
    named, and its argument parsing must take that call (its work may refuse the dummy
    arguments)."""
    compiled_type, *twins = [cls for cls in factory.__mro__[1:] if cls is not object]
    methods = {
        name: method
        for name, method in vars(compiled_type).items()
        if callable(method) and name != "__new__"  # the stubs declare __new__ (stubtest)
    }
    assert {"touch", "hit_run", "held_among", "leading_held", "store"} <= methods.keys()
    refusals = []
    for name in methods:
        declarations = [vars(twin)[name] for twin in twins if name in vars(twin)]
        assert declarations, f"{compiled_type.__name__}.{name} has no Python declaration"
        for declared in declarations:
            signature = inspect.signature(declared)
            parameters = list(signature.parameters.values())[1:]
            positional = [0 for p in parameters if p.kind is p.POSITIONAL_ONLY]
            named = {p.name: 0 for p in parameters if p.kind is not p.POSITIONAL_ONLY}
            try:
                getattr(factory(2), name)(*positional, **named)
            except TypeError as error:
                if any(words in str(error) for words in ARGUMENT_REFUSALS):
                    refusals.append(f"{declared.__qualname__}{signature}: {error}")
    assert not refusals, "\n".join(refusals)
