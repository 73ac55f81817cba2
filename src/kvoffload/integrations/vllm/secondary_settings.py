"""The settings of our secondary tiers, read from one entry of vLLM's ``secondary_tiers`` list.

No vLLM import: an entry is plain data, checked whole before anything opens,
so a typo or a bad value stops start-up with one error naming the tier and
the key instead of a default silently taken. vLLM's factory removes ``type``,
``module_path`` and ``backpressure`` before the tier sees the rest; the
class-level checks (made while vLLM builds its metric definitions) see them
and skip them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.admission import available_admissions, config_params
from kvoffload.admission.registry import ParamPairs
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.policies import available_policies
from kvoffload.tiers.url import parse_remote_url

VLLM_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys vLLM's own tiering reads from a tier entry; accepted and left to it."""

COMMON_KEYS = frozenset(
    {"admission", "admission_params", "offer_hits", "io_threads", "enable_kv_events", "locality"}
)
DISK_KEYS = COMMON_KEYS | {"disk_dir", "disk_bytes", "eviction_policy", "fsync"}
SHARED_KEYS = COMMON_KEYS | {"url", "remote_bytes"}

DEFAULT_ADMISSION = "recommended"
"""What decides the cascade unless the entry says otherwise; ``none`` writes every store."""

LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class SecondarySettings:
    """One checked tier entry. ``capacity_bytes`` sizes the admission layer's memory
    (and, for the disk tier, the slot file); ``target`` is the directory or URL."""

    tier_type: str
    target: str
    capacity_bytes: int
    admission: str = DEFAULT_ADMISSION
    admission_params: ParamPairs = ()
    """The admission rule's parameters (entry key ``admission_params``: name to value)."""
    offer_hits: bool = True
    eviction_policy: str = "lru"
    io_threads: int = 2
    fsync: bool = False
    enable_kv_events: bool = False
    locality: str | None = None


def parse_disk_settings(tier_type: str, entry: Mapping[str, Any]) -> SecondarySettings:
    """The disk tier's entry: ``disk_dir`` and ``disk_bytes`` are required."""
    _check_keys(tier_type, entry, DISK_KEYS)
    policy = entry.get("eviction_policy", "lru")
    if policy not in available_policies():
        raise _error(
            tier_type,
            "eviction_policy",
            f"{policy!r} is not a kvoffload policy; known: {', '.join(available_policies())}",
        )
    return SecondarySettings(
        tier_type=tier_type,
        target=_required_str(tier_type, entry, "disk_dir"),
        capacity_bytes=_int(tier_type, entry, "disk_bytes", 1, None),
        admission=_admission(tier_type, entry),
        admission_params=_admission_params(tier_type, entry),
        offer_hits=_bool(tier_type, entry, "offer_hits", True),
        eviction_policy=str(policy),
        io_threads=_int(tier_type, entry, "io_threads", 1, 2),
        fsync=_bool(tier_type, entry, "fsync"),
        enable_kv_events=_bool(tier_type, entry, "enable_kv_events"),
        locality=_locality(tier_type, entry, None),
    )


def parse_shared_settings(tier_type: str, entry: Mapping[str, Any]) -> SecondarySettings:
    """The shared tier's entry: ``url`` is required, and ``remote_bytes`` (this instance's
    share of the server, which sizes the admission layer) unless admission is ``none``."""
    _check_keys(tier_type, entry, SHARED_KEYS)
    admission = _admission(tier_type, entry)
    needs_bytes = admission != "none"
    url = _required_str(tier_type, entry, "url")
    try:
        parse_remote_url(url)  # its syntax now; the server answers when the tier opens
    except InvalidArgumentError as exc:
        raise _error(tier_type, "url", str(exc)) from None
    return SecondarySettings(
        tier_type=tier_type,
        target=url,
        capacity_bytes=_int(
            tier_type, entry, "remote_bytes", 1 if needs_bytes else 0, None if needs_bytes else 0
        ),
        admission=admission,
        admission_params=_admission_params(tier_type, entry),
        offer_hits=_bool(tier_type, entry, "offer_hits", True),
        io_threads=_int(tier_type, entry, "io_threads", 1, 2),
        enable_kv_events=_bool(tier_type, entry, "enable_kv_events"),
        locality=_locality(tier_type, entry, "REMOTE"),
    )


def _error(tier_type: str, key: str, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"secondary tier {tier_type!r} key {key!r}: {what}")


def _check_keys(tier_type: str, entry: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(entry) - known - VLLM_KEYS)
    if unknown:
        raise _error(tier_type, unknown[0], f"unknown key; known: {', '.join(sorted(known))}")


def _admission(tier_type: str, entry: Mapping[str, Any]) -> str:
    name = entry.get("admission", DEFAULT_ADMISSION)
    if name not in available_admissions():
        raise _error(
            tier_type,
            "admission",
            f"{name!r} is not a kvoffload admission layer; "
            f"known: {', '.join(available_admissions())}",
        )
    return str(name)


def _admission_params(tier_type: str, entry: Mapping[str, Any]) -> ParamPairs:
    return config_params(
        _admission(tier_type, entry),
        entry.get("admission_params"),
        f"secondary tier {tier_type!r} key 'admission_params'",
    )


def _required_str(tier_type: str, entry: Mapping[str, Any], key: str) -> str:
    value = entry.get(key)
    if value is None:
        raise _error(tier_type, key, "required")
    if not isinstance(value, str) or not value:
        raise _error(tier_type, key, f"must be a non-empty string, got {value!r}")
    return value


def _int(
    tier_type: str, entry: Mapping[str, Any], key: str, minimum: int, default: int | None
) -> int:
    value = entry.get(key, default)
    if value is None:
        raise _error(tier_type, key, "required")
    # JSON from the command line: accept numeric strings, as vLLM's own keys do.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(tier_type, key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _bool(tier_type: str, entry: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise _error(tier_type, key, f"must be true or false, got {value!r}")
    return value


def _locality(tier_type: str, entry: Mapping[str, Any], default: str | None) -> str | None:
    value = entry.get("locality", default)
    if value is None:
        return None
    if value not in LOCALITIES:
        raise _error(tier_type, "locality", f"one of {', '.join(LOCALITIES)}, got {value!r}")
    return str(value)
