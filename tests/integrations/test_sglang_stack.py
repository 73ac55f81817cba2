"""SGLang's L3 tiers come from the stack builder (``kvoffload.tiers.stack``): the same
:class:`LowerTierConfig` the simulator's and vLLM's tiers are opened by, its checks
naming the backend's keys, its openers and admission books the ones the backend keeps."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvoffload.admission import AdmissionLayer
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.settings import parse_settings
from kvoffload.managers.stack import LowerTierConfig, StackConfig
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.tiers.slot_file import DiskTierError, footprint
from kvoffload.tiers.stack import LowerTiers, tier_opener
from tier_servers import ValkeyProcess

FINGERPRINT = bytes(range(16))


def test_a_disk_tier_reads_the_same_from_sglang_keys_and_from_a_stack_config() -> None:
    settings = parse_settings(
        {
            "kvoffload.disk_dir": "/nvme/l3",
            "kvoffload.disk_bytes": 4096,
            "kvoffload.disk_policy": "arc",
            "kvoffload.disk_admission": "recommended",
            "kvoffload.disk_write_budget": "0.25",
        }
    )
    stack = StackConfig(
        8,
        disk_dir="/nvme/l3",
        disk_blocks=16,
        disk_policy="arc",
        disk_admission="recommended",
        disk_write_budget=0.25,
    )
    assert settings.disk_tier is not None and stack.disk_tier is not None
    assert settings.remote_tier is None and stack.remote_tier is None
    sized = dataclasses.replace(
        settings.disk_tier, blocks=16, write_budget=settings.disk_write_budget.amount
    )
    assert sized == stack.disk_tier


@pytest.mark.parametrize(
    ("sglang_keys", "stack", "sglang_named", "stack_named"),
    [
        (
            {"kvoffload.remote_write_budget": "0.1"},
            {"remote_write_budget": 0.1},
            "hicache-storage-backend-extra-config 'kvoffload.remote_write_budget' needs "
            "'kvoffload.remote_admission' 'recommended'",
            "remote_write_budget needs remote_admission 'recommended'",
        ),
        (
            {"kvoffload.remote_admission": "feedback", "kvoffload.remote_write_budget": "1"},
            {"remote_admission": "feedback", "remote_write_budget": 1.0, "remote_blocks": 4},
            "'kvoffload.remote_write_budget' needs 'kvoffload.remote_admission' 'recommended'"
            " (the optimiser), not 'feedback'",
            "remote_write_budget needs remote_admission 'recommended' (the optimiser), not "
            "'feedback'",
        ),
    ],
)
def test_one_check_names_each_callers_key(
    sglang_keys: dict[str, Any], stack: dict[str, Any], sglang_named: str, stack_named: str
) -> None:
    """The rule lives in :class:`LowerTierConfig` once; each caller's error names its key."""
    url = "redis://127.0.0.1:1/0"
    extra = {"kvoffload.remote_url": url, "kvoffload.remote_bytes": 1 << 20, **sglang_keys}
    with pytest.raises(InvalidArgumentError) as from_sglang:
        parse_settings(extra)
    assert sglang_named in str(from_sglang.value)
    with pytest.raises(InvalidArgumentError) as from_stack:
        StackConfig(8, remote_url=url, **stack)
    assert stack_named in str(from_stack.value)


def test_an_opener_names_the_engines_key_only_where_it_has_one(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    settings = parse_settings({"kvoffload.disk_dir": str(blocker), "kvoffload.disk_bytes": 64})
    assert settings.disk_tier is not None
    sglang = dataclasses.replace(settings.disk_tier, blocks=4)
    with pytest.raises(DiskTierError) as named:
        tier_opener(sglang, FINGERPRINT)()
    assert str(named.value).startswith("hicache-storage-backend-extra-config 'kvoffload.disk_dir':")
    plain = StackConfig(8, disk_dir=str(blocker), disk_blocks=4).disk_tier
    assert plain is not None
    with pytest.raises(DiskTierError) as unnamed:
        tier_opener(plain, FINGERPRINT)()
    assert str(unnamed.value) in str(named.value) and "disk_dir" not in str(unnamed.value)


def test_a_size_in_pages_is_checked_when_it_is_known() -> None:
    settings = parse_settings({"kvoffload.disk_dir": "/nvme/l3", "kvoffload.disk_bytes": 64})
    assert settings.disk_tier is not None and settings.disk_tier.blocks is None
    with pytest.raises(InvalidArgumentError, match=r"'kvoffload\.disk_bytes': a disk tier"):
        dataclasses.replace(settings.disk_tier, blocks=0)
    with pytest.raises(InvalidArgumentError, match=r"'kvoffload\.disk_policy' 'bogus'"):
        LowerTierConfig("disk", "/d", 4, "bogus", names={"policy": "'kvoffload.disk_policy'"})


def test_the_backend_keeps_the_builders_openers_and_books(
    backends: Any,
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang_helpers import HostPool

    from kvoffload.integrations.sglang import storage

    built: list[LowerTiers] = []
    monkeypatch.setattr(storage, "lower_tiers", _recorder(storage.lower_tiers, built))
    pool = HostPool()
    page_bytes = len(pool.page_bytes(0))
    extra = {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(32, page_bytes) + 1,
        "kvoffload.disk_policy": "arc",
        "kvoffload.disk_admission": "sketch",
        "kvoffload.remote_url": valkey_server.url,
        "kvoffload.remote_admission": "feedback",
        "kvoffload.remote_bytes": 96 * page_bytes,
    }
    backend = backends(extra, pool, model="built")
    (tiers,) = built
    assert tiers.disk is not None and tiers.remote is not None
    disk, remote = backend.paths
    for path, parts in ((disk, tiers.disk), (remote, tiers.remote)):
        assert isinstance(parts.book, AdmissionLayer)
        assert path.layer is parts.book
        assert path._open is parts.open
    assert tiers.disk.config.blocks == 32 and tiers.remote.config.blocks == 96
    assert disk.layer.capacity == 32 and remote.layer.capacity == 96
    assert Path(tiers.disk.config.location) == tmp_path / "l3" / "dp0"
    assert disk.tier.capacity_blocks == 32 and disk.tier.path.is_relative_to(
        tmp_path / "l3" / "dp0"
    )
    assert isinstance(disk.tier.policy, ARCCachePolicy)
    assert remote.tier.fingerprint == backend.fingerprint


def _recorder(builder: Any, built: list[LowerTiers]) -> Any:
    """``builder`` as it is, each result kept in ``built``."""

    def recording(*args: Any, **kwargs: Any) -> LowerTiers:
        tiers: LowerTiers = builder(*args, **kwargs)
        built.append(tiers)
        return tiers

    return recording
