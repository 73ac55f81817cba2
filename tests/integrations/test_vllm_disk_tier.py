"""The vLLM spec's disk tier: ``kvoffload.disk_timeout_ms`` reaches it, and what it found on
start (blocks recovered, slots dropped by reason) shows on vLLM's ``/metrics``, read from
a real slot file left by an earlier run, one of whose headers is broken."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import SPEC_CONFIG, create_spec, metrics_frontend

from kvoffload import block_id_key
from kvoffload.tiers import DiskTier

KEYS = [block_id_key(i, 3) for i in range(1, 5)]


def break_header(tier: DiskTier, key: Any) -> None:
    """Flip a byte inside ``key``'s header in the slot file: it then fails its checksum."""
    start = tier.slot_offset(key)
    assert start is not None
    with open(tier.path, "r+b") as file:
        file.seek(start + 6)
        byte = file.read(1)[0]
        file.seek(start + 6)
        file.write(bytes([byte ^ 0xFF]))


def disk_extra(tmp_path: Path, **more: Any) -> dict[str, Any]:
    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 16 * 1024}
    return extra | {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1 << 20} | more


def disk_tier(spec: Any) -> DiskTier:
    spec.get_manager()
    tier = spec._stack.disk
    assert isinstance(tier, DiskTier)
    return tier


@pytest.mark.parametrize(("given", "seconds"), [({}, 10.0), ({"timeout": 750}, 0.75)])
def test_the_disk_timeout_key_reaches_the_disk_tier(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, given: dict[str, int], seconds: float
) -> None:
    more = {"kvoffload.disk_timeout_ms": given["timeout"]} if given else {}
    spec = create_spec(disk_extra(tmp_path, **more))
    try:
        assert disk_tier(spec).deadline_s == seconds
    finally:
        spec.close()


def test_recovery_counts_reach_vllm_metrics(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    extra = disk_extra(tmp_path)
    spec = create_spec(extra)
    earlier = DiskTier(tmp_path, spec.disk_blocks, spec.fingerprint)
    earlier.write(KEYS, [bytes([i]) * spec.bytes_per_block for i in range(len(KEYS))])
    earlier.poll(wait=True)
    break_header(earlier, KEYS[0])
    earlier.close()

    frontend, registry = metrics_frontend(extra)
    manager = spec.get_manager()
    try:
        frontend.observe(manager.get_stats().data, 0)

        def gauge(name: str, **labels: str) -> float | None:
            value = registry.get_sample_value(f"vllm:kvoffload_{name}", {"engine": "0", **labels})
            return None if value is None else float(value)

        assert gauge("tier_recovered_blocks", tier="disk") == len(KEYS) - 1
        assert gauge("tier_dropped_blocks", tier="disk", reason="corrupt") == 1
        assert gauge("tier_dropped_blocks", tier="disk", reason="torn") == 0
        assert gauge("tier_dropped_blocks", tier="disk", reason="foreign") == 0
    finally:
        spec.close()


def test_without_a_disk_tier_no_recovery_gauge_is_declared(
    vllm_modules: dict[str, ModuleType],
) -> None:
    from kvoffload.integrations.vllm.spec import KVOffloadSpec

    plain = KVOffloadSpec.build_metric_definitions({"cpu_bytes_to_use": 4096})
    with_disk = KVOffloadSpec.build_metric_definitions(
        {"cpu_bytes_to_use": 4096, "kvoffload.disk_dir": "/x", "kvoffload.disk_bytes": 4096}
    )
    names = {"vllm:kvoffload_tier_recovered_blocks", "vllm:kvoffload_tier_dropped_blocks"}
    assert not names & set(plain) and names <= set(with_disk)
    assert with_disk["vllm:kvoffload_tier_dropped_blocks"].labelnames == ("tier", "reason")
