"""Write budgets: how many offload writes an operator allows, in the unit they think in.

A simulator speaks of writes per block reference, a link of bytes per second,
an SSD of drive writes per day (the wear figure drives are bought by). The
operator writes whichever they have (``0.2``, ``200MB/s``, ``1dwpd``);
:meth:`WriteBudget.parse` reads it once, and :class:`BudgetCredit` turns it
into a token bucket of block writes, earned per block reference or per second
of a clock (the trace's in the simulator, the wall clock in an engine).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvoffload.admission.params import is_finite, read_number, shown
from kvoffload.core.errors import InvalidArgumentError, brief, is_number
from kvoffload.core.manager import stack_layers

PER_REF, BYTES_PER_S, DWPD = "writes/ref", "bytes/s", "dwpd"
UNITS = (PER_REF, BYTES_PER_S, DWPD)
SECONDS_PER_DAY = 86_400.0
BURST_REFS = 1024
"""A per-reference budget may be spent ahead by at most this many references' worth."""
BURST_SECONDS = 10.0
"""A budget in bytes per second may be spent ahead by at most this many seconds' worth (or
one block): a cap on the write rate, as a link's or a drive's bandwidth is."""
DWPD_BURST_SECONDS = 3600.0
"""A budget in drive writes per day may be spent ahead by at most an hour's worth: wear
counts the day's total, so bursts may use what quiet minutes left."""
MAX_BANK_BLOCKS = float(2**53)
"""No bank holds more blocks than this (exact in a float): a huge budget's bank would
overflow to infinity, which no count of blocks to write is."""
RATE_WINDOW_REFS = 1 << 16
"""The reference rate that converts a per-time budget into writes per reference is
measured over about this many recent references (counts halve past it)."""

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_BITS = re.compile(r"[KMGTP]i?b")
"""A unit written as bits are (``Gb``, ``Mib``): a 10 Gbit/s link given as ``10Gb/s`` read as
10 GB/s, eight times the budget meant. Units are read whatever their case otherwise."""
_DIGITS = r"\d(?:_?\d)*"
"""Digits as Python's float() reads them, one underscore allowed between two (``1_000``),
as every other number on the command line takes them."""
_NUMBER = (
    rf"([-+]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:e[-+]?{_DIGITS})?"
    r"|nan|[-+]?inf(?:inity)?)"
)
"""A number as ``float()`` reads one. The fraction's digits follow the point only: with
the point optional before them, digits could be split between the whole and the
fraction at every place, and refusing a long run of them took quadratic time."""
_PER_REF = re.compile(rf"{_NUMBER}\s*(?:/\s*ref)?", re.IGNORECASE)
_PER_SECOND = re.compile(rf"{_NUMBER}\s*([kmgtp]i?b|b)\s*/\s*s(?:ec)?", re.IGNORECASE)
_DWPD = re.compile(rf"{_NUMBER}\s*dwpd", re.IGNORECASE)
_BYTES = re.compile(rf"{_NUMBER}\s*([kmgtp]i?b|b)?", re.IGNORECASE)
FORMS = (
    "writes per block reference (0.2), bytes per second (200MB/s) or drive writes per day (1dwpd)"
)


def _amount(text: str, what: str) -> float:
    try:
        return read_number(text, 0.0)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def _byte_unit(unit: str, text: object, what: str) -> int:
    """The bytes ``unit`` stands for; one written as bits (``Gb``) is refused, not read as
    bytes (:data:`_BITS`)."""
    if _BITS.fullmatch(unit):
        raise InvalidArgumentError(
            f"{what}: {unit!r} reads as bits; give bytes, {unit[:-1]}B (a byte is 8 bits), "
            f"got {brief(text)}"
        )
    return _BYTE_UNITS[unit.lower()]


def parse_bytes(text: str | int, what: str = "a size") -> int:
    """A byte count: an integer, or a number with B, kB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), e.g. ``"1.92TB"``."""
    if isinstance(text, bool):
        raise InvalidArgumentError(f"{what}: must be a number of bytes, got {brief(text)}")
    if isinstance(text, int):
        if text < 1:
            raise InvalidArgumentError(f"{what}: must be >= 1 byte, got {shown(text)}")
        if not is_finite(text):  # no rate is computed with it: a JSON integer of 400 digits
            raise InvalidArgumentError(
                f"{what}: must be a finite number of bytes, got {shown(text)}"
            )
        return text
    match = _BYTES.fullmatch(str(text).strip())
    if match is None:
        raise InvalidArgumentError(
            f"{what}: must be a number of bytes, e.g. 1.92TB or 2TiB, got {brief(text)}"
        )
    # One message for every size below a byte: -1e-400 and 1e-400 (which reads as 0) too.
    if match[1].lstrip().startswith("-") or float(match[1]) == 0:
        raise InvalidArgumentError(f"{what}: must be >= 1 byte, got {brief(text)}")
    value = _amount(match[1], what) * _byte_unit(match[2] or "", text, what)
    if value < 1:
        raise InvalidArgumentError(f"{what}: must be >= 1 byte, got {brief(text)}")
    if math.isinf(value):  # a finite number times its unit can overflow: 1e300TB
        raise InvalidArgumentError(f"{what}: must be a finite number of bytes, got {brief(text)}")
    return int(value)


@dataclass(frozen=True)
class WriteBudget:
    """A write budget: ``amount`` in ``unit`` (one of :data:`UNITS`).

    ``block_bytes`` (a block's size in the tier) turns bytes into blocks, and
    ``drive_bytes`` (the drive's size) drive writes into bytes; whoever builds
    the tier knows them and sets them with :meth:`sized`.
    """

    amount: float
    unit: str = PER_REF
    block_bytes: int | None = None
    drive_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise InvalidArgumentError(
                f"write budget unit must be one of {', '.join(UNITS)}, got {self.unit!r}"
            )
        amount = self.amount
        if not is_number(amount):
            raise InvalidArgumentError(f"write budget must be a number, got {amount!r}")
        if not is_finite(amount) or amount < 0:
            raise InvalidArgumentError(
                f"write budget must be a finite number of {self.unit} >= 0, got {shown(amount)}"
            )
        for name in ("block_bytes", "drive_bytes"):
            size = getattr(self, name)
            bad = isinstance(size, bool) or not isinstance(size, int) or size < 1
            if size is not None and bad:
                raise InvalidArgumentError(
                    f"write budget {name} must be an integer >= 1, got {shown(size)}"
                )

    @classmethod
    def parse(cls, text: str | float | WriteBudget) -> WriteBudget:
        """``0.2`` or ``0.2/ref``, ``200MB/s`` or ``1.5GiB/s``, ``1dwpd``; one clear error else."""
        if isinstance(text, WriteBudget):
            return text
        if is_number(text):
            check_write_budget(text)  # before float(), which overflows for a huge int
            return cls(float(text))
        if not isinstance(text, str):
            raise InvalidArgumentError(
                f"write budget must be a number or a string, got {brief(text)}"
            )
        stripped = text.strip()
        if match := _PER_REF.fullmatch(stripped):
            return cls(_amount(match[1], "write budget"))
        if match := _PER_SECOND.fullmatch(stripped):
            per_s = _amount(match[1], "write budget") * _byte_unit(match[2], text, "write budget")
            if math.isinf(per_s):  # a finite number times its unit can overflow: 1e300TB/s
                raise InvalidArgumentError(
                    f"write budget: must be a finite rate, got {brief(text)}"
                )
            return cls(per_s, BYTES_PER_S)
        if match := _DWPD.fullmatch(stripped):
            return cls(_amount(match[1], "write budget"), DWPD)
        raise InvalidArgumentError(f"write budget: expected {FORMS}, got {brief(text)}")

    @property
    def per_ref(self) -> bool:
        """Whether the budget is counted in block references rather than in time."""
        return self.unit == PER_REF

    def sized(self, block_bytes: int | None, drive_bytes: int | None = None) -> WriteBudget:
        """The budget with the tier's block size and drive size (kept where already set)."""
        return replace(
            self,
            block_bytes=self.block_bytes or block_bytes,
            drive_bytes=self.drive_bytes or drive_bytes,
        )

    def bytes_per_second(self) -> float:
        """A per-time budget in bytes per second."""
        if self.unit == BYTES_PER_S:
            return self.amount
        if self.unit == DWPD:
            if self.drive_bytes is None:
                raise InvalidArgumentError(
                    f"a write budget of {self.describe()} needs the drive's size "
                    "(--drive-bytes or kvoffload.drive_bytes, or a disk tier, whose size is taken)"
                )
            per_day = self.amount * self._size("drive_bytes", self.drive_bytes)
            if math.isinf(per_day):  # else a rate of inf blocks a second: no budget, unsaid
                raise InvalidArgumentError(
                    f"a write budget of {self.describe()} comes to more bytes a day than a "
                    "float holds on its drive: give a finite one, or leave it out for no budget"
                )
            return per_day / SECONDS_PER_DAY
        raise InvalidArgumentError(f"a write budget of {self.describe()} is not per second")

    def blocks_per_second(self) -> float:
        """A per-time budget in block writes per second."""
        per_s = self.bytes_per_second()
        if self.block_bytes is None:
            raise InvalidArgumentError(
                f"a write budget of {self.describe()} needs the tier's block size in bytes"
            )
        return per_s / self._size("block_bytes", self.block_bytes)

    def _size(self, name: str, size: int) -> int:
        """``size`` (bytes), refused where a float cannot hold it: the conversion would raise
        ``OverflowError``. Checked here, not on construction, so that a caller's ``check``
        names the key the size came from."""
        if not is_finite(size):
            raise InvalidArgumentError(
                f"a write budget of {self.describe()}: {name} must be a finite number of "
                f"bytes, got {shown(size)}"
            )
        return size

    def check(self) -> None:
        """Refuse a per-time budget that lacks the sizes its conversion needs."""
        if not self.per_ref:
            self.blocks_per_second()

    def describe(self) -> str:
        """The budget as an operator would write it."""
        if self.unit == PER_REF:
            return f"{self.amount:g} writes per block reference"
        if self.unit == DWPD:
            return f"{self.amount:g} drive writes per day"
        return f"{self.amount / 1e6:g} MB/s"


def check_write_budget(budget: float | WriteBudget | None) -> None:
    """A write budget is ``None``, a :class:`WriteBudget` or a finite number of writes per
    block reference >= 0."""
    if budget is None or isinstance(budget, WriteBudget):
        return
    if not is_number(budget):
        raise InvalidArgumentError(f"write budget must be a number, got {budget!r}")
    if not is_finite(budget) or budget < 0:
        raise InvalidArgumentError(
            f"write budget must be a finite number of writes per block reference >= 0, "
            f"got {shown(budget)}"
        )


class BudgetCredit:
    """A token bucket of block writes for one tier.

    Per-reference budgets earn ``amount`` per block reference, at most
    :data:`BURST_REFS` references' worth banked; per-time budgets earn their
    blocks per second of :attr:`clock`, at most :data:`BURST_SECONDS`' worth
    (:data:`DWPD_BURST_SECONDS`' for drive writes per day) banked. Every bank holds
    at least one block, so that a budget below one block per burst still writes at
    its rate, and at most :data:`MAX_BANK_BLOCKS`. The bucket starts empty, so from the first call
    writes never exceed what was earned; over any span they exceed the span's
    earnings by at most the bank.
    """

    def __init__(
        self, budget: float | WriteBudget, clock: Callable[[], float] = time.monotonic
    ) -> None:
        check_write_budget(budget)
        self.budget = WriteBudget.parse(budget)
        self.budget.check()
        self.clock = clock
        """Seconds, for per-time budgets; the simulator sets its trace clock here."""
        if self.budget.per_ref:
            self._rate = self.budget.amount
            burst = float(BURST_REFS)
        else:
            self._rate = self.budget.blocks_per_second()
            burst = DWPD_BURST_SECONDS if self.budget.unit == DWPD else BURST_SECONDS
        self._cap = min(max(self._rate * burst, 1.0), MAX_BANK_BLOCKS)
        self._credit = 0.0
        self._last: float | None = None
        self._refs = 0.0
        self._seconds = 0.0

    def earn(self, refs: int, now: float | None = None) -> None:
        """``refs`` block references were seen (at ``now``, by default the clock's time)."""
        if self.budget.per_ref:
            self._credit = min(self._cap, self._credit + self._rate * refs)
            return
        now = self.clock() if now is None else now
        elapsed = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now if self._last is None else max(self._last, now)
        self._credit = min(self._cap, self._credit + self._rate * elapsed)
        self._refs += refs
        self._seconds += elapsed
        if self._refs > RATE_WINDOW_REFS:
            self._refs /= 2
            self._seconds /= 2

    def allowance(self) -> int:
        """Blocks that may be written now."""
        return int(self._credit + 1e-9)

    def spend(self, blocks: int) -> None:
        """``blocks`` were written."""
        self._credit -= blocks

    def writes_per_ref(self) -> float:
        """The budget in writes per block reference, at the recently observed reference
        rate for per-time budgets (infinite before any reference took time)."""
        if self.budget.per_ref:
            return self._rate
        if self._refs <= 0 or self._seconds <= 0:
            return math.inf
        return self._rate * self._seconds / self._refs


def attach_clock(manager: object, clock: Callable[[], float]) -> int:
    """Give every write budget in a stack of decorators (following ``backing``) ``clock``;
    returns how many there were. The simulator hands its trace clock down this way."""
    found = 0
    for layer in stack_layers(manager):
        credit = getattr(layer, "write_credit", None)
        if isinstance(credit, BudgetCredit):
            credit.clock = clock
            found += 1
    return found
