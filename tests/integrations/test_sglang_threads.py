"""kvoffload's HiCache backend called from SGLang's threads at once, bytes compared.

SGLang's cache controller calls its storage backend from a prefetch query thread
(``batch_exists``), a prefetch I/O thread (``batch_get`` / ``batch_get_v1``) and a backup
thread (``batch_set`` / ``batch_set_v1``), and its scheduler may ``clear`` meanwhile. Here
they all run together on a disk tier small enough to evict all the time (alone, and over a
real Valkey server): each key always stands for the same page, so any page reported read
must hold exactly that page's bytes, whatever was evicted, rewritten or cleared meanwhile.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import HostPool, page_hash

from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

KEYS = 48
BATCH = 6
ROUNDS = 150
BACKUP_PAGES = list(range(BATCH))
"""Host pages the backup thread writes from; each reader has pages of its own."""


class Pages:
    """One page's content per key, as SGLang's page hash names a page's tokens."""

    def __init__(self, pool: HostPool) -> None:
        generator = torch.Generator().manual_seed(11)
        shape = pool.get_dummy_flat_data_page().shape
        self.tensors = [torch.randn(shape, generator=generator).to(pool.dtype) for _ in range(KEYS)]
        self.bytes = [bytes(t.view(torch.uint8).numpy()) for t in self.tensors]
        self.keys = [page_hash(9000 + i) for i in range(KEYS)]


def run_together(jobs: list[Callable[[], None]]) -> list[BaseException]:
    """Run ``jobs`` on threads of their own; what they raised."""
    raised: list[BaseException] = []

    def guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # collected for the test thread to report
            raised.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    return raised


@pytest.mark.parametrize("shared", [False, True], ids=["disk", "disk+valkey"])
@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "copy"])
def test_prefetch_backup_and_clear_threads_only_ever_read_a_keys_own_bytes(
    backends: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    shared: bool,
    interface_v1: int,
) -> None:
    pool = HostPool(pages=3 * BATCH)
    pages = Pages(pool)
    page_bytes = len(pages.bytes[0])
    extra: dict[str, Any] = {
        "interface_v1": interface_v1,
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(KEYS // 3, page_bytes),
    }
    if shared:
        server: ValkeyProcess = request.getfixturevalue("valkey_server")
        extra["kvoffload.remote_url"] = server.url
    backend = backends(extra, pool, model=f"threads-{interface_v1}-{shared}")
    start = {p: int(pool.indices([p])[0]) for p in range(3 * BATCH)}
    wrong: list[int] = []

    def store(chosen: list[int]) -> None:
        for page, key in zip(BACKUP_PAGES, chosen, strict=True):
            pool.set_from_flat_data_page(start[page], pages.tensors[key])
        keys = [pages.keys[k] for k in chosen]
        if interface_v1:
            done = backend.batch_set_v1(keys, pool.indices(BACKUP_PAGES))
            assert isinstance(done, list) and len(done) == BATCH
            assert all(isinstance(ok, bool) for ok in done)
        else:
            values = [pool.get_data_page(start[p]) for p in BACKUP_PAGES]
            assert isinstance(backend.batch_set(keys, values), bool)

    def backup() -> None:
        rng = random.Random(1)
        for _ in range(ROUNDS):
            store(rng.sample(range(KEYS), BATCH))

    def prefetch(reader: int) -> Callable[[], None]:
        own = [BATCH * (reader + 1) + i for i in range(BATCH)]

        def run() -> None:
            rng = random.Random(10 + reader)
            for _ in range(ROUNDS):
                chosen = rng.sample(range(KEYS), BATCH)
                keys = [pages.keys[k] for k in chosen]
                if interface_v1:
                    got = backend.batch_get_v1(keys, pool.indices(own))
                    assert isinstance(got, list) and len(got) == BATCH
                    landed = zip(own, got, strict=True)
                    read = [pool.page_bytes(p) if ok else None for p, ok in landed]
                else:
                    targets = [pool.get_dummy_flat_data_page() for _ in keys]
                    tensors = backend.batch_get(keys, targets)
                    assert isinstance(tensors, list) and len(tensors) == BATCH
                    read = [
                        None if t is None else bytes(t.view(torch.uint8).numpy()) for t in tensors
                    ]
                for key, data in zip(chosen, read, strict=True):
                    if data is not None and data != pages.bytes[key]:
                        wrong.append(key)

        return run

    def query() -> None:
        rng = random.Random(3)
        for _ in range(ROUNDS):
            found = backend.batch_exists([pages.keys[k] for k in rng.sample(range(KEYS), BATCH)])
            assert isinstance(found, int) and 0 <= found <= BATCH

    def clear() -> None:
        for _ in range(ROUNDS // 30):
            assert backend.clear() is True

    raised = run_together([backup, prefetch(0), prefetch(1), query, clear])
    assert raised == []
    assert wrong == []
    # Quiet again: the last pages stored are held, and each key a look-up finds reads
    # back as its own bytes.
    store(list(range(BATCH)))
    held = [k for k in range(KEYS) if backend.batch_exists([pages.keys[k]]) == 1]
    assert set(range(BATCH)) <= set(held)
    for key in held:
        if interface_v1:
            assert backend.batch_get_v1([pages.keys[key]], pool.indices([BATCH])) == [True]
            assert pool.page_bytes(BATCH) == pages.bytes[key]
        else:
            got = backend.batch_get([pages.keys[key]], [pool.get_dummy_flat_data_page()])[0]
            assert got is not None and bytes(got.view(torch.uint8).numpy()) == pages.bytes[key]
