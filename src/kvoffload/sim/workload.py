"""What the simulator replays: requests with arrival times and prefix-chained block keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.core.keys import OffloadKey, make_offload_key

ID_BYTES = 8


def block_id_key(block_id: int) -> OffloadKey:
    """The offload key of trace block ``block_id`` (8 big-endian bytes, KV group 0).

    Traces name blocks by integer ids that already encode the whole prefix, so
    the id itself can stand in for the engine's chained hash.
    """
    return make_offload_key(block_id.to_bytes(ID_BYTES, "big"), 0)


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
