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
from dataclasses import dataclass, replace
from typing import Any, cast

from kvoffload.admission import WriteBudget, parse_bytes
from kvoffload.admission.params import read_integer
from kvoffload.admission.registry import ParamPairs, params_json
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.integrations.vllm.settings import MAX_BYTES
from kvoffload.managers.stack import DISK, REMOTE, LowerTierConfig
from kvoffload.tiers.disk import check_timeout_ms
from kvoffload.tiers.slot_file import slot_note, slots_within
from kvoffload.tiers.url import parse_remote_url

VLLM_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys vLLM's own tiering reads from a tier entry; accepted and left to it."""

COMMON_KEYS = frozenset(
    {
        "admission",
        "admission_params",
        "write_budget",
        "offer_hits",
        "io_threads",
        "enable_kv_events",
        "locality",
        "max_pending_write_bytes",
    }
)
DISK_KEYS = COMMON_KEYS | {"disk_dir", "disk_bytes", "eviction_policy", "fsync", "disk_timeout_ms"}
SHARED_KEYS = COMMON_KEYS | {"url", "remote_bytes"}

DEFAULT_ADMISSION = "recommended"
"""What decides the cascade unless the entry says otherwise; ``none`` writes every store."""

LOCALITIES = ("LOCAL", "REMOTE")

TIER_KEYS = {
    "location": "disk_dir",
    "blocks": "disk_bytes",
    "policy": "eviction_policy",
    "deadline_s": "disk_timeout_ms",
    "admission": "admission",
    "admission_params": "admission_params",
    "write_budget": "write_budget",
    "io_threads": "io_threads",
    "fsync": "fsync",
}
"""The entry's key of each :class:`LowerTierConfig` field, as its errors name them."""


@dataclass(frozen=True)
class SecondarySettings:
    """One checked tier entry. ``tier``: the tier and its admission layer as the stack
    builder opens them (:func:`~kvoffload.tiers.stack.tier_opener`,
    :func:`~kvoffload.tiers.stack.tier_book`), its size in blocks ``None`` until the CPU
    tier's chunk size is known; ``capacity_bytes`` sizes it (and the admission layer's
    memory). ``write_budget`` is the entry's as written, sized in chunks at open."""

    tier_type: str
    tier: LowerTierConfig
    capacity_bytes: int
    write_budget: WriteBudget | None = None
    offer_hits: bool = True
    enable_kv_events: bool = False
    locality: str | None = None
    max_pending_write_bytes: int | None = None
    """Bytes of vLLM's CPU chunks the tier's cascades queued or under way may pin before a
    cascade offered is refused; ``None``: the tier's default
    (:func:`~kvoffload.tiers.backlog.default_pending_bytes` of its I/O threads)."""

    @property
    def admission(self) -> str:
        return self.tier.admission

    @property
    def admission_params(self) -> ParamPairs:
        """The admission rule's parameters (entry key ``admission_params``: name to value)."""
        return cast(ParamPairs, self.tier.admission_params or ())

    def sized(self, block_bytes: int) -> LowerTierConfig:
        """The tier in blocks of ``block_bytes`` (the chunk's KV bytes); a size that holds no
        block (and is needed) names its key."""
        if self.tier.kind == DISK:  # the whole slot file (superblock, headers) fits
            blocks = slots_within(self.capacity_bytes, block_bytes)
            slot = f" ({slot_note(block_bytes)})"
        else:
            blocks, slot = self.capacity_bytes // block_bytes, ""
        if blocks < 1 and (self.tier.kind == DISK or self.tier.admission != "none"):
            raise InvalidArgumentError(
                f"{self.tier.where}{self.tier.key('blocks')}: {self.capacity_bytes} holds no "
                f"block of {block_bytes} bytes{slot}"
            )
        budget = self.write_budget
        if budget is not None:
            budget = budget.sized(block_bytes, self.capacity_bytes or None)
            try:
                budget.check()
            except InvalidArgumentError as exc:
                raise _error(self.tier_type, "write_budget", str(exc)) from None
        return replace(self.tier, blocks=blocks, write_budget=budget)


def parse_disk_settings(tier_type: str, entry: Mapping[str, Any]) -> SecondarySettings:
    """The disk tier's entry: ``disk_dir`` and ``disk_bytes`` are required."""
    _check_keys(tier_type, entry, DISK_KEYS)
    entry = set_keys(entry)
    timeout = entry.get("disk_timeout_ms")
    if timeout is not None:
        where = f"secondary tier {tier_type!r} key 'disk_timeout_ms'"
        timeout = check_timeout_ms(timeout, where) / 1000
    budget = _budget(tier_type, entry)
    tier = _tier(
        tier_type,
        entry,
        DISK,
        _required_str(tier_type, entry, "disk_dir"),
        budget,
        policy=entry.get("eviction_policy", "lru"),
        deadline_s=timeout,
        fsync=entry.get("fsync", False),
    )
    return SecondarySettings(
        tier_type=tier_type,
        tier=tier,
        capacity_bytes=_int(tier_type, entry, "disk_bytes", 1, None),
        write_budget=budget,
        offer_hits=_bool(tier_type, entry, "offer_hits", True),
        enable_kv_events=_bool(tier_type, entry, "enable_kv_events"),
        locality=_locality(tier_type, entry, None),
        max_pending_write_bytes=_pending_bound(tier_type, entry),
    )


def parse_shared_settings(tier_type: str, entry: Mapping[str, Any]) -> SecondarySettings:
    """The shared tier's entry: ``url`` is required, and ``remote_bytes`` (this instance's
    share of the server, which sizes the admission layer) unless admission is ``none``."""
    _check_keys(tier_type, entry, SHARED_KEYS)
    entry = set_keys(entry)
    url = _required_str(tier_type, entry, "url")
    try:
        parse_remote_url(url)  # its syntax now; the server answers when the tier opens
    except InvalidArgumentError as exc:
        raise _error(tier_type, "url", str(exc)) from None
    budget = _budget(tier_type, entry)
    tier = _tier(tier_type, entry, REMOTE, url, budget)
    needs_bytes = tier.admission != "none"
    return SecondarySettings(
        tier_type=tier_type,
        tier=tier,
        capacity_bytes=_int(
            tier_type, entry, "remote_bytes", 1 if needs_bytes else 0, None if needs_bytes else 0
        ),
        write_budget=budget,
        offer_hits=_bool(tier_type, entry, "offer_hits", True),
        enable_kv_events=_bool(tier_type, entry, "enable_kv_events"),
        locality=_locality(tier_type, entry, "REMOTE"),
        max_pending_write_bytes=_pending_bound(tier_type, entry),
    )


def _tier(
    tier_type: str,
    entry: Mapping[str, Any],
    kind: str,
    location: str,
    budget: WriteBudget | None,
    **fields: Any,
) -> LowerTierConfig:
    """The entry's tier settings, checked by :class:`LowerTierConfig` (naming its keys);
    its size stays unknown (``None``) until the chunk size is."""
    names = {name: f"key {key!r}" for name, key in TIER_KEYS.items()}
    if kind == REMOTE:
        names.update(location="key 'url'", blocks="key 'remote_bytes'")
    return LowerTierConfig(
        kind,
        location,
        None,
        admission=entry.get("admission", DEFAULT_ADMISSION),
        admission_params=_admission_params(tier_type, entry),
        write_budget=budget,
        io_threads=_integral(entry.get("io_threads", 2)),
        where=f"secondary tier {tier_type!r} ",
        names=names,
        **fields,
    )


def _error(tier_type: str, key: str, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"secondary tier {tier_type!r} key {key!r}: {what}")


def _check_keys(tier_type: str, entry: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(entry) - known - VLLM_KEYS, key=repr)
    if unknown:
        raise _error(
            tier_type,
            unknown[0],
            f"unknown key; known: {', '.join(sorted(known))} and vLLM's "
            f"{', '.join(sorted(VLLM_KEYS))}",
        )


def set_keys(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The entry's keys with a value: a key set to ``null`` is left unset, its default
    taken, as a YAML or JSON config writes a setting it leaves alone (a ``null`` locality
    gave no locality, a ``null`` ``remote_bytes`` beside ``admission: none`` was "required")."""
    return {key: value for key, value in entry.items() if value is not None}


def _admission_params(tier_type: str, entry: Mapping[str, Any]) -> object:
    """The entry's admission parameters as name-value pairs (JSON text decoded); checked
    against the rule by :class:`LowerTierConfig`."""
    value = entry.get("admission_params")
    if isinstance(value, str):
        try:
            value = params_json(value)
        except InvalidArgumentError as exc:
            raise _error(tier_type, "admission_params", str(exc)) from None
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return tuple(sorted(value.items()))
    return value


def _budget(tier_type: str, entry: Mapping[str, Any]) -> WriteBudget | None:
    """The entry's write budget as written (its rule is checked with the tier's settings)."""
    value = entry.get("write_budget")
    if value is None:
        return None
    try:
        return WriteBudget.parse(value)
    except InvalidArgumentError as exc:
        raise _error(tier_type, "write_budget", str(exc)) from None


def _pending_bound(tier_type: str, entry: Mapping[str, Any]) -> int | None:
    """The entry's bound on the CPU chunk bytes its cascades pin: a byte count or a size
    (``"512MiB"``), as the spec's ``*_max_pending_write_bytes``; ``None`` if unset."""
    value = entry.get("max_pending_write_bytes")
    if value is None:
        return None
    return parse_bytes(value, f"secondary tier {tier_type!r} key 'max_pending_write_bytes'")


def _integral(value: Any) -> Any:
    """A count as JSON from the command line may spell it (``"4"``, ``4.0``) as an int;
    anything else unchanged, for the check to refuse."""
    if isinstance(value, str) and (whole := read_integer(value)) is not None:
        return whole
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _required_str(tier_type: str, entry: Mapping[str, Any], key: str) -> str:
    """A required text setting; blank (spaces, a newline from a template) is refused as empty
    is: a ``disk_dir`` of ``" "`` made a directory of that name in vLLM's working directory."""
    value = entry.get(key)
    if value is None:
        raise _error(tier_type, key, "required")
    if not isinstance(value, str) or not value.strip():
        raise _error(tier_type, key, f"must be a non-blank string, got {value!r}")
    return value


def _int(
    tier_type: str, entry: Mapping[str, Any], key: str, minimum: int, default: int | None
) -> int:
    value = _integral(entry.get(key, default))
    if value is None:
        raise _error(tier_type, key, "required")
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_BYTES:
        raise _error(tier_type, key, f"must be an integer in {minimum}..{MAX_BYTES}, got {value!r}")
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
