"""How the recommended admission does on random traffic shapes it was not developed on.

The admission table checks the recommended configuration on six workloads at
three capacities, and a few held-out seeds and mixes; that says little about
its worst case. This script draws ``--shapes`` random traffic shapes from a
seeded RNG and runs, for each, store-everything (``store_threshold 0``), the
seed filter (``store_threshold 2``) and ``--admission recommended --policy
recommended`` in the same run, with the admission table's own comparison
(``admission_table.compare``: LRU baselines, margin against the better one,
the goal of +0.008 hit at no more than 0.9x its writes where the Belady bound
is 0.03 or more above it).

A shape varies what the table holds fixed:

* synthetic traffic: one to four kinds of chat / RAG / agent / one-shot with
  random weights, 1-12 requests/s, 500-6,000 requests, blocks of 16 or 32
  tokens, and a workload seed drawn from 100 up (the development used seeds
  0-5);
* the Mooncake synthetic trace, transformed in memory: arrival times scaled
  (x0.25-x4, i.e. compressed or stretched), a random subsample of its
  requests, or its first or second half (skipped, with a note, when the
  trace is absent);
* with ``--family chat``, traffic of the kind of the held-out real chat trace
  instead (``longchat``: one system prompt, long pastes, most blocks used
  once, reuse minutes apart), with every knob of its shape drawn
  (:class:`ChatShape`: the one-turn share 0.3-0.8, the medians of a paste,
  a first and a later message, of the turns past the second and of the gap
  between turns), 1-8 requests/s, 2,000-12,000 requests, blocks of 256 or
  512 tokens, and in two shapes of five a second kind at 10-40% of the
  requests;
* with ``--family phased``, traffic that changes: two or three synthetic
  mixes of the default family's kinds, one after the other (the next phase's
  blocks all new: another application, as when daytime chat gives way to
  batch jobs), each a share of the requests, so that the optimiser must
  notice the change and move;
* for all: the offload tier at 3%-40% of the workload's unique blocks and
  the GPU prefix cache at 1%-5% (at least the largest request), both
  log-uniform.

It prints one row per shape and a summary: the goal count (and how many
shapes have the room the goal needs), the minimum,
10th percentile and median hit margin, how many shapes lose more than 0.005
and more than 0.003 (a margin of exactly -0.005 is no loss past 0.005), the
worst shapes, how often the
recommended configuration writes more than the better baseline, and its
worst writes ratios (against the better baseline and store-everything). The
margin is also given in tier-fulls of hits (margin x references / tier blocks):
the unit of ``admission_lower_bound.py``, where a rule that follows one baseline's
world can be made to miss half a tier-full, whatever the run's length.

    python benchmarks/admission_robustness.py [--shapes N] [--seed S] [--family mixed|chat|phased]
                                              [--jobs J] [--json PATH]
                                              [--baselines DIR] [--write-budget W]

``--baselines DIR`` keeps each shape's baseline figures and Belady bound in
``DIR`` and reuses them (see ``admission_table.py``): a change to the
recommended configuration then re-runs only its own run per shape.

``--write-budget W`` gives the recommended run a budget of ``W`` writes per
block reference (the baselines keep none) and the summary says on how many
shapes its writes stayed within it, and the highest writes per reference
against the budget.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import (
    RATIO_NOISE,
    ROOM_GOAL,
    TRACE,
    check_outputs,
    compare,
    positive_int,
    write_rows,
)
from kvoffload.core.keys import OffloadKey, block_id_key
from kvoffload.sim.generators import ChatShape
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.traces import read_trace
from kvoffload.sim.workload import Request, Workload

KINDS = ("chat", "rag", "agent", "oneshot")
KIND_COUNTS = {1: 3, 2: 3, 3: 2, 4: 1}
"""How many kinds a synthetic shape mixes, with the weight of each count."""
TRACE_SHARE = 0.15
"""The share of shapes cut from the Mooncake trace."""
TRACE_CUTS = ("time", "subsample", "first half", "second half")
RATE = (1.0, 12.0)
REQUESTS = (500, 6000)
BLOCK_TOKENS = (16, 32)
CPU_SHARE = (0.03, 0.40)
GPU_SHARE = (0.01, 0.05)
TIME_SCALE = (0.25, 4.0)
SUBSAMPLE = (0.3, 0.8)
CHAT_ONE_TURN = (0.3, 0.8)
CHAT_LOG_UNIFORM = {
    "paste_tokens": (3_000.0, 30_000.0),
    "first_tokens": (1_000.0, 8_000.0),
    "follow_up_tokens": (200.0, 2_000.0),
    "extra_turns": (0.5, 4.0),
    "turn_gap_s": (20.0, 900.0),
}
"""The :class:`ChatShape` knobs a chat-family shape draws, each log-uniform."""
CHAT_RATE = (1.0, 8.0)
CHAT_REQUESTS = (2000, 12000)
CHAT_BLOCK_TOKENS = (256, 512)
CHAT_SECOND_KIND = 0.4
"""The share of chat-family shapes that mix in a second kind, at 10-40% of requests."""
PHASES = (2, 3)
"""How many phases a shape of the phased family runs, one after the other."""
PHASE_SHARE = (0.2, 0.8)
"""The bounds of each phase's weight, before the weights are scaled to one."""
LOSS = 0.005
"""A hit margin below minus this is a loss worth naming: no shape may lose more."""
NEVER_LOSE = 0.003
"""The loss the never-lose goal allows on a row of the table, counted on shapes too."""
WORST = 8
"""Shapes listed in the summary, by hit margin."""
Row = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """One random traffic shape: where its requests come from and the cache sizes.

    ``cut`` is empty for synthetic traffic (``mix``, ``rate``, ``requests``,
    ``block_tokens``, ``seed``), or one of :data:`TRACE_CUTS` for the
    Mooncake trace, with ``factor`` its time scale or kept share and ``seed``
    the subsample's.
    """

    index: int
    cpu_share: float
    gpu_share: float
    seed: int
    mix: tuple[tuple[str, float], ...] = ()
    rate: float = 0.0
    requests: int = 0
    block_tokens: int = 0
    cut: str = ""
    factor: float = 1.0
    chat_shape: ChatShape | None = None
    phases: tuple[tuple[tuple[str, float], ...], ...] = ()
    """The mixes of a phased shape, in order (``mix`` is the first)."""
    phase_shares: tuple[float, ...] = ()
    """Each phase's share of ``requests``."""

    def describe(self) -> str:
        """The traffic part of the shape, in one short phrase."""
        if self.phases:
            kinds = " -> ".join(
                f"[{_describe_mix(mix)}] {share:.0%}"
                for mix, share in zip(self.phases, self.phase_shares, strict=True)
            )
            return (
                f"{kinds}, {self.rate:.1f}/s, {self.requests:,} req, "
                f"{self.block_tokens} tok, seed {self.seed}"
            )
        if not self.cut:
            kinds = _describe_mix(self.mix)
            if self.chat_shape is not None:
                c = self.chat_shape
                kinds += (
                    f" (1-turn {c.one_turn:.2f}, paste {c.paste_tokens:,.0f}, first "
                    f"{c.first_tokens:,.0f}, later {c.follow_up_tokens:,.0f}, "
                    f"+{c.extra_turns:.1f} turns, gap {c.turn_gap_s:.0f} s)"
                )
            return (
                f"{kinds}, {self.rate:.1f}/s, {self.requests:,} req, "
                f"{self.block_tokens} tok, seed {self.seed}"
            )
        if self.cut == "time":
            return f"mooncake, time x{self.factor:.2f}"
        if self.cut == "subsample":
            return f"mooncake, {self.factor:.0%} of requests (seed {self.seed})"
        return f"mooncake, {self.cut}"

    def load(self, trace: Path = TRACE) -> Workload:
        """The shape's workload, built in memory (``trace``: the Mooncake trace's path)."""
        if self.phases:
            return self._phased()
        if not self.cut:
            source = WorkloadSource(
                mix=self.mix,
                requests=self.requests,
                seed=self.seed,
                rate=self.rate,
                block_tokens=self.block_tokens,
                chat_shape=self.chat_shape,
            )
            return source.load()
        workload = read_trace(trace)
        requests = workload.requests
        if self.cut == "time":
            for request in requests:
                request.arrival_s *= self.factor
        elif self.cut == "subsample":
            keep = random.Random(self.seed).sample(
                range(len(requests)), int(self.factor * len(requests))
            )
            requests = [requests[i] for i in sorted(keep)]
        elif self.cut == "first half":
            requests = requests[: len(requests) // 2]
        else:
            requests = requests[len(requests) // 2 :]
        workload.requests = requests
        return workload

    def _phased(self) -> Workload:
        """The phases' workloads one after the other, each with blocks of its own: the
        generator names blocks from 0 in every workload, so each phase's keys are renamed
        past the last phase's, and its arrivals start one mean gap after the last one."""
        requests: list[Request] = []
        start_s, next_id = 0.0, 0
        ends = [
            round(sum(self.phase_shares[: n + 1]) * self.requests) for n in range(len(self.phases))
        ]
        ends[-1] = self.requests
        counts = [max(1, end - start) for start, end in zip([0, *ends], ends, strict=False)]
        for number, (mix, count) in enumerate(zip(self.phases, counts, strict=True)):
            source = WorkloadSource(
                mix=mix,
                requests=count,
                seed=self.seed + number,
                rate=self.rate,
                block_tokens=self.block_tokens,
            )
            renamed: dict[OffloadKey, OffloadKey] = {}
            part = source.load().requests
            for request in part:
                request.arrival_s += start_s
                keys = []
                for key in request.keys:
                    new = renamed.get(key)
                    if new is None:
                        new = renamed[key] = block_id_key(next_id + len(renamed))
                    keys.append(new)
                request.keys = keys
            requests += part
            next_id += len(renamed)
            start_s = part[-1].arrival_s + 1.0 / self.rate
        name = " -> ".join(_describe_mix(mix) for mix in self.phases)
        return Workload(f"phased({name}, seed={self.seed})", self.block_tokens, requests)


def _describe_mix(mix: tuple[tuple[str, float], ...]) -> str:
    return " / ".join(f"{kind} {weight:.2f}" for kind, weight in mix)


def _log_uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    low, high = bounds
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _draw_sizes(rng: random.Random) -> tuple[float, float, int]:
    """A shape's tier and GPU cache shares and its workload seed, drawn in that order."""
    cpu_share = round(_log_uniform(rng, CPU_SHARE), 3)
    gpu_share = round(_log_uniform(rng, GPU_SHARE), 4)
    return cpu_share, gpu_share, rng.randrange(100, 1_000_000)


SyntheticRanges = tuple[tuple[float, float], tuple[int, int], tuple[int, ...]]
"""Arrival rate, request count and block sizes a synthetic shape draws from."""


def _synthetic(
    rng: random.Random,
    index: int,
    sizes: tuple[float, float, int],
    mix: tuple[tuple[str, float], ...],
    ranges: SyntheticRanges,
    chat_shape: ChatShape | None = None,
) -> Shape:
    """A synthetic shape of ``mix``: rate, request count and block size drawn in that order."""
    rate, requests, block_tokens = ranges
    return Shape(
        index,
        *sizes,
        mix=mix,
        rate=round(_log_uniform(rng, rate), 1),
        requests=int(round(_log_uniform(rng, requests), -2)),
        block_tokens=rng.choice(block_tokens),
        chat_shape=chat_shape,
    )


def draw_shape(rng: random.Random, index: int) -> Shape:
    """One shape from ``rng``; every parameter inside its range above."""
    cpu_share, gpu_share, seed = sizes = _draw_sizes(rng)
    if rng.random() < TRACE_SHARE:
        cut = rng.choice(TRACE_CUTS)
        factor = 1.0
        if cut == "time":
            factor = round(_log_uniform(rng, TIME_SCALE), 2)
        elif cut == "subsample":
            factor = round(rng.uniform(*SUBSAMPLE), 2)
        return Shape(index, cpu_share, gpu_share, seed, cut=cut, factor=factor)
    return _synthetic(rng, index, sizes, _draw_mix(rng), (RATE, REQUESTS, BLOCK_TOKENS))


def _draw_mix(rng: random.Random) -> tuple[tuple[str, float], ...]:
    """One to four of :data:`KINDS` with random weights (scaled to one)."""
    count = rng.choices(list(KIND_COUNTS), weights=list(KIND_COUNTS.values()))[0]
    kinds = sorted(rng.sample(KINDS, count))
    weights = [rng.uniform(0.1, 1.0) for _ in kinds]
    return tuple((kind, round(w / sum(weights), 2)) for kind, w in zip(kinds, weights, strict=True))


def draw_chat_shape(rng: random.Random, index: int) -> Shape:
    """One shape of the chat family from ``rng``."""
    sizes = _draw_sizes(rng)
    knobs = {name: float(f"{_log_uniform(rng, b):.2g}") for name, b in CHAT_LOG_UNIFORM.items()}
    chat_shape = ChatShape(one_turn=round(rng.uniform(*CHAT_ONE_TURN), 2), **knobs)
    mix: tuple[tuple[str, float], ...] = (("longchat", 1.0),)
    if rng.random() < CHAT_SECOND_KIND:
        share = round(rng.uniform(0.1, 0.4), 2)
        mix = (("longchat", round(1 - share, 2)), (rng.choice(KINDS), share))
    ranges = (CHAT_RATE, CHAT_REQUESTS, CHAT_BLOCK_TOKENS)
    return _synthetic(rng, index, sizes, mix, ranges, chat_shape)


def draw_phased_shape(rng: random.Random, index: int) -> Shape:
    """One shape of the phased family from ``rng``: each phase's mix differs from the last."""
    sizes = _draw_sizes(rng)
    phases = [_draw_mix(rng)]
    for _ in range(rng.choice(PHASES) - 1):
        mix = _draw_mix(rng)
        while {kind for kind, _ in mix} == {kind for kind, _ in phases[-1]}:
            mix = _draw_mix(rng)
        phases.append(mix)
    weights = [rng.uniform(*PHASE_SHARE) for _ in phases]
    shares = tuple(round(w / sum(weights), 2) for w in weights)
    shape = _synthetic(rng, index, sizes, phases[0], (RATE, REQUESTS, BLOCK_TOKENS))
    return replace(shape, phases=tuple(phases), phase_shares=shares)


FAMILIES = {"mixed": draw_shape, "chat": draw_chat_shape, "phased": draw_phased_shape}
"""How each ``--family`` draws a shape."""


def draw_shapes(count: int, seed: int, family: str = "mixed") -> list[Shape]:
    """``count`` shapes of ``family``, the same ones for the same seed."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(seed)
    draw = FAMILIES[family]
    return [draw(rng, index) for index in range(count)]


def run_shape(
    shape: Shape, baselines: Path | None = None, write_budget: float | None = None
) -> Row:
    """The admission table's comparison on one shape, with its parameters."""
    name = f"shape {shape.describe()} {shape.cpu_share} {shape.gpu_share}.json"
    cached = baselines / name.replace("/", "-") if baselines else None
    row = compare(shape.load(), shape.gpu_share, shape.cpu_share, cached, write_budget)
    everything = float(row["store-all writes"])
    ours = float(row["recommended writes"])
    return {
        **asdict(shape),
        "traffic": shape.describe(),
        **row,
        "writes vs store-all": ours / everything if everything else float("inf"),
        "margin tier-fulls": float(row["hit margin"])
        * int(row["refs"])
        / max(1, int(row["cpu_blocks"])),
    }


def budget_per_ref(text: str) -> float:
    """An argparse type: a write budget in writes per block reference (> 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, interpolated between the nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def loses_more_than(margin: float, allowance: float) -> bool:
    """Whether a hit margin is a loss of more than ``allowance``: a margin of exactly minus
    the allowance is not, though its float may fall an ulp below it."""
    return margin < -allowance - RATIO_NOISE


def summarise(rows: list[Row], write_budget: float | None = None) -> Row:
    """The figures the summary prints: goal count, margin quantiles, the worst shapes, and
    with ``write_budget`` how the recommended runs kept it."""
    margins = [r["hit margin"] for r in rows]
    ratios = [r["writes ratio"] for r in rows]
    versus_all = [r["writes vs store-all"] for r in rows]
    finite = [x for x in ratios if math.isfinite(x)]
    worst = sorted(rows, key=lambda r: r["hit margin"])[:WORST]
    in_tiers = sorted(rows, key=lambda r: r["margin tier-fulls"])
    budget: Row = {}
    if write_budget is not None:
        writes = [float(r["recommended writes"]) for r in rows]
        budget = {
            "write budget": write_budget,
            # The budget's bucket starts empty: over a whole run, writes stay within it.
            "within budget": sum(w <= write_budget + 1e-12 for w in writes),
            "highest writes per ref": max(writes),
        }
    return {
        "shapes": len(rows),
        "goal met": sum(bool(r["goal met"]) for r in rows),
        "shapes with room": sum(r["room to bound"] >= ROOM_GOAL - RATIO_NOISE for r in rows),
        "min hit margin": min(margins),
        "p10 hit margin": percentile(margins, 0.1),
        "median hit margin": percentile(margins, 0.5),
        "losses": sum(loses_more_than(m, LOSS) for m in margins),
        "losses past never-lose": sum(loses_more_than(m, NEVER_LOSE) for m in margins),
        "writes more than better": sum(x > 1.0 for x in ratios) / len(rows),
        "better writes nothing": len(ratios) - len(finite),
        "worst writes ratio": max(finite, default=float("nan")),
        "writes more than store-all": sum(x > 1.0 for x in versus_all),
        "worst writes vs store-all": max(versus_all),
        "worst shapes": [r["index"] for r in worst],
        "min margin tier-fulls": in_tiers[0]["margin tier-fulls"],
        "worst shapes in tier-fulls": [r["index"] for r in in_tiers[:WORST]],
        **budget,
    }


def _print_rows(rows: list[Row]) -> None:
    print(
        "| # | traffic | tier | GPU | better baseline | Belady | hit margin "
        "| writes vs better | writes vs store-all | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['index']} | {r['traffic']} "
            f"| {r['cpu_share']:.1%} ({r['cpu_blocks']:,}) "
            f"| {r['gpu_blocks'] / r['unique_blocks']:.1%} "
            f"({r['gpu_blocks']:,}) "
            f"| {r['better baseline']} {r[r['better baseline'] + ' hit']:.3f} "
            f"| {r['belady hit']:.3f} | {r['hit margin']:+.4f} "
            f"| {_times(r['writes ratio'])} | {_times(r['writes vs store-all'])} "
            f"| {'yes' if r['goal met'] else 'no'} |"
        )


def _print_summary(summary: Row, rows: list[Row]) -> None:
    by_index = {r["index"]: r for r in rows}
    n = summary["shapes"]
    print()
    print(
        f"shapes: {n}, {summary['shapes with room']} with room (the Belady bound {ROOM_GOAL} "
        f"or more above the better baseline), goal met on {summary['goal met']} "
        f"({summary['goal met'] / n:.0%} of all)"
    )
    print(
        f"hit margin vs the better baseline: min {summary['min hit margin']:+.4f}, "
        f"10th percentile {summary['p10 hit margin']:+.4f}, "
        f"median {summary['median hit margin']:+.4f}; "
        f"{summary['losses']} shapes lose more than {LOSS}, "
        f"{summary['losses past never-lose']} more than {NEVER_LOSE}"
    )
    print(
        f"hit margin in tier-fulls of hits: min {summary['min margin tier-fulls']:+.3f} "
        f"(shapes {', '.join(f'#{i}' for i in summary['worst shapes in tier-fulls'][:3])})"
    )
    print(
        f"writes more than the better baseline on {summary['writes more than better']:.0%} "
        f"of shapes (the better baseline writes nothing on {summary['better writes nothing']}); "
        f"worst writes ratio {summary['worst writes ratio']:.2f}x"
    )
    print(
        f"writes more than store-everything on {summary['writes more than store-all']} shapes; "
        f"worst {summary['worst writes vs store-all']:.2f}x of its writes"
    )
    if "write budget" in summary:
        print(
            f"write budget {summary['write budget']} writes per reference: kept on "
            f"{summary['within budget']} of {n} shapes; highest "
            f"{summary['highest writes per ref']:.4f}"
        )
    print("worst shapes by hit margin:")
    for index in summary["worst shapes"]:
        r = by_index[index]
        print(
            f"  #{index} {r['traffic']}, tier {r['cpu_share']:.1%}, "
            f"GPU {r['gpu_blocks'] / r['unique_blocks']:.1%}: "
            f"{r['hit margin']:+.4f} ({r['margin tier-fulls']:+.3f} tier-fulls) "
            f"vs {r['better baseline']}, "
            f"writes {_times(r['writes ratio'])}, {r['recommended switches']} "
            f"switch{'' if r['recommended switches'] == 1 else 'es'}"
        )


def _times(ratio: float) -> str:
    """A writes ratio as printed; a baseline that wrote nothing gives no ratio."""
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a (the baseline wrote none)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", type=positive_int, default=250, help="how many shapes to draw")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shape drawing")
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="mixed",
        help="mixed: synthetic kinds and Mooncake cuts; chat: chat-trace-like traffic; "
        "phased: synthetic mixes that change during the run",
    )
    parser.add_argument("--jobs", type=positive_int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows and the summary here")
    parser.add_argument(
        "--baselines", type=Path, help="keep and reuse the baselines' figures in this folder"
    )
    parser.add_argument(
        "--write-budget",
        type=budget_per_ref,
        help="the recommended run's write budget, in writes per block reference",
    )
    args = parser.parse_args()
    check_outputs(parser, args)
    shapes = draw_shapes(args.shapes, args.seed, args.family)
    if not TRACE.is_file():
        skipped = [s for s in shapes if s.cut]
        shapes = [s for s in shapes if not s.cut]
        print(f"note: {TRACE} not found, {len(skipped)} Mooncake shapes skipped", file=sys.stderr)
        if not shapes:
            return 1
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        budgets = [args.write_budget] * len(shapes)
        rows = []
        # A draw of 250 shapes runs for a quarter of an hour: one progress line per shape.
        for row in pool.map(run_shape, shapes, [args.baselines] * len(shapes), budgets):
            rows.append(row)
            print(
                f"shape {len(rows)}/{len(shapes)}: {row['hit margin']:+.4f} vs "
                f"{row['better baseline']}",
                file=sys.stderr,
                flush=True,
            )
    summary = summarise(rows, args.write_budget)
    _print_rows(rows)
    _print_summary(summary, rows)
    return write_rows(args.json, {"shapes": rows, "summary": summary}) if args.json else 0


if __name__ == "__main__":
    sys.exit(main())
