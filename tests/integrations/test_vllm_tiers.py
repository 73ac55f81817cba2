"""The spec's lower tiers: a shared Valkey tier two "instances" share, and a disk tier.

Lower tiers move no KV bytes to vLLM's workers yet, so the spec runs them only
with ``kvoffload.tiers_without_bytes``; every spec here but one sets it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm_helpers

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.managers import TieredOffloadingManager
from kvoffload.tiers import RemoteTierError
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 9)]
MEASURE_ONLY = {"kvoffload.tiers_without_bytes": True}


def create_spec(extra: dict[str, Any], **kwargs: Any) -> Any:
    """Our spec through vLLM's factory, with the lower tiers allowed to run without bytes."""
    return vllm_helpers.create_spec({**MEASURE_ONLY, **extra}, **kwargs)


@pytest.mark.parametrize(
    "tier",
    [
        {"kvoffload.remote_url": "redis://127.0.0.1:6379/0"},
        {"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 4096},
    ],
)
def test_lower_tiers_are_refused_unless_running_without_bytes_is_asked_for(
    vllm_modules: dict[str, ModuleType], tier: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgumentError, match=r"stale KV.*kvoffload\.tiers_without_bytes"):
        vllm_helpers.create_spec({"cpu_bytes_to_use": 4096, **tier})
    with pytest.raises(InvalidArgumentError, match="must be true or false"):
        vllm_helpers.create_spec(
            {"cpu_bytes_to_use": 4096, "kvoffload.tiers_without_bytes": "yes", **tier}
        )


@pytest.fixture
def specs() -> Iterator[list[Any]]:
    """Specs a test creates, closed (their tier writes finished) even when it fails."""
    made: list[Any] = []
    yield made
    for spec in made:
        spec.close()


def _context(req_id: str, keys: list[OffloadKey]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, 16 * position)
    return context


def _lookup_until_settled(manager: Any, key: OffloadKey, context: Any) -> list[Any]:
    """Every answer to ``key``'s lookups, asking again (as vLLM's scheduler does) on RETRY."""
    from vllm.v1.kv_offload.base import LookupResult

    answers = [manager.lookup(key, context)]
    deadline = time.monotonic() + 10
    while answers[-1] is LookupResult.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        answers.append(manager.lookup(key, context))
    return answers


def _store(manager: Any, keys: list[OffloadKey], context: Any) -> None:
    output = manager.prepare_store(keys, context)
    assert output is not None and list(output.keys_to_store) == keys
    manager.complete_store(keys, context)


def test_a_second_instance_hits_what_the_first_wrote_to_the_shared_tier(
    vllm_modules: dict[str, ModuleType], valkey_server: ValkeyProcess, specs: list[Any]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    extra = {"cpu_bytes_to_use": 16 * 1024, "kvoffload.remote_url": valkey_server.url}
    first = create_spec(extra, model="shared-a")
    specs.append(first)
    writer = first.get_manager()
    assert isinstance(writer.backing, TieredOffloadingManager)
    context = _context("w", KEYS)
    assert writer.lookup(KEYS[0], context) is LookupResult.MISS
    _store(writer, KEYS, context)
    writer.on_request_finished(context)
    first.close()  # its write-through to the server has finished

    second = create_spec(extra, model="shared-a")
    other_model = create_spec(extra, model="shared-b")
    specs += [second, other_model]
    reader = second.get_manager()
    context = _context("r", KEYS)
    for key in KEYS:
        answers = _lookup_until_settled(reader, key, context)
        assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.HIT, answers
    spec = reader.prepare_load(KEYS, context)
    assert len(spec.block_ids) == len(KEYS)
    reader.complete_load(KEYS, context)
    assert reader.backing.tiers[0].stats.hit_blocks == len(KEYS)
    # Another model's blocks are never offered, though the keys are the same.
    assert other_model.get_manager().lookup(KEYS[0], _context("o", KEYS)) is LookupResult.MISS


def test_an_admission_layer_sits_over_the_tier_stack(
    vllm_modules: dict[str, ModuleType], valkey_server: ValkeyProcess, specs: list[Any]
) -> None:
    from kvoffload.admission import find_admission

    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.remote_url": valkey_server.url,
        "kvoffload.admission": "recommended",
    }
    spec = create_spec(extra, model="admission")
    specs.append(spec)
    layer = find_admission(spec.get_manager().backing)
    assert layer is not None and isinstance(layer.backing, TieredOffloadingManager)
    assert [tier.medium for tier in layer.backing.tiers] == ["REMOTE"]


def test_a_pending_store_is_hit_pending_with_a_shared_tier(
    vllm_modules: dict[str, ModuleType], valkey_server: ValkeyProcess, specs: list[Any]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    spec = create_spec(
        {"cpu_bytes_to_use": 4 * 1024, "kvoffload.remote_url": valkey_server.url},
        model="pending",
    )
    specs.append(spec)
    manager = spec.get_manager()
    context = _context("p", KEYS[:2])
    assert manager.prepare_store(KEYS[:2], context) is not None
    assert manager.lookup(KEYS[0], context) is LookupResult.HIT_PENDING
    manager.complete_store(KEYS[:2], context)
    assert manager.lookup(KEYS[0], context) is LookupResult.HIT


def test_blocks_evicted_to_the_disk_tier_come_back_through_a_retry(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, specs: list[Any]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    extra = {
        "cpu_bytes_to_use": 2 * 1024,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": 16 * 1024,
    }
    spec = create_spec(extra)
    specs.append(spec)
    assert spec.disk_blocks == 16
    manager = spec.get_manager()
    for index, pair in enumerate((KEYS[0:2], KEYS[2:4])):
        context = _context(f"s{index}", pair)
        _store(manager, pair, context)
        manager.on_request_finished(context)
    disk = manager.backing.tiers[0]
    disk.poll(wait=True)  # the evicted blocks' background writes have landed
    assert (disk.medium, disk.stats.stored_blocks) == ("DISK", 2)
    context = _context("back", KEYS[:2])
    answers = _lookup_until_settled(manager, KEYS[0], context)
    assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.HIT, answers


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kvoffload.remote_url": "bogus://x"}, "kvoffload.remote_url"),
        ({"kvoffload.remote_url": "redis://127.0.0.1:notaport/0"}, "kvoffload.remote_url"),
        ({"kvoffload.disk_dir": "/tmp/x"}, "kvoffload.disk_bytes"),
        ({"kvoffload.disk_bytes": 4096}, "kvoffload.disk_dir"),
        ({"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 10}, "kvoffload.disk_bytes"),
        ({"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": -1}, "kvoffload.disk_bytes"),
        ({"kvoffload.disk_dir": "", "kvoffload.disk_bytes": 4096}, "kvoffload.disk_dir"),
    ],
)
def test_bad_tier_settings_fail_at_start_up_naming_the_key(
    vllm_modules: dict[str, ModuleType], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        create_spec({"cpu_bytes_to_use": 4096, **extra})


def test_a_disk_dir_that_is_a_file_fails_naming_the_key(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    spec = create_spec(
        {
            "cpu_bytes_to_use": 4096,
            "kvoffload.disk_dir": str(blocker / "disk"),
            "kvoffload.disk_bytes": 4096,
        }
    )
    with pytest.raises(InvalidArgumentError, match=r"kvoffload\.disk_dir"):
        spec.get_manager()


def test_an_unreachable_server_fails_the_scheduler_start_naming_the_key(
    vllm_modules: dict[str, ModuleType], own_server: ValkeyProcess
) -> None:
    url = f"redis://127.0.0.1:{own_server.port}/0?timeout_ms=200"
    spec = create_spec({"cpu_bytes_to_use": 4096, "kvoffload.remote_url": url})
    started = time.monotonic()
    with pytest.raises(RemoteTierError, match=r"kvoffload\.remote_url.*not reachable"):
        spec.get_manager()
    assert time.monotonic() - started < 5


def test_a_wrong_password_fails_the_scheduler_start_naming_the_key(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    server = ValkeyProcess(tmp_path / "auth", password="right-one")
    server.start()
    try:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0?timeout_ms=2000"
        spec = create_spec({"cpu_bytes_to_use": 4096, "kvoffload.remote_url": url})
        with pytest.raises(RemoteTierError, match=r"kvoffload\.remote_url.*authentication"):
            spec.get_manager()
    finally:
        server.stop()
