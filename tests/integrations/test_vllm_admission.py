"""``kvoffload.admission`` and every registered policy, configured the way vLLM users do."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import create_spec

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.admission import (
    AdmissionLayer,
    OptimisingAdmission,
    available_admissions,
    find_admission,
)
from kvoffload.policies import available_policies, create_cache_policy
from kvoffload.sim.traces import read_trace

CAPACITY = 4392
"""Blocks in the tier: 10% of the Mooncake trace's unique blocks, as in test_vllm_replay."""

GHOST_HITS = "vllm:kvoffload_admission_ghost_hits"
CONTROL = "vllm:kvoffload_admission_control"


def _manager(admission: str, num_blocks: int = CAPACITY, **extra: Any) -> Any:
    config = {"cpu_bytes_to_use": num_blocks * 1024, "kvoffload.admission": admission}
    return create_spec(config | extra).get_manager()


def _context(req_id: str, keys: list[bytes]) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, 16 * position)
    return context


@pytest.fixture(scope="module")
def mooncake(mooncake_trace: Path) -> Any:
    return read_trace(mooncake_trace)


def _announcements(layer: AdmissionLayer) -> list[tuple[int, int, bool]]:
    """Each request ``layer`` is told of, as (keys, GPU-held, tier-served), recorded as the
    adapter announces it."""
    announced: list[tuple[int, int, bool]] = []
    begin = layer.begin_request

    def begin_request(keys: list[bytes], **kwargs: Any) -> None:
        announced.append((len(keys), kwargs["gpu_held"], kwargs["tier_hit"]))
        begin(keys, **kwargs)

    layer.begin_request = begin_request
    return announced


def test_recommended_admission_cuts_writes_on_mooncake(
    vllm_modules: dict[str, ModuleType], mooncake: Any
) -> None:
    from kvoffload.integrations.vllm.replay import replay

    everything = replay(_manager("none"), mooncake.requests, mooncake.block_tokens)
    manager = _manager("recommended")
    admitted = replay(manager, mooncake.requests, mooncake.block_tokens)
    assert admitted.written_blocks < 0.6 * everything.written_blocks
    assert admitted.hit_ratio >= everything.hit_ratio - 0.01
    stats = manager.get_stats().reduce()
    assert stats["vllm:kvoffload_stores_admitted"] == admitted.written_blocks
    assert stats["vllm:kvoffload_stores_skipped"] > 0
    # Offers of blocks already held are neither admitted nor skipped.
    assert (
        stats["vllm:kvoffload_stores_admitted"] + stats["vllm:kvoffload_stores_skipped"]
        <= stats["vllm:kvoffload_stores_offered"]
    )
    assert stats[GHOST_HITS] > 0
    assert 0.0 <= stats[CONTROL] <= 1.0


def test_sketch_admission_stores_on_the_second_request_only(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """Seen-twice admission counts requests, not vLLM's repeated per-key lookups."""
    from vllm.v1.kv_offload.base import LookupResult

    manager = _manager("sketch", num_blocks=8)
    keys = [block_id_key(i) for i in range(3)]
    first = _context("a", keys)
    manager.on_new_request(first)
    for _ in range(5):  # the scheduler re-polls a request's lookups
        assert manager.lookup(keys[0], first) is LookupResult.MISS
    assert manager.prepare_store(keys, first).keys_to_store == []
    manager.on_request_finished(first)
    stats = manager.get_stats().reduce()
    assert (stats["vllm:kvoffload_stores_offered"], stats["vllm:kvoffload_stores_skipped"]) == (
        3,
        3,
    )
    second = _context("b", keys)
    manager.on_new_request(second)
    assert manager.lookup(keys[0], second) is LookupResult.MISS
    output = manager.prepare_store(keys, second)
    assert output.keys_to_store == keys
    manager.complete_store(keys, second)
    manager.on_request_finished(second)
    stats = manager.get_stats().reduce()
    assert stats["vllm:kvoffload_stores_admitted"] == 3
    assert stats["vllm:kvoffload_stores_skipped"] == 0
    assert manager.lookup(keys[2], _context("c", keys)) is LookupResult.HIT


def test_a_request_the_tier_served_is_announced_as_such(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM looks up only past the GPU cache's hit, so a lookup hit is a tier-served prefix."""
    from vllm.v1.kv_offload.base import LookupResult

    manager = _manager("sketch", num_blocks=64)
    layer = manager._layer
    announced: list[list[bytes]] = []
    begin = layer.begin_request

    def begin_request(keys: list[bytes], **kwargs: Any) -> None:
        if kwargs.get("tier_hit"):
            announced.append(list(keys))
        begin(keys, **kwargs)

    layer.begin_request = begin_request
    keys = [block_id_key(i) for i in range(6)]
    for name in ("a1", "a2"):  # stored on its second sighting
        first = _context(name, keys[:3])
        manager.on_new_request(first)
        assert manager.lookup(keys[0], first) is LookupResult.MISS
        manager.complete_store(manager.prepare_store(keys[:3], first).keys_to_store, first)
        manager.on_request_finished(first)
    assert announced == []
    served = _context("b", keys)
    manager.on_new_request(served)
    assert [manager.lookup(key, served) for key in keys[:4]] == [LookupResult.HIT] * 3 + [
        LookupResult.MISS
    ]
    manager.prepare_load(keys[:3], served)
    manager.complete_load(keys[:3], served)
    manager.prepare_store(keys[3:], served)
    manager.on_request_finished(served)
    assert announced == [keys]
    missed = _context("c", [block_id_key(i) for i in range(10, 13)])
    manager.on_new_request(missed)
    assert manager.lookup(block_id_key(10), missed) is LookupResult.MISS
    manager.prepare_store([block_id_key(10)], missed)
    manager.on_request_finished(missed)
    assert announced == [keys]


def test_a_request_vllm_delays_for_anothers_load_and_the_gpu_serves_is_no_tier_hit(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM delays a request whose hit blocks another request is loading, and asks again
    in a later step, when the GPU holds them: the layer is told of the GPU hit it then had
    and that the tier served nothing, not of its first attempt's lookups."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm_scheduler import (
        allocate,
        connector_scheduler,
        end_step,
        report_finished,
        schedule_prefill,
        schedule_step,
        vllm_request,
    )

    spec = create_spec({"cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "sketch"})
    scheduler = connector_scheduler(spec)
    layer = spec.get_manager()._layer
    announced = _announcements(layer)
    prompt = list(range(49))  # three whole blocks and one token
    for name in ("cold", "stored"):  # the sketch stores the prompt on its second sighting
        request = vllm_request(name, prompt)
        scheduler.on_new_request(request)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        allocate(scheduler, request, 4, 0)
        meta = schedule_prefill(scheduler, request, 4)
    report_finished(scheduler, list(meta.store_jobs))
    loading, delayed = vllm_request("loading", prompt), vllm_request("delayed", prompt)
    scheduler.on_new_request(loading)
    assert scheduler.get_num_new_matched_tokens(loading, 0) == (48, True)
    allocate(scheduler, loading, 4, 48)
    load_jobs = list(end_step(scheduler).load_jobs)
    scheduler.on_new_request(delayed)
    assert scheduler.get_num_new_matched_tokens(delayed, 0) == (None, False)
    end_step(scheduler)
    report_finished(scheduler, load_jobs)
    announced.clear()
    delayed.num_computed_tokens = 48  # the loaded blocks are in the GPU's prefix cache now
    assert scheduler.get_num_new_matched_tokens(delayed, 48) == (0, False)
    allocate(scheduler, delayed, 4, 0)
    schedule_prefill(scheduler, delayed, 4)
    assert announced == [(3, 3, False)]
    loading.num_computed_tokens = 48
    schedule_step(scheduler, loading, 1, 4)
    scheduler.request_finished(loading)
    finished = SchedulerOutput.make_empty()
    finished.finished_req_ids = {"loading"}
    finished.num_scheduled_tokens = {"loading": 0}
    scheduler.build_connector_meta(finished)
    assert announced[1:] == [(3, 0, True)]  # the request that loaded: the tier served it


def test_a_finished_request_leaves_nothing_for_the_step_end(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """The requests that looked up keys in a step are kept until its end, to forget the
    lookups of those vLLM did not schedule; a request finished meanwhile is dropped then,
    so that a driver that never ends a step (a replay) does not keep every request."""
    from vllm.v1.kv_offload.base import LookupResult

    manager = _manager("sketch", num_blocks=8)
    for name in ("a", "b"):
        context = _context(name, [block_id_key(1)])
        manager.on_new_request(context)
        assert manager.lookup(block_id_key(1), context) is LookupResult.MISS
        manager.on_request_finished(context)
    assert manager._looked_up_in_step == {}


@pytest.mark.parametrize(("stored_chunks", "loads"), [(2, False), (3, True)])
def test_a_chunk_the_gpu_holds_part_of_is_looked_up_and_served_only_if_vllm_loads(
    vllm_modules: dict[str, ModuleType], stored_chunks: int, loads: bool
) -> None:
    """Two GPU blocks a chunk: vLLM looks up from the chunk the GPU's hit ends in (1.5
    chunks held: from chunk 1) and loads the rest of it only with at least a chunk to
    load. The layer is told the whole chunks the GPU held, and of a tier hit only when
    vLLM loaded: a hit on chunk 1 alone (16 tokens past the GPU's) is not loaded."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm_scheduler import (
        allocate,
        connector_scheduler,
        end_step,
        report_finished,
        schedule_prefill,
        vllm_request,
    )

    spec = create_spec(
        {"cpu_bytes_to_use": 64 * 2048, "kvoffload.admission": "sketch"}, blocks_per_chunk=2
    )
    scheduler = connector_scheduler(spec)
    layer = spec.get_manager()._layer
    announced = _announcements(layer)
    prompt = list(range(97))  # three chunks of 32 tokens and one token
    jobs: list[int] = []
    for name in ("cold", "stored"):  # the sketch stores on the second sighting
        request = vllm_request(name, prompt[: 32 * stored_chunks + 1])
        scheduler.on_new_request(request)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        allocate(scheduler, request, 2 * stored_chunks + 1, 0)
        jobs += schedule_prefill(scheduler, request, 2 * stored_chunks + 1).store_jobs
    report_finished(scheduler, jobs)
    announced.clear()
    request = vllm_request("gpu hit 1.5 chunks", prompt)
    scheduler.on_new_request(request)
    request.num_computed_tokens = 48
    hit = 48 if loads else 0
    assert scheduler.get_num_new_matched_tokens(request, 48) == (hit, loads)
    allocate(scheduler, request, 7, hit)
    if not loads:
        schedule_prefill(scheduler, request, 7)
    else:
        load_jobs = list(end_step(scheduler).load_jobs)
        report_finished(scheduler, load_jobs)
        request.num_computed_tokens = 96
        schedule_prefill(scheduler, request, 7)
        request.num_computed_tokens = 97
        scheduler.request_finished(request)
        finished = SchedulerOutput.make_empty()
        finished.finished_req_ids = {request.request_id}
        finished.num_scheduled_tokens = {request.request_id: 0}
        scheduler.build_connector_meta(finished)
    assert announced == [(3, 1, loads)]


def test_a_request_that_offers_nothing_is_still_a_sighting(
    vllm_modules: dict[str, ModuleType],
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    manager = _manager("sketch", num_blocks=8)
    key = block_id_key(7)
    looked = _context("a", [key])
    manager.on_new_request(looked)
    assert manager.lookup(key, looked) is LookupResult.MISS
    manager.on_request_finished(looked)  # aborted before storing anything
    storing = _context("b", [key])
    manager.on_new_request(storing)
    assert manager.prepare_store([key], storing).keys_to_store == [key]


def test_vllms_scheduler_shows_the_layer_its_gpu_hit_though_it_offers_it_again(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM looks up past the GPU's prefix hit, but a request that loads nothing offers
    every block from the first, GPU-held ones too (and looks none up when less than one
    block lies past the hit): the layer's what-if worlds count those blocks as GPU hits,
    not as tier lookups, as the simulator does."""
    from vllm_scheduler import allocate, connector_scheduler, schedule_prefill, vllm_request

    spec = create_spec({"cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "recommended"})
    scheduler = connector_scheduler(spec)
    layer = find_admission(spec.get_manager().backing)
    assert isinstance(layer, OptimisingAdmission)
    prompt = list(range(49))  # three whole blocks and one token
    gpu_held: list[int] = []
    for name, tokens, gpu_hit in [
        ("cold", prompt, 0),
        ("gpu hit, offload miss", prompt[:32] + [900 + t for t in range(17)], 32),
        ("all on the GPU", prompt, 48),
    ]:
        request = vllm_request(name, tokens)
        scheduler.on_new_request(request)
        request.num_computed_tokens = gpu_hit
        assert scheduler.get_num_new_matched_tokens(request, gpu_hit) == (0, False)
        allocate(scheduler, request, 4, 0)
        before = layer.worlds.total_gpu_hits
        schedule_prefill(scheduler, request, 4)
        gpu_held.append(layer.worlds.total_gpu_hits - before)
    assert gpu_held == [0, 2, 3]


def test_a_request_vllm_offers_in_parts_is_one_request_to_the_layer(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM offers the blocks a step completed: a prompt prefilled in chunks, and each block
    decoding fills, is offered in parts. The layer sees one request growing (what it was
    shown before, then the new keys, counted once), so it knows the prefix before each part
    and the request's first key, not a new request per part."""
    from vllm_scheduler import (
        allocate,
        connector_scheduler,
        offload_keys,
        schedule_step,
        vllm_request,
    )

    spec = create_spec({"cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "feedback"})
    scheduler = connector_scheduler(spec)
    layer = spec.get_manager()._layer
    announced: list[tuple[list[bytes], int]] = []
    begin = layer.begin_request

    def begin_request(keys: list[bytes], **kwargs: Any) -> None:
        announced.append((list(keys), kwargs.get("counted", 0)))
        begin(keys, **kwargs)

    layer.begin_request = begin_request
    request = vllm_request("chunked", list(range(49)))
    keys = offload_keys(request)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    allocate(scheduler, request, 4, 0)
    schedule_step(scheduler, request, 32, 4)  # the first prefill chunk: blocks 0 and 1
    schedule_step(scheduler, request, 17)  # the rest: block 2
    assert announced == [(keys[:2], 0), (keys[:3], 2)]


def test_admission_metrics_are_declared_only_with_a_layer(
    vllm_modules: dict[str, ModuleType],
) -> None:
    from kvoffload.integrations.vllm import KVOffloadSpec

    with_layer = KVOffloadSpec.build_metric_definitions({"kvoffload.admission": "feedback"})
    assert {GHOST_HITS, CONTROL} <= set(with_layer)
    assert GHOST_HITS not in KVOffloadSpec.build_metric_definitions({})
    values = _manager("feedback", num_blocks=4).get_stats().reduce()
    assert set(values) <= set(with_layer)
    assert GHOST_HITS not in _manager("none", num_blocks=4).get_stats().reduce()


def test_an_unknown_admission_fails_at_start_up_listing_the_names(
    vllm_modules: dict[str, ModuleType],
) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        _manager("tinylfu", num_blocks=4)
    message = str(error.value)
    assert "'kvoffload.admission'" in message and "'tinylfu'" in message
    assert all(name in message for name in available_admissions())


PACKAGE_POLICIES = [
    name
    for name in available_policies()
    if type(create_cache_policy(name, 4)).__module__.startswith("kvoffload.")
]
"""The package's policies, not the reference renderings that tests register where they are
collected first (``naive-*`` in ``tests/core/test_policy_differential.py``, ``walking-*`` in
the parking tests): each walks for every eviction, the slowest half a minute on the Mooncake
replay, and its own test pins it to the package's policy."""


@pytest.mark.parametrize("policy", PACKAGE_POLICIES)
def test_every_registered_policy_backs_the_spec_and_vllms_manager(
    vllm_modules: dict[str, ModuleType], mooncake: Any, policy: str
) -> None:
    """``eviction_policy`` with our spec, and ``kvoffload_<name>`` inside vLLM's manager."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvoffload.integrations.vllm.replay import replay

    ours = _manager("none", eviction_policy=policy)
    expected = type(create_cache_policy(policy, 4))
    assert type(ours.backing.policy) is expected
    theirs = CPUOffloadingManager(
        CAPACITY, f"kvoffload_{policy}", cache_policy_module_path="kvoffload.integrations.vllm"
    )
    assert type(theirs._policy._policy) is expected
    ours_result = replay(ours, mooncake.requests, mooncake.block_tokens)
    theirs_result = replay(theirs, mooncake.requests, mooncake.block_tokens)
    assert ours_result.hit_ratio > 0.2
    assert abs(ours_result.hit_ratio - theirs_result.hit_ratio) <= 0.01
    assert abs(ours_result.writes_per_ref - theirs_result.writes_per_ref) <= 0.01


def test_vllms_metrics_frontend_shows_the_admission_counters(
    vllm_modules: dict[str, ModuleType],
) -> None:
    import prometheus_client
    from vllm_helpers import SPEC_CONFIG, metrics_frontend

    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 8 * 1024, "kvoffload.admission": "sketch"}
    frontend, registry = metrics_frontend(extra)
    manager = create_spec(extra).get_manager()
    keys = [block_id_key(i) for i in range(2)]
    manager.prepare_store(keys, _context("a", keys))
    frontend.observe(manager.get_stats().data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:kvoffload_stores_skipped_total{engine="0"} 2.0' in text
    assert 'vllm:kvoffload_admission_ghost_hits_total{engine="0"} 0.0' in text
    assert 'vllm:kvoffload_admission_control{engine="0"} 2.0' in text


@pytest.mark.parametrize("disk", [False, True])
def test_a_cpu_size_whose_admission_memory_the_machine_lacks_names_cpu_bytes_to_use(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, disk: bool
) -> None:
    """The CPU tier's layer is built by the stack builder, not a tier's book: it names the
    size's key as the books do (before: only 'an admission frequency sketch of ...')."""
    from kvoffload.core.errors import InsufficientMemoryError

    tiers = {"kvoffload.disk_dir": str(tmp_path), "kvoffload.disk_bytes": 1 << 20} if disk else {}
    spec = create_spec({"cpu_bytes_to_use": 1 << 62, "kvoffload.admission": "sketch", **tiers})
    named = "kv_connector_extra_config 'cpu_bytes_to_use': an admission frequency sketch"
    with pytest.raises(InsufficientMemoryError, match=named):
        spec.get_manager()


def test_a_disk_size_whose_admission_memory_the_machine_lacks_names_disk_bytes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """A lower tier's layer is built inside the tiered manager: it names the size's key as
    the CPU tier's does (before: only 'an admission frequency sketch of ...')."""
    from kvoffload.core.errors import InsufficientMemoryError

    spec = create_spec(
        {
            "cpu_bytes_to_use": 1 << 30,
            "kvoffload.disk_dir": str(tmp_path),
            "kvoffload.disk_bytes": 1 << 60,
            "kvoffload.disk_admission": "sketch",
        }
    )
    with pytest.raises(
        InsufficientMemoryError,
        match=r"kv_connector_extra_config 'kvoffload\.disk_bytes': an admission frequency",
    ):
        spec.get_manager()
