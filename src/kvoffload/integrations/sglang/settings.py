"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

No SGLang import here: the mapping is plain data, and checking all of it up
front turns a typo into one clear error at start-up instead of a default
silently taken. kvoffload's keys start with :data:`PREFIX`; the few keys
SGLang itself reads from the same mapping are accepted and left to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.admission import WriteBudget, config_params
from kvoffload.admission.params import read_integer
from kvoffload.admission.registry import ParamPairs
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.managers.stack import DISK, REMOTE, LowerTierConfig
from kvoffload.tiers.disk import MAX_FILE_BYTES, check_timeout_ms
from kvoffload.tiers.url import parse_remote_url

PREFIX = "kvoffload."

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        "file_storage_path",
    }
)
"""Keys SGLang reads itself (the ``dynamic`` loader's three, the zero-copy switch, its
prefetch settings, which it mostly removes before the backend sees the mapping) or adds
(``file_storage_path``, from ``--file-storage-path``): accepted and left to it."""

MAX_BYTES = MAX_FILE_BYTES
"""A tier's size past the largest file (any 64-bit size) is a typo: refused by its key, not
later under another's."""

DISK_DIR = f"{PREFIX}disk_dir"
DISK_BYTES = f"{PREFIX}disk_bytes"
DISK_POLICY = f"{PREFIX}disk_policy"
DISK_ADMISSION = f"{PREFIX}disk_admission"
DISK_ADMISSION_PARAMS = f"{PREFIX}disk_admission_params"
DISK_TIMEOUT_MS = f"{PREFIX}disk_timeout_ms"
"""Each disk I/O job's deadline in milliseconds (plus its bytes at 50 MB/s), as vLLM's
``kvoffload.disk_timeout_ms``; absent: the disk tier's default."""
REMOTE_URL = f"{PREFIX}remote_url"
REMOTE_ADMISSION = f"{PREFIX}remote_admission"
REMOTE_ADMISSION_PARAMS = f"{PREFIX}remote_admission_params"
"""Each tier's admission parameters: a mapping (or JSON text of one) of name to value."""
REMOTE_BYTES = f"{PREFIX}remote_bytes"
"""What the server may hold of ours: sizes the shared tier's admission layer only."""
EVENTS_ENDPOINT = f"{PREFIX}kv_events_endpoint"
EVENTS_REPLAY_ENDPOINT = f"{PREFIX}kv_events_replay_endpoint"
METRICS_PORT = f"{PREFIX}metrics_port"
DISK_WRITE_BUDGET = f"{PREFIX}disk_write_budget"
REMOTE_WRITE_BUDGET = f"{PREFIX}remote_write_budget"
"""A tier's write budget (``--write-budget``'s strings: ``0.2``, ``200MB/s``, ``1dwpd``),
kept by that tier's optimiser (its admission ``recommended``); drive writes per day count
against the tier's size (``disk_bytes``, ``remote_bytes``)."""

OWN_KEYS = frozenset(
    {
        DISK_DIR,
        DISK_BYTES,
        DISK_POLICY,
        DISK_ADMISSION,
        DISK_ADMISSION_PARAMS,
        DISK_TIMEOUT_MS,
        REMOTE_URL,
        REMOTE_ADMISSION,
        REMOTE_ADMISSION_PARAMS,
        REMOTE_BYTES,
        EVENTS_ENDPOINT,
        EVENTS_REPLAY_ENDPOINT,
        METRICS_PORT,
        DISK_WRITE_BUDGET,
        REMOTE_WRITE_BUDGET,
    }
)

NEEDS = {
    DISK_DIR: (
        DISK_POLICY,
        DISK_ADMISSION,
        DISK_ADMISSION_PARAMS,
        DISK_TIMEOUT_MS,
        DISK_WRITE_BUDGET,
    ),
    REMOTE_URL: (REMOTE_ADMISSION, REMOTE_ADMISSION_PARAMS, REMOTE_BYTES, REMOTE_WRITE_BUDGET),
    EVENTS_ENDPOINT: (EVENTS_REPLAY_ENDPOINT,),
}
"""Keys that mean something only beside another: given alone they would be taken and
ignored (a disk admission rule on a backend with the shared tier only), so they stop
start-up instead."""


@dataclass(frozen=True)
class BackendSettings:
    """The checked settings of one backend (:mod:`kvoffload.integrations.sglang.storage`)."""

    interface_v1: bool = False
    disk_dir: str | None = None
    disk_bytes: int = 0
    disk_policy: str = "lru"
    disk_admission: str = "none"
    disk_admission_params: ParamPairs = ()
    disk_deadline_s: float | None = None
    remote_url: str | None = field(default=None, repr=False)  # may hold a password
    remote_admission: str = "none"
    remote_admission_params: ParamPairs = ()
    remote_bytes: int = 0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    metrics_port: int | None = None
    disk_write_budget: WriteBudget | None = None
    remote_write_budget: WriteBudget | None = None

    @property
    def disk_tier(self) -> LowerTierConfig | None:
        """The disk tier as the stack builder opens it, its size in pages still unknown."""
        if self.disk_dir is None:
            return None
        return LowerTierConfig(
            DISK,
            self.disk_dir,
            None,
            self.disk_policy,
            self.disk_deadline_s,
            admission=self.disk_admission,
            admission_params=self.disk_admission_params,
            write_budget=self.disk_write_budget,
            where=WHERE,
            names=_tier_keys(DISK, DISK_DIR, DISK_BYTES),
        )

    @property
    def remote_tier(self) -> LowerTierConfig | None:
        """The shared tier as the stack builder opens it, its size in pages still unknown."""
        if self.remote_url is None:
            return None
        return LowerTierConfig(
            REMOTE,
            self.remote_url,
            None,
            admission=self.remote_admission,
            admission_params=self.remote_admission_params,
            write_budget=self.remote_write_budget,
            where=WHERE,
            names=_tier_keys(REMOTE, REMOTE_URL, REMOTE_BYTES),
        )


WHERE = "hicache-storage-backend-extra-config "


def _tier_keys(kind: str, location: str, size: str) -> dict[str, str]:
    """A tier's :class:`LowerTierConfig` fields by this backend's keys, as errors quote them."""
    keys = {name: f"{PREFIX}{kind}_{name}" for name in ("policy", "admission", "write_budget")}
    keys.update(admission_params=f"{PREFIX}{kind}_admission_params", location=location)
    keys["blocks"] = size
    return {name: repr(key) for name, key in keys.items()}


def parse_settings(extra_config: Mapping[str, Any] | None) -> BackendSettings:
    """Check every key and value; an :class:`InvalidArgumentError` names the bad one."""
    written = _dotted(extra_config or {})
    unknown = sorted(set(written) - SGLANG_KEYS - OWN_KEYS, key=repr)
    if unknown:
        raise InvalidArgumentError(
            f"unknown hicache-storage-backend-extra-config key {unknown[0]!r} for kvoffload; "
            f"known: {', '.join(sorted(OWN_KEYS))} and SGLang's {', '.join(sorted(SGLANG_KEYS))}"
        )
    # A JSON null is the key's default, as SGLang reads its own keys (``interface_v1`` by
    # ``bool(get(key, 0))``): one rule for every key, the required ones then missing.
    config = {key: value for key, value in written.items() if value is not None}
    disk_dir = _str(config, DISK_DIR)
    remote_url = _str(config, REMOTE_URL)
    if disk_dir is None and remote_url is None:
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config needs {DISK_DIR!r} or {REMOTE_URL!r} (or both)"
        )
    if (disk_dir is None) != (DISK_BYTES not in config):
        missing = DISK_BYTES if disk_dir is not None else DISK_DIR
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config {DISK_DIR!r} and {DISK_BYTES!r} go together; "
            f"{missing!r} is missing"
        )
    for needed, keys in NEEDS.items():
        given = [key for key in keys if config.get(key) is not None]
        if config.get(needed) is None and given:
            raise InvalidArgumentError(
                f"hicache-storage-backend-extra-config {given[0]!r} needs {needed!r}"
            )
    if remote_url is not None:
        try:
            parse_remote_url(remote_url)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(
                f"hicache-storage-backend-extra-config {REMOTE_URL!r}: {exc}"
            ) from None
    remote_admission = _str(config, REMOTE_ADMISSION) or "none"
    if remote_admission != "none" and REMOTE_BYTES not in config:
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config {REMOTE_ADMISSION!r} {remote_admission!r} "
            f"needs {REMOTE_BYTES!r} (what the server may hold of ours) to size its memory"
        )
    port = config.get(METRICS_PORT)
    disk_admission = _str(config, DISK_ADMISSION) or "none"
    settings = BackendSettings(
        interface_v1=_flag(config, "interface_v1"),
        disk_dir=disk_dir,
        disk_bytes=_int(config, DISK_BYTES, 1, 0, MAX_BYTES) if disk_dir is not None else 0,
        disk_policy=_str(config, DISK_POLICY) or "lru",
        disk_admission=disk_admission,
        disk_admission_params=_params(config, DISK_ADMISSION_PARAMS, disk_admission),
        disk_deadline_s=_deadline_s(config),
        remote_url=remote_url,
        remote_admission=remote_admission,
        remote_admission_params=_params(config, REMOTE_ADMISSION_PARAMS, remote_admission),
        remote_bytes=_int(config, REMOTE_BYTES, 1, 0, MAX_BYTES) if REMOTE_BYTES in config else 0,
        kv_events_endpoint=_str(config, EVENTS_ENDPOINT),
        kv_events_replay_endpoint=_str(config, EVENTS_REPLAY_ENDPOINT),
        metrics_port=None if port is None else _int(config, METRICS_PORT, 0, 0, 65535),
        disk_write_budget=_budget(config, DISK_WRITE_BUDGET),
        remote_write_budget=_budget(config, REMOTE_WRITE_BUDGET),
    )
    _ = settings.disk_tier, settings.remote_tier  # their checks stop a budget without its rule
    return settings


def _dotted(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_config`` with a ``kvoffload`` table read as the keys it spells: SGLang also
    reads the mapping from a TOML or YAML file (``@l3.toml``), where
    ``kvoffload.disk_dir = ...`` (TOML's dotted key) or keys nested under ``kvoffload:``
    make one table of ours."""
    written = dict(extra_config)
    table = written.get(PREFIX[:-1])
    if not isinstance(table, Mapping):
        return written
    del written[PREFIX[:-1]]
    for name, value in table.items():
        key = f"{PREFIX}{name}"
        if key in written:
            raise InvalidArgumentError(f"{WHERE}{key!r} is given twice, dotted and in a table")
        written[key] = value
    return written


def _deadline_s(config: Mapping[str, Any]) -> float | None:
    """The disk tier's job deadline in seconds, if set."""
    value = config.get(DISK_TIMEOUT_MS)
    if value is None:
        return None
    return check_timeout_ms(value, f"{WHERE}{DISK_TIMEOUT_MS!r}") / 1000


def _budget(config: Mapping[str, Any], key: str) -> WriteBudget | None:
    """A tier's write budget as written (the tier's settings check that its rule keeps it)."""
    value = config.get(key)
    if value is None:
        return None
    try:
        return WriteBudget.parse(value)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{WHERE}{key!r}: {exc}") from None


def _int(
    config: Mapping[str, Any], key: str, minimum: int, default: int, maximum: int | None = None
) -> int:
    value = config.get(key, default)
    # As vLLM's keys: numeric strings and whole floats, as JSON may spell a size (500e9).
    if isinstance(value, str) and (whole := read_integer(value)) is not None:
        value = whole
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
    if bad or (maximum is not None and value > maximum):
        bound = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config {key!r} must be an integer {bound}, "
            f"got {value!r}"
        )
    return int(value)


def _params(config: Mapping[str, Any], key: str, admission: str) -> ParamPairs:
    where = f"hicache-storage-backend-extra-config {key!r}"
    return config_params(admission, config.get(key), where)


def _str(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config {key!r} must be a non-blank string, "
            f"got {value!r}"
        )
    return value


def _flag(config: Mapping[str, Any], key: str) -> bool:
    """SGLang tests ``bool(value)``; only the values that reads unambiguously are taken."""
    value = config.get(key, 0)
    if value not in (0, 1, True, False):
        raise InvalidArgumentError(
            f"hicache-storage-backend-extra-config {key!r} must be 0 or 1, got {value!r}"
        )
    return bool(value)
