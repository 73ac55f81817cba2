"""SGLang's look-up and read contract over both tiers, for any way the pages lie in them.

SGLang's cache controller takes ``batch_exists`` as the number of leading pages it may
fetch, then reads them with ``batch_get_v1`` and keeps the leading run of ``True``: every
page a look-up counts must read back intact, wherever it lies (disk, server, both).
Pages are laid out per example on a real disk tier and a real Valkey server.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import HostPool, page_hash

from kvoffload.integrations.sglang.storage import page_key
from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess

NOWHERE, DISK, SERVER, BOTH = "nowhere", "disk", "server", "both"
PAGES = 8
EXAMPLES = 40


@dataclass
class Tiers:
    """A disk-and-server backend and a server-only one of the same model (so the same
    pages on the server), shared by every example; each example takes fresh keys."""

    pool: HostPool
    both: Any
    server_only: Any
    server: ValkeyProcess
    fresh: Iterator[int]

    def lay_out(self, where: list[str]) -> list[str]:
        """Fresh keys for pages 0.. of the pool, each stored where ``where`` says."""
        keys = [page_hash(next(self.fresh)) for _ in where]
        self.pool.fill(list(range(len(where))), seed=next(self.fresh))
        for i, place in enumerate(where):
            if place in (DISK, BOTH):
                assert self.both.batch_set_v1([keys[i]], self.pool.indices([i])) == [True]
            if place == DISK:
                name = self.both.paths[1].tier.name(page_key(keys[i]))
                assert self.server.client().delete(name) == 1
            if place == SERVER:
                assert self.server_only.batch_set_v1([keys[i]], self.pool.indices([i])) == [True]
        return keys


@pytest.fixture
def tiers(backends: Any, tmp_path: Path, valkey_server: ValkeyProcess) -> Tiers:
    pool = HostPool(pages=2 * PAGES)
    remote = {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}
    disk = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(2 * PAGES * EXAMPLES, len(pool.page_bytes(0))),
    }
    both = backends({**remote, **disk}, pool, model="contract")
    server_only = backends(remote, pool, model="contract")
    return Tiers(pool, both, server_only, valkey_server, itertools.count(50_000))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    # The backends are built once for all examples on purpose: fresh keys keep them apart.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(where=st.lists(st.sampled_from([NOWHERE, DISK, SERVER, BOTH]), min_size=1, max_size=PAGES))
def test_a_look_up_counts_the_leading_pages_that_read_back_intact(
    tiers: Tiers, where: list[str]
) -> None:
    keys = tiers.lay_out(where)
    pool, backend = tiers.pool, tiers.both
    expected = [pool.page_bytes(p) for p in range(len(where))]
    held = [place != NOWHERE for place in where]
    before = backend.get_stats().kvoffload
    assert backend.batch_exists(keys) == (held.index(False) if False in held else len(held))
    after = backend.get_stats().kvoffload
    # One look-up, each tier asked as one.
    assert all(after[tier]["lookups"] - before[tier]["lookups"] <= 1 for tier in after)
    into = list(range(PAGES, PAGES + len(where)))
    pool.zero()
    assert backend.batch_get_v1(keys, pool.indices(into)) == held
    read = [pool.page_bytes(p) for p, ok in zip(into, held, strict=True) if ok]
    assert read == [page for page, ok in zip(expected, held, strict=True) if ok]
