"""A manager stack's configuration and its named parts, and the one place that orders them.

The order is fixed here and nowhere else: the reuse filter outermost (it sees
calls first), then the admission layer, then the CPU tier, alone or as the top
of a :class:`TieredOffloadingManager`. :func:`assemble` does that over a
bottom it is given; opening the lower tiers is
:func:`kvoffload.tiers.stack.build_stack`'s, one layer up, because managers
may not import tiers. Callers take the parts from :class:`Stack`'s handles
and walk no ``backing`` to find them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload.admission import (
    AdmissionLayer,
    WriteBudget,
    available_admissions,
    check_write_budget,
    resolve_admission,
    wrap_with_admission,
)
from kvoffload.admission.registry import admission_params
from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD, MAX_TRACKED_KEYS
from kvoffload.core.errors import InvalidArgumentError, check_integer
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager
from kvoffload.core.tier_protocol import LowerTier, SlotBytes, check_deadline_s, check_io_threads
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.reuse_filter import FilterReusedOffloadingManager
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import available_policies

OPTIMISER = "optimiser"
DISK, REMOTE = "disk", "remote"
"""The kinds of lower tier: a disk directory (write-back), a shared server (write-through)."""


@dataclass(frozen=True)
class LowerTierConfig:
    """One lower tier and its admission book: the disk tier (``location`` its directory) or
    the shared tier (``location`` its URL), opened by :mod:`kvoffload.tiers.stack`.

    ``blocks``: the disk tier's size, or the shared tier's as its admission book models it
    (0: unknown); ``None`` until known (SGLang counts pages once its host pool registers).
    Checked on construction (again on :func:`dataclasses.replace`); an error names the field
    as the caller spells it: ``names`` maps a field to the caller's key, ``where`` prefixes.
    ``size_key``: the caller's key of the size when it is not ``blocks`` (vLLM's is in
    bytes), which memory the tier's admission layer needs and the machine lacks names.
    """

    kind: str
    location: str = field(repr=False)  # a URL may hold a password
    blocks: int | None = 0
    policy: str = "lru"
    """The disk tier's eviction policy (the shared server evicts by its own rules)."""
    deadline_s: float | None = None
    """The deadline of each disk I/O job; ``None``: the disk tier's default."""
    admission: str = "none"
    admission_params: object | None = field(default=None, compare=False)
    write_budget: float | WriteBudget | None = None
    io_threads: int = 2
    """The tier's I/O threads (the shared tier's connections)."""
    fsync: bool = False
    """Whether the disk tier syncs each write to the device before reporting it."""
    max_pending_write_bytes: int | None = None
    """The payload bytes of writes queued or under way past which the tier drops a write
    offered (:mod:`kvoffload.tiers.backlog`); ``None``: the tier's default."""
    where: str = field(default="", compare=False, repr=False)
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    size_key: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._check()
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{self.where}{exc}") from None

    def key(self, name: str) -> str:
        """The caller's name of field ``name``."""
        return self.names.get(name, name)

    @property
    def size_name(self) -> str:
        """The caller's name of the tier's size, as its admission layer's memory error says."""
        return self.size_key or f"{self.where}{self.key('blocks')}"

    def tier_settings(self, store_threshold: int = 0) -> TierSettings:
        """How the tiered manager writes to this tier: write-back to disk, write-through to
        the shared tier (others see a block as soon as it is stored)."""
        return TierSettings(
            self.kind == REMOTE,
            store_threshold,
            self.admission,
            self.write_budget,
            self.blocks or 0,
            self.admission_params,
            self.size_name,
        )

    def _check(self) -> None:
        if self.kind not in (DISK, REMOTE):
            raise InvalidArgumentError(f"a lower tier is {DISK!r} or {REMOTE!r}, not {self.kind!r}")
        if not isinstance(self.location, str) or not self.location:
            raise InvalidArgumentError(
                f"{self.key('location')} must be a non-empty string, got {self.location!r}"
            )
        check_io_threads(self.io_threads, self.key("io_threads"))
        if not isinstance(self.fsync, bool):
            raise InvalidArgumentError(
                f"{self.key('fsync')} must be true or false, got {self.fsync!r}"
            )
        if self.deadline_s is not None:
            check_deadline_s(self.deadline_s, self.key("deadline_s"))
        if self.max_pending_write_bytes is not None:
            check_integer(self.key("max_pending_write_bytes"), self.max_pending_write_bytes, 1)
        if self.kind == DISK:
            _policy(self.key("policy"), self.policy)
        admission, budget = self.key("admission"), self.key("write_budget")
        _admission(admission, self.admission, budget, self.write_budget)
        try:
            admission_params(self.admission, self.admission_params)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{self.key('admission_params')}: {exc}") from None
        if self.blocks is None:
            return
        check_integer(self.key("blocks"), self.blocks, 0)
        if self.kind == DISK and self.blocks < 1:
            raise InvalidArgumentError(
                f"{self.key('blocks')}: a disk tier needs >= 1 block, got {self.blocks}"
            )
        if self.admission != "none" and self.blocks < 1:
            raise InvalidArgumentError(
                f"{admission} {self.admission!r} needs {self.key('blocks')} >= 1 (the "
                f"{'shared ' if self.kind == REMOTE else ''}tier's size its admission layer "
                "models)"
            )


@dataclass(frozen=True)
class StackConfig:
    """Everything that defines a manager stack; checked on construction, each error naming
    its field. ``disk_dir`` / ``remote_url`` ``None``: no such tier.

    ``admission`` / ``write_budget`` judge stores into the CPU tier; ``disk_admission``,
    ``remote_admission`` and their budgets (writes per block reference reaching that
    tier) each tier's own writes, after ``tier_store_threshold``. ``remote_blocks`` is
    the shared tier's size as its admission layer models it (the server's is unknown).
    """

    cpu_blocks: int
    policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    admission: str = "none"
    write_budget: float | WriteBudget | None = None
    admission_params: object | None = field(default=None, compare=False)
    """The CPU tier's rule's parameters (see ``admission_params`` in the registry)."""
    disk_dir: str | None = None
    disk_blocks: int = 0
    disk_policy: str | None = None
    """``None``: the CPU tier's policy. Given (not ``None``) without ``disk_dir`` it is
    refused, as ``disk_blocks``, ``disk_deadline_s`` and the tier's admission settings are
    (and ``remote_blocks`` and the shared tier's without ``remote_url``): it would be
    ignored."""
    disk_deadline_s: float | None = None
    """The deadline of each disk I/O job; ``None``: the disk tier's default."""
    disk_max_pending_write_bytes: int | None = None
    """The disk tier's bound on the bytes of its writes not done yet, past which a write
    offered is dropped; ``None``: the tier's default (see :class:`LowerTierConfig`)."""
    remote_url: str | None = field(default=None, repr=False)  # may hold a password
    remote_blocks: int = 0
    tier_store_threshold: int = 0
    disk_admission: str = "none"
    disk_write_budget: float | WriteBudget | None = None
    disk_admission_params: object | None = field(default=None, compare=False)
    """The disk tier's rule's parameters, as ``admission_params`` for the CPU tier's."""
    remote_admission: str = "none"
    remote_write_budget: float | WriteBudget | None = None
    remote_admission_params: object | None = field(default=None, compare=False)
    remote_max_pending_write_bytes: int | None = None
    """The shared tier's, as ``disk_max_pending_write_bytes``."""
    enable_events: bool = False
    wait_for_tiers: bool = False
    slot_bytes: SlotBytes | None = field(default=None, compare=False)
    """The CPU slots' bytes; ``None``: the lower tiers keep books only (empty payloads)."""
    fingerprint: bytes = b""
    """What the lower tiers' blocks mean (:func:`~kvoffload.tiers.layout_fingerprint`)."""
    size_keys: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """The caller's keys of ``cpu_blocks``, ``disk_blocks`` and ``remote_blocks`` where they
    differ (vLLM's are sizes in bytes), which memory a tier's admission layer needs and the
    machine lacks names."""
    disk_tier: LowerTierConfig | None = field(init=False, compare=False, repr=False)
    remote_tier: LowerTierConfig | None = field(init=False, compare=False, repr=False)
    """The lower tiers' settings as :func:`kvoffload.tiers.stack.build_stack` opens them
    (``None``: no such tier); their checks are :class:`LowerTierConfig`'s."""

    def __post_init__(self) -> None:
        for name in ("cpu_blocks", "store_threshold", "disk_blocks", "remote_blocks"):
            check_integer(name, getattr(self, name), 0)
        check_integer("cpu_blocks", self.cpu_blocks, 1)
        if self.store_threshold > MAX_STORE_THRESHOLD:
            raise InvalidArgumentError(
                f"store_threshold must be from 0 to {MAX_STORE_THRESHOLD} (0 or 1: no filter), "
                f"got {self.store_threshold}"
            )
        check_integer("max_tracker_size", self.max_tracker_size, 1, MAX_TRACKED_KEYS)
        check_integer("tier_store_threshold", self.tier_store_threshold, 0)
        _policy("policy", self.policy)
        for name in ("enable_events", "wait_for_tiers"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"{name} must be true or false, got {getattr(self, name)!r}"
                )
        _admission("admission", self.admission, "write_budget", self.write_budget)
        try:
            admission_params(self.admission, self.admission_params)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"admission_params: {exc}") from None
        for kind, where, tier, own in (
            ("disk", "disk_dir", "a disk", ("disk_policy", "disk_deadline_s")),
            ("remote", "remote_url", "a shared", ()),
        ):
            if getattr(self, where) is not None:
                continue
            names = (
                f"{kind}_admission",
                f"{kind}_write_budget",
                f"{kind}_admission_params",
                f"{kind}_max_pending_write_bytes",
                *own,
            )
            for name in names:
                if getattr(self, name) not in ("none", None, ()):
                    raise InvalidArgumentError(f"{name} needs {tier} tier ({where})")
            if getattr(self, f"{kind}_blocks"):
                raise InvalidArgumentError(f"{kind}_blocks needs {tier} tier ({where})")
        disk = remote = None
        if self.disk_dir is not None:
            disk = LowerTierConfig(
                DISK,
                self.disk_dir,
                self.disk_blocks,
                self.policy if self.disk_policy is None else self.disk_policy,
                self.disk_deadline_s,
                self.disk_admission,
                self.disk_admission_params,
                self.disk_write_budget,
                max_pending_write_bytes=self.disk_max_pending_write_bytes,
                names=_field_names(DISK, "disk_dir"),
                size_key=self.size_keys.get("disk_blocks", ""),
            )
        if self.remote_url is not None:
            remote = LowerTierConfig(
                REMOTE,
                self.remote_url,
                self.remote_blocks,
                admission=self.remote_admission,
                admission_params=self.remote_admission_params,
                write_budget=self.remote_write_budget,
                max_pending_write_bytes=self.remote_max_pending_write_bytes,
                names=_field_names(REMOTE, "remote_url"),
                size_key=self.size_keys.get("remote_blocks", ""),
            )
        object.__setattr__(self, "disk_tier", disk)
        object.__setattr__(self, "remote_tier", remote)

    @property
    def has_lower_tiers(self) -> bool:
        return self.disk_dir is not None or self.remote_url is not None


def _field_names(kind: str, location: str) -> dict[str, str]:
    """A :class:`StackConfig` tier's fields by their :class:`LowerTierConfig` names."""
    own = ("blocks", "policy", "deadline_s", "max_pending_write_bytes")
    names = {name: f"{kind}_{name}" for name in own}
    names.update(admission=f"{kind}_admission", write_budget=f"{kind}_write_budget")
    names.update(admission_params=f"{kind}_admission_params", location=location)
    return names


def _policy(name: str, value: str) -> None:
    """A registered policy's name (a list lookup: any value, hashable or not, is refused
    with the names)."""
    if value not in available_policies():
        raise InvalidArgumentError(
            f"{name} {value!r} is not one of {', '.join(available_policies())}"
        )


def _admission(name: str, value: str, budget_name: str, budget: float | WriteBudget | None) -> None:
    if value not in available_admissions():
        raise InvalidArgumentError(
            f"{name}: unknown admission {value!r}; known: {', '.join(available_admissions())}"
        )
    try:
        check_write_budget(budget)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{budget_name}: {exc}") from None
    if budget is not None and resolve_admission(value) != OPTIMISER:
        raise InvalidArgumentError(
            f"{budget_name} needs {name} 'recommended' (the optimiser), not {value!r}"
        )


@dataclass
class Stack:
    """A built stack: ``manager`` (outermost, what an engine calls) and its parts by name;
    a part the configuration does not have is ``None``."""

    manager: OffloadingManager
    cpu: CPUOffloadingManager
    filter: FilterReusedOffloadingManager | None = None
    admission: AdmissionLayer | None = None
    tiered: TieredOffloadingManager | None = None
    disk: LowerTier | None = None
    remote: LowerTier | None = None

    @property
    def direct(self) -> OffloadingManager:
        """The manager under the filter and the admission layer: where per-key drivers send
        lookups and touches that must count no sighting."""
        return self.tiered if self.tiered is not None else self.cpu

    @property
    def disk_admission(self) -> AdmissionLayer | None:
        return self._tier_admission(self.disk)

    @property
    def remote_admission(self) -> AdmissionLayer | None:
        return self._tier_admission(self.remote)

    def _tier_admission(self, tier: LowerTier | None) -> AdmissionLayer | None:
        if tier is None or self.tiered is None:
            return None
        return self.tiered.admissions[self.tiered.tiers.index(tier)]

    def holds(self, key: OffloadKey) -> bool:
        """Whether the CPU tier has a slot for ``key`` (ready, pinned or pending)."""
        return self.cpu.holds(key)

    def close(self) -> None:
        """Wait for the lower tiers' I/O in flight and close them (nothing without tiers)."""
        if self.tiered is not None:
            self.tiered.close()


def assemble(config: StackConfig, stack: Stack) -> Stack:
    """``stack`` (its CPU tier, and its tiered manager if any) under ``config``'s admission
    layer and then its reuse filter; ``stack.manager`` becomes the outermost."""
    bottom: OffloadingManager = stack.tiered if stack.tiered is not None else stack.cpu
    manager = wrap_with_admission(
        config.admission,
        bottom,
        config.cpu_blocks,
        config.write_budget,
        config.admission_params,
        config.size_keys.get("cpu_blocks", "cpu_blocks"),
    )
    if isinstance(manager, AdmissionLayer):
        stack.admission = manager
    if config.store_threshold >= 2:
        stack.filter = FilterReusedOffloadingManager(
            manager, config.store_threshold, config.max_tracker_size
        )
        manager = stack.filter
    stack.manager = manager
    return stack


def build_cpu_stack(config: StackConfig) -> Stack:
    """The stack of a configuration without lower tiers (refused here: they need
    :func:`kvoffload.tiers.stack.build_stack`)."""
    if config.has_lower_tiers:
        raise InvalidArgumentError("lower tiers are opened by kvoffload.tiers.build_stack")
    cpu = CPUOffloadingManager(config.cpu_blocks, config.policy, config.enable_events)
    return assemble(config, Stack(cpu, cpu))
