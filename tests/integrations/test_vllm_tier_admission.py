"""The spec's per-tier admission keys: each lower tier behind its own layer, built by the
package's one builder; a bad key or value stops start-up naming it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm_helpers

from kvoffload import InvalidArgumentError
from kvoffload.admission import OptimisingAdmission

create_spec = vllm_helpers.create_spec


def test_the_disk_tier_gets_its_own_optimiser_and_budget(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.disk_write_budget": 0.25,
    }
    spec = create_spec(extra, model="tier-admission")
    try:
        spec.get_manager()
        stack = spec._stack
        assert stack is not None and stack.admission is None and stack.disk is not None
        layer = stack.disk_admission
        assert isinstance(layer, OptimisingAdmission) and layer.objective.write_budget == 0.25
        assert layer.capacity == spec.disk_blocks
        disk_info = [series for series in spec.config_info() if series["tier"] == "disk"]
        assert disk_info[0]["admission"] == "recommended"
    finally:
        spec.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kvoffload.disk_admission": "recommended"}, "kvoffload.disk_admission"),
        ({"kvoffload.remote_admission": "bogus"}, "kvoffload.remote_admission"),
        ({"kvoffload.disk_write_budget": 0.1}, "kvoffload.disk_write_budget"),
        (
            {
                "kvoffload.remote_url": "redis://127.0.0.1:1/0",
                "kvoffload.remote_admission": "feedback",
            },
            "kvoffload.remote_bytes",
        ),
        (
            {
                "kvoffload.disk_dir": "/tmp/x",
                "kvoffload.disk_bytes": 4096,
                "kvoffload.disk_admission": "feedback",
                "kvoffload.disk_write_budget": 0.1,
            },
            "kvoffload.disk_write_budget",
        ),
        (
            {
                "kvoffload.disk_dir": "/tmp/x",
                "kvoffload.disk_bytes": 4096,
                "kvoffload.disk_admission": "recommended",
                "kvoffload.disk_write_budget": -1,
            },
            "kvoffload.disk_write_budget",
        ),
    ],
)
def test_a_bad_tier_admission_key_is_refused_by_name(
    vllm_modules: dict[str, ModuleType], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=named.replace(".", r"\.")):
        create_spec({"cpu_bytes_to_use": 4096, **extra})
