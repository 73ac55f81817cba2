"""Our spec's manager against vLLM 0.33's own CPUOffloadingManager, through vLLM's per-key API.

Replays the Mooncake trace one request after another with
``kvoffload.integrations.vllm.replay`` (the driver the tests use) and prints,
per policy and store threshold, hit ratio and writes per block reference for
both managers, and the microseconds per block reference each spent, measured
in the same process (best of ``--repeat``), so the speed ratio holds under the
machine's load. ``--admission NAME`` puts that admission layer in front of
our tier only (vLLM has none), to show what it saves against vLLM's manager.
``--disk-blocks N`` puts a disk tier of N blocks under our CPU tier instead
and compares, for our stack under vLLM's API and for the simulator
(``kvoffload simulate --disk-dir``) over the same stack, the hits (CPU tier,
promotions included), the writes and the disk tier's figures; both with
the simulator's GPU cache of ``--gpu-blocks`` in front, the requests one
after another. Needs vLLM installed (see the README's set-up).

    python benchmarks/vllm_replay.py [--trace PATH] [--blocks N] [--repeat N] [--json PATH]
        [--admission NAME] [--disk-blocks N [--disk-admission NAME] [--gpu-blocks N]]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.admission import resolve_admission
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic_trace.jsonl"
)
CONFIGS = [("lru", 0), ("lru", 2), ("arc", 0), ("arc", 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--blocks", type=int, default=4392, help="tier size (default: 4392)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--admission", default="none", help="our admission layer (default: none)")
    parser.add_argument(
        "--disk-blocks", type=int, default=0, help="a disk tier: ours against the simulator"
    )
    parser.add_argument("--disk-admission", default="none", help="the disk tier's admission layer")
    parser.add_argument(
        "--gpu-blocks", type=int, default=878, help="GPU cache, with a disk tier (default: 878)"
    )
    args = parser.parse_args()
    if args.disk_blocks:
        _check_tiered(parser, args)
        try:
            tiered(args)
        except (KVOffloadError, OSError) as exc:  # the trace, the disk tier's directory
            parser.error(str(exc))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvoffload.integrations.vllm.adapter import VLLMManagerAdapter
        from kvoffload.integrations.vllm.offer_filter import OfferCountFilter
        from kvoffload.integrations.vllm.replay import replay
        from kvoffload.managers import StackConfig, build_cpu_stack
        from kvoffload.sim.traces import read_trace

    workload = read_trace(args.trace)
    n = args.blocks

    def ours(policy: str, threshold: int) -> Any:
        def build() -> Any:
            return build_cpu_stack(StackConfig(n, policy, admission=args.admission))

        return VLLMManagerAdapter(build, OfferCountFilter(threshold) if threshold >= 2 else None)

    def theirs(policy: str, threshold: int) -> Any:
        return CPUOffloadingManager(n, policy, store_threshold=threshold)

    def best(make: Callable[[], Any]) -> tuple[Any, float]:
        runs = []
        for _ in range(args.repeat):
            manager = make()
            started = time.perf_counter()
            result = replay(manager, workload.requests, workload.block_tokens)
            runs.append((time.perf_counter() - started, result))
        seconds, result = min(runs, key=lambda run: run[0])
        return result, seconds * 1e6 / result.refs

    rows = []
    print(
        "policy thr  hit vLLM  hit ours  wr/ref vLLM  wr/ref ours  "
        "us/ref vLLM  us/ref ours  speed-up"
    )
    for policy, threshold in CONFIGS:
        v, v_us = best(lambda: theirs(policy, threshold))  # noqa: B023 - called at once
        o, o_us = best(lambda: ours(policy, threshold))  # noqa: B023
        rows.append(
            {
                "policy": policy,
                "store_threshold": threshold,
                "ours_admission": args.admission,
                "vllm_hit_ratio": v.hit_ratio,
                "ours_hit_ratio": o.hit_ratio,
                "vllm_writes_per_ref": v.writes_per_ref,
                "ours_writes_per_ref": o.writes_per_ref,
                "vllm_us_per_ref": v_us,
                "ours_us_per_ref": o_us,
            }
        )
        print(
            f"{policy:<6} {threshold:>3}  {v.hit_ratio:8.4f}  {o.hit_ratio:8.4f}  "
            f"{v.writes_per_ref:11.4f}  {o.writes_per_ref:11.4f}  {v_us:11.2f}  {o_us:11.2f}  "
            f"{v_us / o_us:7.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


TIERED_FIGURES = [
    ("total hit", "total_hit_ratio", "{:.4f}"),
    ("offload hit", "offload_hit_ratio", "{:.4f}"),
    ("writes/ref", "writes_per_ref", "{:.4f}"),
    ("offload hit blocks", "offload_hit_blocks", "{}"),
    ("blocks written", "written_blocks", "{}"),
    ("disk blocks read", "disk_hit_blocks", "{}"),
    ("disk blocks written", "disk_stored_blocks", "{}"),
    ("disk offered/admitted", "disk_offered_admitted", "{}"),
    ("delayed lookups", "delayed_lookups", "{}"),
    ("disk rule/switches", "disk_rule_switches", "{}"),
]


def _check_tiered(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad tier options before the replays, naming the option."""
    if args.disk_blocks < 0:
        parser.error(f"--disk-blocks must be >= 0 (0: no disk tier), got {args.disk_blocks}")
    for option, value in (("--blocks", args.blocks), ("--gpu-blocks", args.gpu_blocks)):
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    try:
        resolve_admission(args.disk_admission)
    except InvalidArgumentError as exc:
        parser.error(f"--disk-admission: {exc}")


def tiered(args: argparse.Namespace) -> None:
    """Our CPU + disk stack under vLLM's API against the simulator over the same stack."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvoffload.integrations.vllm.adapter import VLLMManagerAdapter
        from kvoffload.integrations.vllm.replay import replay
        from kvoffload.sim.run import SimConfig, simulate
        from kvoffload.sim.traces import read_trace
        from kvoffload.sim.workload import Request, Workload
        from kvoffload.tiers import build_stack, fingerprint_of

    workload = read_trace(args.trace)
    block_tokens = workload.block_tokens

    def config(disk_dir: str) -> SimConfig:
        return SimConfig(
            args.gpu_blocks,
            args.blocks,
            admission=args.admission,
            disk_dir=disk_dir,
            disk_blocks=args.disk_blocks,
            disk_admission=args.disk_admission,
            bound=False,
        )

    with tempfile.TemporaryDirectory() as simulated_dir, tempfile.TemporaryDirectory() as ours_dir:
        simulated = config(simulated_dir)
        # One request after another, as the replay runs them: each arrives once the one
        # before has finished, so none runs while another waits for its promotion.
        apart = 1.0 + max(
            r.input_tokens / simulated.prefill_tokens_per_s
            + r.output_tokens / simulated.decode_tokens_per_s
            for r in workload.requests
        )
        spaced = [
            Request(i * apart, r.input_tokens, r.output_tokens, r.keys)
            for i, r in enumerate(workload.requests)
        ]
        report = simulate(Workload(workload.name, block_tokens, spaced), simulated)
        disk = report.tiers["disk"]
        rows = {
            "simulator": {
                "total_hit_ratio": report.total_hit_ratio,
                "offload_hit_ratio": report.offload_hit_ratio,
                "writes_per_ref": report.writes_per_ref,
                "offload_hit_blocks": report.offload_hit_blocks,
                "written_blocks": report.offload_blocks_written,
                "disk_hit_blocks": disk["hit_blocks"],
                "disk_stored_blocks": disk["stored_blocks"],
                "disk_offered_admitted": f"{disk['offered_blocks']}/{disk['admitted_blocks']}",
                "delayed_lookups": report.lookups_deferred,
                "disk_rule_switches": _rule(
                    disk.get("admission_candidate"), disk.get("admission_switches")
                ),
            }
        }
        ours = config(ours_dir)
        stack_config = ours.stack_config(
            fingerprint_of("vllm_replay", args.trace.name),
            bytes_per_block=ours.engine_config(block_tokens).bytes_per_block,
        )
        stacks: list[Any] = []

        def build() -> Any:
            stacks.append(build_stack(stack_config))
            return stacks[-1]

        result = replay(VLLMManagerAdapter(build), spaced, block_tokens, args.gpu_blocks)
        (stack,) = stacks
        stack.close()
        (disk_tier,) = stack.tiered.tiers
        layer = None if stack.disk_admission is None else stack.disk_admission.stats()
        candidate, switches = ("", 0) if layer is None else (layer.candidate, layer.switches)
        rows["ours (vLLM API)"] = {
            "total_hit_ratio": result.total_hit_ratio,
            "offload_hit_ratio": result.hit_ratio,
            "writes_per_ref": result.writes_per_ref,
            "offload_hit_blocks": result.hit_blocks,
            "written_blocks": result.written_blocks,
            "disk_hit_blocks": disk_tier.stats.hit_blocks,
            "disk_stored_blocks": disk_tier.stats.stored_blocks,
            "disk_offered_admitted": (
                f"{stack.tiered.offered_blocks[0]}/{stack.tiered.admitted_blocks[0]}"
            ),
            "delayed_lookups": result.delayed_scans,
            "disk_rule_switches": _rule(candidate, switches),
        }
    print(
        f"CPU tier {args.blocks} blocks ({args.admission}), disk tier {args.disk_blocks} blocks "
        f"({args.disk_admission}), GPU cache {args.gpu_blocks} blocks"
    )
    print(f"{'':<22}" + "".join(f"{side:>18}" for side in rows))
    for label, field, form in TIERED_FIGURES:
        print(f"{label:<22}" + "".join(f"{form.format(row[field]):>18}" for row in rows.values()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def _rule(candidate: str | None, switches: int | None) -> str:
    """An optimising layer's rule and switches (``-``: the tier has no such layer)."""
    return "-" if not candidate else f"{candidate}/{switches}"


if __name__ == "__main__":
    main()
