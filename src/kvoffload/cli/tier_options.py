"""Options of the tiers below the CPU tier, shared by ``simulate`` and ``sweep``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvoffload.cli import output
from kvoffload.sim import tier_model
from kvoffload.sim.run import RunReport, SimConfig, blocks_for_gib


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tiers below the CPU tier (blocks promoted back through the CPU tier on a hit)"
    )
    group.add_argument(
        "--disk-dir", metavar="PATH", help="local-disk tier in this directory (kept across runs)"
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument("--disk-gb", type=float, metavar="X", help="disk tier size in GiB")
    size.add_argument("--disk-blocks", type=int, metavar="N", help="disk tier size in blocks")
    group.add_argument(
        "--disk-policy", help="disk tier eviction policy (default: the CPU tier's --policy)"
    )
    group.add_argument(
        "--remote",
        metavar="URL",
        help="shared Valkey/Redis tier, e.g. redis://[user:pass@]host:port/0, rediss:// for "
        "TLS, or host:port,host:port,... for a Cluster's seed nodes",
    )
    group.add_argument(
        "--tier-store-threshold",
        type=int,
        default=0,
        help="write a block to disk/remote only after this many lookups; below 2: all (default: 0)",
    )
    for name, what, default in (
        ("disk-gb-per-s", "modelled disk bandwidth, GB/s", tier_model.DISK_GB_PER_S),
        ("disk-latency-ms", "modelled disk latency per batch", tier_model.DISK_LATENCY_MS),
        ("remote-gb-per-s", "modelled remote bandwidth, GB/s", tier_model.REMOTE_GB_PER_S),
        ("remote-latency-ms", "modelled remote latency per batch", tier_model.REMOTE_LATENCY_MS),
    ):
        group.add_argument(
            f"--{name}", type=float, default=default, help=f"{what} (default: {default:g})"
        )


def with_tiers(config: SimConfig, args: argparse.Namespace, block_tokens: int) -> SimConfig:
    """``config`` with the lower tiers the options ask for."""
    disk_blocks = 0
    if args.disk_dir is not None:
        disk_blocks = args.disk_blocks or 0
        if args.disk_gb is not None:
            disk_blocks = blocks_for_gib(args.disk_gb, config.layout, block_tokens)
    return dataclasses.replace(
        config,
        disk_dir=args.disk_dir,
        disk_blocks=disk_blocks,
        remote_url=args.remote,
        tier_store_threshold=args.tier_store_threshold,
        disk_policy=args.disk_policy,
        disk_gb_per_s=args.disk_gb_per_s,
        disk_latency_ms=args.disk_latency_ms,
        remote_gb_per_s=args.remote_gb_per_s,
        remote_latency_ms=args.remote_latency_ms,
    )


def separate_disk_dirs(configs: list[SimConfig]) -> list[SimConfig]:
    """One disk subdirectory per configuration, so parallel runs never share files."""
    return [
        dataclasses.replace(
            config,
            disk_dir=str(
                Path(config.disk_dir)
                / f"cpu{config.cpu_blocks}-{config.policy}-t{config.store_threshold}"
            ),
        )
        if config.disk_dir is not None
        else config
        for config in configs
    ]


def tier_rows(report: RunReport) -> list[tuple[str, str]]:
    """Table rows for the lower tiers of a run (none without them)."""
    rows = []
    for name, entry in report.tiers.items():
        if name == "cpu":
            continue
        rows.append(
            (
                f"{name} tier",
                f"{output.count(entry['hit_blocks'])} blocks hit "
                f"({output.size(entry['read_bytes'])}, modelled "
                f"{output.ratio(entry.get('read_seconds'))} s), "
                f"{output.count(entry['stored_blocks'])} stored "
                f"({output.size(entry['written_bytes'])}), "
                f"{output.count(entry['failed'])} failed, {output.count(entry['corrupt'])} corrupt",
            )
        )
    return rows
