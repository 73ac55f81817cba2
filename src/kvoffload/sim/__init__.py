"""Replay serving workloads through a GPU prefix cache and the offload tiers.

Layers, each replaceable: workloads (trace readers and generators), the
engine model that drives an :class:`~kvoffload.core.manager.OffloadingManager`,
and runs, sweeps and bounds built on them. Plotting lives in
:mod:`kvoffload.sim.plots` and needs the ``plot`` extra.
"""

from kvoffload.sim.belady import BeladyResult, belady_bound
from kvoffload.sim.engine import EngineConfig, EngineStats, ServingEngine
from kvoffload.sim.generators import DEFAULT_MIX, generate, parse_mix
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.run import RunReport, SimConfig, blocks_for_gib, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.sweep import run_sweep, sweep_configs
from kvoffload.sim.trace_stats import TraceStats, trace_stats
from kvoffload.sim.traces import TraceFormatError, read_trace
from kvoffload.sim.transfers import NullTransferBackend, TransferBackend
from kvoffload.sim.workload import Request, Workload

__all__ = [
    "DEFAULT_MIX",
    "BeladyResult",
    "EngineConfig",
    "EngineStats",
    "GPUPrefixCache",
    "NullTransferBackend",
    "Request",
    "RunReport",
    "ServingEngine",
    "SimConfig",
    "TraceFormatError",
    "TraceStats",
    "TransferBackend",
    "Workload",
    "WorkloadSource",
    "belady_bound",
    "blocks_for_gib",
    "generate",
    "parse_mix",
    "read_trace",
    "run_sweep",
    "simulate",
    "sweep_configs",
    "trace_stats",
]
