"""The spec as vLLM loads it: configuration, the per-key adapter, stats and events."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import create_spec

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.integrations.vllm.settings import parse_settings
from kvoffload.managers import CPUOffloadingManager, Stack


def test_factory_builds_our_spec_and_sizes_the_tier(vllm_modules: dict[str, ModuleType]) -> None:
    from kvoffload.integrations.vllm import KVOffloadSpec

    spec = create_spec(
        {"cpu_bytes_to_use": 10 * 2048, "eviction_policy": "arc"}, blocks_per_chunk=2
    )
    assert type(spec) is KVOffloadSpec
    assert spec.bytes_per_block == 2048
    assert spec.num_blocks == 10
    backing = spec.get_manager().backing
    assert isinstance(backing, CPUOffloadingManager)
    assert backing.num_blocks == 10
    assert type(backing.policy).__name__ == "ARCCachePolicy"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"cpu_bytes_to_use": 4096, "evicton_policy": "lru"}, "evicton_policy"),
        ({"cpu_bytes_to_use": 4096, "eviction_policy": "mru"}, "mru"),
        ({"cpu_bytes_to_use": 4096, "store_threshold": -1}, "store_threshold"),
        # Past the counter's bound: refused at start-up, saying 0 is accepted too.
        (
            {"cpu_bytes_to_use": 4096, "store_threshold": 2**63},
            "'store_threshold' must be an integer from 0 to 4,611,686,018,427,387,904",
        ),
        ({"cpu_bytes_to_use": 4096, "max_tracker_size": "many"}, "max_tracker_size"),
        # Past the reuse table's limit: refused deeper, without the key's name, before.
        (
            {"cpu_bytes_to_use": 4096, "max_tracker_size": 2**62},
            "'max_tracker_size' must be an integer from 1 to 576,460,752,303,423,487",
        ),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        # Past what one buffer holds: a TypeError from torch in every worker before.
        ({"cpu_bytes_to_use": 2**63}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1e300}, "cpu_bytes_to_use"),
        # Past any 64-bit size: refused later, under kvoffload.disk_dir's name, before.
        (
            {"cpu_bytes_to_use": 4096, "kvoffload.disk_dir": "/x", "kvoffload.disk_bytes": 2**63},
            "'kvoffload.disk_bytes' must be an integer from 1 to 9,223,372,036,854,775,807",
        ),
        (
            {
                "cpu_bytes_to_use": 4096,
                "kvoffload.remote_url": "redis://127.0.0.1:1",
                "kvoffload.remote_bytes": 10**400,
            },
            "'kvoffload.remote_bytes' must be an integer from 1 to 9,223,372,036,854,775,807",
        ),
        # An int past any float: an OverflowError from float() before.
        (
            {
                "cpu_bytes_to_use": 4096,
                "kvoffload.disk_dir": "/x",
                "kvoffload.disk_bytes": 1 << 30,
                "kvoffload.disk_timeout_ms": 10**400,
            },
            "'kvoffload.disk_timeout_ms' must be a number of milliseconds",
        ),
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 4096, "kvoffload.admision": "tinylfu"}, "kvoffload.admision"),
        ({"cpu_bytes_to_use": 4096, "kvoffload.remote_url": ""}, "kvoffload.remote_url"),
        ({"cpu_bytes_to_use": 4096, "kvoffload.admission": "bogus"}, "kvoffload.admission"),
        ({"cpu_bytes_to_use": 4096, "kvoffload.admission": 3}, "kvoffload.admission"),
        # Keys that mean nothing alone, taken and ignored before.
        ({"cpu_bytes_to_use": 4096, "kvoffload.remote_bytes": 1 << 30}, "needs the remote"),
        ({"cpu_bytes_to_use": 4096, "kvoffload.drive_bytes": "1TB"}, "it needs 'kvoffload"),
        # Beside a budget in another unit alone it was taken and ignored too.
        (
            {
                "cpu_bytes_to_use": 4096,
                "kvoffload.admission": "recommended",
                "kvoffload.write_budget": "200MB/s",
                "kvoffload.drive_bytes": "1TB",
            },
            r"no budget given is one \('kvoffload.write_budget': 200 MB/s\)",
        ),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_key(
    vllm_modules: dict[str, ModuleType], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        create_spec(extra)


def test_settings_accept_vllm_connector_keys_and_numeric_strings() -> None:
    settings = parse_settings(
        {"cpu_bytes_to_use": "4096", "store_threshold": "2", "offload_prompt_only": False}
    )
    assert (settings.cpu_bytes_to_use, settings.store_threshold) == (4096, 2)


def test_settings_accept_whole_json_floats_as_vllm_does() -> None:
    # JSON's 64e9 is a float; vLLM's CPU spec takes int() of it, so a config it runs with
    # must not stop ours. A fraction of a byte or a block is still refused, naming the key.
    settings = parse_settings(
        {
            "cpu_bytes_to_use": 64e9,
            "store_threshold": 2.0,
            "kvoffload.disk_dir": "/nvme/kv",
            "kvoffload.disk_bytes": 5e11,
        }
    )
    assert (settings.cpu_bytes_to_use, settings.store_threshold) == (64_000_000_000, 2)
    assert settings.disk_bytes == 500_000_000_000
    assert all(type(n) is int for n in (settings.cpu_bytes_to_use, settings.disk_bytes))
    with pytest.raises(InvalidArgumentError, match="'store_threshold' must be an integer"):
        parse_settings({"cpu_bytes_to_use": 4096, "store_threshold": 2.5})


def test_a_tier_too_small_for_one_block_is_refused(vllm_modules: dict[str, ModuleType]) -> None:
    with pytest.raises(InvalidArgumentError, match="holds no offloaded block"):
        create_spec({"cpu_bytes_to_use": 1000}, bytes_per_block=1024)


def _context(req_id: str, keys: list[bytes]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, 16 * position)
    return context


def test_lookup_results_follow_block_states(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    manager = create_spec({"cpu_bytes_to_use": 4 * 1024}).get_manager()
    a, b = block_id_key(1), block_id_key(2)
    context = _context("r", [a, b])
    manager.on_new_request(context)
    assert manager.lookup(a, context) is LookupResult.MISS
    output = manager.prepare_store([a, b], context)
    assert output.keys_to_store == [a, b]
    assert isinstance(output.store_spec, CPULoadStoreSpec)
    assert output.store_spec.block_ids.tolist() == [0, 1]
    assert manager.lookup(a, context) is LookupResult.HIT_PENDING
    manager.complete_store([a], context)
    assert manager.lookup(a, context) is LookupResult.HIT
    assert manager.lookup(b, context) is LookupResult.HIT_PENDING
    spec = manager.prepare_load([a], context)
    assert spec.block_ids.tolist() == [0]
    manager.complete_load([a], context)
    manager.on_request_finished(context)


def test_a_deferred_lookup_is_retry(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    from kvoffload.integrations.vllm.adapter import VLLMManagerAdapter

    class Deferring(CPUOffloadingManager):
        def lookup(self, keys: Any) -> int | None:
            return None

    def build() -> Stack:
        manager = Deferring(4)
        return Stack(manager, manager)

    adapter = VLLMManagerAdapter(build)
    assert adapter.lookup(block_id_key(1), _context("r", [])) is LookupResult.RETRY


def test_store_threshold_counts_offers_not_lookups(vllm_modules: dict[str, ModuleType]) -> None:
    manager = create_spec({"cpu_bytes_to_use": 8 * 1024, "store_threshold": 2}).get_manager()
    keys = [block_id_key(i) for i in range(3)]
    context = _context("r", keys)
    for _ in range(3):
        for key in keys:
            manager.lookup(key, context)
    assert manager.prepare_store(keys, context).keys_to_store == []
    output = manager.prepare_store(keys, context)
    assert output.keys_to_store == keys
    manager.complete_store(keys, context)
    # Held keys are reuses, never filtered; a new key starts its count again.
    assert manager.prepare_store([*keys, block_id_key(9)], context).keys_to_store == []
    stats = manager.get_stats().reduce()
    assert stats["vllm:kvoffload_stores_skipped"] == 3 + 1
    assert stats["vllm:kvoffload_stores_admitted"] == 3


def test_stats_are_increments_and_declared_as_metrics(vllm_modules: dict[str, ModuleType]) -> None:
    spec = create_spec({"cpu_bytes_to_use": 2 * 1024})
    manager = spec.get_manager()
    keys = [block_id_key(i) for i in range(3)]
    context = _context("r", keys)
    manager.prepare_store(keys[:2], context)
    manager.complete_store(keys[:2], context)
    manager.prepare_load(keys[:1], context)
    manager.complete_load(keys[:1], context)
    manager.prepare_store(keys[2:], context)  # evicts one
    manager.lookup(keys[2], context)
    first = manager.get_stats()
    values = first.reduce()
    assert values["vllm:kvoffload_loads"] == 1
    assert values["vllm:kvoffload_bytes_loaded"] == 1024
    assert values["vllm:kvoffload_stores_offered"] == 3
    assert values["vllm:kvoffload_stores_admitted"] == 3
    assert values["vllm:kvoffload_evictions"] == 1
    assert values["vllm:kvoffload_bytes_stored"] == 2 * 1024
    assert values["vllm:kvoffload_held_blocks"] == 2
    assert values["vllm:kvoffload_lookups"] == 1
    declared = type(spec).build_metric_definitions(dict(spec.extra_config))
    assert set(values) <= set(declared)
    assert manager.get_stats().reduce()["vllm:kvoffload_stores_offered"] == 0


def test_events_carry_vllm_media(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import Medium

    manager = create_spec({"cpu_bytes_to_use": 1024}, events=True).get_manager()
    a, b = block_id_key(1), block_id_key(2)
    context = _context("r", [a, b])
    manager.prepare_store([a], context)
    manager.complete_store([a], context)
    manager.prepare_store([b], context)
    events = list(manager.take_events())
    assert [(e.keys, e.medium, e.removed) for e in events] == [
        ([a], Medium.CPU, False),
        ([a], Medium.CPU, True),
    ]
    assert list(manager.take_events()) == []


def test_reset_cache_drops_every_block(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    manager = create_spec({"cpu_bytes_to_use": 4 * 1024}).get_manager()
    a = block_id_key(1)
    context = _context("r", [a])
    manager.prepare_store([a], context)
    manager.complete_store([a], context)
    manager.reset_cache()
    assert manager.lookup(a, context) is LookupResult.MISS


def test_vllms_own_metrics_frontend_shows_our_counters(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """What ``get_stats`` reports reaches vLLM's ``/metrics`` through its offloading frontend."""
    import prometheus_client
    from vllm_helpers import SPEC_CONFIG, metrics_frontend

    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 4 * 1024}
    frontend, registry = metrics_frontend(extra)
    manager = create_spec(extra).get_manager()
    a, b = block_id_key(1), block_id_key(2)
    context = _context("r", [a, b])
    manager.prepare_store([a, b], context)
    manager.complete_store([a], context)
    frontend.observe(manager.get_stats().data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:kvoffload_stores_offered_total{engine="0"} 2.0' in text
    assert 'vllm:kvoffload_stores_completed_total{engine="0"} 1.0' in text
    assert 'vllm:kvoffload_bytes_stored_total{engine="0"} 1024.0' in text
    assert 'vllm:kvoffload_held_blocks{engine="0"} 2.0' in text


def test_a_failed_store_releases_its_slot_without_an_eviction(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM 0.33's event tracker forgets what ``prepare_store`` recorded for a key only on
    a metadata-only removal; a key stored again before the events are taken is held."""
    from vllm.v1.kv_offload.base import Medium

    from kvoffload.integrations.vllm.adapter import RELEASES_METADATA

    manager = create_spec({"cpu_bytes_to_use": 4 * 1024}, events=True).get_manager()
    a, b = block_id_key(1), block_id_key(2)
    context = _context("r", [a, b])
    manager.prepare_store([a, b], context)
    manager.complete_store([a, b], context, success=False)
    manager.prepare_store([b], context)
    events = [
        (e.keys, e.medium, e.removed, getattr(e, "metadata_only", None))
        for e in manager.take_events()
    ]
    if RELEASES_METADATA:
        assert events == [([a], Medium.CPU, True, True)]
    else:
        assert events == []
    manager.complete_store([b], context, success=False)
    released = [e.keys for e in manager.take_events() if getattr(e, "metadata_only", False)]
    assert released == ([[b]] if RELEASES_METADATA else [])


def test_a_key_set_to_null_takes_its_default(vllm_modules: dict[str, ModuleType]) -> None:
    """JSON's ``null`` for a key is the key unset, as vLLM reads its own keys (a null
    ``blocks_per_chunk`` is its default): a null ``store_threshold``, ``eviction_policy`` or
    ``kvoffload.remote_bytes`` stopped start-up. A required key given as null is missing,
    and an unknown key is refused whatever its value."""
    nulls = {
        key: None
        for key in (
            "eviction_policy",
            "store_threshold",
            "max_tracker_size",
            "block_size",
            "kvoffload.admission",
            "kvoffload.admission_params",
            "kvoffload.disk_dir",
            "kvoffload.disk_bytes",
            "kvoffload.disk_timeout_ms",
            "kvoffload.disk_max_pending_write_bytes",
            "kvoffload.remote_url",
            "kvoffload.remote_bytes",
            "kvoffload.remote_max_pending_write_bytes",
            "kvoffload.write_budget",
        )
    }
    spec = create_spec({"cpu_bytes_to_use": 4096, **nulls})
    assert spec.settings == parse_settings({"cpu_bytes_to_use": 4096})
    with pytest.raises(InvalidArgumentError, match="needs 'cpu_bytes_to_use'"):
        create_spec({"cpu_bytes_to_use": None})
    with pytest.raises(InvalidArgumentError, match="unknown kv_connector_extra_config key"):
        create_spec({"cpu_bytes_to_use": 4096, "kvoffload.admision": None})
