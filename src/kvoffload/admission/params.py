"""Admission parameters: one frozen dataclass per rule, checked and parsed here only.

Each field is declared with :func:`param` (default, bounds, one line of
help, listed by ``--admission-param help``); :func:`check_params` validates
an instance (called from each dataclass's ``__post_init__``), and
:func:`parse_params` builds one from a flat ``name -> value`` mapping whose
values are strings (the CLI's ``key=value``) or JSON numbers (vLLM's and
SGLang's extra-config). Every error names the key, and an unknown key lists
the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from kvoffload.core.errors import SHOWN_CHARS, InvalidArgumentError, brief, is_number

ParamValue = str | int | float
"""A raw parameter value: text from the command line, or a JSON number."""

P = TypeVar("P")


def param(default: float, low: float, high: float = math.inf, help: str = "") -> Any:
    """A parameter field: ``default``, inclusive bounds ``low``..``high``, and the one line
    shown by ``--help`` and the docs. The field's annotation, ``int`` or ``float``, is the
    type its values must have (not the default's: a float field may default to a whole
    number)."""
    return dataclasses.field(default=default, metadata={"low": low, "high": high, "help": help})


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The parameters of a rule that has none."""


def check_params(params: object, rule: str) -> None:
    """Raise :class:`InvalidArgumentError` naming the first field of ``params`` whose value
    has the wrong type or lies outside its bounds."""
    for field in dataclasses.fields(params):  # type: ignore[arg-type]
        value = getattr(params, field.name)
        low, high = field.metadata["low"], field.metadata["high"]
        wants_int = _wants_int(field)
        if (
            isinstance(value, bool)
            or not isinstance(value, int if wants_int else int | float)
            or not (wants_int or is_finite(value))
        ):
            raise InvalidArgumentError(
                f"admission parameter {field.name!r} of {rule!r} must be "
                f"{_kind(wants_int, value)}, got {shown(value)}"
            )
        if not low <= value <= high:
            bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            raise InvalidArgumentError(
                f"admission parameter {field.name!r} of {rule!r} must be {bounds}, "
                f"got {shown(value)}"
            )


def given_or_default(params: P | None, cls: type[P], rule: str) -> P:
    """``params``, or ``cls``'s defaults where ``None``: a dict or another rule's parameters
    once failed as an ``AttributeError`` at the first field read, far from the call."""
    if params is None:
        return cls()
    if not isinstance(params, cls):
        raise InvalidArgumentError(
            f"params of {rule!r} must be {cls.__name__}, got {type(params).__name__}"
        )
    return params


def parse_params(cls: type[P], raw: Mapping[str, ParamValue], rule: str) -> P:
    """``cls`` from ``raw``; absent keys keep their defaults."""
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, int | float] = {}
    for key, value in raw.items():
        field = fields.get(key)
        if field is None:
            valid = ", ".join(sorted(fields)) or "none"
            raise InvalidArgumentError(
                f"unknown admission parameter {brief(key)} for {rule!r}; valid: {valid}"
            )
        values[key] = _convert(value, field, rule)
    return cls(**values)


def describe_params(cls: type[Any]) -> list[tuple[str, str, str, str]]:
    """Each parameter of ``cls`` as its name, default, range and line of help: what
    ``--admission-param help`` lists, so that an operator need not open the docs."""
    rows = []
    defaults = cls()
    for field in dataclasses.fields(cls):
        low, high = _plain(field.metadata["low"]), field.metadata["high"]
        bounds = f">= {low}" if high == math.inf else f"{low} to {_plain(high)}"
        default = _plain(getattr(defaults, field.name))
        rows.append((field.name, default, bounds, field.metadata["help"]))
    return rows


def _plain(value: int | float) -> str:
    """``value`` as the docs write it: ``2^62`` and ``2^59 - 1`` for the largest bounds."""
    if isinstance(value, int) and value >= 2**20:
        if value & (value - 1) == 0:
            return f"2^{value.bit_length() - 1}"
        if value & (value + 1) == 0:
            return f"2^{value.bit_length()} - 1"
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def parse_pairs(pairs: list[str] | tuple[str, ...], what: str) -> dict[str, str]:
    """``["key=value", ...]`` as a mapping (a later key wins); ``what`` names the option."""
    if not isinstance(pairs, list | tuple):  # a lone "key=value" would iterate by letter
        raise InvalidArgumentError(f"{what} takes a list of key=value, got {brief(pairs)}")
    parsed: dict[str, str] = {}
    for pair in pairs:
        if not isinstance(pair, str):
            raise InvalidArgumentError(f"{what} takes key=value, got {brief(pair)}")
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InvalidArgumentError(f"{what} takes key=value, got {brief(pair)}")
        parsed[key.strip()] = value.strip()
    return parsed


def _wants_int(field: dataclasses.Field[Any]) -> bool:
    """Whether ``field`` is declared ``int`` (the annotation is text under postponed
    evaluation, the class where it is not)."""
    return field.type in ("int", int)


def is_finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float or an int a float can hold: ``math.isfinite``
    raises ``OverflowError`` for an int past 1.8e308 (a long number in extra-config JSON).
    Write budgets and their sizes are checked with it too."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def read_number(
    text: str, low: float = -math.inf, high: float = math.inf, above_low: bool = False
) -> float:
    """The finite number ``text`` writes, in ``low``..``high`` (above ``low`` where
    ``above_low``) as written rather than as its float: ``-1e-400`` is below 0 (its float,
    -0.0, is not), ``1e-400`` is too small to tell from 0 (not 0), ``-0`` is 0. The one reader
    of the command line's non-integer numbers, mix weights, admission parameters given as
    text and write budgets; its error gives the reason, and the caller names the option."""
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgumentError(f"expected a number, got {brief(text)}") from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"must be a finite number, got {brief(text)}")
    try:
        written = Decimal(text)
    except InvalidOperation:  # a spelling float() reads and Decimal() does not
        written = Decimal(value)
    # A bound as its shortest spelling, as a user writes it: a written "0.01" would fall
    # below the float 0.01, which is 0.01000000000000000020...
    lowest = Decimal(repr(low))
    if written < lowest or (above_low and written == lowest):
        raise InvalidArgumentError(
            f"must be {'>' if above_low else '>='} {low:g}, got {as_written(text)}"
        )
    if written > Decimal(repr(high)):
        bound = f"{high:,.0f}" if float(high).is_integer() else f"{high:g}"
        raise InvalidArgumentError(f"must be <= {bound}, got {as_written(text)}")
    if value == 0 and written != 0:
        raise InvalidArgumentError(f"{as_written(text)} is too small to tell from 0")
    return 0.0 if value == 0 else value  # -0 is 0


def read_integer(text: str) -> int | None:
    """The integer ``text`` writes as the command line reads one (Python's ``int()``: a
    sign, blanks around it, ``_`` between digits as in ``1_000``), or ``None``. The one
    reader of integers given as text in engines' extra-config: an ``isdigit()`` test before
    ``int()`` refused ``1_000``, which the command line, a timeout's ``float()`` and vLLM's
    own ``int()`` of its sizes take, and let ``'²'`` through to ``int()``'s own error."""
    try:
        return int(text)
    except ValueError:  # no integer, or past int()'s 4,300 digits
        return None


def shown(value: object) -> str:
    """``value`` for an error message: its repr, but not the hundreds of digits of an int
    past a float's range (nor the ``ValueError`` repr raises past 4,300 of them), and a long
    text cut (:func:`~kvoffload.core.errors.brief`)."""
    if isinstance(value, int) and not isinstance(value, bool) and not is_finite(value):
        return "an integer outside a float's range"
    return brief(value)


def as_written(text: str) -> str:
    """``text`` unquoted as an error line shows a number, or quoted and cut where long: a
    value pasted by mistake was echoed whole, a line of 100,000 digits."""
    return text if len(text) <= SHOWN_CHARS else brief(text)


def _kind(wants_int: bool, value: object) -> str:
    """What a field wants, as its error says it: "a finite number" for a float field given
    a number no float holds finitely (``inf`` from JSON's ``Infinity``, a 400-digit
    integer), which "must be a number" told an operator it already was."""
    if wants_int:
        return "an integer"
    return "a finite number" if is_number(value) else "a number"


def _convert(value: object, field: dataclasses.Field[Any], rule: str) -> int | float:
    key, wants_int = field.name, _wants_int(field)
    if isinstance(value, str) and not wants_int:  # as written: "-1e-400" is below 0
        try:
            return read_number(value, field.metadata["low"], field.metadata["high"])
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"admission parameter {key!r} of {rule!r}: {exc}") from None
    if isinstance(value, str):
        whole = read_integer(value)
        if whole is not None:
            return whole
    elif is_number(value):
        if not wants_int and is_finite(value):
            return float(value)
        if wants_int and isinstance(value, int):
            return value
        if wants_int and is_finite(value) and float(value).is_integer():
            return int(value)  # JSON's 16.0 (or 1e4) is the integer it writes
    raise InvalidArgumentError(
        f"admission parameter {key!r} of {rule!r} must be {_kind(wants_int, value)}, "
        f"got {shown(value)}"
    )
