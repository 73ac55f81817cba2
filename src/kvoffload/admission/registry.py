"""Admission rules by name, so configurations and the CLI can pick one with a string.

A rule registers itself with ``@register_admission("name", params=SomeParams)``
on its class, in its own module under ``kvoffload.admission``; every module
of the package is imported on the first look-up, so a new rule is one file
(see docs/admission.md, "Adding an admission rule"). ``none`` stores every
offered block; aliases (``recommended``, ``reuse``) name a registered rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvoffload.admission.base import AdmissionLayer
from kvoffload.admission.budget import WriteBudget, check_write_budget
from kvoffload.admission.params import (
    NoParams,
    ParamValue,
    as_written,
    check_params,
    parse_params,
)
from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError, brief
from kvoffload.core.manager import OffloadingManager, stack_layers

NO_ADMISSION = "none"
OPTIMISER = "optimiser"
ALIASES = {"recommended": OPTIMISER, "reuse": "filter"}
"""Names standing for a registered rule; ``recommended`` pairs with policy ``recommended``."""

RawParams = Mapping[str, ParamValue]
ParamPairs = tuple[tuple[str, ParamValue], ...]
"""Checked raw parameters in a hashable form, for frozen settings dataclasses."""


class AdmissionRule(Protocol):
    """What a registered class offers: a layer over ``backing`` built from its parameters."""

    @classmethod
    def from_params(cls, backing: OffloadingManager, capacity: int, params: Any) -> Any: ...


@dataclass(frozen=True)
class Registered:
    """One registered rule: its class and its parameters dataclass."""

    name: str
    cls: type[AdmissionRule]
    params: type[Any]


_RULES: dict[str, Registered] = {}
_loaded = False
_BROKEN: dict[str, str] = {}
"""Modules of the package that failed to import on discovery: file -> the one-line cause."""

R = TypeVar("R", bound=type[Any])


def register_admission(name: str, params: type[Any] = NoParams) -> Callable[[R], R]:
    """Class decorator registering an admission rule under ``name``.

    The class builds itself with ``from_params(backing, capacity, params)``
    (:class:`AdmissionLayer` has one that calls ``cls(backing, capacity, params=params)``).
    """
    if not isinstance(name, str) or not name:  # another type would break every sorted list
        raise InvalidArgumentError(f"an admission rule's name is a non-empty string, got {name!r}")
    # Checked here, not at the rule's first use, where either was a TypeError or an
    # AttributeError from deep inside the registry.
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise InvalidArgumentError(
            f"admission {name!r}: params must be a dataclass of its parameters, got {params!r}"
        )
    _check_declared(name, params)

    def register(cls: R) -> R:
        if not callable(getattr(cls, "from_params", None)):
            raise InvalidArgumentError(
                f"admission {name!r}: {cls!r} has no from_params (an AdmissionLayer has one)"
            )
        known = _RULES.get(name)
        if name == NO_ADMISSION or name in ALIASES or (known is not None and known.cls is not cls):
            raise InvalidArgumentError(f"admission {name!r} is already registered")
        _RULES[name] = Registered(name, cls, params)
        return cls

    return register


def _check_declared(name: str, params: type[Any]) -> None:
    """Refuse a parameters dataclass the registry cannot read: a field declared without
    :func:`~kvoffload.admission.params.param` has no bounds (``--admission-param help``
    and every check of an instance failed with ``KeyError: 'low'``), and defaults outside
    their own bounds failed only at the rule's first use."""
    for field in dataclasses.fields(params):
        if "low" not in field.metadata:
            raise InvalidArgumentError(
                f"admission {name!r}: parameter {field.name!r} of {params.__name__} is not "
                "declared with param(default, low, high, help)"
            )
    try:
        check_params(params(), name)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"admission {name!r}: default parameters: {exc}") from None


def _rules() -> dict[str, Registered]:
    """The registry, after importing every module of the package once (which registers).

    A module that fails to import is recorded in :data:`_BROKEN` and the others are still
    imported: its exception, raised from here, once ended the discovery, and every rule
    file after it stayed unknown for the rest of the process, named by no error."""
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module("kvoffload.admission")
        for module in pkgutil.iter_modules(package.__path__):
            try:
                importlib.import_module(f"kvoffload.admission.{module.name}")
            except Exception as exc:  # any error a rule file raises names that file
                cause = str(exc).strip().splitlines()
                _BROKEN[_file_of(module)] = ": ".join([type(exc).__name__, *cause[:1]])
    return _RULES


def _file_of(module: pkgutil.ModuleInfo) -> str:
    """The file a module of the package was found in, as the error names it."""
    spec = module.module_finder.find_spec(module.name)  # type: ignore[call-arg]
    origin = None if spec is None else spec.origin
    return origin or f"kvoffload.admission.{module.name}"


def _broken_files() -> str:
    """The modules that failed to import, for the error of a name they may have held."""
    if not _BROKEN:
        return ""
    files = "; ".join(f"{path} ({cause})" for path, cause in sorted(_BROKEN.items()))
    return f"; rule files that failed to import: {files}"


def available_admissions() -> list[str]:
    """Valid admission names, aliases included, sorted."""
    return sorted([NO_ADMISSION, *_rules(), *ALIASES])


def resolve_admission(name: str) -> str:
    """The canonical name of ``name``; the error for an unknown one lists the valid names."""
    canonical = ALIASES.get(name, name) if isinstance(name, str) else None  # a list: no key
    if canonical is None or (canonical != NO_ADMISSION and canonical not in _rules()):
        raise InvalidArgumentError(
            f"unknown admission {brief(name)}; known: {', '.join(available_admissions())}"
            f"{_broken_files()}"
        )
    return canonical


def params_class(name: str) -> type[Any]:
    """The parameters dataclass of the rule ``name`` (:class:`NoParams` for ``none``)."""
    canonical = resolve_admission(name)
    return NoParams if canonical == NO_ADMISSION else _rules()[canonical].params


def admission_params(name: str, raw: RawParams | object | None = None) -> Any:
    """The parameters of rule ``name``: ``raw`` is ``None`` (defaults), a flat
    ``key -> value`` mapping (see :func:`~kvoffload.admission.params.parse_params`) or its
    items as pairs, or an instance of the rule's dataclass."""
    cls = params_class(name)
    if raw is None:
        return cls()
    if isinstance(raw, cls):
        check_params(raw, resolve_admission(name))
        return raw
    if isinstance(raw, tuple):
        # Pairs, as config_params gives them; ``("threshold", 3)``, one pair unwrapped,
        # once escaped as dict()'s "update sequence element #0 has length 9".
        with contextlib.suppress(TypeError, ValueError):
            raw = dict(raw)
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):  # another rule's
        raise InvalidArgumentError(
            f"params of {resolve_admission(name)!r} must be {cls.__name__} or a mapping of "
            f"name to value, got {type(raw).__name__}"
        )
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(
            f"admission parameters must be a mapping of name to value, got {brief(raw)}"
        )
    if raw and cls is NoParams:
        given = ", ".join(sorted(map(str, raw)))  # keys of any type: {1: 2} was a TypeError
        raise InvalidArgumentError(
            f"admission {brief(name)} takes no parameters, got {as_written(given)}"
        )
    return parse_params(cls, raw, resolve_admission(name))


class _NameGivenTwice(Exception):
    """A name that occurs twice in one JSON object (not a ``ValueError``, which the JSON
    decoder's own errors are)."""


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a name given twice: ``json`` keeps the last one
    silently, so of ``{"threshold": 3, "threshold": 5}`` an operator's 3 went unused."""
    members: dict[str, Any] = {}
    for name, value in pairs:
        if name in members:
            raise _NameGivenTwice(name)
        members[name] = value
    return members


def params_json(text: str) -> object:
    """Admission parameters written as JSON text, decoded; :class:`InvalidArgumentError`
    whose line the caller prefixes with the setting's name (``must be a JSON object ...``,
    ``gives admission parameter 'x' twice``) for text that is no JSON or names one twice."""
    try:
        return json.loads(text, object_pairs_hook=_unique_names)
    except _NameGivenTwice as twice:
        raise InvalidArgumentError(
            f"gives admission parameter {brief(twice.args[0])} twice"
        ) from None
    except (ValueError, RecursionError):  # nested past the decoder's depth: no parameters
        raise InvalidArgumentError(
            f"must be a JSON object of admission parameters, got {brief(text)}"
        ) from None


def config_params(name: str, value: object, where: str) -> ParamPairs:
    """Raw parameters of rule ``name`` from an engine's extra-config, checked: ``value`` is
    ``None``, a mapping of name to value, or JSON text of one; errors start with ``where``."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = params_json(value)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where} {exc}") from None
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise InvalidArgumentError(
            f"{where} must be a mapping of admission parameter to value, got {brief(value)}"
        )
    try:
        admission_params(name, value)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    return tuple(sorted(value.items()))


def wrap_with_admission(
    name: str,
    backing: OffloadingManager,
    capacity: int,
    write_budget: float | WriteBudget | None = None,
    params: RawParams | object | None = None,
    size_key: str = "",
) -> OffloadingManager:
    """``backing`` behind the admission rule ``name`` (unchanged for ``none``).

    A ``write_budget`` (writes per block reference, or a :class:`WriteBudget`) needs
    the optimiser, the only layer that can keep to one. ``params``: see
    :func:`admission_params`. ``size_key``: the caller's key of ``capacity``, which
    memory the layer's size asks and the machine lacks then names (the layer grows with it).
    """
    try:
        return _wrap(name, backing, capacity, write_budget, params)
    except InsufficientMemoryError as exc:
        if not size_key:
            raise
        raise InsufficientMemoryError(f"{size_key}: {exc}") from None


def _wrap(
    name: str,
    backing: OffloadingManager,
    capacity: int,
    write_budget: float | WriteBudget | None,
    params: RawParams | object | None,
) -> OffloadingManager:
    from kvoffload.admission.optimiser import OptimisingAdmission

    canonical = resolve_admission(name)
    parsed = admission_params(canonical, params)
    check_write_budget(write_budget)
    if write_budget is not None:
        if canonical != OPTIMISER:
            raise InvalidArgumentError(
                f"a write budget needs admission 'recommended' (the optimiser), not {name!r}"
            )
        return OptimisingAdmission(backing, capacity, write_budget=write_budget, params=parsed)
    if canonical == NO_ADMISSION:
        return backing
    built: OffloadingManager = _rules()[canonical].cls.from_params(backing, capacity, parsed)
    return built


def find_admission(manager: OffloadingManager) -> AdmissionLayer | None:
    """The first admission layer in a stack of decorators, following ``backing``."""
    for layer in stack_layers(manager):
        if isinstance(layer, AdmissionLayer):  # abstract: find_layer's type[...] refuses it
            return layer
    return None
