"""The simulator's seam to whatever moves block bytes.

The engine model decides *when* a transfer finishes (from its bandwidth
model); a backend does, or skips, the real work. The default backend moves
nothing; the data plane's backend copies real KV bytes and verifies loads, so
the same replay gives the same hit ratios either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvoffload.core.keys import OffloadKey
from kvoffload.core.specs import LoadStoreSpec


class TransferBackend(Protocol):
    def compute(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int]) -> None:
        """The engine computed ``keys`` into these GPU blocks (same order)."""

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        """Start copying GPU blocks holding ``keys`` to ``dst`` (same order)."""

    def submit_load(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        src: LoadStoreSpec,
        gpu_block_ids: Sequence[int],
    ) -> None:
        """Start copying ``src`` (holding ``keys``) into these GPU blocks (same order)."""

    def finish(self, job_id: int) -> bool:
        """Wait for ``job_id`` and report whether it succeeded (loads are verified here)."""

    def close(self) -> None:
        """Wait for everything in flight and release resources."""


class NullTransferBackend:
    """Moves no bytes; every transfer succeeds when the engine model says it is done."""

    def compute(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int]) -> None:
        return None

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        return None

    def submit_load(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        src: LoadStoreSpec,
        gpu_block_ids: Sequence[int],
    ) -> None:
        return None

    def finish(self, job_id: int) -> bool:
        return True

    def close(self) -> None:
        return None
