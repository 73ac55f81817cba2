"""vLLM's one-key scans read a request's run of lower-tier blocks in one promotion.

vLLM's scheduler (0.32 and 0.33) looks a request up one key at a time; with a
disk or shared tier below the CPU tier, each block only a lower tier held used to
start a read of its own (a 10-block request: 10 reads, 10 round trips to the
server). The adapter now looks the request up in one batch at the first key of
each scan, as the seed's batch lookup and the simulator do, and answers the
scan's later keys from what the CPU tier then holds. vLLM's own connector
scheduler drives the spec here; its workers copy real bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import Instance, request_context
from vllm_scheduler import allocate, connector_scheduler, end_step, offload_keys, vllm_request

from kvoffload import block_id_key
from kvoffload.tiers.slot_file import slot_start, slot_stride
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

BLOCKS = 10
BLOCK_BYTES = 2 * 256
"""Two KV tensors of 256-byte pages per block (``Instance``'s default)."""
OTHERS = [block_id_key(1000 + i) for i in range(BLOCKS)]
WAIT_S = 30.0


def _written_below(instance: Instance, keys: list[Any]) -> Any:
    """Store ``keys``, then as many other blocks: the CPU tier of ``BLOCKS`` blocks keeps
    the others, and ``keys`` are on the lower tier only (written back when evicted, or
    through when stored). The GPU contents ``keys`` were stored from."""
    gpu_blocks = list(range(BLOCKS))
    expected = instance.gpu(0, gpu_blocks)
    for name, stored in (("first", keys), ("others", OTHERS)):
        context = request_context(name, stored)
        instance.store(stored, gpu_blocks, context)
        instance.manager.on_request_finished(context)
    tiered = instance.manager.backing
    (tier,) = tiered.tiers
    tier.poll(wait=True)
    assert tier.present(keys) == BLOCKS and not any(tiered.holds(key) for key in keys)
    return expected


def _matched(scheduler: Any, request: Any) -> int:
    """vLLM's scheduler asking for ``request`` at each step until the manager can tell."""
    scheduler.on_new_request(request)
    deadline = time.monotonic() + WAIT_S
    while True:
        matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if matched is not None:
            return int(matched)
        end_step(scheduler)
        assert time.monotonic() < deadline, "the lookup never settled"
        time.sleep(0.005)


def _disk(tmp_path: Path) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": BLOCKS * BLOCK_BYTES,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(4 * BLOCKS, slot_stride(BLOCK_BYTES)),
    }


def _disk_and_shared(tmp_path: Path, valkey_server: ValkeyProcess) -> dict[str, Any]:
    """A disk and a shared tier below the CPU tier, each with the feedback rule's book."""
    return {
        **_disk(tmp_path),
        "kvoffload.disk_admission": "feedback",
        "kvoffload.remote_url": valkey_server.url,
        "kvoffload.remote_admission": "feedback",
        "kvoffload.remote_bytes": 4 * BLOCKS * BLOCK_BYTES,
    }


def _record_sightings(
    monkeypatch: pytest.MonkeyPatch, stack: Any, tiers: tuple[str, ...]
) -> dict[str, list[list[Any]]]:
    """The keys each of ``tiers``' admission layers is shown, call by call."""
    shown: dict[str, list[list[Any]]] = {tier: [] for tier in tiers}
    for tier in tiers:
        layer = getattr(stack, f"{tier}_admission")
        begin_request = layer.begin_request

        def record(
            keys: list[Any], *, tier: str = tier, begin: Any = begin_request, **options: Any
        ) -> None:
            shown[tier].append(list(keys))
            begin(keys, **options)

        monkeypatch.setattr(layer, "begin_request", record)
    return shown


@pytest.mark.parametrize(
    ("tier", "source"), [("cpu", "host"), ("disk", "disk"), ("remote", "external_unspecified")]
)
def test_vllm_counts_loaded_tokens_under_the_tier_they_came_from(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
    tier: str,
    source: str,
) -> None:
    """vLLM's ``vllm:prompt_tokens_cached_by_source`` asks the manager where each block it
    loads came from: the CPU tier's blocks are ``host`` (as vLLM's own CPU manager
    answers), blocks promoted for the request from the disk tier ``disk``, from the shared
    tier ``external_unspecified`` (a remote store, in vLLM's terms). Every block was
    ``external_unspecified``, the answer of a manager that does not say."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    cpu = {"cpu_bytes_to_use": BLOCKS * BLOCK_BYTES}
    remote = {**cpu, "kvoffload.remote_url": valkey_server.url}
    extra = {"cpu": cpu, "disk": _disk(tmp_path), "remote": remote}[tier]
    instance = instances(extra, model=f"source-{tier}-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    if tier == "cpu":
        instance.store(keys, list(range(BLOCKS)), request_context("writer", keys))
    else:
        _written_below(instance, keys)
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == 16 * BLOCKS
    allocate(scheduler, request, BLOCKS + 1, 16 * BLOCKS)
    sources = scheduler.get_external_cache_hit_sources(request, 16 * BLOCKS)
    assert sources == {CacheHitSource(source): 16 * BLOCKS}


@pytest.mark.parametrize(
    ("tier", "allowed", "read"),
    [
        ("disk", [{"medium": "cpu"}], False),
        ("disk", [{"locality": "remote"}], False),
        ("disk", [{"medium": "storage", "locality": "local"}], True),
        ("remote", [{"locality": "local"}], False),
        ("remote", [{"medium": "storage"}], True),
    ],
)
def test_a_request_reads_only_the_lower_tiers_its_kv_load_tiers_name(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
    tier: str,
    allowed: list[dict[str, str]],
    read: bool,
) -> None:
    """vLLM turns a request's ``kv_load_tiers`` (in its ``kv_transfer_params``) into the
    tier filter of its request context: a lower tier the filter leaves out is not read for
    the request (its blocks are recomputed), as vLLM's own tiering skips it; one it names is.
    Each tier matches as its KV events describe it: the disk tier local storage, the shared
    tier remote storage."""
    remote = {"cpu_bytes_to_use": BLOCKS * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    extra = _disk(tmp_path) if tier == "disk" else remote
    instance = instances(extra, model=f"filter-{tier}-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    _written_below(instance, keys)
    request.kv_transfer_params = {"kv_load_tiers": allowed}
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == (16 * BLOCKS if read else 0)
    assert instance.manager.backing.promotion_batches == [1 if read else 0]


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_request_only_a_lower_tier_holds_is_read_in_one_promotion(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
    tier: str,
) -> None:
    remote = {"cpu_bytes_to_use": BLOCKS * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    extra = _disk(tmp_path) if tier == "disk" else remote
    instance = instances(extra, model=f"one-read-{tier}-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    assert len(keys) == BLOCKS
    expected = _written_below(instance, keys)
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == 16 * BLOCKS
    tiered = instance.manager.backing
    assert tiered.promotion_batches == [1]
    assert tiered.tiers[0].stats.hit_blocks == BLOCKS
    instance.clear_gpu()
    instance.load(keys, list(range(BLOCKS)), request_context("load", keys))
    for loaded, want in zip(instance.gpu(0, list(range(BLOCKS))), expected, strict=True):
        assert torch.equal(loaded, want)


def test_the_disk_tier_s_admission_sees_a_scanned_request_once(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk tier's layer is shown the request's keys once, as one request, though vLLM
    asks each key, and asks again at the next step while the promotion runs (each key was
    a request of its own)."""
    extra = {**_disk(tmp_path), "kvoffload.disk_admission": "feedback"}
    instance = instances(extra, model=f"one-sighting-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    (disk,) = instance.manager.backing.tiers
    disk.write(keys, [bytes([i]) * instance.scheduler.bytes_per_block for i in range(BLOCKS)])
    disk.poll(wait=True)  # written there before, as by an earlier run
    layer = instance.scheduler._stack.disk_admission
    shown: list[list[Any]] = []
    begin_request = layer.begin_request

    def record(keys: list[Any], **options: Any) -> None:
        shown.append(list(keys))
        begin_request(keys, **options)

    monkeypatch.setattr(layer, "begin_request", record)
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == 16 * BLOCKS
    assert shown == [keys]


@pytest.mark.parametrize(
    ("allowed", "seen_by"),
    [
        (None, ["disk", "remote"]),
        ([{"locality": "remote"}], ["remote"]),
        ([{"locality": "local"}], ["disk"]),
    ],
)
def test_a_lower_tier_s_admission_sees_only_requests_that_may_read_it(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
    allowed: list[dict[str, str]] | None,
    seen_by: list[str],
) -> None:
    """A request whose ``kv_load_tiers`` leaves a lower tier out never reads from it, so its
    lookups are no reference that tier could serve: vLLM's tiering does not ask a tier left
    out, and a request that left out every lower tier was shown to none. One that left out
    only one was still shown to that tier's admission layer, and counted in its reuse and
    write budget. Stores still reach every tier, as in vLLM."""
    extra = _disk_and_shared(tmp_path, valkey_server)
    instance = instances(extra, model=f"filtered-books-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    if allowed is not None:
        request.kv_transfer_params = {"kv_load_tiers": allowed}
    shown = _record_sightings(monkeypatch, instance.scheduler._stack, ("disk", "remote"))
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == 0
    keys = offload_keys(request)
    assert shown == {tier: [keys] if tier in seen_by else [] for tier in shown}


def test_a_prompt_read_from_the_disk_tier_again_is_a_new_reference_to_it(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose whole run the disk tier promoted is asked again once the read lands,
    and the CPU tier then answers it alone. That answer did not end the record of the
    request as one waiting for a retry: every later request with the same prompt that
    reached the disk tier again was taken for that retry and never shown to the disk
    tier's admission layer, which saw a prompt read from it over and over as read once."""
    extra = {**_disk(tmp_path), "kvoffload.disk_admission": "feedback"}
    instance = instances(extra, model=f"read-again-{tmp_path.name}")
    tokens = list(range(16 * BLOCKS + 1))
    keys = offload_keys(vllm_request("first", tokens))
    (disk,) = instance.manager.backing.tiers
    disk.write(keys, [bytes([i]) * instance.scheduler.bytes_per_block for i in range(BLOCKS)])
    disk.poll(wait=True)
    shown = _record_sightings(monkeypatch, instance.scheduler._stack, ("disk",))
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, vllm_request("first", tokens)) == 16 * BLOCKS
    instance.load(keys, list(range(BLOCKS)), request_context("load", keys))
    others = request_context("others", OTHERS)
    instance.store(OTHERS, list(range(BLOCKS)), others)  # the CPU tier evicts the prompt
    instance.manager.on_request_finished(others)
    assert not any(instance.manager.backing.holds(key) for key in keys)
    assert _matched(scheduler, vllm_request("second", tokens)) == 16 * BLOCKS

    assert shown == {"disk": [keys, keys]}


def test_a_request_that_may_read_another_tier_is_new_to_it_while_one_like_it_waits(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests with one prompt, the first allowed the disk tier only
    (``kv_load_tiers``), the second every tier, asked while the first waits for its
    promotion of the blocks the disk held. A retry is known by its prompt's last key; the
    second request, taken for the first's retry, was shown to no tier, so the shared tier's
    admission layer, which the first could not read from, never saw the second at all."""
    extra = _disk_and_shared(tmp_path, valkey_server)
    instance = instances(extra, model=f"other-tiers-{tmp_path.name}")
    tokens = list(range(16 * BLOCKS + 1))
    local_only, every_tier = vllm_request("local", tokens), vllm_request("every", tokens)
    local_only.kv_transfer_params = {"kv_load_tiers": [{"locality": "local"}]}
    keys = offload_keys(local_only)
    disk, _ = instance.manager.backing.tiers
    size = instance.scheduler.bytes_per_block
    disk.write(keys[:4], [bytes([i]) * size for i in range(4)])
    disk.poll(wait=True)
    shown = _record_sightings(monkeypatch, instance.scheduler._stack, ("disk", "remote"))
    scheduler = connector_scheduler(instance.scheduler)
    scheduler.on_new_request(local_only)
    assert scheduler.get_num_new_matched_tokens(local_only, 0)[0] is None  # promoting
    end_step(scheduler)

    # Asked before the first request asks again: its answer waits for the promotion, or
    # finds it landed.
    assert _matched(scheduler, every_tier) == 16 * 4
    assert _matched(scheduler, local_only) == 16 * 4
    assert shown["remote"] == [keys[4:]]


@pytest.mark.parametrize(
    ("cpu_blocks", "on_disk", "loaded"),
    [(BLOCKS, 6, 6), (4, BLOCKS, 4)],
    ids=["tail-on-no-tier", "more-than-the-cpu-tier-holds"],
)
def test_a_scan_loads_the_run_the_cpu_tier_could_take(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    cpu_blocks: int,
    on_disk: int,
    loaded: int,
) -> None:
    """The batch lookup stops at the first block no tier holds, and promotes only what the
    CPU tier has room for: the scan is asked again while that read runs (the keys past it
    ``RETRY``), then loads the promoted blocks, which its own lookups never evicted."""
    extra = {**_disk(tmp_path), "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES}
    instance = instances(extra, model=f"run-{tmp_path.name}")
    request = vllm_request("reader", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    tiered = instance.manager.backing
    (disk,) = tiered.tiers
    size = instance.scheduler.bytes_per_block
    disk.write(keys[:on_disk], [bytes([i]) * size for i in range(on_disk)])
    disk.poll(wait=True)
    scheduler = connector_scheduler(instance.scheduler)

    assert _matched(scheduler, request) == 16 * loaded
    assert tiered.promotion_batches == [1]
    assert disk.stats.hit_blocks == loaded
    assert [tiered.is_reserved(key) for key in keys] == [True] * loaded + [False] * (
        BLOCKS - loaded
    )


def test_keys_asked_from_the_last_back_are_looked_up_one_at_a_time(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM asks a sliding-window layer's keys from the newest back: each is a one-key
    lookup, not a batch of the request's tail that asks the tier about it again per key."""
    from vllm.v1.kv_offload.base import LookupResult

    instance = instances(_disk(tmp_path), model=f"backwards-{tmp_path.name}")
    keys = [block_id_key(i) for i in range(1, BLOCKS + 1)]
    tiered = instance.manager.backing
    (disk,) = tiered.tiers
    disk.write(keys, [bytes([i]) * instance.scheduler.bytes_per_block for i in range(BLOCKS)])
    disk.poll(wait=True)
    asked: list[int] = []
    present = disk.present

    def record(keys: list[Any]) -> int:
        asked.append(len(keys))
        return present(keys)

    monkeypatch.setattr(disk, "present", record)
    context = request_context("window", keys)
    answers = [instance.manager.lookup(key, context) for key in reversed(keys)]

    assert answers == [LookupResult.RETRY] * BLOCKS
    assert asked == [1] * BLOCKS
    assert tiered.promotion_batches == [BLOCKS]


def test_an_aborted_request_s_promotion_is_released_for_other_stores(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
) -> None:
    """A request vLLM aborts after its promotion landed (a client gone while it waited)
    left the promoted blocks reserved for ``reserve_lookups`` lookups: on a CPU tier they
    fill, every store was refused meanwhile. Its finish now releases them."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import RequestStatus

    extra = {**_disk(tmp_path), "cpu_bytes_to_use": 4 * BLOCK_BYTES}
    instance = instances(extra, model=f"abort-{tmp_path.name}")
    request = vllm_request("gone", list(range(16 * BLOCKS + 1)))
    keys = offload_keys(request)
    tiered = instance.manager.backing
    (disk,) = tiered.tiers
    size = instance.scheduler.bytes_per_block
    disk.write(keys, [bytes([i]) * size for i in range(BLOCKS)])
    disk.poll(wait=True)
    scheduler = connector_scheduler(instance.scheduler)
    assert _matched(scheduler, request) == 16 * 4
    assert all(tiered.is_reserved(key) for key in keys[:4])

    request.status = RequestStatus.FINISHED_ABORTED
    scheduler.request_finished(request)
    step = SchedulerOutput.make_empty()  # the step that tells the manager of the finish
    step.finished_req_ids = {request.request_id}
    scheduler.build_connector_meta(step)

    assert not any(tiered.is_reserved(key) for key in keys)
    assert instance.manager.prepare_store(OTHERS[:4], request_context("next", OTHERS[:4]))


def test_a_request_aborted_while_its_promotion_runs_hides_no_later_request(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    instances: Callable[..., Instance],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup answered ``None`` records its prompt (by its last key) so that the retry is
    no new reference to the disk tier's admission layer. A request vLLM aborted while it
    waited never retried, and its record stayed: the next request with that prompt, a new
    reference, was taken for the retry and never shown to the layer."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import RequestStatus

    extra = {**_disk(tmp_path), "kvoffload.disk_admission": "feedback"}
    instance = instances(extra, model=f"aborted-waiter-{tmp_path.name}")
    tokens = list(range(16 * BLOCKS + 1))
    gone = vllm_request("gone", tokens)
    keys = offload_keys(gone)
    (disk,) = instance.manager.backing.tiers
    size = instance.scheduler.bytes_per_block
    disk.write(keys[:4], [bytes([i]) * size for i in range(4)])
    disk.poll(wait=True)
    shown = _record_sightings(monkeypatch, instance.scheduler._stack, ("disk",))
    scheduler = connector_scheduler(instance.scheduler)
    scheduler.on_new_request(gone)
    assert scheduler.get_num_new_matched_tokens(gone, 0)[0] is None  # promoting
    gone.status = RequestStatus.FINISHED_ABORTED
    scheduler.request_finished(gone)
    step = SchedulerOutput.make_empty()  # the step that tells the manager of the finish
    step.finished_req_ids = {gone.request_id}
    scheduler.build_connector_meta(step)

    assert _matched(scheduler, vllm_request("next", tokens)) == 16 * 4
    assert shown == {"disk": [keys, keys[4:]]}
