"""The spec's settings, read from vLLM's ``kv_connector_extra_config`` mapping.

No vLLM import here: the mapping is plain data, and checking it up front
turns a typo into one clear error at start-up rather than a default silently
taken. Keys are vLLM's own (what users of its CPU offloading already write)
plus kvoffload's, all under the :data:`PREFIX`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.admission import (
    WriteBudget,
    available_admissions,
    config_params,
    parse_bytes,
    resolve_admission,
)
from kvoffload.admission.budget import DWPD
from kvoffload.admission.params import read_integer
from kvoffload.admission.registry import ParamPairs
from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD, MAX_TRACKED_KEYS
from kvoffload.core.errors import InvalidArgumentError, brief
from kvoffload.managers.stack import DISK, REMOTE, LowerTierConfig
from kvoffload.policies import available_policies
from kvoffload.tiers.disk import DEFAULT_TIMEOUT_MS, check_timeout_ms

PREFIX = "kvoffload."
"""kvoffload's own keys start with this."""

SPEC_KEYS = frozenset(
    {"cpu_bytes_to_use", "eviction_policy", "store_threshold", "max_tracker_size"}
)
"""vLLM's CPU offloading keys that this spec reads."""

CONNECTOR_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
    }
)
"""Keys that vLLM's offloading connector itself reads; accepted and left to it."""

MAX_BYTES = 2**63 - 1
"""The most bytes one CPU buffer (a torch tensor, a shared-memory file) or one file can
hold: each worker's CPU tier is one buffer, the disk tier one file; a shared tier's size
past it is a typo too."""

ADMISSION_KEY = f"{PREFIX}admission"
"""An admission layer by name (``kvoffload.admission`` registry); ``none`` stores everything."""

ADMISSION_PARAMS_KEY = f"{PREFIX}admission_params"
"""The admission rule's parameters: a mapping (or JSON text of one) of name to value."""

REMOTE_URL_KEY = f"{PREFIX}remote_url"
"""The shared tier's address (``kvoffload.tiers`` URL syntax), checked by connecting at start-up."""

DISK_DIR_KEY = f"{PREFIX}disk_dir"
DISK_BYTES_KEY = f"{PREFIX}disk_bytes"
"""A local-disk tier: its directory and size; each needs the other."""

DISK_ADMISSION_KEY = f"{PREFIX}disk_admission"
DISK_ADMISSION_PARAMS_KEY = f"{PREFIX}disk_admission_params"
DISK_WRITE_BUDGET_KEY = f"{PREFIX}disk_write_budget"
REMOTE_ADMISSION_KEY = f"{PREFIX}remote_admission"
REMOTE_ADMISSION_PARAMS_KEY = f"{PREFIX}remote_admission_params"
REMOTE_WRITE_BUDGET_KEY = f"{PREFIX}remote_write_budget"
REMOTE_BYTES_KEY = f"{PREFIX}remote_bytes"
"""Each lower tier's own admission layer, its parameters (as ``admission_params`` the CPU
tier's) and write budget (writes per block reference reaching it); the shared tier's size
as its admission layer models it."""
TIER_ADMISSION_KEYS = frozenset(
    {
        DISK_ADMISSION_KEY,
        DISK_ADMISSION_PARAMS_KEY,
        DISK_WRITE_BUDGET_KEY,
        REMOTE_ADMISSION_KEY,
        REMOTE_ADMISSION_PARAMS_KEY,
        REMOTE_WRITE_BUDGET_KEY,
        REMOTE_BYTES_KEY,
    }
)

DISK_TIMEOUT_KEY = f"{PREFIX}disk_timeout_ms"
"""The deadline of each disk tier operation in milliseconds (needs the disk tier)."""

DISK_BACKLOG_KEY = f"{PREFIX}disk_max_pending_write_bytes"
REMOTE_BACKLOG_KEY = f"{PREFIX}remote_max_pending_write_bytes"
"""Each lower tier's bound on the payload bytes of its writes not done yet, past which a
write offered is dropped (a byte count or a size such as ``"512MiB"``; needs the tier)."""

WRITE_BUDGET_KEY = f"{PREFIX}write_budget"
DRIVE_BYTES_KEY = f"{PREFIX}drive_bytes"
"""The optimiser's write budget (``--write-budget``'s strings: ``0.2``, ``200MB/s``,
``1dwpd``) and the drive size drive writes per day convert with (default: the disk tier's)."""

OWN_KEYS = frozenset(
    {
        ADMISSION_KEY,
        ADMISSION_PARAMS_KEY,
        REMOTE_URL_KEY,
        DISK_DIR_KEY,
        DISK_BYTES_KEY,
        DISK_TIMEOUT_KEY,
        DISK_BACKLOG_KEY,
        REMOTE_BACKLOG_KEY,
        *TIER_ADMISSION_KEYS,
        WRITE_BUDGET_KEY,
        DRIVE_BYTES_KEY,
    }
)
"""kvoffload's keys. They name layers that are built by ``build_manager``."""


@dataclass(frozen=True)
class SpecSettings:
    """The checked settings of one :class:`~kvoffload.integrations.vllm.spec.KVOffloadSpec`."""

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    admission: str = "none"
    admission_params: ParamPairs = ()
    remote_url: str | None = field(default=None, repr=False)  # may hold a password
    disk_dir: str | None = None
    disk_bytes: int = 0
    disk_admission: str = "none"
    disk_admission_params: ParamPairs = ()
    disk_write_budget: WriteBudget | None = None
    remote_admission: str = "none"
    remote_admission_params: ParamPairs = ()
    remote_write_budget: WriteBudget | None = None
    remote_bytes: int = 0
    disk_timeout_ms: float = DEFAULT_TIMEOUT_MS
    disk_max_pending_write_bytes: int | None = None
    remote_max_pending_write_bytes: int | None = None
    """``None``: the tier's default bound (:mod:`kvoffload.tiers.backlog`)."""
    write_budget: WriteBudget | None = None
    drive_bytes: int | None = None

    @property
    def has_lower_tiers(self) -> bool:
        return self.remote_url is not None or self.disk_dir is not None


def parse_settings(extra_config: Mapping[str, Any]) -> SpecSettings:
    """Check every key and value; an :class:`InvalidArgumentError` names the bad one."""
    unknown = sorted(set(extra_config) - SPEC_KEYS - CONNECTOR_KEYS - OWN_KEYS, key=repr)
    if unknown:
        raise InvalidArgumentError(
            f"unknown kv_connector_extra_config key {unknown[0]!r} for kvoffload's spec; "
            f"known: {', '.join(sorted(SPEC_KEYS | OWN_KEYS))} and vLLM's connector keys "
            f"({', '.join(sorted(CONNECTOR_KEYS))})"
        )
    if "cpu_bytes_to_use" not in extra_config:
        raise InvalidArgumentError("kv_connector_extra_config needs 'cpu_bytes_to_use'")
    policy = extra_config.get("eviction_policy", "lru")
    if policy not in available_policies():
        raise InvalidArgumentError(
            f"eviction_policy {brief(policy)} is not a kvoffload policy; "
            f"known: {', '.join(available_policies())}"
        )
    admission = _str(extra_config, ADMISSION_KEY) or "none"
    if admission not in available_admissions():
        raise InvalidArgumentError(
            f"kv_connector_extra_config {ADMISSION_KEY!r} {brief(admission)} is not a kvoffload "
            f"admission layer; known: {', '.join(available_admissions())}"
        )
    params = config_params(
        admission,
        extra_config.get(ADMISSION_PARAMS_KEY),
        f"kv_connector_extra_config {ADMISSION_PARAMS_KEY!r}",
    )
    disk_dir = _str(extra_config, DISK_DIR_KEY)
    if (disk_dir is None) != (DISK_BYTES_KEY not in extra_config):
        raise InvalidArgumentError(
            f"kv_connector_extra_config {DISK_DIR_KEY!r} and {DISK_BYTES_KEY!r} go together; "
            f"got only {DISK_BYTES_KEY if disk_dir is None else DISK_DIR_KEY!r}"
        )
    remote_url = _str(extra_config, REMOTE_URL_KEY)
    tier_admission = _tier_admission(extra_config, disk_dir=disk_dir, remote_url=remote_url)
    disk_timeout_ms = DEFAULT_TIMEOUT_MS
    if DISK_TIMEOUT_KEY in extra_config:
        if disk_dir is None:
            raise InvalidArgumentError(
                f"kv_connector_extra_config {DISK_TIMEOUT_KEY!r} needs the disk tier "
                f"({DISK_DIR_KEY!r} and {DISK_BYTES_KEY!r})"
            )
        disk_timeout_ms = check_timeout_ms(
            extra_config[DISK_TIMEOUT_KEY], f"kv_connector_extra_config {DISK_TIMEOUT_KEY!r}"
        )
    write_budget, drive_bytes = _write_budget(extra_config, admission)
    return SpecSettings(
        cpu_bytes_to_use=_int(extra_config, "cpu_bytes_to_use", 1, maximum=MAX_BYTES),
        eviction_policy=str(policy),
        store_threshold=_int(extra_config, "store_threshold", 0, 0, MAX_STORE_THRESHOLD),
        max_tracker_size=_int(extra_config, "max_tracker_size", 1, 64_000, MAX_TRACKED_KEYS),
        admission=admission,
        admission_params=params,
        remote_url=remote_url,
        disk_dir=disk_dir,
        disk_bytes=(
            _int(extra_config, DISK_BYTES_KEY, 1, 0, MAX_BYTES) if disk_dir is not None else 0
        ),
        **tier_admission,
        disk_timeout_ms=disk_timeout_ms,
        disk_max_pending_write_bytes=_backlog_bound(
            extra_config,
            DISK_BACKLOG_KEY,
            disk_dir,
            f"disk tier ({DISK_DIR_KEY!r} and {DISK_BYTES_KEY!r})",
        ),
        remote_max_pending_write_bytes=_backlog_bound(
            extra_config, REMOTE_BACKLOG_KEY, remote_url, f"remote tier ({REMOTE_URL_KEY!r})"
        ),
        write_budget=write_budget,
        drive_bytes=drive_bytes,
    )


def _tier_admission(
    config: Mapping[str, Any], *, disk_dir: str | None, remote_url: str | None
) -> dict[str, Any]:
    """The lower tiers' own admission settings, checked by the stack builder's
    :class:`LowerTierConfig` (its size still unknown), each error naming this spec's key.
    A budget takes what ``kvoffload.write_budget`` takes; it is sized by the spec."""
    settings: dict[str, Any] = {}
    for kind, location, location_key, key, params_key, budget_key in (
        (
            DISK,
            disk_dir,
            DISK_DIR_KEY,
            DISK_ADMISSION_KEY,
            DISK_ADMISSION_PARAMS_KEY,
            DISK_WRITE_BUDGET_KEY,
        ),
        (
            REMOTE,
            remote_url,
            REMOTE_URL_KEY,
            REMOTE_ADMISSION_KEY,
            REMOTE_ADMISSION_PARAMS_KEY,
            REMOTE_WRITE_BUDGET_KEY,
        ),
    ):
        admission = _str(config, key) or "none"
        budget = _parsed_budget(config, budget_key)
        given = [
            name
            for name, is_set in (
                (key, admission != "none"),
                (budget_key, budget is not None),
                (params_key, config.get(params_key) is not None),
            )
            if is_set
        ]
        params: ParamPairs = ()
        if location is None:
            if given:
                raise InvalidArgumentError(
                    f"kv_connector_extra_config {given[0]!r} needs the {kind} tier "
                    f"({location_key!r})"
                )
        else:
            if admission in available_admissions():  # else refused below, naming its key
                params = config_params(
                    admission, config.get(params_key), f"kv_connector_extra_config {params_key!r}"
                )
            LowerTierConfig(
                kind,
                location,
                None,
                admission=admission,
                admission_params=params,
                write_budget=budget,
                where="kv_connector_extra_config ",
                names={
                    "admission": repr(key),
                    "admission_params": repr(params_key),
                    "write_budget": repr(budget_key),
                },
            )
        settings[f"{kind}_admission"] = admission
        settings[f"{kind}_admission_params"] = params
        settings[f"{kind}_write_budget"] = budget
    if remote_url is None and REMOTE_BYTES_KEY in config:
        raise InvalidArgumentError(
            f"kv_connector_extra_config {REMOTE_BYTES_KEY!r} needs the remote tier "
            f"({REMOTE_URL_KEY!r})"
        )
    if settings["remote_admission"] != "none" and REMOTE_BYTES_KEY not in config:
        raise InvalidArgumentError(
            f"kv_connector_extra_config {REMOTE_ADMISSION_KEY!r} needs {REMOTE_BYTES_KEY!r} "
            "(what the server may hold of ours: it sizes the admission layer)"
        )
    settings["remote_bytes"] = (
        _int(config, REMOTE_BYTES_KEY, 1, 0, MAX_BYTES) if REMOTE_BYTES_KEY in config else 0
    )
    return settings


def _backlog_bound(
    config: Mapping[str, Any], key: str, location: str | None, tier: str
) -> int | None:
    """The bound under ``key`` in bytes (an integer or a size such as ``"512MiB"``), if set;
    refused without its tier, where it would be taken and ignored."""
    if key not in config:
        return None
    where = f"kv_connector_extra_config {key!r}"
    if location is None:
        raise InvalidArgumentError(f"{where} needs the {tier}")
    return parse_bytes(config[key], where)


def _parsed_budget(config: Mapping[str, Any], key: str) -> WriteBudget | None:
    """The write budget under ``key`` as written: a number or a string of
    :meth:`WriteBudget.parse` (``0.2``, ``200MB/s``, ``1dwpd``); an error names ``key``."""
    if config.get(key) is None:
        return None
    try:
        return WriteBudget.parse(config[key])
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"kv_connector_extra_config {key!r}: {exc}") from None


def _write_budget(
    config: Mapping[str, Any], admission: str
) -> tuple[WriteBudget | None, int | None]:
    """The write budget and drive size keys, checked (the budget needs the optimiser)."""
    budget = _parsed_budget(config, WRITE_BUDGET_KEY)
    drive = config.get(DRIVE_BYTES_KEY)
    try:
        drive_bytes = None if drive is None else parse_bytes(drive, "drive size")
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"kv_connector_extra_config {DRIVE_BYTES_KEY!r}: {exc}"
        ) from None
    if drive_bytes is not None and budget is None and config.get(DISK_WRITE_BUDGET_KEY) is None:
        raise InvalidArgumentError(
            f"kv_connector_extra_config {DRIVE_BYTES_KEY!r} is the drive a write budget in "
            f"drive writes per day counts against: it needs {WRITE_BUDGET_KEY!r} or "
            f"{DISK_WRITE_BUDGET_KEY!r}"
        )
    budgets = {WRITE_BUDGET_KEY: budget, DISK_WRITE_BUDGET_KEY: config.get(DISK_WRITE_BUDGET_KEY)}
    given = {key: WriteBudget.parse(value) for key, value in budgets.items() if value is not None}
    # Beside budgets in other units alone the drive size was taken and ignored.
    if drive_bytes is not None and all(each.unit != DWPD for each in given.values()):
        named = ", ".join(f"{key!r}: {each.describe()}" for key, each in given.items())
        raise InvalidArgumentError(
            f"kv_connector_extra_config {DRIVE_BYTES_KEY!r} is the drive a write budget in "
            f"drive writes per day counts against, and no budget given is one ({named}): give "
            f'it in drive writes per day ("1dwpd") or leave {DRIVE_BYTES_KEY!r} out'
        )
    if budget is not None and resolve_admission(admission) != "optimiser":
        raise InvalidArgumentError(
            f"kv_connector_extra_config {WRITE_BUDGET_KEY!r} needs {ADMISSION_KEY!r} "
            f"'recommended' (the optimiser), not {brief(admission)}"
        )
    return budget, drive_bytes


def _int(
    config: Mapping[str, Any],
    key: str,
    minimum: int,
    default: int | None = None,
    maximum: int | None = None,
) -> int:
    value = config.get(key, default)
    # vLLM's own spec takes int() of these, so accept what that keeps whole: numeric strings
    # (JSON from the command line) and whole floats (a JSON number written 64e9).
    if isinstance(value, str) and (whole := read_integer(value)) is not None:
        value = whole
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum:,}"
        raise InvalidArgumentError(
            f"kv_connector_extra_config {key!r} must be an integer {bound}, got {value!r}"
        )
    return int(value)


def _str(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidArgumentError(
            f"kv_connector_extra_config {key!r} must be a non-blank string, got {value!r}"
        )
    return value
