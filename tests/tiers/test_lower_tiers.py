"""Every lower tier answers every call of :class:`LowerTier`, under the protocol's parameter
names: the engines' paths call them without asking which tier they hold (a tier lacking
``wait_written`` failed every write batch SGLang's backend or vLLM's cascade gave it)."""

from __future__ import annotations

import inspect

import pytest
from tier_helpers import tiny_fingerprint as fingerprint

from kvoffload.core.keys import make_offload_key
from kvoffload.core.tier_protocol import LowerTier
from kvoffload.integrations.sglang.paths import OffTier
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RemoteTier
from tier_servers import ValkeyProcess

CALLS = [name for name, member in vars(LowerTier).items() if callable(member)]


def test_the_protocol_has_the_calls_the_engines_paths_make() -> None:
    assert {"read", "write", "poll", "wait_written", "close"} <= set(CALLS)


@pytest.mark.parametrize("tier", [DiskTier, RemoteTier, OffTier])
@pytest.mark.parametrize("call", [name for name in CALLS if not name.startswith("_")])
def test_each_lower_tier_has_each_call_of_the_protocol(tier: type, call: str) -> None:
    method = getattr(tier, call, None)
    assert callable(method), f"{tier.__name__} lacks {call}"
    wanted = list(inspect.signature(getattr(LowerTier, call)).parameters)
    assert list(inspect.signature(method).parameters) == wanted


def test_the_shared_tier_waits_for_the_writes_the_server_holds(
    own_server: ValkeyProcess,
) -> None:
    """The shared tier's writes go out on its I/O threads after ``write`` returns: a paused
    server (``CLIENT PAUSE ... WRITE``, as in a failover) holds them, and ``wait_written``
    returns once they are done, counting none; the poll after it finds every one finished."""
    own_server.start()
    tier = RemoteTier(own_server.url_with(60_000), fingerprint("wait-written"))
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(4)]
    try:
        own_server.client().execute_command("CLIENT", "PAUSE", "1000", "WRITE")
        assert tier.write(keys, [bytes([i]) * 32 for i in range(4)]) == 4
        tier.wait_written()
        assert tier.has_pending_work() and tier.stats.stored_blocks == 0  # not counted yet
        tier.poll(wait=False)
        assert tier.stats.stored_blocks == 4 and not tier.has_pending_work()
    finally:
        tier.close()
