"""The disk tier's size with several ranks, and ``reset_cache`` per tier.

vLLM's ``reset_prefix_cache(reset_connector=True)`` reaches the manager's
``reset_cache``: the CPU tier and the local disk tier are this engine's and
are emptied; a shared tier holds other engines' blocks too and keeps them.
Until vLLM's ``on_reset_flushed`` (the workers have reported every job in
flight at the reset) no promotion may fill a slot the reset freed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import Instance, lookup_until_settled, request_context
from vllm_scheduler import connector_scheduler

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.tiers.slot_file import SUPER_BYTES, slot_start, slot_stride
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

KEYS = [block_id_key(i) for i in range(1, 13)]
BLOCK_BYTES = 2 * 256
"""Per rank: two KV tensors of 256-byte pages (the ``Instance`` default)."""


def _store_in_pairs(instance: Instance, keys: list[Any], settle: bool = False) -> None:
    """Store ``keys`` two at a time from GPU blocks 0-1, each request finished: with a
    2-block CPU tier every pair but the last is written back to the disk tier.

    ``settle`` waits for each pair's disk writes before the next pair, so that a full
    disk tier always has a written slot to evict: on a loaded machine a write still in
    flight cannot be evicted and the next write-back would be refused.
    """
    for index in range(0, len(keys), 2):
        pair = keys[index : index + 2]
        context = request_context(f"s{index}", pair)
        instance.store(pair, [0, 1], context)
        instance.manager.on_request_finished(context)
        if settle:
            instance.manager.backing.tiers[0].poll(wait=True)


def _disk(tmp_path: Path, world_size: int, disk_bytes: int) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 2 * BLOCK_BYTES * world_size,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": disk_bytes,
    }


def test_with_two_ranks_the_disk_tier_stays_within_disk_bytes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    world_size, page_bytes = 2, 4096  # blocks larger than a disk page: slots of 5 pages
    rank_bytes = 2 * page_bytes
    stride = slot_stride(world_size * rank_bytes)
    assert stride > slot_stride(rank_bytes)
    disk_bytes = slot_start(4, stride) + stride // 2  # room for four blocks, not five
    extra = {
        "cpu_bytes_to_use": 2 * rank_bytes * world_size,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": disk_bytes,
    }
    instance = instances(extra, world_size=world_size, page_bytes=page_bytes)
    disk = instance.manager.backing.tiers[0]
    assert disk.capacity_blocks == 4
    _store_in_pairs(instance, KEYS[:12], settle=True)  # ten written back, into four slots
    assert (disk.stats.stored_blocks, disk.stats.failed, disk.stats.rejected) == (10, 0, 0)
    assert len(disk) == 4
    assert disk.path.stat().st_size <= disk_bytes
    assert instance.scheduler.config_info()[1]["size_bytes"] <= disk_bytes


def test_a_disk_too_small_for_its_superblock_and_one_slot_is_refused(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    from vllm_helpers import create_spec

    too_small = SUPER_BYTES + slot_stride(BLOCK_BYTES) - 1
    with pytest.raises(InvalidArgumentError, match=r"kvoffload\.disk_bytes.*disk slot takes"):
        create_spec(_disk(tmp_path, 1, too_small), bytes_per_block=BLOCK_BYTES)


def test_reset_empties_the_local_disk_tier(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    extra = _disk(tmp_path, 1, slot_start(16, slot_stride(BLOCK_BYTES)))
    instance = instances(extra)
    _store_in_pairs(instance, KEYS[:4])
    disk = instance.manager.backing.tiers[0]
    disk.poll(wait=True)
    assert disk.present(KEYS[:2]) == 2
    # vLLM's own scheduler class resets (no job in flight, so it reports the flush at once).
    connector_scheduler(instance.scheduler).reset_cache()
    context = request_context("after", KEYS[:4])
    for key in KEYS[:4]:
        assert lookup_until_settled(instance.manager, key, context) == [LookupResult.MISS]
    assert instance.manager.backing.tiers[0].present(KEYS[:2]) == 0
    # The tier works on after the reset, and a restart finds only what came after it.
    _store_in_pairs(instance, KEYS[4:8])
    instance.scheduler.close()
    restarted = instances(extra)
    lower = restarted.manager.backing.tiers[0]
    assert (lower.present(KEYS[:2]), lower.present(KEYS[4:6])) == (0, 2)


def test_reset_empties_the_tiers_own_file_never_one_a_planted_link_leads_to(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    """The reset removed the slot file by its path once the tier was closed: a directory
    replaced by a link since sent the removal into the link's target, another directory's
    ``blocks.kvs``. The tier now empties its own file through the descriptor it opened."""
    extra = _disk(tmp_path, 1, slot_start(16, slot_stride(BLOCK_BYTES)))
    instance = instances(extra)
    _store_in_pairs(instance, KEYS[:4])
    disk = instance.manager.backing.tiers[0]
    disk.poll(wait=True)
    own = disk.path
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / own.name).write_bytes(b"another process's file")
    own.parent.rename(tmp_path / "moved")
    own.parent.symlink_to(foreign)
    connector_scheduler(instance.scheduler).reset_cache()
    assert (foreign / own.name).read_bytes() == b"another process's file"
    assert (tmp_path / "moved" / own.name).stat().st_size == 0


def test_a_reset_whose_lower_tiers_cannot_open_again_leaves_the_cpu_tier_running(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reset reopens the lower tiers; one that cannot (here the disk directory replaced
    by a link; a shared server down is the same) raised into vLLM's reset. The engine now
    goes on with its CPU tier alone, logged, until it restarts (its bound on the disk's
    write backlog set: the tier's own settings go with the tier)."""
    from vllm.v1.kv_offload.base import LookupResult

    extra = _disk(tmp_path, 1, slot_start(16, slot_stride(BLOCK_BYTES)))
    extra["kvoffload.disk_max_pending_write_bytes"] = 4 * BLOCK_BYTES
    instance = instances(extra)
    _store_in_pairs(instance, KEYS[:4])
    directory = instance.manager.backing.tiers[0].path.parent
    directory.rename(tmp_path / "moved")
    directory.symlink_to(tmp_path / "moved")
    connector_scheduler(instance.scheduler).reset_cache()
    assert "runs on its CPU tier alone" in caplog.text
    caplog.clear()
    connector_scheduler(instance.scheduler).reset_cache()  # tries the tiers again: still off
    assert "runs on its CPU tier alone" in caplog.text
    context = request_context("after", KEYS[:4])
    for key in KEYS[:4]:
        assert lookup_until_settled(instance.manager, key, context) == [LookupResult.MISS]
    _store_in_pairs(instance, KEYS[4:8])
    assert lookup_until_settled(instance.manager, KEYS[6], request_context("again", KEYS[4:8])) == [
        LookupResult.HIT
    ]


def _reports_flush() -> bool:
    from kvoffload.integrations.vllm.adapter import REPORTS_FLUSH

    return REPORTS_FLUSH


def test_reset_keeps_the_shared_tier_and_holds_promotions_until_flushed(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
) -> None:
    """Through vLLM's scheduler: a load in flight at the reset holds promotions from the
    shared tier until the worker reports it; then the kept blocks come back."""
    if not _reports_flush():
        pytest.skip("this vLLM never reports a reset's jobs flushed (0.32)")
    from vllm_scheduler import (
        allocate,
        end_step,
        offload_keys,
        report_finished,
        vllm_request,
    )

    extra = {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    model = f"reset-{uuid.uuid4().hex[:8]}"
    local = vllm_request("local", list(range(48)))
    shared = vllm_request("shared", list(range(100, 148)))
    writer = instances(extra, model=model)
    writer.store(offload_keys(shared)[:2], [0, 1], request_context("w", offload_keys(shared)))
    expected = writer.gpu(0, [0, 1])
    writer.scheduler.close()  # its write-through has landed on the server

    engine = instances(extra, model=model, seed=9)
    engine.store(offload_keys(local)[:2], [0, 1], request_context("e", offload_keys(local)))
    scheduler = connector_scheduler(engine.scheduler)
    scheduler.on_new_request(local)
    assert scheduler.get_num_new_matched_tokens(local, 0) == (32, True)
    allocate(scheduler, local, 3, 32)
    (load_job,) = end_step(scheduler).load_jobs  # in flight at the reset
    scheduler.reset_cache()

    scheduler.on_new_request(shared)
    assert scheduler.get_num_new_matched_tokens(shared, 0) == (0, False)  # held: recompute
    end_step(scheduler)
    report_finished(scheduler, [load_job])  # vLLM calls on_reset_flushed here

    again = vllm_request("again", list(range(100, 148)))
    scheduler.on_new_request(again)
    answers = [scheduler.get_num_new_matched_tokens(again, 0)]
    deadline = time.monotonic() + 10
    while answers[-1][0] is None and time.monotonic() < deadline:
        time.sleep(0.005)
        answers.append(scheduler.get_num_new_matched_tokens(again, 0))
    assert answers[0] == (None, False) and answers[-1] == (32, True), answers
    allocate(scheduler, again, 3, 32)
    assert len(end_step(scheduler).load_jobs) == 1
    engine.clear_gpu()
    engine.load(offload_keys(again)[:2], [4, 5], request_context("l", offload_keys(again)))
    for loaded, want in zip(engine.gpu(0, [4, 5]), expected, strict=True):
        assert torch.equal(loaded, want)


def test_a_cpu_only_reset_holds_nothing(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import LookupResult
    from vllm_helpers import create_spec

    manager = create_spec({"cpu_bytes_to_use": 4 * 1024}).get_manager()
    manager.reset_cache()  # vLLM's on_reset_flushed may come much later
    context = request_context("r", KEYS[:1])
    output = manager.prepare_store(KEYS[:1], context)
    assert output is not None and output.keys_to_store == KEYS[:1]
    manager.complete_store(KEYS[:1], context)
    assert manager.lookup(KEYS[0], context) is LookupResult.HIT


def test_without_flush_reports_a_reset_holds_no_promotion(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
) -> None:
    """vLLM 0.32 never calls ``on_reset_flushed``: the shared tier serves again at once."""
    from vllm.v1.kv_offload.base import LookupResult

    if _reports_flush():
        pytest.skip("this vLLM reports a reset's jobs flushed (0.33)")
    extra = {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    instance = instances(extra, model=f"reset32-{uuid.uuid4().hex[:8]}")
    context = request_context("w", KEYS[:2])
    instance.store(KEYS[:2], [0, 1], context)
    instance.manager.on_request_finished(context)
    instance.manager.reset_cache()
    answers = lookup_until_settled(instance.manager, KEYS[0], request_context("r", KEYS[:2]))
    assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.HIT, answers
