"""kvoffload as SGLang's HiCache L3, built by SGLang's own factory from a ``dynamic`` config.

Pages round-trip through both of SGLang's interfaces (flat page tensors, and
zero-copy host-pool indices) against the disk tier and real Valkey servers
(standalone and a 3-node Cluster), bytes compared. The host pool is ours
(:class:`sglang_helpers.HostPool`, SGLang's page layouts): SGLang's own does
not import without a GPU stack.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import AsymmetricHostPool, DcpHostPool, HostPool, page_hash
from whatif_calls import record_whatif_calls

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.sglang.storage import page_key
from kvoffload.tiers.disk import DEFAULT_DEADLINE_S
from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

KEYS = [page_hash(i) for i in range(12)]


def disk(tmp_path: Path, pages: int = 64, pool: HostPool | None = None) -> dict[str, Any]:
    page_bytes = (pool or HostPool()).page_bytes(0).__len__()
    return {
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(pages, page_bytes),
    }


def tier_config(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind == "disk":
        return disk(tmp_path)
    server = request.getfixturevalue("valkey_server" if kind == "valkey" else "valkey_cluster")
    return {"kvoffload.remote_url": server.url}


def round_trip_v1(backend: Any, pool: HostPool, keys: list[str], seed: int) -> None:
    """Store pages 0.. from the pool, wipe it, load them into other pages; bytes must match."""
    n = len(keys)
    pool.fill(list(range(n)), seed)
    expected = [pool.page_bytes(p) for p in range(n)]
    assert backend.batch_set_v1(keys, pool.indices(list(range(n)))) == [True] * n
    pool.zero()
    assert backend.batch_exists(keys) == n
    into = list(range(n, 2 * n))
    assert backend.batch_get_v1(keys, pool.indices(into)) == [True] * n
    assert [pool.page_bytes(p) for p in into] == expected
    assert all(pool.page_bytes(p) == bytes(len(expected[0])) for p in range(n))


@pytest.mark.parametrize("kind", ["disk", "valkey", "cluster"])
@pytest.mark.parametrize(
    "layout,mla", [("page_first", False), ("layer_first", False), ("page_first", True)]
)
def test_zero_copy_round_trip(
    backends: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
    layout: str,
    mla: bool,
) -> None:
    pool = HostPool(layout, mla=mla)
    extra = {"interface_v1": 1, **tier_config(kind, tmp_path, request)}
    backend = backends(extra, pool, model=f"rt-{kind}-{layout}-{mla}", mla=mla)
    round_trip_v1(backend, pool, KEYS[:6], seed=1)
    stats = backend.get_stats().kvoffload
    name = "disk" if kind == "disk" else "remote"
    assert stats[name]["stores_completed"] == 6 and stats[name]["loads"] == 6
    assert stats[name]["bytes_loaded"] == 6 * len(pool.page_bytes(0))


def test_the_copy_interface_answers_false_to_anything_but_a_page(
    backends: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pool = HostPool("layer_first")
    backend = backends(tier_config("disk", tmp_path, request), pool, model="copy-bad")
    keys = [page_hash(200 + i) for i in range(2)]
    pool.fill([0], seed=3)
    page = pool.get_data_page(0)
    assert backend.set(keys[0]) is False  # SGLang's signature: a value may be left out
    assert backend.set(keys[0], None, target_location=page) is False
    assert backend.set(keys[0], bytes(8)) is False
    assert backend.set(keys[0], page[:-1]) is False
    assert backend.batch_set(keys, [page]) is False
    assert not backend.exists(keys[0]) and not backend.exists(keys[1])
    assert backend.set(keys[0], page) is True
    got = backend.get(keys[0])
    assert got is not None and torch.equal(got, page)


BAD_INDICES = {
    "one page short": lambda pool: pool.indices([2]),
    "one page long": lambda pool: pool.indices([2, 3, 4]),
    "part of a page": lambda pool: pool.indices([2, 3])[:-1],
    "floats": lambda pool: pool.indices([2, 3]).float(),
    "a list": lambda pool: pool.indices([2, 3]).tolist(),
    "two rows": lambda pool: pool.indices([2, 3]).reshape(2, -1),
    "past the pool": lambda pool: pool.indices([2, 16]),
    "a page crossing its end": lambda pool: pool.indices([2, 15]) + 2,
    "negative": lambda pool: pool.indices([2, 3]) - 3 * pool.page_size,
}


@pytest.mark.parametrize("what", list(BAD_INDICES))
def test_zero_copy_calls_with_indices_that_name_no_pages_of_theirs_move_nothing(
    backends: Any, tmp_path: Path, what: str
) -> None:
    """SGLang's pools turn a page's first index into a pointer unchecked: indices that are not
    ``page_size`` per key inside the pool answer False and touch no byte (before, a read past
    the pool wrote there and a short list reported unwritten pages stored)."""
    pool = HostPool("page_first")
    backend = backends({"interface_v1": 1, **disk(tmp_path)}, pool, model=f"bad-{what}")
    keys = KEYS[:2]
    pool.fill([0, 1, 2, 3], seed=4)
    assert backend.batch_set_v1(keys, pool.indices([0, 1])) == [True, True]
    before = pool.kv_buffer.clone()
    indices = BAD_INDICES[what](pool)
    assert backend.batch_set_v1([KEYS[2], KEYS[3]], indices) == [False, False]
    assert backend.batch_exists([KEYS[2]]) == 0 and backend.batch_exists([KEYS[3]]) == 0
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert torch.equal(pool.kv_buffer, before)
    assert backend.batch_get_v1([], indices[:0]) == [] == backend.batch_set_v1([], indices[:0])


def test_the_copy_interface_reads_nothing_without_one_cpu_tensor_per_key(
    backends: Any, tmp_path: Path
) -> None:
    """Targets of another count (a ValueError from a zip before) or not tensors (an
    AttributeError) answer None for every key, as a read that found nothing."""
    pool = HostPool("layer_first")
    backend = backends(disk(tmp_path), pool, model="copy-targets")
    keys = [page_hash(300 + i) for i in range(2)]
    pool.fill([0, 1], seed=5)
    assert backend.batch_set(keys, [pool.get_data_page(p * pool.page_size) for p in (0, 1)])
    page = pool.get_dummy_flat_data_page
    assert backend.batch_get(keys, [page()]) == [None, None]
    assert backend.batch_get(keys[:1], [page(), page()]) == [None]
    assert backend.batch_get(keys[:1], page()) == [None]
    assert backend.get(keys[0], bytearray(len(pool.page_bytes(0)))) is None
    got = backend.batch_get(keys, (page(), page()))
    assert all(isinstance(one, torch.Tensor) for one in got)


def test_a_copy_read_into_a_target_of_another_size_leaves_the_shared_page_alone(
    backends: Any, valkey_server: ValkeyProcess
) -> None:
    """A target that is not a page's bytes answers None without asking the tiers: before,
    the shared tier took the value's length against the target's as a corrupt value and
    deleted the page from the server, for every deployment that shares it."""
    pool = HostPool("layer_first")
    backend = backends({"kvoffload.remote_url": valkey_server.url}, pool, model="copy-size")
    key = page_hash(400)
    pool.fill([0], seed=7)
    page = pool.get_data_page(0)
    assert backend.set(key, page) is True
    for wrong in (page[: page.numel() // 2].clone(), torch.zeros(2 * page.numel())):
        assert backend.get(key, wrong) is None
        assert backend.batch_get([key, key], [pool.get_dummy_flat_data_page(), wrong]) == [
            None,
            None,
        ]
    assert backend.exists(key)
    assert backend.get_stats().kvoffload["remote"]["corrupt"] == 0
    got = backend.get(key, pool.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, page)


def test_keys_that_are_not_strings_are_pages_by_their_text(backends: Any, tmp_path: Path) -> None:
    """SGLang's own backends format a key into their names; ours takes its ``str()`` too
    (a TypeError from deep inside before), and a lone surrogate its UTF-8 bytes as Python
    keeps them (a UnicodeEncodeError)."""
    pool = HostPool("layer_first")
    backend = backends(disk(tmp_path), pool, model="copy-keys")
    pool.fill([0], seed=6)
    page = pool.get_data_page(0)
    assert not backend.exists(7) and backend.batch_exists([None, 7]) == 0
    assert backend.set(7, page) is True and backend.set("\ud800", page) is True
    assert backend.exists("7") and backend.exists("\ud800")
    got = backend.get(7)
    assert got is not None and torch.equal(got, page)


@pytest.mark.parametrize("kind", ["disk", "valkey", "cluster"])
def test_copy_interface_round_trip(
    backends: Any, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    pool = HostPool("layer_first")
    backend = backends(tier_config(kind, tmp_path, request), pool, model=f"copy-{kind}")
    keys = [page_hash(100 + i) for i in range(4)]
    pool.fill([0, 1, 2, 3], seed=2)
    pages = [pool.get_data_page(p * pool.page_size) for p in range(4)]
    assert backend.batch_set(keys[:3], pages[:3]) is True
    assert backend.set(keys[3], pages[3]) is True
    assert backend.exists(keys[3]) and not backend.exists(page_hash(999))
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get([*keys, page_hash(999)], [*targets, pool.get_dummy_flat_data_page()])
    assert got[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(got[:4], pages, strict=True))
    single = backend.get(keys[1])
    assert single is not None and torch.equal(single, pages[1])
    strided = torch.zeros(2 * pages[2].numel(), dtype=pages[2].dtype)[::2]  # not one run
    filled = backend.get(keys[2], strided)
    assert filled is not None and torch.equal(filled, pages[2])


def test_batch_exists_counts_the_leading_run_across_tiers(
    backends: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    pool = HostPool()
    remote = {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}
    both = backends({**remote, **disk(tmp_path)}, pool, model="prefix")
    remote_only = backends(remote, pool, model="prefix")
    pool.fill(list(range(6)), seed=3)
    assert all(both.batch_set_v1([KEYS[i] for i in (0, 2, 4)], pool.indices([0, 2, 4])))
    assert both.batch_exists(KEYS[:6]) == 1
    assert both.batch_exists(KEYS[4:6]) == 1
    # Page 1 on the server only, page 2 on disk only: the run spans both tiers.
    assert remote_only.batch_set_v1([KEYS[1]], pool.indices([1])) == [True]
    remote_tier = both.paths[1].tier
    valkey_server.client().delete(remote_tier.name(page_key(KEYS[2])))
    assert both.batch_exists(KEYS[:6]) == 3
    assert both.batch_exists(KEYS[3:6]) == 0
    expected = [pool.page_bytes(p) for p in range(3)]
    pool.zero()
    assert both.batch_get_v1(KEYS[:3], pool.indices([3, 4, 5])) == [True] * 3
    assert [pool.page_bytes(p) for p in (3, 4, 5)] == expected
    counters = both.get_stats().kvoffload
    assert counters["disk"]["loads"] == 2 and counters["remote"]["loads"] == 1


def test_a_look_up_counts_once_per_tier_and_asks_no_tier_for_the_page_that_ended_its_run(
    backends: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """``lookups`` counts the ``batch_exists`` calls that reached a tier: a run that stopped
    part-way asked the tier that served it again for the page it stopped at (which it
    cannot hold), counted once more each time, and a server alone took a second round
    trip for every partial hit."""
    pool = HostPool()
    remote = {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}
    remote_only = backends(remote, pool, model="asked")
    pool.fill(list(range(4)), seed=5)
    assert all(remote_only.batch_set_v1(KEYS[:2], pool.indices([0, 1])))
    client = valkey_server.client()
    asked_before = client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    assert remote_only.batch_exists(KEYS[:4]) == 2
    asked = client.info("commandstats")["cmdstat_exists"]["calls"] - asked_before
    assert asked <= 4  # each page at most once
    counters = remote_only.get_stats().kvoffload["remote"]
    assert counters["lookups"] == 1 and counters["lookup_hit_pages"] == 2
    # Page 0 on both tiers, 1 on the server only, 2 on disk only: disk, server, disk.
    both = backends({**remote, **disk(tmp_path)}, pool, model="asked")
    assert all(both.batch_set_v1([KEYS[0], KEYS[2]], pool.indices([0, 2])))
    client.delete(both.paths[1].tier.name(page_key(KEYS[2])))
    assert both.batch_exists(KEYS[:4]) == 3
    counters = both.get_stats().kvoffload
    assert (counters["disk"]["lookups"], counters["disk"]["lookup_hit_pages"]) == (1, 2)
    assert (counters["remote"]["lookups"], counters["remote"]["lookup_hit_pages"]) == (1, 1)


def test_two_backends_share_the_valkey_tier(backends: Any, valkey_server: ValkeyProcess) -> None:
    """Two SGLang workers of one model: what one writes, the other loads."""
    extra = {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}
    writer_pool, reader_pool = HostPool(), HostPool()
    writer = backends(extra, writer_pool, model="shared")
    reader = backends(extra, reader_pool, model="shared")
    other_model = backends(extra, HostPool(), model="another")
    writer_pool.fill(list(range(5)), seed=4)
    assert all(writer.batch_set_v1(KEYS[:5], writer_pool.indices(list(range(5)))))
    assert reader.batch_exists(KEYS[:8]) == 5 and other_model.batch_exists(KEYS[:8]) == 0
    assert reader.batch_get_v1(KEYS[:5], reader_pool.indices([7, 6, 5, 4, 3])) == [True] * 5
    assert [reader_pool.page_bytes(p) for p in (7, 6, 5, 4, 3)] == [
        writer_pool.page_bytes(p) for p in range(5)
    ]
    assert reader.get_stats().kvoffload["remote"]["loads"] == 5


def test_mla_has_one_writer_rank_and_every_rank_reads(
    backends: Any, tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    extra = {"interface_v1": 1, "kvoffload.remote_url": valkey_server.url}
    pools = [HostPool(mla=True), HostPool(mla=True)]
    ranks = [backends(extra, pools[r], model="mla", mla=True, tp_rank=r, tp_size=2) for r in (0, 1)]
    for pool in pools:
        pool.fill([0, 1], seed=5)
    assert ranks[1].batch_set_v1(KEYS[:2], pools[1].indices([0, 1])) == [True, True]
    assert ranks[1].batch_exists(KEYS[:2]) == 0  # the second rank wrote nothing
    assert all(ranks[0].batch_set_v1(KEYS[:2], pools[0].indices([0, 1])))
    assert ranks[1].batch_get_v1(KEYS[:2], pools[1].indices([2, 3])) == [True, True]
    assert pools[1].page_bytes(2) == pools[0].page_bytes(0)
    with pytest.raises(InvalidArgumentError, match=re.escape("kvoffload.disk_dir")):
        backends(disk(tmp_path), HostPool(mla=True), mla=True, tp_rank=0, tp_size=2)


def test_only_the_mla_writer_rank_keeps_an_admission_layer(
    backends: Any, valkey_server: ValkeyProcess
) -> None:
    """An MLA model's other ranks write nothing (SGLang skips their backups), so an
    admission layer there would only take memory (the optimiser's worlds, sized by the
    server's pages) and prefetch-thread time on every look-up, on every rank but one."""
    extra = {
        "interface_v1": 1,
        "kvoffload.remote_url": valkey_server.url,
        "kvoffload.remote_admission": "recommended",
        "kvoffload.remote_bytes": 64 * len(HostPool(mla=True).page_bytes(0)),
    }
    ranks = [
        backends(extra, HostPool(mla=True), model="mla-admission", mla=True, tp_rank=r, tp_size=2)
        for r in (0, 1)
    ]
    assert [rank.is_writer for rank in ranks] == [True, False]
    for rank in ranks:
        rank.batch_exists(KEYS)
    writer, reader = (rank.get_stats().kvoffload["remote"] for rank in ranks)
    assert writer["admission"]["tracked_keys"] > 0
    assert "admission" not in reader
    assert reader["lookups"] == 1


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_mla_under_decode_context_parallelism_keeps_each_shard_apart(
    backends: Any, valkey_server: ValkeyProcess, interface_v1: int
) -> None:
    """With DCP, an MLA pool's host indices are logical (``logical_page_size`` a page, each
    rank's rows its share): the backend attaches (an AssertionError from the pool before),
    the first rank of each shard writes, and every rank reads its own shard's pages."""
    extra = {"interface_v1": interface_v1, "kvoffload.remote_url": valkey_server.url}
    pools = [DcpHostPool(dcp_size=2) for _ in range(4)]
    ranks = [
        backends(extra, pool, model="dcp", mla=True, tp_rank=r, tp_size=4, dcp_pool=pool)
        for r, pool in enumerate(pools)
    ]
    assert [rank.is_writer for rank in ranks] == [True, True, False, False]
    for r in (0, 1):
        pools[r].fill([0, 1, 2], seed=20 + r)
    for r in (0, 1):
        if interface_v1:
            assert ranks[r].batch_set_v1(KEYS[:3], pools[r].indices([0, 1, 2])) == [True] * 3
        else:
            pages = [pools[r].get_data_page(int(pools[r].indices([p])[0])) for p in (0, 1, 2)]
            assert ranks[r].batch_set(KEYS[:3], pages) is True
    assert [rank.batch_exists(KEYS[:3]) for rank in ranks] == [3] * 4
    for r in (2, 3):
        if interface_v1:
            assert ranks[r].batch_get_v1(KEYS[:3], pools[r].indices([5, 4, 3])) == [True] * 3
        else:
            targets = [pools[r].get_dummy_flat_data_page() for _ in range(3)]
            got = ranks[r].batch_get(KEYS[:3], targets)
            for p, page in zip((5, 4, 3), got, strict=True):
                assert page is not None
                pools[r].set_from_flat_data_page(int(pools[r].indices([p])[0]), page)
        writer = pools[r % 2]
        assert [pools[r].page_bytes(p) for p in (5, 4, 3)] == [
            writer.page_bytes(p) for p in range(3)
        ]
    assert pools[0].page_bytes(0) != pools[1].page_bytes(0)
    past_the_pool = pools[2].indices([16])  # logical pages 0..15
    assert ranks[2].batch_get_v1(KEYS[:1], past_the_pool) == [False]


def test_disk_evicts_by_its_policy_and_admission_holds_back_first_sightings(
    backends: Any, tmp_path: Path
) -> None:
    pool = HostPool()
    extra = {
        "interface_v1": 1,
        **disk(tmp_path, pages=4),
        "kvoffload.disk_policy": "lru",
        "kvoffload.disk_admission": "sketch",
    }
    backend = backends(extra, pool, model="admission")
    pool.fill(list(range(10)), seed=6)
    assert backend.batch_exists(KEYS[:8]) == 0  # first sighting
    assert backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])) == [True] * 4
    counters = backend.get_stats().kvoffload["disk"]
    assert counters["stores_skipped"] == 4 and counters["stores_completed"] == 0
    assert backend.batch_exists(KEYS[:8]) == 0  # second sighting: now worth writing
    assert backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3])) == [True] * 4
    # Loading pages 0 and 1 makes them the most recent: 2 and 3 make room for 4 and 5.
    assert backend.batch_get_v1(KEYS[:2], pool.indices([8, 9])) == [True] * 2
    assert backend.batch_set_v1(KEYS[4:6], pool.indices([4, 5])) == [True] * 2
    assert backend.batch_exists(KEYS[:2]) == 2 and backend.batch_exists(KEYS[2:6]) == 0
    assert backend.batch_exists(KEYS[4:6]) == 2
    counters = backend.get_stats().kvoffload["disk"]
    assert counters["evictions"] == 2 and counters["held_pages"] == 4
    # More pages in one batch than the disk holds: the rest are failed writes, not errors.
    assert backend.batch_set_v1(KEYS[:6], pool.indices(list(range(6)))).count(False) == 2
    assert backend.get_stats().kvoffload["disk"]["rejected"] == 2
    pool.fill([8, 9], seed=7)
    assert backend.batch_set_v1(KEYS[8:10], pool.indices([8, 9])) == [True, True]
    counters = backend.get_stats().kvoffload["disk"]
    assert counters["stores_skipped"] == 6 and counters["admission"]["rejected"] == 6


def _inside(view: Any, buffer: Any) -> bool:
    """Whether the bytes of ``view`` lie inside the memory of tensor ``buffer``."""
    import numpy as np

    start = np.frombuffer(view, dtype=np.uint8).ctypes.data
    base = buffer.data_ptr()
    return bool(
        base <= start and start + view.nbytes <= base + buffer.numel() * buffer.element_size()
    )


@pytest.mark.parametrize("kind", ["disk", "valkey"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mha_pages_reach_the_tier_as_their_segments_never_joined(
    backends: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
    layout: str,
) -> None:
    """Both interfaces hand the tier a page's K and V segments in place (views of the host
    pool), and the zero-copy reads land in the segments themselves: no staging copy."""
    pool = HostPool(layout)
    extra = {"interface_v1": 1, **tier_config(kind, tmp_path, request)}
    backend = backends(extra, pool, model=f"parts-{kind}-{layout}")
    tier = backend.paths[0].tier
    written: list[Any] = []
    targets: list[Any] = []
    write, read = tier.write, tier.read

    def spy_write(keys: Any, payloads: Any) -> None:
        written.extend(payloads)
        write(keys, payloads)

    def spy_read(keys: Any, target: Any) -> Any:
        targets.extend(target(i) for i in range(len(keys)))
        return read(keys, target)

    tier.write, tier.read = spy_write, spy_read
    round_trip_v1(backend, pool, KEYS[:5], seed=8)
    segments = 2 if layout == "page_first" else 2 * pool.layer_num
    for parts in (*written, *targets):
        assert len(parts) == segments and all(_inside(p, pool.kv_buffer) for p in parts)
    written.clear()
    keys = [page_hash(200 + i) for i in range(3)]
    pool.fill([0, 1, 2], seed=9)
    pages = [pool.get_data_page(p * pool.page_size, flat=False) for p in range(3)]
    expected = [pool.page_bytes(p) for p in range(3)]
    assert backend.batch_set(keys, pages) is True  # not one run of memory each: split, not joined
    assert all(
        len(parts) > 1 and all(_inside(p, pool.kv_buffer) for p in parts) for parts in written
    )
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [bytes(t.view(torch.uint8).numpy()) for t in got] == expected


def test_stats_of_the_recommended_admission_reach_get_stats(
    backends: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang asks for them at every scheduler step: the layer's own numbers, without the
    cumulative what-if figures, which they do not show (about 20 us a step)."""
    pool = HostPool()
    extra = {
        "interface_v1": 1,
        **disk(tmp_path, pages=4),
        "kvoffload.disk_admission": "recommended",
    }
    backend = backends(extra, pool, model="optimiser")
    pool.fill(list(range(4)), seed=7)
    assert backend.batch_exists(KEYS[:4]) == 0
    backend.batch_set_v1(KEYS[:4], pool.indices([0, 1, 2, 3]))
    asked = record_whatif_calls(monkeypatch)
    admission = backend.get_stats().kvoffload["disk"]["admission"]
    assert True not in asked
    assert admission["offers"] == 4.0
    assert all(isinstance(value, float) for value in admission.values())
    monkeypatch.undo()
    (path,) = [path for path in backend.paths if path.name == "disk"]
    assert admission == path.layer.stats().numbers()


def test_a_hybrid_models_extra_host_pool_stops_the_attach_naming_it(
    backends: Any, sglang: dict[str, Any], tmp_path: Path
) -> None:
    """SGLang 0.5.23's hybrid controller registers each host pool through
    ``register_mem_host_pool_v2`` and then calls ``batch_*_v2`` for the non-KV ones; the KV
    pool is accepted, any other stops the attach with one line naming it."""
    names = sglang["sglang.srt.mem_cache.hicache_storage"].PoolName
    pool = HostPool()
    backend = backends({"interface_v1": 1, **disk(tmp_path)}, pool, model="hybrid")
    backend.register_mem_host_pool_v2(pool, names.KV)
    assert backend.registered_pools == {names.KV: pool}
    with pytest.raises(InvalidArgumentError, match="host pool 'mamba', which needs SGLang's batch"):
        backend.register_mem_host_pool_v2(HostPool(mla=True), names.MAMBA)
    round_trip_v1(backend, pool, KEYS[:2], seed=4)  # the KV pages still work


def test_the_disk_deadline_key_reaches_the_opened_disk_tier(backends: Any, tmp_path: Path) -> None:
    """``kvoffload.disk_timeout_ms`` is each disk job's deadline, as under vLLM; without it
    the disk tier's default (10 s)."""
    timed = backends({**disk(tmp_path / "timed"), "kvoffload.disk_timeout_ms": 250}, HostPool())
    default = backends(disk(tmp_path / "default"), HostPool())
    assert timed.paths[0].tier.deadline_s == 0.25
    assert default.paths[0].tier.deadline_s == DEFAULT_DEADLINE_S


@pytest.mark.parametrize("kind", ["disk", "valkey"])
def test_k_and_v_of_different_head_dims_round_trip_through_the_zero_copy_interface(
    backends: Any, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    """SGLang's host pool for K and V of different head dims (MiMo-V2) has no flat pages,
    only segments (K, then V, of different sizes): the zero-copy interface stores and loads
    them; the attach raised SGLang's NotImplementedError before, asking for the dummy page."""
    pool = AsymmetricHostPool()
    backend = backends(
        {"interface_v1": 1, **tier_config(kind, tmp_path, request)}, pool, model=f"asym-{kind}"
    )
    assert backend.pages.page_bytes == len(pool.page_bytes(0))
    round_trip_v1(backend, pool, KEYS[:5], seed=8)


def test_a_pool_without_flat_pages_stops_the_copy_interface_naming_interface_v1(
    backends: Any, tmp_path: Path
) -> None:
    """SGLang's copy interface reads and writes flat pages, which this pool cannot give:
    start-up stops, saying to set ``interface_v1``."""
    with pytest.raises(InvalidArgumentError, match=r"no flat pages.*'interface_v1': 1"):
        backends(disk(tmp_path), AsymmetricHostPool(), model="asym-copy")
