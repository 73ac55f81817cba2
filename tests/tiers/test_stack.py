"""The one builder: every part a configuration asks for has its handle, each bad setting is
refused naming its field, and tiers opened before a failure are closed again."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest

from kvoffload.admission import FeedbackAdmission, OptimisingAdmission
from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError
from kvoffload.core.tier_protocol import MAX_IO_THREADS
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager, build_manager
from kvoffload.managers.stack import LowerTierConfig, StackConfig, build_cpu_stack
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.tiers import DiskTier, RemoteTier, RemoteTierError, build_stack
from kvoffload.tiers.backlog import default_pending_bytes
from kvoffload.tiers.slot_file import DiskTierError
from tier_servers import ValkeyProcess

FINGERPRINT = bytes(range(16))


def test_a_cpu_stack_has_only_its_cpu_tier() -> None:
    stack = build_stack(StackConfig(8))
    assert isinstance(stack.cpu, CPUOffloadingManager) and stack.manager is stack.cpu
    assert stack.direct is stack.cpu
    parts = (stack.filter, stack.admission, stack.tiered, stack.disk, stack.remote)
    assert parts == (None, None, None, None, None)
    assert (stack.disk_admission, stack.remote_admission) == (None, None)


def test_the_filter_is_outermost_then_the_admission_layer_then_the_cpu_tier() -> None:
    stack = build_stack(StackConfig(8, store_threshold=2, admission="recommended"))
    assert isinstance(stack.filter, FilterReusedOffloadingManager)
    assert isinstance(stack.admission, OptimisingAdmission)
    assert stack.manager is stack.filter and stack.filter.backing is stack.admission
    assert stack.admission.backing is stack.cpu and stack.direct is stack.cpu


def test_build_manager_keeps_its_meaning_through_the_builder() -> None:
    manager = build_manager(8, "arc", 3, admission="feedback")
    assert isinstance(manager, FilterReusedOffloadingManager)
    assert isinstance(manager.backing, FeedbackAdmission)
    assert isinstance(manager.backing.backing, CPUOffloadingManager)


def test_a_disk_stack_names_its_tier_and_its_admission(tmp_path: Path) -> None:
    config = StackConfig(
        8,
        admission="feedback",
        disk_dir=str(tmp_path),
        disk_blocks=32,
        disk_admission="recommended",
        disk_write_budget=0.5,
        fingerprint=FINGERPRINT,
    )
    stack = build_stack(config)
    try:
        assert isinstance(stack.tiered, TieredOffloadingManager)
        assert isinstance(stack.disk, DiskTier) and stack.remote is None
        assert stack.tiered.tiers == [stack.disk] and stack.tiered.cpu is stack.cpu
        assert isinstance(stack.admission, FeedbackAdmission)
        assert stack.admission.backing is stack.tiered and stack.direct is stack.tiered
        layer = stack.disk_admission
        assert isinstance(layer, OptimisingAdmission)
        assert layer.capacity == 32 and layer.objective.write_budget == 0.5
        assert stack.remote_admission is None
    finally:
        stack.close()


def test_a_disk_tier_without_its_own_admission_has_no_layer(tmp_path: Path) -> None:
    stack = build_stack(
        StackConfig(8, disk_dir=str(tmp_path), disk_blocks=4, fingerprint=FINGERPRINT)
    )
    try:
        assert stack.tiered is not None and stack.tiered.admissions == [None]
        assert stack.disk_admission is None and stack.admission is None
        assert stack.manager is stack.tiered
    finally:
        stack.close()


def test_a_remote_stack_names_its_tier(valkey_server: ValkeyProcess) -> None:
    config = StackConfig(
        8,
        remote_url=valkey_server.url,
        remote_blocks=64,
        remote_admission="sketch",
        fingerprint=b"stack-remote-tst",
    )
    stack = build_stack(config)
    try:
        assert isinstance(stack.remote, RemoteTier) and stack.disk is None
        assert stack.remote_admission is not None and stack.remote_admission.capacity == 64
    finally:
        stack.close()


def test_each_tier_takes_its_write_backlog_bound(
    tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """``disk_max_pending_write_bytes`` / ``remote_max_pending_write_bytes`` reach the tiers
    the stack opens (they could be set on a tier opened by hand only); unset, each tier
    keeps its default."""
    config = StackConfig(
        8,
        disk_dir=str(tmp_path / "bound"),
        disk_blocks=4,
        disk_max_pending_write_bytes=3000,
        remote_url=valkey_server.url,
        remote_max_pending_write_bytes=5000,
        fingerprint=b"stack-backlog-ts",
    )
    for fields, disk_bound, remote_bound in (
        ({}, 3000, 5000),
        (
            {"disk_max_pending_write_bytes": None, "remote_max_pending_write_bytes": None},
            default_pending_bytes(2),
            default_pending_bytes(2),
        ),
    ):
        stack = build_stack(dataclasses.replace(config, **fields))
        try:
            assert isinstance(stack.disk, DiskTier) and isinstance(stack.remote, RemoteTier)
            assert stack.disk.max_pending_write_bytes == disk_bound
            assert stack.remote.max_pending_write_bytes == remote_bound
        finally:
            stack.close()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"cpu_blocks": 0}, "cpu_blocks"),
        ({"store_threshold": 1.5}, "store_threshold"),
        ({"tier_store_threshold": -1}, "tier_store_threshold"),
        ({"max_tracker_size": 0}, "max_tracker_size"),
        ({"enable_events": "no"}, "enable_events"),
        ({"wait_for_tiers": 1}, "wait_for_tiers"),
        ({"admission": "bogus"}, "admission"),
        ({"write_budget": 0.5}, "write_budget"),
        ({"disk_dir": "d", "disk_blocks": 0}, "disk_blocks"),
        ({"disk_admission": "recommended"}, "disk_admission"),
        ({"disk_dir": "d", "disk_blocks": 4, "disk_policy": ""}, "disk_policy"),  # was "lru"
        ({"disk_dir": "d", "disk_blocks": 4, "disk_policy": 0}, "disk_policy"),
        ({"disk_dir": "d", "disk_blocks": 4, "disk_admission": "nope"}, "disk_admission"),
        (
            {
                "disk_dir": "d",
                "disk_blocks": 4,
                "disk_admission": "feedback",
                "disk_write_budget": 1,
            },
            "disk_write_budget",
        ),
        (
            {
                "disk_dir": "d",
                "disk_blocks": 4,
                "disk_admission": "recommended",
                "disk_write_budget": -1,
            },
            "disk_write_budget",
        ),
        ({"remote_url": "redis://h:1", "remote_admission": "recommended"}, "remote_blocks"),
        ({"remote_admission": "recommended", "remote_blocks": 4}, "remote_admission"),
        ({"disk_max_pending_write_bytes": 1 << 20}, "disk_max_pending_write_bytes needs a disk"),
        ({"disk_policy": "arc"}, r"^disk_policy needs a disk tier \(disk_dir\)$"),
        ({"disk_deadline_s": 0.5}, r"^disk_deadline_s needs a disk tier \(disk_dir\)$"),
        ({"disk_blocks": 4}, r"^disk_blocks needs a disk tier \(disk_dir\)$"),
        ({"disk_dir": "d", "remote_blocks": 4}, r"^remote_blocks needs a shared tier"),
        ({"disk_write_budget": 0.0}, r"^disk_write_budget needs a disk tier \(disk_dir\)$"),
        ({"remote_url": "redis://h:1", "disk_policy": "arc"}, "disk_policy needs a disk"),
        (
            {"remote_max_pending_write_bytes": 1 << 20},
            "remote_max_pending_write_bytes needs a shared",
        ),
        (
            {"disk_dir": "d", "disk_blocks": 4, "disk_max_pending_write_bytes": 0},
            "disk_max_pending_write_bytes must be an integer >= 1",
        ),
        (
            {"disk_dir": "d", "disk_blocks": 4, "disk_max_pending_write_bytes": True},
            "disk_max_pending_write_bytes must be an integer >= 1",
        ),
        (
            {"remote_url": "redis://h:1", "remote_max_pending_write_bytes": 1.5},
            "remote_max_pending_write_bytes must be an integer >= 1",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(fields: dict[str, Any], named: str) -> None:
    values: dict[str, Any] = {"cpu_blocks": 8, **fields}
    with pytest.raises(InvalidArgumentError, match=named):
        StackConfig(**values)


@pytest.mark.parametrize("io_threads", [0, True, 2.0, MAX_IO_THREADS + 1])
def test_a_tier_s_io_threads_are_refused_past_the_bound_naming_the_key(io_threads: Any) -> None:
    """Each thread is started when the tier opens: 10**6 started threads until the system
    refused one, and left those running."""
    with pytest.raises(InvalidArgumentError, match=r"^disk\.io_threads must be an integer"):
        LowerTierConfig(
            "disk", "d", 4, io_threads=io_threads, names={"io_threads": "disk.io_threads"}
        )


@pytest.mark.parametrize("deadline_s", [0, 0.0005, 1e-300, 600.5, float("nan"), True])
def test_a_deadline_outside_1_ms_to_10_minutes_is_refused(deadline_s: Any) -> None:
    """Below a millisecond every I/O job would miss its deadline and count as failed."""
    with pytest.raises(InvalidArgumentError, match=r"^deadline_s must be from 0\.001 s to 600 s"):
        LowerTierConfig("disk", "d", 4, deadline_s=deadline_s)
    assert LowerTierConfig("disk", "d", 4, deadline_s=0.001).deadline_s == 0.001


@pytest.mark.parametrize("policy", ["bogus", ["lru"], None])
@pytest.mark.parametrize("tiers", [{}, {"disk_dir": "d", "disk_blocks": 4}])
def test_a_bad_policy_is_refused_on_construction_naming_policy(
    policy: Any, tiers: dict[str, Any]
) -> None:
    """Not later, at the build, nor as the disk tier's ``disk_policy`` (which it only
    defaults), nor as a ``TypeError`` for a value that cannot be a dict key."""
    with pytest.raises(InvalidArgumentError) as error:
        StackConfig(8, policy=policy, **tiers)
    assert str(error.value).startswith(f"policy {policy!r} is not one of arc, lru")


def test_the_cpu_only_builder_refuses_lower_tiers(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="build_stack"):
        build_cpu_stack(StackConfig(8, disk_dir=str(tmp_path), disk_blocks=4))


def _refused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_tier_that_fails_to_open_closes_the_ones_opened_before(tmp_path: Path) -> None:
    """The shared tier cannot connect: the disk tier opened first releases its directory,
    which a second tier on it could not take while it stayed open."""
    url = f"redis://127.0.0.1:{_refused_port()}/0?timeout_ms=100"
    config = StackConfig(
        8, disk_dir=str(tmp_path), disk_blocks=4, remote_url=url, fingerprint=FINGERPRINT
    )
    with pytest.raises(RemoteTierError):
        build_stack(config)
    held = DiskTier(tmp_path, 4, FINGERPRINT)  # free again: the failed build closed its tier
    try:
        with pytest.raises(DiskTierError, match="in use"):
            DiskTier(tmp_path, 4, FINGERPRINT)  # and an open tier does hold it
    finally:
        held.close()


@pytest.mark.parametrize("disk", [False, True])
def test_a_cpu_size_whose_admission_memory_the_machine_lacks_names_its_key(
    tmp_path: Path, disk: bool
) -> None:
    """As a lower tier's book names its size's key; with a disk tier, the tier opened before
    the CPU tier's layer is closed again (its directory free)."""
    tiers: dict[str, Any] = {"disk_dir": str(tmp_path), "disk_blocks": 4} if disk else {}
    config = StackConfig(
        10**30,
        admission="sketch",
        fingerprint=FINGERPRINT,
        size_keys={"cpu_blocks": "cpu_gib"},
        **tiers,
    )
    with pytest.raises(InsufficientMemoryError, match=r"^cpu_gib: an admission frequency sketch"):
        build_stack(config)
    DiskTier(tmp_path, 4, FINGERPRINT).close()


def test_a_disk_size_whose_admission_memory_the_machine_lacks_names_its_key(
    tmp_path: Path,
) -> None:
    """The tiered manager builds a lower tier's book from its settings (not ``tier_book``): it
    named no key, and the tier opened before it stays usable once closed."""
    config = StackConfig(
        8,
        fingerprint=FINGERPRINT,
        disk_dir=str(tmp_path),
        disk_blocks=10**14,
        disk_admission="sketch",
    )
    with pytest.raises(InsufficientMemoryError, match=r"^disk_blocks: an admission frequency"):
        build_stack(config)
    DiskTier(tmp_path, 4, FINGERPRINT).close()
