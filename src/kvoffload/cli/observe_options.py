"""``simulate``'s options for what the outside world sees: KV events and Prometheus metrics.

pyzmq, msgspec and prometheus_client are imported only when an option asks
for them, with one clear line naming the extra to install if they are absent.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.observe import ObservedManager, Observers
from kvoffload.observe.transfers import ObservedWorker


def add_observe_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV events and metrics")
    group.add_argument(
        "--kv-events-endpoint",
        metavar="URL",
        help="publish the tier's KV events as vLLM does, binding a ZMQ PUB socket here "
        "(e.g. tcp://127.0.0.1:5557)",
    )
    group.add_argument(
        "--kv-events-replay-endpoint",
        metavar="URL",
        help="serve missed KV event batches to late or gapped subscribers here (ZMQ ROUTER)",
    )
    group.add_argument(
        "--kv-events-topic", default="kvoffload", help="topic of the KV events (default: kvoffload)"
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT during the replay",
    )
    group.add_argument(
        "--serve-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the events and metrics endpoints up this long after the replay (default: 0)",
    )


def _require(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise KVOffloadError(
            f"this option needs {exc.name}; install it with: pip install 'kvoffload[{extra}]'"
        ) from None


@contextmanager
def observing(args: argparse.Namespace, block_tokens: int) -> Iterator[Observers | None]:
    """The run's observers, or ``None`` when no option asks for one; endpoints close on exit."""
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.serve_after < 0:
        raise InvalidArgumentError(f"--serve-after must be >= 0, got {args.serve_after}")
    if not args.kv_events_endpoint and args.metrics_port is None:
        yield None
        return
    sinks: list[Callable[[Any], None]] = []
    hooks: list[Callable[[ObservedManager], None]] = []
    transfer_hooks: list[Callable[[ObservedWorker], None]] = []
    with ExitStack() as stack:
        if args.kv_events_endpoint:
            publisher_module = _require("kvoffload.observe.publisher", "events")
            publisher = stack.enter_context(
                publisher_module.KVEventPublisher(
                    args.kv_events_endpoint,
                    args.kv_events_replay_endpoint,
                    topic=args.kv_events_topic,
                    block_size=block_tokens,
                )
            )
            sinks.append(publisher.publish)
        if args.metrics_port is not None:
            metrics = _require("kvoffload.observe.metrics", "metrics")
            server = stack.enter_context(metrics.MetricsServer(args.metrics_port))

            def register(observed: ObservedManager) -> None:
                server.add(metrics.ManagerCollector(lambda: observed.counters, {"tier": "cpu"}))

            def register_transfers(observed: ObservedWorker) -> None:
                server.add(metrics.TransferCollector(observed.latency))

            hooks.append(register)
            transfer_hooks.append(register_transfers)
        yield Observers(tuple(sinks), tuple(hooks), tuple(transfer_hooks))
        if args.serve_after > 0:
            time.sleep(args.serve_after)
