"""The spec's per-tier admission keys: each lower tier behind its own layer, built by the
package's one builder; a bad key or value stops start-up naming it."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm_helpers

from kvoffload import InvalidArgumentError
from kvoffload.admission import OptimisingAdmission, WriteBudget
from kvoffload.admission.budget import BYTES_PER_S, DWPD, PER_REF

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


@pytest.mark.parametrize(
    ("budget", "unit"),
    [(0.25, PER_REF), ("0.25", PER_REF), ("20kB/s", BYTES_PER_S), ("2dwpd", DWPD)],
)
def test_a_tier_s_write_budget_takes_what_the_cpu_tier_s_takes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, budget: str | float, unit: str
) -> None:
    """``kvoffload.disk_write_budget`` / ``kvoffload.remote_write_budget`` take the numbers
    and strings ``kvoffload.write_budget`` takes, in the spec's block size; drive writes per
    day count against the tier's size (they took a number only)."""
    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.disk_write_budget": budget,
        "kvoffload.remote_url": "redis://127.0.0.1:1/0",  # never asked: no stack is built
        "kvoffload.remote_admission": "recommended",
        "kvoffload.remote_bytes": 1 << 30,
        "kvoffload.remote_write_budget": budget,
    }
    spec = create_spec(extra, model="tier-budgets")
    config = spec.stack_config(events=False)
    for sized, size in ((config.disk_write_budget, 1 << 20), (config.remote_write_budget, 1 << 30)):
        assert isinstance(sized, WriteBudget) and sized.unit == unit
        assert sized.block_bytes == spec.bytes_per_block
        if unit == DWPD:
            assert sized.bytes_per_second() == pytest.approx(2 * size / 86_400)
        elif unit == PER_REF:
            assert sized.amount == 0.25


def test_a_string_write_budget_reaches_the_disk_tier_s_optimiser(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.disk_write_budget": "20kB/s",
    }
    spec = create_spec(extra, model="tier-budget-rate")
    try:
        spec.get_manager()
        layer = spec._stack.disk_admission
        assert isinstance(layer, OptimisingAdmission) and layer.write_credit is not None
        assert layer.write_credit.budget.blocks_per_second() == pytest.approx(
            20_000 / spec.bytes_per_block
        )
    finally:
        spec.close()


@pytest.mark.parametrize(
    ("key", "budget", "message"),
    [
        ("kvoffload.disk_write_budget", "lots", "write budget: expected"),
        ("kvoffload.disk_write_budget", True, "must be a number or a string"),
        ("kvoffload.remote_write_budget", "-1MB/s", "write budget: must"),
        ("kvoffload.remote_write_budget", "1e300TB/s", "finite rate"),
        ("kvoffload.disk_write_budget", "1e303dwpd", "more bytes a day than a float holds"),
        ("kvoffload.remote_write_budget", "1e300dwpd", "more bytes a day than a float holds"),
    ],
)
def test_a_bad_tier_write_budget_is_refused_naming_its_key(
    vllm_modules: dict[str, ModuleType], key: str, budget: object, message: str
) -> None:
    extra = {
        "cpu_bytes_to_use": 4096,
        "kvoffload.disk_dir": "/tmp/x",
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.remote_url": "redis://127.0.0.1:1/0",
        "kvoffload.remote_admission": "recommended",
        "kvoffload.remote_bytes": 1 << 30,
        key: budget,
    }
    with pytest.raises(InvalidArgumentError, match=f"'{re.escape(key)}': .*{message}"):
        create_spec(extra)


def test_the_drive_key_sizes_the_disk_tier_s_drive_writes_per_day(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """``kvoffload.drive_bytes`` is the drive of the disk tier's budget too, as the
    simulator's ``--drive-bytes`` (it was refused without ``kvoffload.write_budget``)."""
    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.disk_write_budget": "2dwpd",
        "kvoffload.drive_bytes": "1.92TB",
    }
    sized = create_spec(extra).stack_config(events=False).disk_write_budget
    assert isinstance(sized, WriteBudget)
    assert sized.bytes_per_second() == pytest.approx(2 * 1.92e12 / 86_400)


def test_each_lower_tier_s_rule_takes_its_parameters_as_the_cpu_tier_s_does(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """``kvoffload.disk_admission_params`` / ``kvoffload.remote_admission_params`` set a
    lower tier's rule as ``kvoffload.admission_params`` sets the CPU tier's (a mapping or
    JSON text of one): before them a lower tier's rule ran on its defaults, whatever the
    operator meant."""
    extra = {
        "cpu_bytes_to_use": 16 * 1024,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
        "kvoffload.disk_admission": "recommended",
        "kvoffload.disk_admission_params": {"filter_threshold": 3, "hit_tolerance": "0.01"},
        "kvoffload.remote_url": "redis://127.0.0.1:1/0",  # never asked: no stack is built
        "kvoffload.remote_admission": "sketch",
        "kvoffload.remote_bytes": 1 << 30,
        "kvoffload.remote_admission_params": '{"threshold": 4.0}',
    }
    spec = create_spec(extra, model="tier-params")
    config = spec.stack_config(events=False)
    assert config.disk_tier is not None and config.remote_tier is not None
    assert dict(config.disk_tier.admission_params) == {  # type: ignore[call-overload]
        "filter_threshold": 3,
        "hit_tolerance": "0.01",
    }
    assert dict(config.remote_tier.admission_params) == {"threshold": 4.0}  # type: ignore[call-overload]
    del extra["kvoffload.remote_url"], extra["kvoffload.remote_admission"]
    del extra["kvoffload.remote_bytes"], extra["kvoffload.remote_admission_params"]
    spec = create_spec(extra, model="tier-params-disk")
    try:
        spec.get_manager()
        assert spec._stack is not None
        layer = spec._stack.disk_admission
        assert isinstance(layer, OptimisingAdmission)
        assert layer.filter.store_threshold == 3 and layer.objective.hit_tolerance == 0.01
    finally:
        spec.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"kvoffload.disk_admission": "sketch", "kvoffload.disk_admission_params": {"x": 1}},
            r"'kvoffload\.disk_admission_params': unknown admission parameter 'x' for "
            r"'sketch'; valid: min_sample, sample_factor, threshold$",
        ),
        (
            {"kvoffload.disk_admission_params": {"threshold": 3}},
            r"'kvoffload\.disk_admission_params': admission 'none' takes no parameters",
        ),
        (
            {
                "kvoffload.disk_admission": "sketch",
                "kvoffload.disk_admission_params": '{"threshold": 2.5}',
            },
            r"'kvoffload\.disk_admission_params': .*'threshold' of 'sketch' must be an integer",
        ),
        (
            {"kvoffload.remote_admission_params": {"threshold": 3}},
            r"'kvoffload\.remote_admission_params' needs the remote tier",
        ),
    ],
)
def test_a_bad_tier_admission_parameter_is_refused_naming_its_key(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    disk = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1 << 20}
    with pytest.raises(InvalidArgumentError, match=message):
        create_spec({"cpu_bytes_to_use": 16 * 1024, **disk, **extra})
