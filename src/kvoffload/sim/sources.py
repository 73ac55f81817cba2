"""Where a workload comes from, as a small picklable description.

Sweeps ship this description to worker processes, each of which builds its
own copy of the workload, instead of pickling every request across.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.sim.generators import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_MIX,
    DEFAULT_RATE,
    DEFAULT_REQUESTS,
    ChatShape,
    generate,
)
from kvoffload.sim.traces import read_trace
from kvoffload.sim.workload import Progress, Workload


@dataclass(frozen=True)
class WorkloadSource:
    """A trace file (``trace`` set) or a seeded synthetic mix (``trace`` unset)."""

    trace: str | None = None
    fmt: str = "auto"
    block_tokens: int | None = None
    """Tokens per block; defaults to the trace format's, or 16 for synthetic workloads."""
    mix: tuple[tuple[str, float], ...] = tuple(DEFAULT_MIX.items())
    requests: int = DEFAULT_REQUESTS
    seed: int = 0
    rate: float = DEFAULT_RATE
    chat_shape: ChatShape | None = None
    """The shape of ``longchat`` traffic in the mix (default: :class:`ChatShape`'s)."""

    def load(self, progress: Progress | None = None) -> Workload:
        """The workload; ``progress(done, total)`` follows a long read or generation (in
        bytes of a trace file, in requests of a synthetic mix)."""
        if self.trace is not None:
            return read_trace(self.trace, self.fmt, self.block_tokens, progress)
        return generate(
            dict(self.mix),
            num_requests=self.requests,
            seed=self.seed,
            block_tokens=DEFAULT_BLOCK_TOKENS if self.block_tokens is None else self.block_tokens,
            rate=self.rate,
            chat_shape=self.chat_shape,
            progress=progress,
        )
