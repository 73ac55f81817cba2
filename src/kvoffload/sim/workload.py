"""What the simulator replays: requests with arrival times and prefix-chained block keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.core.keys import OffloadKey


@dataclass(slots=True)
class Request:
    """One prompt: when it arrives, how long it is, and the keys of its blocks in order.

    ``keys[i]`` names the prefix up to and including block ``i``; a trailing
    partial block may or may not have a key, depending on the source.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: list[OffloadKey]


@dataclass
class Workload:
    """Requests sorted by arrival time, all keyed with blocks of ``block_tokens`` tokens."""

    name: str
    block_tokens: int
    requests: list[Request] = field(default_factory=list)

    @property
    def num_refs(self) -> int:
        """Block references: the sum of every request's key count."""
        return sum(len(r.keys) for r in self.requests)
