"""The real tier's per-key loops in C against their Python reference (``block_loops.py``):
each loop alone on random states, and whole CPU managers under every policy driven by long
random runs, with the same answers, errors, events and state after every step."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from tests.compiled import NOT_BUILT
from tests.core.parking_drivers import MANAGER_OPS, CountingBlock, drive, random_ops

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.errors import KVOffloadError
from kvoffload.core.keys import OffloadKey
from kvoffload.managers import cpu
from kvoffload.policies import base, block_loops, loops, lru
from kvoffload.policies.base import BlockStatus, ParkingOrder

try:
    from kvoffload.policies import _block_loops as compiled
except ImportError:
    compiled = None  # type: ignore[assignment]

needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
KEYS = [block_id_key(i) for i in range(8)]
LOOP_NAMES = list(loops.__all__)

ref_counts = st.lists(st.sampled_from([None, -1, 0, 1, 2]), min_size=8, max_size=8)
key_lists = st.lists(st.integers(0, 7), max_size=8).map(lambda ids: [KEYS[i] for i in ids])


def blocks_of(counts: list[int | None], block_type: type[BlockStatus] = BlockStatus) -> dict:
    """The manager's dict: key ``i`` holds slot ``10 + i`` with ``counts[i]`` (``None``: absent)."""
    blocks = {}
    for i, count in enumerate(counts):
        if count is not None:
            block = block_type(10 + i)
            block.ref_cnt = count
            blocks[KEYS[i]] = block
    return blocks


def state(blocks: dict[OffloadKey, BlockStatus]) -> list[tuple[OffloadKey, int, int]]:
    return [(key, block.block_id, block.ref_cnt) for key, block in blocks.items()]


def outcome(call: Callable[[], Any]) -> object:
    """What a call returns, or the type and text of what it raises."""
    try:
        return call()
    except (LookupError, ValueError, TypeError) as error:
        return type(error), str(error)


def both(name: str) -> Iterator[Callable[..., Any]]:
    yield getattr(block_loops, name)
    yield getattr(compiled, name)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(counts=ref_counts, keys=key_lists, block_type=st.sampled_from([BlockStatus, CountingBlock]))
def test_the_manager_loops_match_their_reference(
    counts: list[int | None], keys: list[OffloadKey], block_type: type[BlockStatus]
) -> None:
    """Each loop over the manager's dict: the same answer (a refusal's index included, with
    every count put back), the same counts after, and the same reads of ``ref_cnt`` where a
    block type reads it through a property."""
    for name in ("leading_ready", "pin_all", "unpin_all", "mark_ready"):
        seen = []
        for loop in both(name):
            blocks = blocks_of(counts, block_type)
            CountingBlock.reads = 0
            answer = outcome(lambda: loop(blocks, keys))  # noqa: B023 - called at once
            seen.append((answer, state(blocks), CountingBlock.reads))
        assert seen[0] == seen[1], name


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(counts=ref_counts, picks=st.lists(st.integers(0, 7), max_size=8, unique=True))
def test_the_store_loops_match_their_reference(counts: list[int | None], picks: list[int]) -> None:
    """Evicting (victims dropped, slots freed in order), claiming new blocks, entering them:
    the same keys, ids, dict and free list."""
    seen = []
    for drop, claim, store in zip(
        both("drop_victims"), both("claim_pending"), both("store_pairs"), strict=True
    ):
        blocks = blocks_of(counts)
        victims = [(KEYS[i], blocks[KEYS[i]]) for i in picks if KEYS[i] in blocks]
        free: list[BlockStatus] = [BlockStatus(1)]
        evicted = drop(blocks, victims, free)
        ids = claim(free)
        stored = outcome(lambda: store(blocks, [KEYS[i] for i in picks], free))  # noqa: B023
        ordered: OrderedDict[OffloadKey, BlockStatus] = OrderedDict.fromkeys(KEYS[:2])  # type: ignore[arg-type]
        shared = outcome(lambda: store(ordered, KEYS[6:], free[:2]))  # noqa: B023
        seen.append(
            (evicted, ids, stored, shared, state(blocks), [b.block_id for b in free], list(ordered))
        )
    assert seen[0] == seen[1]


def parking(counts: list[int | None], parked: int) -> ParkingOrder:
    """An LRU order of the held keys, the first ``parked`` of them set aside."""
    order = ParkingOrder()
    order.following = True
    order.order.update(blocks_of(counts))
    popped = [order.order.popitem(False) for _ in range(min(parked, len(order.order)))]
    order._park(popped)
    return order


def parking_state(order: ParkingOrder) -> object:
    return (
        [(key, block.block_id, block.ref_cnt) for key, block in order.order.items()],
        [(key, place, block.ref_cnt) for key, (place, block) in order.parked.items()],
        dict(order._ready),
    )


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(
    counts=ref_counts,
    parked=st.integers(0, 4),
    keys=key_lists,
    n=st.integers(0, 9),
    protected=key_lists,
)
def test_the_lru_loops_match_their_reference(
    counts: list[int | None],
    parked: int,
    keys: list[OffloadKey],
    n: int,
    protected: list[OffloadKey],
) -> None:
    """LRU's touch (parked blocks taken back) and an eviction from the front: the same order,
    parked blocks and victims."""
    seen = []
    for move, front in zip(both("move_recent"), both("front_victims"), strict=True):
        order = parking(counts, parked)
        move(order.order, order, keys)
        after_touch = parking_state(order)
        victims = outcome(lambda: front(order.order, n, set(protected)))  # noqa: B023
        if isinstance(victims, list):
            victims = [(key, block.block_id, block.ref_cnt) for key, block in victims]
        seen.append((after_touch, victims, parking_state(order)))
    assert seen[0] == seen[1]


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(
        st.one_of(st.binary(max_size=2), st.integers(-3, 3), st.floats(0, 2), st.text(max_size=1)),
        max_size=90,
    )
)
def test_distinct_keys_match_their_reference(keys: list[object]) -> None:
    """An offer's keys each once, in order: equal keys of other types (1, 1.0), equal bytes
    that are other objects, offers longer than the compiled table's room on the stack; the
    first of equal keys kept, as the very object."""
    copies = [bytes(key) if isinstance(key, bytes) else key for key in keys]
    kept = compiled.distinct(copies + keys)
    assert kept == block_loops.distinct(copies + keys)
    assert all(a is b for a, b in zip(kept, block_loops.distinct(copies + keys), strict=True))
    with pytest.raises(TypeError, match="unhashable"):
        compiled.distinct([b"a", []])


@needs_compiled
def test_loops_refuse_bad_arguments_as_the_reference_does() -> None:
    """A negative eviction size, and pairs of different lengths (after the pairs they share)."""
    for front in both("front_victims"):
        with pytest.raises(ValueError):
            front(OrderedDict(), -1, set())
    for store in both("store_pairs"):
        blocks: dict[OffloadKey, BlockStatus] = {}
        with pytest.raises(ValueError, match="shorter"):
            store(blocks, KEYS[:2], [BlockStatus(0)])
        assert list(blocks) == KEYS[:1]
        with pytest.raises(ValueError, match="longer"):
            store({}, KEYS[:1], [BlockStatus(0), BlockStatus(1)])


def observe(manager: CPUOffloadingManager, op: str, keys: list[OffloadKey], n: int) -> object:
    """One driver call's answer or error, with the manager's events and whole state after."""
    try:
        if op == "lookup":
            answer: object = manager.lookup(keys)
        elif op == "pin":  # any keys: refusals too
            answer = manager.prepare_load(keys).block_ids.tolist()
        elif op == "unpin":
            answer = manager.complete_load(keys)
        else:
            answer = drive(manager, op, keys, n)
    except KVOffloadError as error:
        answer = (type(error), str(error))
    policy = manager.policy
    orders = {
        name: list(value.items()) if isinstance(value, ParkingOrder | OrderedDict) else value
        for name, value in vars(policy).items()
    }
    held = sorted((key, b.block_id, b.ref_cnt) for key, b in manager._blocks.items())
    events = [(e.keys, e.removed) for e in manager.take_events()]
    return answer, events, held, repr(orders), manager.num_free_blocks, manager._num_evictable


def run_manager(policy: str, seed: int, capacity: int) -> list[object]:
    manager = CPUOffloadingManager(capacity, policy, enable_events=True)
    return [
        observe(manager, op, [KEYS[i % 8] for i in ids], n)
        for op, ids, n in random_ops(
            seed, [*MANAGER_OPS, "finish", "missed", "lookup", "pin", "unpin"], 400
        )
    ]


@needs_compiled
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "slru"])
@pytest.mark.parametrize("seed", range(6))
def test_a_manager_runs_alike_on_the_compiled_loops_and_the_reference(
    policy: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long random runs (stores that evict or are refused, loads of pinned and pending
    blocks, failed stores, removals, touches of parked blocks): every answer, error, event
    and the manager's and policy's whole state after each call the same."""
    capacity = 1 + seed % 5
    compiled_run = run_manager(policy, seed, capacity)
    for module in (cpu, lru, base):
        for name in LOOP_NAMES:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(block_loops, name))
    assert cpu.leading_ready is block_loops.leading_ready
    assert run_manager(policy, seed, capacity) == compiled_run


def test_without_a_compiler_the_reference_runs() -> None:
    """``loops`` picks the compiled functions where they were built, else the reference."""
    chosen = compiled or block_loops
    assert all(getattr(loops, name) is getattr(chosen, name) for name in LOOP_NAMES)


def test_a_block_type_changed_after_use_is_read_anew() -> None:
    """The compiled loops read a block type's slots directly once learnt; a type whose
    ``ref_cnt`` becomes a property later is read through it from then on."""

    class Block(BlockStatus):
        __slots__ = ()

    blocks = blocks_of([0, 0, None], Block)
    assert loops.leading_ready(blocks, KEYS[:3]) == 2
    Block.ref_cnt = property(lambda self: -1)  # type: ignore[assignment]
    assert loops.leading_ready(blocks, KEYS[:3]) == 0
