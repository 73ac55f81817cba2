"""Seeded synthetic serving workloads, for the default run and for tests.

Four kinds of traffic, each with the reuse shape that matters for offloading:

* ``chat``: multi-turn conversations over a few shared system prompts; each
  turn's prompt is the whole conversation so far plus the new message.
* ``rag``: questions over documents whose popularity follows a Zipf law; the
  document (behind a shared instruction prompt) is the reusable prefix.
* ``agent``: tool-using loops behind one long fixed tool prefix; each step
  re-sends the growing history after a short tool-call pause.
* ``oneshot``: unrelated prompts with no reuse at all.
* ``longchat``: long conversations behind one system prompt of a single
  block, sized for 512-token blocks (tens of blocks per request), with
  minutes between turns and most sessions short, so most blocks are used
  once and the reused ones come back from far: the shape of a real
  assistant's traffic rather than of a benchmark. :class:`ChatShape` sets its
  knobs, so that other traffic of the kind can be drawn.

Blocks are keyed like an engine would: a full block's key names its whole
prefix, so shared prefixes share keys and a trailing partial block has none.
The same seed always gives the same workload.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from kvoffload.admission.params import read_number
from kvoffload.core.errors import InvalidArgumentError, is_number
from kvoffload.core.keys import OffloadKey, block_id_key
from kvoffload.core.memory import check_fits
from kvoffload.sim.workload import Progress, Request, Workload

DEFAULT_MIX: dict[str, float] = {"chat": 0.4, "rag": 0.25, "agent": 0.2, "oneshot": 0.15}
DEFAULT_REQUESTS = 2000
DEFAULT_RATE = 4.0
"""Requests per second across the whole mix."""
DEFAULT_BLOCK_TOKENS = 16
"""Tokens per block of a synthetic workload unless told otherwise."""
REQUEST_BYTES = 512
"""Memory of one drawn request apart from its blocks (its record, key list and numbers:
about 250 bytes measured), rounded up."""
BYTES_PER_BLOCK = {"chat": 70, "rag": 50, "agent": 24, "oneshot": 170, "longchat": 150}
"""Peak memory while drawing, per block of a request's prompt: 8 bytes in its key list and
8 in its prefix's ids, and for each new block its key, id and table entry (some 150 bytes),
so a kind that shares more blocks costs less. Measured with ``tracemalloc`` at 1, 16 and
512 tokens per block (longchat 137, 110, 131; chat 64, 62; rag 44, 39; agent 18, 18;
oneshot 158, 161), rounded up."""
EXTRA_REQUESTS = 100
"""Requests' worth of memory a workload takes beyond its own: it draws whole sessions, whose
later turns past its last arrival it drops, and prefixes shared across requests (agent's
tool prompt, rag's documents) once; measured up to 80 at 20 to 300 requests."""
MEAN_PROMPT_TOKENS = {"chat": 3_600, "rag": 4_000, "agent": 12_500, "oneshot": 1_550}
"""Prompt tokens per request of each kind, from its draws, rounded up (chat's with its
longest system prompt); ``longchat``'s come from its :class:`ChatShape`."""


@dataclass(frozen=True)
class _Prefix:
    """Full-block ids of a token sequence, plus its length (the tail may be partial)."""

    ids: tuple[int, ...]
    tokens: int


class _Keys:
    """Mints fresh block ids and turns ids into (shared) offload keys."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._next_id = itertools.count()
        self._keys: dict[int, OffloadKey] = {}

    def extend(self, prefix: _Prefix, tokens: int) -> _Prefix:
        """``prefix`` followed by ``tokens`` new tokens: newly full blocks get fresh ids."""
        total = prefix.tokens + tokens
        new_blocks = total // self.block_tokens - len(prefix.ids)
        fresh = tuple(next(self._next_id) for _ in range(new_blocks))
        return _Prefix(prefix.ids + fresh, total)

    def request(self, arrival_s: float, prompt: _Prefix, output_tokens: int) -> Request:
        keys = self._keys
        out = []
        for block_id in prompt.ids:
            key = keys.get(block_id)
            if key is None:
                key = keys[block_id] = block_id_key(block_id)
            out.append(key)
        return Request(arrival_s, prompt.tokens, output_tokens, out)


_EMPTY = _Prefix((), 0)
Sessions = Iterator[list[Request]]
"""Endless sessions (lists of requests), in order of their first arrival."""


def _zipf_sampler(rng: random.Random, n: int, exponent: float) -> Callable[[], int]:
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** exponent for rank in range(n)))
    total = cumulative[-1]
    return lambda: min(bisect.bisect(cumulative, rng.random() * total), n - 1)


def _chat(rng: random.Random, keys: _Keys, session_rate: float) -> Sessions:
    systems = [keys.extend(_EMPTY, rng.randint(200, 1500)) for _ in range(8)]
    pick_system = _zipf_sampler(rng, len(systems), 1.0)
    start = 0.0
    while True:
        start += rng.expovariate(session_rate)
        context, now, session = systems[pick_system()], start, []
        for _ in range(min(1 + int(rng.expovariate(1 / 3)), 20)):
            context = keys.extend(context, rng.randint(30, 600))
            output = rng.randint(50, 700)
            session.append(keys.request(now, context, output))
            context = keys.extend(context, output)
            now += rng.expovariate(1 / 45)
        yield session


def _rag(rng: random.Random, keys: _Keys, session_rate: float) -> Sessions:
    instructions = keys.extend(_EMPTY, 300)
    documents: dict[int, _Prefix] = {}
    pick_document = _zipf_sampler(rng, 600, 1.0)
    start = 0.0
    while True:
        start += rng.expovariate(session_rate)
        doc = pick_document()
        if doc not in documents:
            documents[doc] = keys.extend(instructions, rng.randint(1000, 6000))
        prompt = keys.extend(documents[doc], rng.randint(20, 200))
        yield [keys.request(start, prompt, rng.randint(50, 300))]


def _agent(rng: random.Random, keys: _Keys, session_rate: float) -> Sessions:
    tools = keys.extend(_EMPTY, 6000)
    start = 0.0
    while True:
        start += rng.expovariate(session_rate)
        context, now, session = keys.extend(tools, rng.randint(200, 800)), start, []
        for _ in range(min(1 + int(rng.expovariate(1 / 7)), 30)):
            output = rng.randint(30, 150)
            session.append(keys.request(now, context, output))
            context = keys.extend(context, output + rng.randint(100, 1500))
            now += rng.uniform(1.0, 5.0)
        yield session


def _oneshot(rng: random.Random, keys: _Keys, session_rate: float) -> Sessions:
    start = 0.0
    while True:
        start += rng.expovariate(session_rate)
        prompt = keys.extend(_EMPTY, rng.randint(100, 3000))
        yield [keys.request(start, prompt, rng.randint(20, 400))]


LONGCHAT_MAX_TOKENS = 126_000
"""The longest ``longchat`` prompt: 246 blocks of 512 tokens."""
LONGCHAT_MAX_TURNS = 40
LONGCHAT_OUTPUT_TOKENS = (200, 1200)
"""The fewest and most tokens of a ``longchat`` answer (uniform)."""
PASTE_SIGMA = 0.9
MESSAGE_SIGMA = 1.2
"""The spreads (of their logarithms) of a pasted text and of a conversation's messages."""


@dataclass(frozen=True)
class ChatShape:
    """The knobs of ``longchat`` traffic (token counts and gaps are medians of lognormals).

    The defaults are the figures of a real assistant's trace that we keep out of the
    repository (most blocks used once, reuse minutes apart); other values draw traffic
    of the same kind, so that a rule is judged on the kind and not on one shape of it.
    """

    one_turn: float = 0.6
    """Share of sessions that paste something long and never come back."""
    paste_tokens: float = 11_000
    first_tokens: float = 3_000
    """A conversation's first message."""
    follow_up_tokens: float = 700
    extra_turns: float = 1.5
    """Mean turns of a conversation past its second."""
    turn_gap_s: float = 150
    system_tokens: int = 700

    def __post_init__(self) -> None:
        if not (is_number(self.one_turn) and 0.0 <= self.one_turn <= 1.0):
            raise InvalidArgumentError(f"one_turn must be a share in [0, 1], got {self.one_turn!r}")
        sizes = ("paste_tokens", "first_tokens", "follow_up_tokens", "extra_turns", "turn_gap_s")
        for name in sizes:
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")
        tokens = self.system_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidArgumentError(f"system_tokens must be an integer >= 1, got {tokens!r}")

    def mean_session_requests(self) -> float:
        """Requests per session, to two places (the arrival rate it sets is nominal)."""
        conversation = 2 + 1 / math.expm1(1 / self.extra_turns)
        return round(self.one_turn + (1 - self.one_turn) * conversation, 2)

    def mean_prompt_tokens(self) -> float:
        """Prompt tokens per request, from the shape's medians and spreads: at least the
        mean the draws give (taken as uncapped when a message would pass the longest
        prompt, and sessions as going on when one does), for a workload's memory to be
        estimated before it is drawn."""
        lognormal_mean = math.exp(MESSAGE_SIGMA**2 / 2)
        pasted = min(
            self.system_tokens + self.paste_tokens * math.exp(PASTE_SIGMA**2 / 2),
            LONGCHAT_MAX_TOKENS,
        )
        first = self.system_tokens + self.first_tokens * lognormal_mean
        per_turn = self.follow_up_tokens * lognormal_mean + sum(LONGCHAT_OUTPUT_TOKENS) / 2
        stay = math.exp(-1 / self.extra_turns)  # chance of one more turn past the second
        session_tokens = session_requests = prompt = 0.0
        for turn in range(1, LONGCHAT_MAX_TURNS + 1):
            prompt += min(first + (turn - 1) * per_turn, LONGCHAT_MAX_TOKENS)
            if turn < 2:
                continue
            last = turn == LONGCHAT_MAX_TURNS
            chance = stay ** (turn - 2) * (1 if last else -math.expm1(-1 / self.extra_turns))
            session_tokens += chance * prompt
            session_requests += chance * turn
        one = self.one_turn
        return (one * pasted + (1 - one) * session_tokens) / (one + (1 - one) * session_requests)


def longchat_sessions(shape: ChatShape) -> Callable[[random.Random, _Keys, float], Sessions]:
    """A ``longchat`` session generator of ``shape``."""

    def sessions(rng: random.Random, keys: _Keys, session_rate: float) -> Sessions:
        system = keys.extend(_EMPTY, shape.system_tokens)
        start = 0.0
        while True:
            start += rng.expovariate(session_rate)
            if rng.random() < shape.one_turn:
                turns, message = 1, rng.lognormvariate(math.log(shape.paste_tokens), PASTE_SIGMA)
            else:
                turns = 2 + int(rng.expovariate(1 / shape.extra_turns))
                message = rng.lognormvariate(math.log(shape.first_tokens), MESSAGE_SIGMA)
            context, now, session = system, start, []
            for _ in range(min(turns, LONGCHAT_MAX_TURNS)):
                tokens = min(int(message), LONGCHAT_MAX_TOKENS - context.tokens)
                if tokens < 1:
                    break
                context = keys.extend(context, tokens)
                output = rng.randint(*LONGCHAT_OUTPUT_TOKENS)
                session.append(keys.request(now, context, output))
                context = keys.extend(context, output)
                now += rng.lognormvariate(math.log(shape.turn_gap_s), 1.2)
                message = rng.lognormvariate(math.log(shape.follow_up_tokens), MESSAGE_SIGMA)
            yield session

    return sessions


GENERATORS: dict[str, Callable[[random.Random, _Keys, float], Sessions]] = {
    "chat": _chat,
    "rag": _rag,
    "agent": _agent,
    "oneshot": _oneshot,
    "longchat": longchat_sessions(ChatShape()),
}
_MEAN_SESSION_REQUESTS = {"chat": 3.5, "rag": 1.0, "agent": 7.5, "oneshot": 1.0}


def parse_mix(text: str) -> dict[str, float]:
    """Parse ``"chat=0.5,rag=0.5"`` into weights, a kind alone (``"rag"``) weighing 1; an
    empty weight (``"rag="``) is refused, and so is one that is not a finite number >= 0
    as written, as typed (``1e309``, not ``inf``; ``-1e-400``, not the -0.0 it reads as),
    an unknown kind and weights that are all zero."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a mix is text such as 'chat=0.5,rag=0.5', got {text!r}")
    weights: dict[str, float] = {}
    for part in text.split(","):
        name, equals, weight = part.partition("=")
        name, weight = name.strip(), weight.strip()
        if not name:  # "chat,": "," alone said that it named '' twice
            raise InvalidArgumentError(
                f"mix {text!r} has an entry without a kind; known: {', '.join(GENERATORS)}"
            )
        if equals and not weight:  # "chat=" was taken as "chat", weight 1
            raise InvalidArgumentError(
                f"mix {text!r} gives {name!r} no weight after '=': give {name}=W, or "
                f"{name} alone for weight 1"
            )
        if name in weights:  # the last one won, silently
            raise InvalidArgumentError(f"mix {text!r} names {name!r} twice")
        try:
            weights[name] = read_number(weight, 0.0) if weight else 1.0
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"mix weight for {name!r}: {exc}") from None
    # Refused here as well as by generate, so that the CLI's message names --mix.
    unknown = sorted(set(weights) - set(GENERATORS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown workload kind {unknown[0]!r}; known: {', '.join(GENERATORS)}"
        )
    if not any(weights.values()):
        raise InvalidArgumentError(f"mix {text!r} gives every kind weight 0: no request to draw")
    return weights


def generate(
    mix: Mapping[str, float] | None = None,
    num_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    rate: float = DEFAULT_RATE,
    chat_shape: ChatShape | None = None,
    progress: Progress | None = None,
) -> Workload:
    """A workload of ``num_requests`` requests drawn from ``mix`` (kind → weight).

    Each kind gets its weight's share of the requests and of the arrival
    ``rate`` (requests per second), drawn from its own seeded random stream;
    ``longchat`` traffic has ``chat_shape`` (default: :class:`ChatShape`'s).
    ``progress(done, num_requests)`` is told the requests drawn now and then.
    """
    mix = DEFAULT_MIX if mix is None else mix
    if not isinstance(mix, Mapping):
        raise InvalidArgumentError(f"mix must be a mapping of workload kind to weight, got {mix!r}")
    if chat_shape is not None and not isinstance(chat_shape, ChatShape):
        raise InvalidArgumentError(f"chat_shape must be a ChatShape, got {chat_shape!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed must be an integer, got {seed!r}")
    unknown = sorted(set(mix) - set(GENERATORS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown workload kind {unknown[0]!r}; known: {', '.join(GENERATORS)}"
        )
    weights = mix.values()
    if not all(is_number(w) and math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise InvalidArgumentError(
            f"mix weights must be finite, >= 0 and not all zero, got {dict(mix)}"
        )
    total = sum(mix.values())
    if math.isinf(total):  # weights near the float maximum: scaled, or every share is nan
        biggest = max(mix.values())
        mix = {kind: weight / biggest for kind, weight in mix.items()}
        total = sum(mix.values())
    for name, value in (("requests", num_requests), ("block size", block_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
        raise InvalidArgumentError(f"rate must be a finite number > 0, got {rate!r}")
    check_fits(
        estimated_bytes(mix, num_requests, block_tokens, chat_shape),
        f"{num_requests:,} synthetic requests at block_tokens={block_tokens}",
    )
    keys = _Keys(block_tokens)
    counts = _apportion(num_requests, {k: w / total for k, w in mix.items()})
    chat_shape = ChatShape() if chat_shape is None else chat_shape
    generators = {**GENERATORS, "longchat": longchat_sessions(chat_shape)}
    per_session = {**_MEAN_SESSION_REQUESTS, "longchat": chat_shape.mean_session_requests()}
    requests: list[Request] = []
    report = None
    for index, (kind, share) in enumerate(sorted(mix.items())):
        if counts[kind] == 0:
            continue
        rng = random.Random(seed * 1000 + index)
        session_rate = rate * share / total / per_session[kind]
        if not 0 < session_rate < math.inf:  # rate * share overflowed or underflowed
            session_rate = rate * (share / total) / per_session[kind]
        if not session_rate > 0:  # underflowed: expovariate would divide by zero
            raise rate_too_low(rate)
        if progress is not None:
            report = functools.partial(_drawn, progress, len(requests), num_requests)
        requests += _take(generators[kind](rng, keys, session_rate), counts[kind], rate, report)
    if progress is not None:
        progress(num_requests, num_requests)
    requests.sort(key=lambda r: r.arrival_s)
    name = "+".join(f"{k}={w / total:g}" for k, w in sorted(mix.items()) if counts[k])
    if counts.get("longchat") and chat_shape != ChatShape():
        name += f", {chat_shape}"
    return Workload(
        name=f"synthetic({name}, seed={seed})", block_tokens=block_tokens, requests=requests
    )


def estimated_bytes(
    mix: Mapping[str, float],
    num_requests: int,
    block_tokens: int,
    chat_shape: ChatShape | None = None,
) -> float:
    """The memory :func:`generate` needs at its peak to draw ``num_requests`` of ``mix``
    (checked weights), a little above what it takes: each request's blocks, its prompt
    tokens over ``block_tokens``, at what a block of its kind costs, for
    :data:`EXTRA_REQUESTS` more than it keeps (``inf`` past a float)."""
    total = sum(mix.values())
    tokens = {**MEAN_PROMPT_TOKENS, "longchat": (chat_shape or ChatShape()).mean_prompt_tokens()}
    per_request = sum(
        weight / total * (REQUEST_BYTES + BYTES_PER_BLOCK[kind] * tokens[kind] / block_tokens)
        for kind, weight in mix.items()
    )
    try:
        return (float(num_requests) + EXTRA_REQUESTS) * per_request
    except OverflowError:  # a count past the float range: past any machine's memory too
        return math.inf


def _apportion(n: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` by ``shares`` with largest remainders, so the counts add up to ``n``."""
    exact = {k: n * s for k, s in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    by_remainder = sorted(exact, key=lambda k: (counts[k] - exact[k], k))
    for kind in by_remainder[: n - sum(counts.values())]:
        counts[kind] += 1
    return counts


class RateTooLowError(InvalidArgumentError):
    """Arrival times drawn at the ``rate`` asked for overflow a float: a class of its own, so
    that a caller that took the rate under another name (the CLI's ``--rate``) can name it."""


def rate_too_low(rate: float, name: str = "rate") -> RateTooLowError:
    """The error of a ``rate`` whose arrival times overflow, naming it ``name``."""
    return RateTooLowError(f"{name} {rate!r} is too low: arrival times overflow a float")


PROGRESS_REQUESTS = 1024
"""Requests drawn between two reports to a progress callback."""


def _drawn(progress: Progress, before: int, total: int, taken: int) -> None:
    """Tell ``progress`` a kind's ``taken`` requests after the ``before`` of the kinds drawn
    earlier, out of the mix's ``total``."""
    progress(before + taken, total)


def _take(
    sessions: Sessions, n: int, rate: float, report: Callable[[int], None] | None = None
) -> list[Request]:
    """The ``n`` earliest requests of sessions that start in order; ``report`` is told
    how many of them have been drawn, now and then.

    Sessions are drawn until the next one starts after the ``n``-th earliest
    request seen so far, so no later session could contribute an earlier one.
    An infinite start (a ``rate`` near zero) would never be after it: refused.
    """
    taken: list[Request] = []
    reported = 0
    for session in sessions:
        if report is not None and len(taken) - reported >= PROGRESS_REQUESTS:
            reported = len(taken)
            report(min(reported, n))
        if math.isinf(session[0].arrival_s):
            raise rate_too_low(rate)
        if len(taken) >= n:
            taken.sort(key=lambda r: r.arrival_s)
            if session[0].arrival_s > taken[n - 1].arrival_s:
                break
        taken += session
    taken.sort(key=lambda r: r.arrival_s)
    return taken[:n]
