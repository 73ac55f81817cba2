"""Exceptions raised for bad input.

Every error the library raises for caller mistakes derives from
:class:`KVOffloadError`, and also from the builtin a caller would expect
(``ValueError`` for a bad argument, ``KeyError`` for an unknown block), so
both ``except KVOffloadError`` and ``except KeyError`` work.
"""

from __future__ import annotations

import operator
from typing import TypeGuard


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises for bad input."""


class InvalidArgumentError(KVOffloadError, ValueError):
    """A constructor or call argument is out of range or unknown."""


class BlockStateError(KVOffloadError, KeyError):
    """A call names a block that is absent or in the wrong state for it.

    ``key`` is the offending key; the manager's state is unchanged.
    """

    def __init__(self, message: str, key: bytes) -> None:
        super().__init__(message)
        self.message = message
        self.key = key

    def __str__(self) -> str:
        # KeyError quotes its argument; keep the message readable instead.
        return self.message


class BlockNotFoundError(BlockStateError):
    """The key is not held by the manager at all."""


class BlockNotReadyError(BlockStateError):
    """The key is held but its store has not completed, so it cannot be loaded."""


class BlockNotPinnedError(BlockStateError):
    """``complete_load`` named a key that no load holds."""


class InsufficientMemoryError(KVOffloadError, MemoryError):
    """A buffer asked for does not fit in its device's memory; nothing was allocated."""


def check_integer(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    """:class:`InvalidArgumentError` naming ``name`` unless ``value`` is an int (not a bool,
    which Python counts as one) of at least ``minimum`` (and at most ``maximum``, where given:
    else a deeper check would refuse it without naming the setting)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum:,}"
        raise InvalidArgumentError(f"{name} must be an integer {bound}, got {value!r}")


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float, and not a bool (an int to Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer_value(value: object) -> int | None:
    """``value`` as an int if it is one of any integer type (``operator.index``: NumPy's,
    a 0-d tensor's), else ``None``: a bool (an int to Python), a float, a str."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


SHOWN_CHARS = 60
"""How much of a bad value an error line shows: a trace field or a setting's text can run
to millions of characters."""


def brief(value: object) -> str:
    """``value``'s repr for an error line, cut to ``SHOWN_CHARS`` with its full length."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"
