"""The default of every ``kv_connector_extra_config`` key the spec reads, as documented.

A key added to the spec without a pinned default fails here; vLLM's own keys
must default as vLLM's CPU offloading does, so that switching a deployment's
``spec_name`` to ours changes nothing the user did not write.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
from vllm_helpers import offloading_config

from kvoffload import InvalidArgumentError
from kvoffload.integrations.vllm.settings import (
    OWN_KEYS,
    SPEC_KEYS,
    SpecSettings,
    parse_settings,
)

REQUIRED = {"cpu_bytes_to_use"}

DOCUMENTED = {
    "eviction_policy": ("eviction_policy", "lru"),
    "store_threshold": ("store_threshold", 0),
    "max_tracker_size": ("max_tracker_size", 64_000),
    "kvoffload.admission": ("admission", "none"),
    "kvoffload.admission_params": ("admission_params", ()),
    "kvoffload.remote_url": ("remote_url", None),
    "kvoffload.disk_dir": ("disk_dir", None),
    "kvoffload.disk_bytes": ("disk_bytes", 0),
    "kvoffload.disk_admission": ("disk_admission", "none"),
    "kvoffload.disk_admission_params": ("disk_admission_params", ()),
    "kvoffload.disk_write_budget": ("disk_write_budget", None),
    "kvoffload.remote_admission": ("remote_admission", "none"),
    "kvoffload.remote_admission_params": ("remote_admission_params", ()),
    "kvoffload.remote_write_budget": ("remote_write_budget", None),
    "kvoffload.remote_bytes": ("remote_bytes", 0),
    "kvoffload.disk_timeout_ms": ("disk_timeout_ms", 10_000.0),
    "kvoffload.disk_max_pending_write_bytes": ("disk_max_pending_write_bytes", None),
    "kvoffload.remote_max_pending_write_bytes": ("remote_max_pending_write_bytes", None),
    "kvoffload.write_budget": ("write_budget", None),
    "kvoffload.drive_bytes": ("drive_bytes", None),
}
"""Key -> (settings field, default), as the documentation's table of keys gives them."""


def test_every_key_has_a_pinned_default_or_is_required() -> None:
    assert set(DOCUMENTED) | REQUIRED == SPEC_KEYS | OWN_KEYS
    fields = {field.name for field in dataclasses.fields(SpecSettings)}
    assert {name for name, _ in DOCUMENTED.values()} | REQUIRED == fields


def test_parsed_defaults_are_the_documented_ones() -> None:
    settings = parse_settings({"cpu_bytes_to_use": 4096})
    parsed = {key: getattr(settings, name) for key, (name, _) in DOCUMENTED.items()}
    assert parsed == {key: default for key, (_, default) in DOCUMENTED.items()}
    assert not settings.has_lower_tiers
    with pytest.raises(InvalidArgumentError, match="needs 'cpu_bytes_to_use'"):
        parse_settings({})


def test_vllms_keys_default_as_vllms_cpu_offloading(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    theirs = CPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20}))
    manager = theirs.get_manager()
    vllm_defaults = {
        "eviction_policy": theirs.eviction_policy,
        "store_threshold": manager.store_threshold,
        "max_tracker_size": manager.max_tracker_size,
    }
    assert vllm_defaults == {key: DOCUMENTED[key][1] for key in SPEC_KEYS - REQUIRED}
