"""The feedback controller and its ghost records: bounds, convergence, recovery after a shift."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from compiled import needs
from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.admission import GhostRecords, ReuseController
from kvoffload.admission.controller import record_outcomes


def feed(controller: ReuseController, cls: int, rate: float, n: int, rng: random.Random) -> None:
    for _ in range(n):
        controller.record(cls, rng.random() < rate)


def test_starts_just_below_the_threshold_and_one_return_flips_a_class() -> None:
    controller = ReuseController(4, threshold=0.5, window=100)
    assert not any(controller.admits(c) for c in range(4))
    assert controller.admitting_share == 0.0
    controller.record(1, True)
    assert controller.admits(1) and controller.admitting_share == 0.25


@pytest.mark.parametrize("rate", [0.1, 0.35, 0.65, 0.9])
def test_converges_on_a_stationary_workload(rate: float) -> None:
    controller = ReuseController(2, threshold=0.5, window=2000)
    rng = random.Random(1)
    feed(controller, 0, rate, 20_000, rng)
    assert controller.rate(0) == pytest.approx(rate, abs=0.05)
    assert controller.admits(0) == (rate >= 0.5)
    assert not controller.admits(1)  # an untouched class keeps its prior
    assert controller.admitting_share == (0.5 if rate >= 0.5 else 0.0)


def test_recovers_after_a_shift_within_a_few_windows() -> None:
    controller = ReuseController(1, threshold=0.5, window=500)
    rng = random.Random(2)
    feed(controller, 0, 0.05, 5000, rng)
    assert not controller.admits(0)
    feed(controller, 0, 0.9, 1500, rng)
    assert controller.admits(0)
    feed(controller, 0, 0.05, 1500, rng)
    assert not controller.admits(0)


def test_estimates_stay_bounded_by_the_window() -> None:
    controller = ReuseController(1, threshold=0.5, window=100)
    feed(controller, 0, 1.0, 10_000, random.Random(3))
    assert controller.outcomes[0] <= 200


def test_a_group_follows_its_own_traffic_and_an_unseen_one_its_class() -> None:
    controller = ReuseController(1, threshold=0.5, window=10_000, groups=4)
    returning, one_shot, unseen = (controller.tag(0, g) for g in (1, 2, 3))
    rng = random.Random(4)
    for _ in range(400):
        controller.record(returning, rng.random() < 0.8)
        for _ in range(3):
            controller.record(one_shot, rng.random() < 0.05)
    assert controller.class_rate(0) < 0.5  # the pooled class would admit nobody
    assert controller.admits(returning) and not controller.admits(one_shot)
    assert controller.rate(unseen) == pytest.approx(controller.class_rate(0))
    assert controller.admitting_share == 0.25
    assert controller.memory_bytes == 8 * 2 * (1 + 4)


def test_with_no_group_strength_a_group_follows_only_its_own_outcomes() -> None:
    """``group_strength`` 0 (a value the feedback rule takes) gives a group its own rate
    alone; a group with no outcome yet has its class's rate (it divided by zero)."""
    controller = ReuseController(1, threshold=0.5, window=10_000, groups=3, group_strength=0.0)
    returning, unseen = controller.tag(0, 1), controller.tag(0, 2)
    controller.record_all([returning] * 3, True)
    controller.record(returning, False)
    assert controller.rate(returning) == pytest.approx(0.75)
    assert controller.rate(unseen) == pytest.approx(controller.class_rate(0))
    assert controller.admits(returning) and controller.admitting_share == pytest.approx(3 / 3)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="threshold"):
        ReuseController(2, threshold=1.5, window=10)
    with pytest.raises(InvalidArgumentError, match="window"):
        ReuseController(2, threshold=0.5, window=0)
    with pytest.raises(InvalidArgumentError, match="groups"):
        ReuseController(2, threshold=0.5, window=10, groups=0)
    with pytest.raises(InvalidArgumentError, match="ghost capacity"):
        GhostRecords(0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prior_outcomes", 0.0),
        ("prior_outcomes", float("nan")),
        ("prior_returns", -1.0),
        ("prior_returns", float("inf")),
        ("group_strength", -2.0),
        ("group_strength", float("nan")),
    ],
)
def test_priors_a_rate_cannot_be_made_of_are_rejected(name: str, value: float) -> None:
    """A rate is ``(returns + prior) / (outcomes + prior)``: no prior outcomes once divided
    by zero at the first decision, and a NaN prior never admitted a block."""
    with pytest.raises(InvalidArgumentError, match=f"{name} must be a finite number"):
        ReuseController(2, threshold=0.5, window=10, **{name: value})  # type: ignore[arg-type]


def test_more_prior_returns_than_outcomes_is_refused() -> None:
    """A return rate above 1 (5 returns in 1 outcome) once admitted every first-seen block
    until the counts outweighed it; the rate of equal priors, 1, is a rate."""
    with pytest.raises(InvalidArgumentError, match=r"prior_returns \(5\) must not exceed"):
        ReuseController(2, threshold=0.5, window=10, prior_returns=5.0, prior_outcomes=1.0)
    assert ReuseController(2, 0.5, 10, prior_returns=1.0, prior_outcomes=1.0).class_rate(0) == 1.0


def test_ghost_is_bounded_and_reports_returns_and_expiries() -> None:
    ghost = GhostRecords(3)
    k = [block_id_key(i) for i in range(5)]
    assert [ghost.add(k[i], i, clock=i) for i in range(3)] == [None, None, None]
    assert ghost.add(k[3], 3, clock=3) == 0  # pushed out the oldest record
    assert len(ghost) == 3
    assert ghost.take(k[2]) == 2 and ghost.take(k[2]) is None
    assert ghost.expire(before=3) == [1]
    assert k[3] in ghost and len(ghost) == 1


def test_ghost_batch_calls_match_one_key_at_a_time() -> None:
    one, batch = GhostRecords(4), GhostRecords(4)
    k = [block_id_key(i) for i in range(7)]
    pushed = [one.add(key, 1, clock=0) for key in [*k[:3], k[0], *k[3:6]]]
    assert batch.add_all([*k[:3], k[0], *k[3:6]], 1) == [p for p in pushed if p is not None]
    assert [key in one for key in k] == [key in batch for key in k]
    assert batch.take_all([k[6], k[5], k[0], k[5]]) == [1, 1]  # k[6] never added, k[5] once
    assert k[5] not in batch and k[0] not in batch and len(batch) == 2


@settings(max_examples=200, deadline=None)
@given(
    classes=st.integers(1, 4),
    groups=st.integers(1, 4),
    strength=st.sampled_from([0.0, 0.5, 4.0]),
    threshold=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    outcomes=st.lists(
        st.tuples(st.lists(st.integers(0, 15), max_size=5), st.booleans(), st.booleans()),
        max_size=40,
    ),
)
def test_the_admitting_share_is_the_share_of_groups_whose_rate_admits_after_every_outcome(
    classes: int,
    groups: int,
    strength: float,
    threshold: float,
    outcomes: list[tuple[list[int], bool, bool]],
) -> None:
    """The share, read between outcomes (it is kept until the next one) and across halvings,
    is always the share of tags whose own :meth:`rate` admits."""
    controller = ReuseController(
        classes, threshold=threshold, window=7, groups=groups, group_strength=strength
    )
    tags = range(classes * groups)

    def share() -> float:
        return sum(controller.rate(tag) >= threshold for tag in tags) / len(tags)

    assert controller.admitting_share == share()
    for chosen, returned, read in outcomes:
        controller.record_all([tag % len(tags) for tag in chosen], returned)
        if read:
            assert controller.admitting_share == share()
    assert controller.admitting_share == share()


def test_a_read_counts_again_only_the_classes_with_outcomes_since_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engines read the share at every step, and a step's outcomes fall in one or two
    of the classes: only those are counted again (all 384 groups of a layer took about
    37 us per busy step), every class after a halving, none on an idle step."""
    counted: list[int] = []
    count = ReuseController._class_admitting

    def recorded(controller: ReuseController, cls: int) -> int:
        counted.append(cls)
        return count(controller, cls)

    monkeypatch.setattr(ReuseController, "_class_admitting", recorded)
    controller = ReuseController(6, threshold=0.5, window=5, groups=64)
    tags = range(6 * 64)
    assert controller.admitting_share == 0.0 and counted == list(range(6))
    for outcomes, recounted in (
        ([controller.tag(2, 5), controller.tag(2, 9), controller.tag(4, 0)], [2, 4]),
        ([], []),
        ([controller.tag(2, 5)], [2]),
        ([controller.tag(1, 3)], list(range(6))),  # the fifth outcome halves every count
    ):
        counted.clear()
        controller.record_all(outcomes, True)
        share = sum(controller.rate(tag) >= 0.5 for tag in tags) / len(tags)
        assert controller.admitting_share == share > 0 and counted == recounted


@needs(record_outcomes)
@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 12),
    groups=st.integers(1, 4),
    batches=st.lists(
        st.tuples(st.lists(st.integers(0, 11), max_size=30), st.booleans(), st.booleans()),
        max_size=25,
    ),
)
def test_compiled_outcomes_count_as_the_python_loop(
    window: int, groups: int, batches: list[tuple[list[int], bool, bool]]
) -> None:
    """``record_all`` in C and the Python loop it replaces give the same floats, halvings
    and admitting counts after every batch (small windows: halvings inside batches)."""
    compiled, python = (ReuseController(12 // groups, 0.5, window, groups) for _ in range(2))
    for tags, returned, as_tuple in batches:
        tags = [tag % (compiled.groups * len(compiled.outcomes)) for tag in tags]
        compiled.record_all(tuple(tags) if as_tuple else tags, returned)
        python._record_each(tags, returned)
        for name in ("returns", "outcomes", "group_returns", "group_outcomes", "_admitting"):
            assert getattr(compiled, name) == getattr(python, name), name
        assert compiled._since_halving == python._since_halving
        assert compiled.admitting_share == python.admitting_share


@needs(record_outcomes)
def test_compiled_outcomes_refuse_a_bad_tag_before_counting_any() -> None:
    controller = ReuseController(2, 0.5, window=100)
    with pytest.raises(IndexError):
        controller.record_all([0, 1, 7], True)
    assert controller.outcomes == [0.0, 0.0] and controller._since_halving == 0
