"""Policies by name, so configurations and the CLI can pick one with a string."""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.policies.base import CachePolicy

_POLICIES: dict[str, type[CachePolicy]] = {}
ALIASES = {"recommended": "lru"}
"""Names standing for a registered policy; ``recommended`` pairs with admission ``recommended``."""


def register_cache_policy(name: str) -> Callable[[type[CachePolicy]], type[CachePolicy]]:
    """Class decorator registering a :class:`CachePolicy` under ``name``."""
    if not isinstance(name, str) or not name:  # another type would break every sorted list
        raise InvalidArgumentError(f"a cache policy's name is a non-empty string, got {name!r}")

    def register(cls: type[CachePolicy]) -> type[CachePolicy]:
        # An alias's name too: it would be listed twice and always resolve to the alias.
        if name in ALIASES or (name in _POLICIES and _POLICIES[name] is not cls):
            raise InvalidArgumentError(f"cache policy {name!r} is already registered")
        _POLICIES[name] = cls
        return cls

    return register


def available_policies() -> list[str]:
    """Registered policy names and aliases, sorted."""
    return sorted([*_POLICIES, *ALIASES])


def resolve_policy(name: str) -> str:
    """The registered name behind ``name``; the error for an unknown one lists the known ones."""
    resolved = ALIASES.get(name, name) if isinstance(name, str) else None
    if resolved is None or resolved not in _POLICIES:
        raise InvalidArgumentError(
            f"unknown cache policy {name!r}; known: {', '.join(available_policies())}"
        )
    return resolved


def create_cache_policy(name: str, capacity: int) -> CachePolicy:
    """A new policy instance; the error for an unknown name lists the known ones."""
    return _POLICIES[resolve_policy(name)](capacity)
