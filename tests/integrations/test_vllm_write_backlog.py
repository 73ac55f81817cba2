"""The spec's write backlog keys: ``kvoffload.disk_max_pending_write_bytes`` and
``kvoffload.remote_max_pending_write_bytes`` bound the bytes each lower tier may have
queued (a write offered past it is dropped, counted); a bad value, or one without its
tier, stops start-up naming the key."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import SPEC_CONFIG, create_spec

from kvoffload import InvalidArgumentError
from kvoffload.integrations.vllm.settings import parse_settings
from kvoffload.tiers import DiskTier, RemoteTier
from kvoffload.tiers.backlog import default_pending_bytes
from tier_servers import ValkeyProcess

DISK = "kvoffload.disk_max_pending_write_bytes"
REMOTE = "kvoffload.remote_max_pending_write_bytes"


def tiers_extra(tmp_path: Path, url: str, **more: Any) -> dict[str, Any]:
    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 16 * 1024, "kvoffload.remote_url": url}
    return extra | {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1 << 20} | more


@pytest.mark.parametrize(
    ("given", "disk_bound", "remote_bound"),
    [
        ({}, default_pending_bytes(2), default_pending_bytes(2)),
        ({DISK: "3MiB", REMOTE: 5000}, 3 * 2**20, 5000),
        ({DISK: 64e6, REMOTE: "1GB"}, 64 * 10**6, 10**9),
    ],
)
def test_the_backlog_keys_reach_the_tiers(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    given: dict[str, Any],
    disk_bound: int,
    remote_bound: int,
) -> None:
    spec = create_spec(tiers_extra(tmp_path, valkey_server.url, **given))
    try:
        spec.get_manager()
        disk, remote = spec._stack.disk, spec._stack.remote
        assert isinstance(disk, DiskTier) and isinstance(remote, RemoteTier)
        assert disk.max_pending_write_bytes == disk_bound
        assert remote.max_pending_write_bytes == remote_bound
    finally:
        spec.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({DISK: 1 << 20}, f"'{DISK}' needs the disk tier ('kvoffload.disk_dir' and"),
        ({REMOTE: 1 << 20}, f"'{REMOTE}' needs the remote tier ('kvoffload.remote_url')"),
        ({"kvoffload.disk_dir": "/tmp/x", DISK: 0}, f"'{DISK}': must be >= 1 byte, got 0"),
        ({"kvoffload.remote_url": "redis://h:1", REMOTE: "lots"}, f"'{REMOTE}': must be a number"),
        ({"kvoffload.disk_dir": "/tmp/x", DISK: True}, f"'{DISK}': must be a number of bytes"),
        ({"kvoffload.disk_dir": "/tmp/x", DISK: None}, f"'{DISK}': must be a number of bytes"),
        ({"kvoffload.disk_dir": "/tmp/x", DISK: "-1MiB"}, f"'{DISK}': must be >= 1 byte"),
    ],
)
def test_a_bad_backlog_key_is_one_error_naming_it(extra: dict[str, Any], message: str) -> None:
    config = {"cpu_bytes_to_use": 4096, **extra}
    if "kvoffload.disk_dir" in extra:
        config["kvoffload.disk_bytes"] = 1 << 20
    with pytest.raises(InvalidArgumentError) as error:
        parse_settings(config)
    assert str(error.value).startswith(f"kv_connector_extra_config {message}")
