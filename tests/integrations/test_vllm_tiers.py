"""The spec's lower tiers at start-up and on the scheduler side: settings, errors, layers.

Blocks moving through them with their bytes: ``test_vllm_tier_bytes.py``.
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
from kvoffload.managers import TieredOffloadingManager
from kvoffload.tiers import RemoteTierError
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 9)]
create_spec = vllm_helpers.create_spec


def test_the_former_measure_only_key_is_an_unknown_key(
    vllm_modules: dict[str, ModuleType],
) -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown.*'kvoffload\.tiers_without_bytes'"):
        create_spec(
            {
                "cpu_bytes_to_use": 4096,
                "kvoffload.disk_dir": "/tmp/x",
                "kvoffload.disk_bytes": 4096,
                "kvoffload.tiers_without_bytes": True,
            }
        )


@pytest.fixture
def specs() -> Iterator[list[Any]]:
    """Specs a test creates, closed (their tier writes finished) even when it fails."""
    made: list[Any] = []
    yield made
    for spec in made:
        spec.close()


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
    context = vllm_helpers.request_context("p", KEYS[:2])
    assert manager.prepare_store(KEYS[:2], context) is not None
    assert manager.lookup(KEYS[0], context) is LookupResult.HIT_PENDING
    manager.complete_store(KEYS[:2], context)
    assert manager.lookup(KEYS[0], context) is LookupResult.HIT


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
            "kvoffload.disk_bytes": 1 << 20,
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
