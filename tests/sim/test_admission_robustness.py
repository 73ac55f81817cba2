"""The robustness benchmark's shape drawing: seeded, inside its ranges, and its trace cuts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load_benchmark, run_script

robust = load_benchmark("admission_robustness")


def _shape(seed: int, mix: tuple[tuple[str, float], ...], requests: int, **knobs: Any) -> Any:
    """A synthetic shape at the tests' tier (10% of unique blocks) and GPU cache (2%)."""
    return robust.Shape(0, 0.1, 0.02, seed, mix=mix, requests=requests, **knobs)


def test_the_same_seed_draws_the_same_shapes() -> None:
    assert robust.draw_shapes(50, 7) == robust.draw_shapes(50, 7)
    assert robust.draw_shapes(50, 7) != robust.draw_shapes(50, 8)
    assert robust.draw_shapes(10, 7) == robust.draw_shapes(50, 7)[:10]


def _inside(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def test_every_shape_stays_inside_its_ranges() -> None:
    shapes = robust.draw_shapes(400, 0)
    assert [s.index for s in shapes] == list(range(400))
    synthetic = [s for s in shapes if not s.cut]
    cuts = [s for s in shapes if s.cut]
    for s in shapes:
        assert _inside(s.cpu_share, robust.CPU_SHARE)
        assert _inside(s.gpu_share, robust.GPU_SHARE)
        assert s.seed >= 100
    for s in synthetic:
        kinds = [kind for kind, _ in s.mix]
        assert len(set(kinds)) == len(kinds) and set(kinds) <= set(robust.KINDS)
        assert all(weight > 0 for _, weight in s.mix)
        assert sum(weight for _, weight in s.mix) == pytest.approx(1.0, abs=0.02)
        assert _inside(s.rate, robust.RATE)
        assert _inside(s.requests, robust.REQUESTS) and isinstance(s.requests, int)
        assert s.block_tokens in robust.BLOCK_TOKENS
    for s in cuts:
        assert s.cut in robust.TRACE_CUTS
        if s.cut == "time":
            assert _inside(s.factor, robust.TIME_SCALE)
        elif s.cut == "subsample":
            assert _inside(s.factor, robust.SUBSAMPLE)
    # The draw covers what the benchmark promises: every mix size and both sources.
    assert {len(s.mix) for s in synthetic} == set(robust.KIND_COUNTS)
    assert {s.cut for s in cuts} == set(robust.TRACE_CUTS)
    assert {s.block_tokens for s in synthetic} == set(robust.BLOCK_TOKENS)


def test_chat_family_shapes_stay_inside_their_ranges_and_load_as_chat_traffic() -> None:
    """``--family chat`` draws ``longchat`` traffic of every knob's range, some with a
    second kind, and leaves the default family's draws as they were."""
    shapes = robust.draw_shapes(200, 3, "chat")
    assert shapes == robust.draw_shapes(200, 3, "chat") != robust.draw_shapes(200, 3)
    for s in shapes:
        assert s.chat_shape is not None and not s.cut
        assert _inside(s.cpu_share, robust.CPU_SHARE)
        assert _inside(s.chat_shape.one_turn, robust.CHAT_ONE_TURN)
        for name, bounds in robust.CHAT_LOG_UNIFORM.items():
            assert _inside(getattr(s.chat_shape, name), (0.9 * bounds[0], 1.1 * bounds[1]))
        assert s.mix[0][0] == "longchat"
        assert sum(weight for _, weight in s.mix) == pytest.approx(1.0, abs=0.02)
        assert _inside(s.rate, robust.CHAT_RATE)
        assert _inside(s.requests, robust.CHAT_REQUESTS)
        assert s.block_tokens in robust.CHAT_BLOCK_TOKENS
    assert {len(s.mix) for s in shapes} == {1, 2}
    assert {kind for s in shapes for kind, _ in s.mix[1:]} == set(robust.KINDS)
    chat = (("longchat", 1.0),)
    small = _shape(5, chat, 150, rate=2.0, block_tokens=512, chat_shape=shapes[0].chat_shape)
    workload = small.load()
    assert len(workload.requests) == 150 and workload.block_tokens == 512
    assert len({r.keys[0] for r in workload.requests}) == 1
    assert "1-turn" in small.describe()
    with pytest.raises(ValueError, match="unknown family 'chats'"):
        robust.draw_shapes(3, 0, "chats")


def test_phased_shapes_change_their_mix_and_load_as_phases_with_blocks_of_their_own() -> None:
    """``--family phased`` runs two or three different mixes one after the other; a phase's
    blocks are its own (the generator names blocks from 0 in every workload, so unrenamed
    phases would share keys that stand for different prefixes)."""
    shapes = robust.draw_shapes(200, 4, "phased")
    assert shapes == robust.draw_shapes(200, 4, "phased") != robust.draw_shapes(200, 4)
    for s in shapes:
        assert len(s.phases) in robust.PHASES and s.mix == s.phases[0]
        assert len(s.phase_shares) == len(s.phases)
        assert sum(s.phase_shares) == pytest.approx(1.0, abs=0.02)
        for earlier, later in zip(s.phases, s.phases[1:], strict=False):
            assert {kind for kind, _ in earlier} != {kind for kind, _ in later}
            assert {kind for kind, _ in later} <= set(robust.KINDS)
        assert _inside(s.rate, robust.RATE) and s.block_tokens in robust.BLOCK_TOKENS
    assert {len(s.phases) for s in shapes} == set(robust.PHASES)
    chat, rag = (("chat", 1.0),), (("rag", 1.0),)
    small = _shape(
        11,
        chat,
        300,
        rate=4.0,
        block_tokens=16,
        phases=(chat, rag, chat),
        phase_shares=(0.5, 0.25, 0.25),
    )
    workload = small.load()
    requests = workload.requests
    assert len(requests) == 300 and workload.block_tokens == 16
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    parts = [requests[:150], requests[150:225], requests[225:]]
    blocks = [{key for r in part for key in r.keys} for part in parts]
    assert not blocks[0] & blocks[1] and not blocks[1] & blocks[2] and not blocks[0] & blocks[2]
    alone = _shape(11, chat, 150, rate=4.0, block_tokens=16).load()
    assert [len(r.keys) for r in alone.requests] == [len(r.keys) for r in parts[0]]
    assert "[chat 1.00] 50% -> [rag 1.00] 25% -> [chat 1.00] 25%" in small.describe()


def test_a_synthetic_shape_loads_with_its_size_and_block_tokens() -> None:
    shape = robust.Shape(
        0,
        0.1,
        0.02,
        123,
        mix=(("chat", 0.5), ("rag", 0.5)),
        rate=3.0,
        requests=200,
        block_tokens=32,
    )
    workload = shape.load()
    assert len(workload.requests) == 200
    assert workload.block_tokens == 32
    assert "chat 0.50 / rag 0.50" in shape.describe()


def test_trace_cuts_scale_time_and_keep_the_right_requests(mooncake_trace: Path) -> None:
    whole = robust.Shape(0, 0.1, 0.02, 1, cut="time", factor=1.0).load(mooncake_trace)
    arrivals = [r.arrival_s for r in whole.requests]
    n = len(arrivals)
    stretched = robust.Shape(0, 0.1, 0.02, 1, cut="time", factor=2.5).load(mooncake_trace)
    assert [r.arrival_s for r in stretched.requests] == pytest.approx([2.5 * a for a in arrivals])
    first = robust.Shape(0, 0.1, 0.02, 1, cut="first half").load(mooncake_trace)
    second = robust.Shape(0, 0.1, 0.02, 1, cut="second half").load(mooncake_trace)
    assert [r.arrival_s for r in first.requests + second.requests] == arrivals
    assert len(first.requests) == n // 2
    sub = robust.Shape(0, 0.1, 0.02, 9, cut="subsample", factor=0.4).load(mooncake_trace)
    kept = [r.arrival_s for r in sub.requests]
    assert len(kept) == int(0.4 * n)
    assert kept == sorted(kept) and set(kept) <= set(arrivals)
    again = robust.Shape(0, 0.1, 0.02, 9, cut="subsample", factor=0.4).load(mooncake_trace)
    assert [r.keys for r in again.requests] == [r.keys for r in sub.requests]


def test_percentile_interpolates_between_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert robust.percentile(values, 0.0) == 1.0
    assert robust.percentile(values, 0.5) == 3.0
    assert robust.percentile(values, 0.1) == pytest.approx(1.4)
    assert robust.percentile(values, 1.0) == 5.0
    with pytest.raises(ValueError, match="no values"):
        robust.percentile([], 0.5)


def test_summary_counts_losses_and_the_worst_shapes() -> None:
    rows = [
        {
            "index": i,
            "hit margin": m,
            "writes ratio": w,
            "writes vs store-all": a,
            "goal met": g,
            "margin tier-fulls": t,
            "room to bound": 0.05 if g else 0.01,
        }
        for i, (m, w, a, g, t) in enumerate(
            [
                (0.02, 0.5, 0.4, True, 0.3),
                (-0.01, 1.5, 0.9, False, -0.1),
                (-0.001, float("inf"), 0.01, False, -0.4),
            ]
        )
    ]
    summary = robust.summarise(rows)
    assert summary["min margin tier-fulls"] == -0.4  # a long run's small margin
    assert summary["worst shapes in tier-fulls"] == [2, 1, 0]
    assert summary["goal met"] == 1
    assert summary["shapes with room"] == 1
    assert summary["losses"] == 1
    assert summary["min hit margin"] == -0.01
    assert summary["worst shapes"] == [1, 2, 0]
    assert summary["better writes nothing"] == 1
    assert summary["worst writes ratio"] == 1.5
    assert summary["writes more than better"] == pytest.approx(2 / 3)
    assert summary["writes more than store-all"] == 0


def test_a_margin_of_exactly_the_allowance_is_not_a_loss_past_it() -> None:
    """Hit ratios are hits x (1 / refs): 990 against 1,000 hits of 2,000 references is a
    margin of exactly -0.005, whose float is -0.0050000000000000044. It loses 0.005, not
    more; 994 loses exactly 0.003; 989 loses more than 0.005."""
    per_ref = 1.0 / 2000
    better = 1000 * per_ref
    rows = [
        {
            "index": i,
            "hit margin": hits * per_ref - better,
            "writes ratio": 1.0,
            "writes vs store-all": 1.0,
            "goal met": False,
            "margin tier-fulls": 0.0,
            "room to bound": 0.0,
        }
        for i, hits in enumerate([990, 994, 989, 1000])
    ]
    assert rows[0]["hit margin"] < -robust.LOSS  # the float the count must see through
    summary = robust.summarise(rows)
    assert summary["losses"] == 1
    assert summary["losses past never-lose"] == 2


def _keep(kept: Path, baselines: dict[str, list[float]], belady: float) -> None:
    """Put figures in the kept-baselines file a run wrote, keeping what it says they are for."""
    figures = json.loads(kept.read_text())
    kept.write_text(json.dumps({**figures, **baselines, "belady": belady}))


def test_no_room_to_the_bound_closes_no_share_of_it(tmp_path: Path) -> None:
    """Where the better baseline hits as often as the Belady bound, the bound's ratio
    (hits / refs) can still sit an ulp above the run's (hits x (1 / refs)): the share of
    the gap closed is then 0, not a loss divided by an ulp."""
    shape = robust.Shape(
        0, 0.1, 0.02, 7, mix=(("chat", 0.6), ("rag", 0.4)), rate=4.0, requests=150, block_tokens=32
    )
    workload = shape.load()
    refs = sum(len(r.keys) for r in workload.requests)
    kept = tmp_path / "kept.json"
    fresh = robust.compare(workload, shape.gpu_share, shape.cpu_share, kept)
    ours = round(float(fresh["recommended hit"]) * refs)
    # A better baseline a few hits above ours that reaches the bound, whose float is
    # an ulp above the baseline's: the figures a kept-baselines file holds for such a row.
    hits = next(h for h in range(ours + 1, refs) if h / refs > h * (1.0 / refs))
    writes = float(fresh["store-all writes"])
    _keep(
        kept,
        {"store-all": [hits * (1.0 / refs), writes], "seed filter": [0.0, 0.0]},
        hits / refs,
    )
    row = robust.compare(workload, shape.gpu_share, shape.cpu_share, kept)
    assert row["hit margin"] < 0
    assert row["gap closed"] == 0.0


@pytest.mark.parametrize(("room", "goal"), [(0.02, False), (0.03, True), (0.04, True)])
def test_the_goal_is_set_only_where_the_bound_leaves_room(
    tmp_path: Path, room: float, goal: bool
) -> None:
    """+0.008 hit at 0.8x the better baseline's writes meets the goal where the Belady bound
    is 0.03 or more above that baseline, and is no goal row where it is closer."""
    shape = robust.Shape(
        0, 0.1, 0.02, 7, mix=(("chat", 0.6), ("rag", 0.4)), rate=4.0, requests=150, block_tokens=32
    )
    workload = shape.load()
    kept = tmp_path / "kept.json"
    fresh = robust.compare(workload, shape.gpu_share, shape.cpu_share, kept)
    ours, writes = float(fresh["recommended hit"]), float(fresh["recommended writes"])
    better = ours - 0.01
    _keep(
        kept,
        {"store-all": [better, writes / 0.8], "seed filter": [better - 0.1, writes]},
        better + room,
    )
    row = robust.compare(workload, shape.gpu_share, shape.cpu_share, kept)
    assert row["hit margin"] == pytest.approx(0.01)
    assert row["writes ratio"] == pytest.approx(0.8)
    assert row["goal met"] is goal
    assert row["room to bound"] == pytest.approx(room)


def test_kept_baselines_give_the_same_row_and_skip_the_baseline_runs(tmp_path: Path) -> None:
    """A shape's row with its baselines read back equals the row computed afresh, and a
    kept file is what the second run reads (a changed figure in it shows in the row)."""
    shape = robust.Shape(
        0,
        0.1,
        0.02,
        7,
        mix=(("chat", 0.6), ("oneshot", 0.4)),
        rate=4.0,
        requests=150,
        block_tokens=32,
    )
    fresh = robust.run_shape(shape)
    refs = sum(len(r.keys) for r in shape.load().requests)
    assert fresh["refs"] == refs
    assert fresh["margin tier-fulls"] == pytest.approx(
        fresh["hit margin"] * refs / fresh["cpu_blocks"]
    )
    assert isinstance(fresh["recommended switches"], int) and fresh["recommended switches"] >= 0
    first = robust.run_shape(shape, tmp_path)
    (kept,) = tmp_path.iterdir()
    assert robust.run_shape(shape, tmp_path) == first == fresh
    figures = json.loads(kept.read_text())
    figures["store-all"][0] += 0.5
    kept.write_text(json.dumps(figures))
    changed = robust.run_shape(shape, tmp_path)
    assert changed["store-all hit"] == pytest.approx(fresh["store-all hit"] + 0.5)
    assert changed["recommended hit"] == fresh["recommended hit"]


def test_a_write_budget_reaches_the_recommended_run_and_the_summary() -> None:
    """With ``--write-budget`` the recommended run writes within it (the baselines keep
    theirs), and the summary counts the shapes that kept it."""
    shape = robust.Shape(
        0, 0.1, 0.02, 7, mix=(("chat", 0.6), ("rag", 0.4)), rate=4.0, requests=150, block_tokens=32
    )
    free = robust.run_shape(shape)
    budget = 0.5 * float(free["recommended writes"])
    capped = robust.run_shape(shape, write_budget=budget)
    assert 0 < capped["recommended writes"] <= budget < free["recommended writes"]
    assert capped["store-all writes"] == free["store-all writes"]
    summary = robust.summarise([free, capped], budget)
    assert summary["within budget"] == 1
    assert summary["highest writes per ref"] == free["recommended writes"]
    assert "write budget" not in robust.summarise([free])


def _small_shape(requests: int) -> Any:
    return robust.Shape(
        0,
        0.1,
        0.02,
        7,
        mix=(("chat", 0.6), ("rag", 0.4)),
        rate=4.0,
        requests=requests,
        block_tokens=32,
    )


def test_kept_baselines_of_another_workload_are_not_reused(tmp_path: Path) -> None:
    """A kept file is named by a workload's description and share, which stay the same when
    a generator, a source's settings or the sizing change: its figures are then another
    workload's, and the row is computed afresh (and the file rewritten) instead."""
    kept = tmp_path / "kept.json"
    before, after = _small_shape(150).load(), _small_shape(200).load()
    robust.compare(before, 0.02, 0.1, kept)
    fresh = robust.compare(after, 0.02, 0.1)
    assert fresh["store-all hit"] != robust.compare(before, 0.02, 0.1)["store-all hit"]
    assert robust.compare(after, 0.02, 0.1, kept) == fresh
    assert robust.compare(after, 0.02, 0.1, kept) == fresh  # the file now holds its own
    assert robust.compare(after, 0.02, 0.2, kept) == robust.compare(after, 0.02, 0.2)


@pytest.mark.parametrize("text", ["", '{"store-all": [0.5, 0.', "[]", '{"belady": 1.0}'])
def test_a_kept_file_that_cannot_be_read_is_computed_again(tmp_path: Path, text: str) -> None:
    """A file an interrupted run left half-written, or of another format, is no figures:
    the row is computed as without it, and the file then holds figures that read back."""
    kept = tmp_path / "kept.json"
    kept.write_text(text)
    workload = _small_shape(150).load()
    fresh = robust.compare(workload, 0.02, 0.1)
    assert robust.compare(workload, 0.02, 0.1, kept) == fresh
    assert json.loads(kept.read_text())["belady"] == fresh["belady hit"]


@pytest.mark.parametrize(
    ("option", "path", "error"),
    [
        ("--json", "missing/rows.json", "no such directory"),
        ("--json", ".", "is a directory"),
        ("--baselines", "file.txt", "is not a directory"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, option: str, path: str, error: str
) -> None:
    """``--json`` was written only after every shape had run (a quarter of an hour at the
    default size), and a path it could not write then lost the run in a traceback."""
    (tmp_path / "file.txt").write_text("")
    script = Path(robust.__file__).resolve()
    arguments = ["--shapes", "1", "--seed", "3", "--jobs", "1", option, path]
    done = run_script(script, arguments, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert error in done.stderr and "Traceback" not in done.stderr
    assert "shape 1/1" not in done.stderr  # refused before the run


@pytest.mark.parametrize("shares", ["0.05,lots", "0.1,0", "-0.1", "nan", "0.1,,0.2"])
def test_a_bad_capacity_share_is_one_line_error(tmp_path: Path, shares: str) -> None:
    """The admission table's ``--shares``: a share that is no number > 0 is refused by its
    option's name, not in a traceback from the middle of the script."""
    script = Path(robust.__file__).resolve().with_name("admission_table.py")
    done = run_script(script, ["--held-out", f"--shares={shares}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "argument --shares" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "lots"])
def test_a_bad_write_budget_is_refused(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        robust.budget_per_ref(text)
