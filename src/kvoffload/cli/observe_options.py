"""``simulate``'s options for what the outside world sees: KV events and Prometheus metrics.

pyzmq, msgspec and prometheus_client are imported only when an option asks
for them, with one clear line naming the extra to install if they are absent.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import ipaddress
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvoffload.admission import AdmissionLayer, find_admission
from kvoffload.cli.options import integer, number
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.manager import OffloadingManager, find_layer
from kvoffload.core.tier_protocol import LowerTier
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.observe import ObservedManager, Observers
from kvoffload.observe.transfers import ObservedWorker
from kvoffload.sim.tier_model import recovery_counts

MAX_SERVE_AFTER = 7 * 24 * 3600.0
"""A week: longer is surely a typo (and beyond what ``time.sleep`` takes on some systems)."""
MAX_PORT = 65535
"""The largest TCP port: a --metrics-port or an endpoint's."""

ENDPOINT_SCHEMES = ("tcp://", "ipc://")
"""ZMQ transports a subscriber in another process can reach."""

DEFAULT_TOPIC = "kvoffload"
CHOSEN_AT_RUN_TIME = (":0", ":*")
"""How an endpoint asks for any free port: the one bound is then told on stderr."""


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
    group.add_argument(  # no default here: given without the events, it is refused
        "--kv-events-topic", help=f"topic of the KV events (default: {DEFAULT_TOPIC})"
    )
    group.add_argument(
        "--metrics-port",
        type=integer(0, MAX_PORT),
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT during the replay (0: any free port)",
    )
    group.add_argument(
        "--serve-after",
        type=number(0.0, maximum=MAX_SERVE_AFTER),
        default=0.0,
        metavar="SECONDS",
        help="keep the events and metrics endpoints up this long after the replay, at most a "
        f"week ({MAX_SERVE_AFTER:.0f}) (default: 0)",
    )


EVENTS_MODULE = "kvoffload.observe.publisher"
METRICS_MODULE = "kvoffload.observe.metrics"


def _require(module: str, extra: str, option: str) -> ModuleType:
    """``module``, or one line naming ``option`` and the extra that installs what it lacks."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise KVOffloadError(
            f"{option} needs {exc.name}; install it with: pip install 'kvoffload[{extra}]'"
        ) from None


def _topic(args: argparse.Namespace) -> str:
    """The KV events' topic: as given (an empty one too), or the default."""
    return DEFAULT_TOPIC if args.kv_events_topic is None else str(args.kv_events_topic)


def check_before_work(args: argparse.Namespace) -> None:
    """Refuse bad endpoints, ports, topics and combinations before the workload is built.

    A port already in use is found here by a trial bind, so a typo costs no replay.
    """
    events, replay = args.kv_events_endpoint, args.kv_events_replay_endpoint
    if replay and not events:
        raise InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    topic = args.kv_events_topic
    if topic is not None and not events:  # it would be ignored, unsaid
        raise InvalidArgumentError("--kv-events-topic needs --kv-events-endpoint")
    if args.serve_after > 0 and not events and args.metrics_port is None:
        raise InvalidArgumentError("--serve-after needs --kv-events-endpoint or --metrics-port")
    # An extra left out is found here, not once the workload is built.
    if events:
        _require(EVENTS_MODULE, "events", "--kv-events-endpoint")
    port = args.metrics_port
    if port is not None:
        _require(METRICS_MODULE, "metrics", "--metrics-port")
        _check_free("127.0.0.1", port, f"--metrics-port {port}")
    if events and events == replay and not events.endswith(CHOSEN_AT_RUN_TIME):
        raise InvalidArgumentError(
            f"--kv-events-endpoint and --kv-events-replay-endpoint are both {events!r}"
        )
    for option, endpoint in (
        ("--kv-events-endpoint", events),
        ("--kv-events-replay-endpoint", replay),
    ):
        if not endpoint:
            continue
        _check_endpoint(endpoint, option)
        # Both trial binds pass, one after the other; the two servers would not.
        if port and _tcp_port(endpoint) == port:
            raise InvalidArgumentError(
                f"--metrics-port {port} and {option} {endpoint!r} both bind port {port}: "
                "give them different ports"
            )
    try:
        _topic(args).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"--kv-events-topic must be UTF-8 text, got {topic!r}") from None


def _check_endpoint(endpoint: str, option: str) -> None:
    """``tcp://HOST:PORT`` (PORT 0..65535 or ``*``, an IPv6 HOST in brackets, as ZMQ binds it)
    or ``ipc://PATH``; a TCP port must be free."""
    if not endpoint.startswith(ENDPOINT_SCHEMES):
        raise InvalidArgumentError(f"{option} {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    address = endpoint.split("://", 1)[1]
    if endpoint.startswith("ipc://"):
        if not address:
            raise InvalidArgumentError(f"{option} {endpoint!r}: expected ipc://PATH")
        return
    host, _, port_text = address.rpartition(":")
    if not host or not port_text:
        raise InvalidArgumentError(f"{option} {endpoint!r}: expected tcp://HOST:PORT")
    if ":" in host and not host.startswith("["):
        raise InvalidArgumentError(
            f"{option} {endpoint!r}: an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT"
        )
    if port_text == "*":
        return
    if not port_text.isdigit() or int(port_text) > MAX_PORT:
        raise InvalidArgumentError(
            f"{option} {endpoint!r}: the port must be 0..65535 or *, got {port_text!r}"
        )
    host = host.strip("[]")
    if host == "*":
        host = "0.0.0.0"
    what = f"{option} {endpoint!r}"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host in _interface_names():
            return  # ZMQ binds the interface's own address
        host = _host_address(host, what)
    _check_free(host, int(port_text), what)


def _tcp_port(endpoint: str) -> int | None:
    """The port a checked endpoint binds, if it names one (a ``tcp://`` one, not ``*``)."""
    port_text = endpoint.rpartition(":")[2]
    return int(port_text) if endpoint.startswith("tcp://") and port_text.isdigit() else None


def _interface_names() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:  # not offered here: every name is then taken for a host's
        return set()


def _host_address(name: str, what: str) -> str:
    """The address ``name`` resolves to, to bind: a name that resolves to none was refused
    only by ZMQ, once the workload had been built ("No such device"), naming no option."""
    try:
        return str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError):
        raise InvalidArgumentError(
            f"{what}: cannot bind: no interface or host named {name!r}"
        ) from None


def _check_free(host: str, port: int, what: str) -> None:
    """A trial bind, closed at once: a port in use or an address not on this machine is refused."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise InvalidArgumentError(f"{what}: cannot bind: {reason}") from None


def lower_tiers(manager: OffloadingManager) -> list[LowerTier]:
    """The tiers below the CPU tier of the stack under ``manager``'s wrappers (none if flat)."""
    tiered = find_layer(manager, TieredOffloadingManager)
    return [] if tiered is None else tiered.tiers


def lower_tier_admissions(manager: OffloadingManager) -> list[tuple[str, AdmissionLayer]]:
    """``(tier name, its own admission layer)`` for each lower tier that has one."""
    tiered = find_layer(manager, TieredOffloadingManager)
    if tiered is None:
        return []
    return [
        (tier.medium.lower(), layer)
        for tier, layer in zip(tiered.tiers, tiered.admissions, strict=True)
        if layer is not None
    ]


def recovery_by_tier(tiers: list[LowerTier]) -> dict[str, dict[str, int]]:
    """Each tier's start-up recovery counts, for those that recover anything (the disk)."""
    counts = {tier.medium.lower(): recovery_counts(tier) for tier in tiers}
    return {name: found for name, found in counts.items() if found}


@dataclass(frozen=True)
class Observing:
    """The run's observers (``None`` when no option asks for one) and what settles them."""

    observers: Observers | None = None
    flushes: tuple[Callable[[], None], ...] = ()

    def settle(self) -> None:
        """Wait until every KV event batch is sent and replayable.

        Called before the results are written, so that whoever sees the
        results can catch up on every event through the replay socket.
        """
        for flush in self.flushes:
            flush()


def _tell(what: str, requested: str, bound: str) -> None:
    """Name an endpoint whose port was picked when binding: nobody could connect otherwise."""
    if requested.endswith(CHOSEN_AT_RUN_TIME):
        print(f"kvoffload: {what} {bound}", file=sys.stderr)


@contextmanager
def observing(args: argparse.Namespace, block_tokens: int) -> Iterator[Observing]:
    """The run's observers; endpoints close on exit.

    :func:`check_before_work` has checked the options.
    """
    if not args.kv_events_endpoint and args.metrics_port is None:
        yield Observing()
        return
    flushes: list[Callable[[], None]] = []
    sinks: list[Callable[[Any], None]] = []
    hooks: list[Callable[[ObservedManager], None]] = []
    transfer_hooks: list[Callable[[ObservedWorker], None]] = []
    with ExitStack() as stack:
        if args.kv_events_endpoint:
            publisher_module = _require(EVENTS_MODULE, "events", "--kv-events-endpoint")
            publisher = stack.enter_context(
                publisher_module.KVEventPublisher(
                    args.kv_events_endpoint,
                    args.kv_events_replay_endpoint,
                    topic=_topic(args),
                    block_size=block_tokens,
                )
            )
            sinks.append(publisher.publish)
            flushes.append(publisher.flush)
            _tell("KV events on", args.kv_events_endpoint, publisher.endpoint)
            if args.kv_events_replay_endpoint:
                _tell(
                    "KV event replay on", args.kv_events_replay_endpoint, publisher.replay_endpoint
                )
        if args.metrics_port is not None:
            metrics = _require(METRICS_MODULE, "metrics", "--metrics-port")
            server = stack.enter_context(metrics.MetricsServer(args.metrics_port))
            if args.metrics_port == 0:
                print(
                    f"kvoffload: metrics on http://127.0.0.1:{server.port}/metrics", file=sys.stderr
                )

            def register(observed: ObservedManager) -> None:
                server.add(metrics.ManagerCollector(lambda: observed.counters, {"tier": "cpu"}))
                tiers = lower_tiers(observed)
                if tiers:
                    server.add(metrics.RecoveryCollector(lambda: recovery_by_tier(tiers)))
                    server.add(metrics.TierCountsCollector(lambda: metrics.tier_counts(tiers)))
                layer = find_admission(observed)
                if layer is not None:
                    server.add(metrics.AdmissionCollector(layer.stats))
                for tier, tier_layer in lower_tier_admissions(observed):
                    server.add(metrics.AdmissionCollector(tier_layer.stats, tier))

            def register_transfers(observed: ObservedWorker) -> None:
                server.add(metrics.TransferCollector(observed.latency))

            hooks.append(register)
            transfer_hooks.append(register_transfers)
        yield Observing(
            Observers(tuple(sinks), tuple(hooks), tuple(transfer_hooks)), tuple(flushes)
        )
        if args.serve_after > 0:
            # The results are out and the command seems done: say why it has not returned.
            print(
                f"kvoffload: results written; the endpoints stay up {args.serve_after:g} s "
                "more (--serve-after; Ctrl-C ends it)",
                file=sys.stderr,
            )
            time.sleep(args.serve_after)
