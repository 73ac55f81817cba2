"""Admission parameters from vLLM's and SGLang's extra-config, and the request boundaries
their adapters announce to the admission layer."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import create_spec

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.admission import AdmissionLayer, FeedbackAdmission, SketchAdmission
from kvoffload.core.keys import OffloadKey
from kvoffload.integrations.sglang.settings import parse_settings as parse_sglang
from kvoffload.integrations.vllm.secondary_settings import parse_disk_settings
from kvoffload.integrations.vllm.settings import parse_settings as parse_vllm


def record(layer: AdmissionLayer) -> list[tuple[str, list[OffloadKey], dict[str, Any]]]:
    """Every ``begin_request`` / ``end_request`` the layer gets, in order."""
    calls: list[tuple[str, list[OffloadKey], dict[str, Any]]] = []
    begin, end = layer.begin_request, layer.end_request

    def begin_request(keys: Sequence[OffloadKey], **kwargs: Any) -> None:
        calls.append(("begin", list(keys), kwargs))
        begin(keys, **kwargs)

    def end_request(keys: Sequence[OffloadKey]) -> None:
        calls.append(("end", list(keys), {}))
        end(keys)

    layer.begin_request = begin_request  # type: ignore[method-assign]
    layer.end_request = end_request  # type: ignore[method-assign]
    return calls


def test_vllm_extra_config_sets_the_rules_parameters(tmp_path: Path, vllm_modules: Any) -> None:
    base = {"cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "feedback"}
    as_json = {**base, "kvoffload.admission_params": '{"threshold": 0.25, "root_groups": 8}'}
    assert parse_vllm(as_json).admission_params == (("root_groups", 8), ("threshold", 0.25))
    tiered = {
        **base,
        "kvoffload.admission_params": {"threshold": "0.25"},
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": 64 * 1024,
    }
    for extra in (as_json, tiered):
        spec = create_spec(extra)
        layer = spec.get_manager()._layer
        assert isinstance(layer, FeedbackAdmission)
        assert layer.controller.threshold == 0.25
        spec.get_manager().shutdown()
    for bad, message in (
        ({"thresold": 0.3}, "unknown admission parameter 'thresold' for 'feedback'; valid: "),
        ({"threshold": 2}, "'threshold' of 'feedback' must be in"),
        ("threshold=0.3", "must be a JSON object"),
    ):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)) as error:
            parse_vllm({**base, "kvoffload.admission_params": bad})
        assert "'kvoffload.admission_params'" in str(error.value)


def test_vllm_secondary_tier_entries_take_admission_params(tmp_path: Path) -> None:
    entry = {
        "disk_dir": str(tmp_path),
        "disk_bytes": 4096,
        "admission": "sketch",
        "admission_params": {"threshold": 3},
    }
    assert parse_disk_settings("KVOffloadDiskTier", entry).admission_params == (("threshold", 3),)
    with pytest.raises(InvalidArgumentError, match="'KVOffloadDiskTier' key 'admission_params'"):
        parse_disk_settings("KVOffloadDiskTier", {**entry, "admission_params": {"x": 1}})


def test_sglang_extra_config_sets_each_tiers_parameters() -> None:
    config = {
        "kvoffload.disk_dir": "/tmp/x",
        "kvoffload.disk_bytes": 4096,
        "kvoffload.disk_admission": "sketch",
        "kvoffload.disk_admission_params": '{"threshold": 4}',
    }
    assert parse_sglang(config).disk_admission_params == (("threshold", 4),)
    assert parse_sglang(config).remote_admission_params == ()
    with pytest.raises(InvalidArgumentError) as error:
        parse_sglang({**config, "kvoffload.disk_admission_params": {"treshold": 4}})
    message = str(error.value)
    assert "'kvoffload.disk_admission_params'" in message and "'treshold'" in message
    assert "valid: min_sample, sample_factor, threshold" in message
    with pytest.raises(InvalidArgumentError, match="'none' takes no parameters"):
        parse_sglang({**config, "kvoffload.disk_admission": "none"})


def _context(req_id: str, keys: list[bytes]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, 16 * position)
    return context


def test_the_vllm_adapter_begins_and_ends_every_request(vllm_modules: Any) -> None:
    manager = create_spec({"cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "sketch"})
    manager = manager.get_manager()
    calls = record(manager._layer)
    keys = [block_id_key(i) for i in range(4)]
    stores = _context("stores", keys)
    manager.on_new_request(stores)
    manager.lookup(keys[0], stores)
    manager.prepare_store(keys, stores)
    manager.on_request_finished(stores)
    assert [(name, got) for name, got, _ in calls] == [("begin", keys), ("end", keys)]
    assert calls[0][2] == {"will_offer": True, "tier_hit": False, "gpu_held": 0, "counted": 0}
    calls.clear()
    looks = _context("looks", keys[:2])
    manager.on_new_request(looks)
    manager.lookup(keys[0], looks)  # no offer: shown to the layer when it finishes
    manager.on_request_finished(looks)
    assert [(name, got) for name, got, _ in calls] == [("begin", keys[:1]), ("end", keys[:1])]
    assert calls[0][2]["will_offer"] is False
    calls.clear()
    # The GPU holds the first two blocks: vLLM looks up from the third; the adapter shows
    # the whole request, the GPU-held prefix first, from the positions vLLM recorded.
    behind_gpu = _context("behind the GPU", keys)
    manager.on_new_request(behind_gpu)
    manager.lookup(keys[2], behind_gpu)
    manager.prepare_store(keys[2:], behind_gpu)
    manager.on_request_finished(behind_gpu)
    assert [(name, got) for name, got, _ in calls] == [("begin", keys), ("end", keys)]
    assert calls[0][2] == {"will_offer": True, "tier_hit": False, "gpu_held": 2, "counted": 0}
    calls.clear()
    # The GPU holds all of it: no lookup, no offer, still one sighting of every block.
    all_on_gpu = _context("all on the GPU", keys)
    manager.on_new_request(all_on_gpu)
    manager.on_request_finished(all_on_gpu)
    assert [(name, got) for name, got, _ in calls] == [("begin", keys), ("end", keys)]
    assert calls[0][2] == {"will_offer": False, "tier_hit": False, "gpu_held": 4, "counted": 0}


def test_the_sglang_backend_begins_at_the_lookup_and_ends_at_the_offer(
    backends: Any, tmp_path: Path
) -> None:
    from sglang_helpers import HostPool, page_hash

    from kvoffload.integrations.sglang.storage import page_key

    pool = HostPool()
    extra = {
        "interface_v1": 1,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": 64 * len(pool.page_bytes(0)),
        "kvoffload.disk_admission": "sketch",
        "kvoffload.disk_admission_params": {"threshold": 1},
    }
    backend = backends(extra, pool, model="boundaries")
    layer = backend.paths[0].layer
    assert isinstance(layer, SketchAdmission) and layer.threshold == 1
    calls = record(layer)
    keys = [page_hash(i) for i in range(3)]
    pool.fill([0, 1, 2], seed=1)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, pool.indices([0, 1, 2])) == [True] * 3
    ours = [page_key(key) for key in keys]
    assert [(name, got) for name, got, _ in calls] == [("begin", ours), ("end", ours)]
    assert backend.get_stats().kvoffload["disk"]["stores_completed"] == 3  # threshold 1
