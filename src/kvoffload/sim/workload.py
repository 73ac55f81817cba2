"""What the simulator replays: requests with arrival times and prefix-chained block keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload.core.keys import OffloadKey

Progress = Callable[[int, int], None]
"""``progress(done, total)``: told now and then how far a long step has come (a trace
read, a mix drawn, a replay), e.g. to draw a progress bar."""


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


def cacheable_keys(request: Request, block_tokens: int, drop_partial: bool) -> list[OffloadKey]:
    """``request.keys``, less the key of a partial last block when ``drop_partial``.

    vLLM never caches or offloads a prompt's partial last block; a source that
    keys it anyway (Mooncake's ``hash_ids`` do) then has one key too many.
    """
    keys = request.keys
    if drop_partial:
        full = request.input_tokens // block_tokens
        if len(keys) > full:
            return keys[:full]
    return keys


def max_gpu_hit(request: Request, block_tokens: int, drop_partial: bool) -> int:
    """The most blocks of ``request`` its GPU prefix cache may serve.

    vLLM matches at most ``input_tokens - 1`` tokens in whole blocks: the last
    token is always computed for its logits, so a prompt that ends on a block
    boundary never hits its last block in GPU memory (the offload tier may
    still load it). Modelled with ``drop_partial`` (vLLM's blocks); the
    ``cache`` mode keys blocks as its source does and caps nothing.
    """
    if not drop_partial:
        return len(request.keys)
    return max(0, (request.input_tokens - 1) // block_tokens)


@dataclass
class Workload:
    """Requests sorted by arrival time, all keyed with blocks of ``block_tokens`` tokens."""

    name: str
    block_tokens: int
    requests: list[Request] = field(default_factory=list)
    trace_format: str | None = None
    """The format a trace was read in (``None``: not a trace), for reports to name."""

    @property
    def num_refs(self) -> int:
        """Block references: the sum of every request's key count."""
        return sum(len(r.keys) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Distinct blocks: the keys of every request, each counted once."""
        return len({key for request in self.requests for key in request.keys})
