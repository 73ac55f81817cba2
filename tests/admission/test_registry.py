"""The admission registry and its parameters: names, aliases, registration, parsing, checks."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload import InvalidArgumentError, block_id_key
from kvoffload.admission import (
    AdmissionLayer,
    AdmissionStats,
    FeedbackAdmission,
    FeedbackParams,
    FilterReusedOffloadingManager,
    OptimisingAdmission,
    SketchAdmission,
    SketchParams,
    admission_params,
    available_admissions,
    config_params,
    param,
    params_class,
    register_admission,
    registry,
    resolve_admission,
    wrap_with_admission,
)
from kvoffload.admission.controller import GROUP_STRENGTH, PRIOR_OUTCOMES, PRIOR_RETURNS
from kvoffload.admission.feedback import DEFAULT_THRESHOLD, MIN_SAMPLE, ROOT_GROUPS, SAMPLE_FACTOR
from kvoffload.admission.optimiser import FILTER_THRESHOLD, FILTER_TRACKER, HIT_TOLERANCE
from kvoffload.admission.params import NoParams, check_params, parse_pairs
from kvoffload.core.keys import OffloadKey
from kvoffload.managers import CPUOffloadingManager, build_manager


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Rules a test registers leave with the test."""
    monkeypatch.setattr(registry, "_RULES", dict(registry._rules()))
    yield


@dataclasses.dataclass(frozen=True)
class EveryNthParams:
    every: int = param(2, 1, help="store every n-th offered block")

    def __post_init__(self) -> None:
        check_params(self, "every-nth")


class EveryNth(AdmissionLayer):
    """A rule written the way docs/admission.md says: one class, one decorator."""

    def __init__(self, backing, capacity, params: EveryNthParams | None = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(backing, capacity)
        self.params = params or EveryNthParams()
        self.sightings = 0

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.sightings += 1

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        return list(offered[:: self.params.every])

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.offers, self.admitted, self.offers - self.admitted, 0, 0.0, 0, 0)


def test_names_and_aliases_resolve_and_an_unknown_name_lists_the_known_ones() -> None:
    assert resolve_admission("recommended") == "optimiser"
    assert resolve_admission("reuse") == "filter"
    assert {"none", "feedback", "filter", "optimiser", "sketch"} <= set(available_admissions())
    with pytest.raises(InvalidArgumentError) as error:
        resolve_admission("tinylfu")
    assert all(name in str(error.value) for name in available_admissions())


@pytest.mark.parametrize("name", [["sketch"], {"sketch": 1}, None, b"sketch"])
@pytest.mark.parametrize(
    "call",
    [
        resolve_admission,
        params_class,
        admission_params,
        lambda name: wrap_with_admission(name, CPUOffloadingManager(8), 8),
    ],
)
def test_a_name_of_another_type_is_refused_listing_the_known_ones(
    call: Callable[[object], object], name: object
) -> None:
    """Not a ``TypeError`` from the alias table for a list or a dict."""
    known = re.escape(", ".join(available_admissions()))
    with pytest.raises(InvalidArgumentError, match=rf"unknown admission .*; known: {known}$"):
        call(name)


def test_a_rule_added_as_the_docs_say_keeps_the_registry_tests_passing(
    scratch_registry: None,
) -> None:
    """docs/admission.md, "Adding an admission rule": a new rule is its file, its test and
    its rows in the parameter table. The known names were matched from ``feedback`` on, so
    a rule named before it (``age``) failed the registry's tests; a rule without parameters
    failed the table's check, with no row to give it."""
    register_admission("age", params=NoParams)(EveryNth)
    test_a_name_of_another_type_is_refused_listing_the_known_ones(resolve_admission, None)
    assert parameter_table_mismatches() == []
    register_admission("every-nth", params=EveryNthParams)(EveryNth)
    assert parameter_table_mismatches() == ["every-nth: table ['-'], dataclass ['every']"]


def test_a_rule_file_that_fails_to_import_is_named_and_hides_no_other(
    scratch_registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its exception once ended the discovery: the first look-up raised it bare, naming no
    file, and every later one found the rule files after it unknown, with no word of why."""
    (tmp_path / "aaa_broken.py").write_text("import kvoffload_no_such_module\n")
    (tmp_path / "zzz_every_other.py").write_text(
        "from kvoffload.admission.registry import register_admission\n"
        "from kvoffload.admission.seen_twice import SketchAdmission\n"
        "register_admission('every-other')(type('EveryOther', (SketchAdmission,), {}))\n"
    )
    package = sys.modules["kvoffload.admission"]
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_BROKEN", {}, raising=False)
    try:
        for _ in range(2):  # the same answer on each look-up, not only on the first
            assert resolve_admission("every-other") == "every-other"
            message = f"unknown admission 'aaa-broken'; .* {tmp_path / 'aaa_broken.py'} "
            with pytest.raises(InvalidArgumentError, match=message + r"\(ModuleNotFoundError: "):
                resolve_admission("aaa-broken")
    finally:
        for name in ("aaa_broken", "zzz_every_other"):
            sys.modules.pop(f"kvoffload.admission.{name}", None)


def test_every_name_builds_its_class() -> None:
    built = {
        name: type(wrap_with_admission(name, CPUOffloadingManager(8), 8))
        for name in ("feedback", "filter", "optimiser", "reuse", "sketch", "recommended")
    }
    assert built == {
        "feedback": FeedbackAdmission,
        "filter": FilterReusedOffloadingManager,
        "optimiser": OptimisingAdmission,
        "reuse": FilterReusedOffloadingManager,
        "sketch": SketchAdmission,
        "recommended": OptimisingAdmission,
    }


def test_a_second_class_under_a_taken_name_is_refused(scratch_registry: None) -> None:
    for taken in ("feedback", "none", "recommended"):
        with pytest.raises(InvalidArgumentError, match="already registered"):
            register_admission(taken)(EveryNth)
    assert register_admission("feedback")(FeedbackAdmission) is FeedbackAdmission  # re-import


@pytest.mark.parametrize("name", [None, b"every-nth", 3, ""])
def test_a_rule_name_that_is_no_string_is_refused_before_it_breaks_the_list(
    scratch_registry: None, name: object
) -> None:
    """Registered, ``None`` made every later ``available_admissions()`` a ``TypeError``."""
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        register_admission(name)(EveryNth)  # type: ignore[arg-type]
    assert "sketch" in available_admissions()


def test_a_rule_without_a_parameters_dataclass_or_a_builder_is_refused_when_registered(
    scratch_registry: None,
) -> None:
    """Registered, either was a ``TypeError`` (``dataclasses.fields``) or an
    ``AttributeError`` (``from_params``) at the rule's first use, far from the mistake."""
    with pytest.raises(InvalidArgumentError, match="params must be a dataclass"):
        register_admission("every-nth", params=dict)
    with pytest.raises(InvalidArgumentError, match="params must be a dataclass"):
        register_admission("every-nth", params=EveryNthParams())  # an instance
    with pytest.raises(InvalidArgumentError, match="has no from_params"):
        register_admission("every-nth", params=EveryNthParams)(EveryNthParams)
    assert "every-nth" not in available_admissions()


@dataclasses.dataclass(frozen=True)
class UndeclaredParams:
    """A parameter written as a plain dataclass field, without :func:`param`."""

    every: int = 2


@dataclasses.dataclass(frozen=True)
class BadDefaultParams:
    every: int = param(0, 1, help="a default below its own bound")


@pytest.mark.parametrize(
    ("params", "refusal"),
    [
        (UndeclaredParams, "'every' of UndeclaredParams is not declared with param"),
        (BadDefaultParams, "default parameters: .*'every' of 'every-nth' must be >= 1, got 0"),
    ],
)
def test_a_parameters_dataclass_the_registry_cannot_read_is_refused_when_registered(
    scratch_registry: None, params: type, refusal: str
) -> None:
    """Registered, a field without ``param()`` was a ``KeyError: 'low'`` at the rule's
    ``--admission-param help`` and at an instance of its parameters, and a default out of
    its own range an error at its first use, naming no mistake in the rule's file."""
    with pytest.raises(InvalidArgumentError, match=refusal):
        register_admission("every-nth", params=params)
    assert "every-nth" not in available_admissions()


def test_a_new_rule_is_one_decorator_and_takes_its_parameters(scratch_registry: None) -> None:
    register_admission("every-nth", params=EveryNthParams)(EveryNth)
    assert "every-nth" in available_admissions()
    layer = wrap_with_admission("every-nth", CPUOffloadingManager(8), 8, params={"every": "3"})
    assert isinstance(layer, EveryNth) and layer.params.every == 3
    keys = [block_id_key(i) for i in range(7)]
    layer.begin_request(keys, lookup_follows=True)
    output = layer.prepare_store(keys)
    assert output is not None and output.keys_to_store == keys[::3]
    assert layer.sightings == 1
    with pytest.raises(InvalidArgumentError, match="'every' of 'every-nth' must be >= 1"):
        wrap_with_admission("every-nth", CPUOffloadingManager(8), 8, params={"every": 0})


def test_the_defaults_are_the_constants_the_figures_were_measured_with() -> None:
    assert FeedbackParams() == FeedbackParams(
        DEFAULT_THRESHOLD,
        ROOT_GROUPS,
        SAMPLE_FACTOR,
        MIN_SAMPLE,
        PRIOR_RETURNS,
        PRIOR_OUTCOMES,
        GROUP_STRENGTH,
    )
    optimiser = admission_params("recommended")
    assert (optimiser.hit_tolerance, optimiser.filter_threshold, optimiser.filter_tracker) == (
        HIT_TOLERANCE,
        FILTER_THRESHOLD,
        FILTER_TRACKER,
    )
    assert dataclasses.asdict(admission_params("filter")) == {
        "store_threshold": 2,
        "max_tracker_size": 64_000,
    }


def test_parameters_reach_the_layer() -> None:
    feedback = wrap_with_admission(
        "feedback",
        CPUOffloadingManager(8),
        8,
        params={"threshold": "0.25", "root_groups": 4, "min_sample": "16", "sample_factor": 2},
    )
    assert isinstance(feedback, FeedbackAdmission)
    controller = feedback.controller
    assert (controller.threshold, controller.groups) == (0.25, 4)
    assert (
        feedback.sketch.sample_size
        == FeedbackAdmission(
            CPUOffloadingManager(8), 8, FeedbackParams(min_sample=16, sample_factor=2)
        ).sketch.sample_size
    )
    assert (
        feedback.sketch.sample_size
        != FeedbackAdmission(CPUOffloadingManager(8), 8).sketch.sample_size
    )
    sketch = wrap_with_admission("sketch", CPUOffloadingManager(8), 8, params={"threshold": 3})
    assert isinstance(sketch, SketchAdmission) and sketch.threshold == 3
    optimiser = wrap_with_admission(
        "recommended",
        CPUOffloadingManager(8),
        8,
        params={"hit_tolerance": 0.01, "filter_threshold": "3", "filter_tracker": "100"},
    )
    assert isinstance(optimiser, OptimisingAdmission)
    assert optimiser.objective.hit_tolerance == 0.01
    assert (optimiser.filter.store_threshold, optimiser.filter.max_tracker_size) == (3, 100)
    seed = build_manager(
        8, admission="reuse", admission_params={"store_threshold": 3, "max_tracker_size": 5}
    )
    assert isinstance(seed, FilterReusedOffloadingManager)
    assert (seed.store_threshold, seed.max_tracker_size) == (3, 5)


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("feedback", {"thresold": "0.3"}, "unknown admission parameter 'thresold'.*valid: "),
        ("feedback", {"threshold": "1.5"}, "'threshold' of 'feedback': must be <= 1, got 1.5"),
        ("feedback", {"root_groups": "2.5"}, "'root_groups' of 'feedback' must be an integer"),
        ("feedback", {"root_groups": True}, "'root_groups' of 'feedback' must be an integer"),
        ("feedback", {"prior_returns": "nan"}, "'prior_returns' of 'feedback': must be a finite"),
        (
            "feedback",
            {"prior_returns": "3", "prior_outcomes": "2"},
            r"'feedback': prior_returns \(3\) must not exceed prior_outcomes \(2\)",
        ),
        ("sketch", {"threshold": "x"}, "'threshold' of 'sketch' must be an integer"),
        ("filter", {"store_threshold": 1}, r"'store_threshold' of 'filter' must be in \[2, "),
        ("optimiser", {"switch_margin": -1}, "'switch_margin' of 'optimiser' must be in"),
        ("none", {"threshold": "2"}, "'none' takes no parameters"),
    ],
)
def test_a_bad_parameter_is_one_error_naming_the_key(
    name: str, raw: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        admission_params(name, raw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [("window_tiers", "0.01", 0.01), ("window_tiers", "1e-2", 0.01), ("hit_tolerance", "1", 1.0)],
)
def test_a_bound_written_out_is_in_range(key: str, text: str, value: float) -> None:
    """Text is judged as written, against the bound as written too: the float 0.01 is
    0.01000000000000000020..., above a written 0.01."""
    assert getattr(admission_params("optimiser", {key: text}), key) == value


def test_a_number_past_the_float_range_is_one_error_naming_the_key() -> None:
    """A long integer (JSON in extra-config, digits on the command line) once escaped as
    ``OverflowError: int too large to convert to float``, a traceback, not the key's error."""
    huge = "1" + "0" * 400
    cases = [
        (lambda: admission_params("sketch", {"threshold": int(huge)}), "in \\[1, 15\\]"),
        (lambda: admission_params("sketch", {"threshold": huge}), "in \\[1, 15\\]"),
        (lambda: admission_params("feedback", {"prior_returns": int(huge)}), "a finite number"),
        (
            lambda: config_params("feedback", f'{{"prior_returns": {huge}}}', "where"),
            "a finite number",
        ),
        (lambda: params_class("feedback")(prior_returns=int(huge)), "a finite number"),
    ]
    for build, message in cases:
        with pytest.raises(InvalidArgumentError, match=f"parameter '[a-z_]+' .* must be {message}"):
            build()


@pytest.mark.parametrize(
    ("build", "shown"),
    [
        (lambda: config_params("optimiser", '{"hit_tolerance": Infinity}', "where"), "inf"),
        (lambda: config_params("optimiser", '{"hit_tolerance": NaN}', "where"), "nan"),
        (lambda: config_params("optimiser", '{"hit_tolerance": 1e400}', "where"), "inf"),
        (lambda: admission_params("optimiser", {"hit_tolerance": -math.inf}), "-inf"),
        (lambda: params_class("optimiser")(hit_tolerance=math.nan), "nan"),
    ],
)
def test_a_float_parameter_given_a_number_no_float_holds_is_told_it_must_be_finite(
    build: Callable[[], object], shown: str
) -> None:
    """JSON's ``Infinity`` (or ``1e400``) was told "must be a number, got inf", the same
    value on the command line "must be a finite number": the first read as if inf were no
    number at all."""
    with pytest.raises(
        InvalidArgumentError,
        match=f"'hit_tolerance' of 'optimiser' must be a finite number, got {shown}$",
    ):
        build()
    with pytest.raises(
        InvalidArgumentError, match="'hit_tolerance' of 'optimiser' must be a number"
    ):
        admission_params("optimiser", {"hit_tolerance": None})


def test_an_integer_too_long_to_print_is_still_the_key_s_error() -> None:
    """The error shows no integer past a float's range: its hundreds of digits made a line
    of hundreds of characters, and past 4,300 digits ``repr`` itself raised ``ValueError:
    Exceeds the limit ... for integer string conversion`` instead of the key's error."""
    for key in ("threshold", "sample_factor"):
        message = f"'{key}' .* got an integer outside"
        with pytest.raises(InvalidArgumentError, match=message) as error:
            admission_params("sketch", {key: 10**5000})
        assert len(str(error.value)) < 200
    with pytest.raises(InvalidArgumentError, match=r"'prior_returns' .* got an integer outside"):
        admission_params("feedback", {"prior_returns": 10**5000})


@pytest.mark.parametrize("raw", [("threshold", 3), (("threshold",),), (3,)])
def test_pairs_that_are_no_pairs_are_one_error_naming_the_parameters(raw: object) -> None:
    """One pair unwrapped once escaped as dict()'s "update sequence element #0"."""
    assert admission_params("sketch", (("threshold", 3),)).threshold == 3
    with pytest.raises(InvalidArgumentError, match="must be a mapping of name to value"):
        admission_params("sketch", raw)


def test_an_unknown_key_lists_every_valid_one() -> None:
    with pytest.raises(InvalidArgumentError) as error:
        admission_params("optimiser", {"tolerance": 0.1})
    fields = [field.name for field in dataclasses.fields(params_class("optimiser"))]
    assert all(field in str(error.value) for field in fields)


def test_every_rules_parameters_accept_their_defaults_as_text() -> None:
    for name in available_admissions():
        cls = params_class(name)
        defaults = dataclasses.asdict(cls())
        assert admission_params(name, {k: str(v) for k, v in defaults.items()}) == cls()


def test_a_float_parameter_takes_a_fraction_whatever_its_default() -> None:
    """The annotation, not the default, types a field: ``window_tiers`` defaults to a whole
    32 and once refused 0.5 as "not an integer"."""
    floats = 0
    for name in available_admissions():
        for field in dataclasses.fields(params_class(name)):
            assert field.type in ("int", "float"), f"{name}.{field.name}: {field.type}"
            if field.type != "float":
                continue
            low, high = field.metadata["low"], field.metadata["high"]
            value = (low + high) / 2 if high != math.inf else low + 0.5
            # No more prior returns than prior outcomes (the default returns, 0.9, are).
            others = {"prior_returns": "0"} if field.name == "prior_outcomes" else {}
            for raw in (str(value), value):
                parsed = admission_params(name, {field.name: raw, **others})
                assert getattr(parsed, field.name) == value
            floats += 1
    assert floats >= 10
    assert admission_params("optimiser", {"window_tiers": "0.5"}).window_tiers == 0.5


@pytest.mark.parametrize("pairs", [[None], ["a=1", 3], [b"a=1"]])
def test_a_pair_that_is_no_string_is_refused_naming_the_option(pairs: list[object]) -> None:
    with pytest.raises(InvalidArgumentError, match="--admission-param takes key=value"):
        parse_pairs(pairs, "--admission-param")  # type: ignore[arg-type]


@pytest.mark.parametrize("pairs", ["threshold=3", None, {"threshold": "3"}])
def test_pairs_that_are_no_list_are_refused(pairs: object) -> None:
    """One ``"threshold=3"`` was read letter by letter ("takes key=value, got 't'"), ``None``
    a ``TypeError``, a mapping its keys alone."""
    with pytest.raises(InvalidArgumentError, match="--admission-param takes a list of key=value"):
        parse_pairs(pairs, "--admission-param")  # type: ignore[arg-type]


def test_key_value_pairs_and_extra_config_values() -> None:
    assert parse_pairs(["a=1", " b = x ", "a=2"], "--admission-param") == {"a": "2", "b": "x"}
    with pytest.raises(InvalidArgumentError, match="--admission-param takes key=value"):
        parse_pairs(["threshold"], "--admission-param")
    assert config_params("sketch", '{"threshold": 3}', "where") == (("threshold", 3),)
    assert config_params("sketch", {"threshold": "3"}, "where") == (("threshold", "3"),)
    assert config_params("sketch", None, "where") == ()
    with pytest.raises(InvalidArgumentError, match=r"^where must be a JSON object"):
        config_params("sketch", "{threshold", "where")
    with pytest.raises(InvalidArgumentError, match=r"^where must be a mapping"):
        config_params("sketch", [1], "where")
    with pytest.raises(InvalidArgumentError, match=r"^where: unknown admission parameter 'x'"):
        config_params("sketch", {"x": 1}, "where")


LONG_ARRAY = "[" + "1, " * 5_000 + "1]"


@pytest.mark.parametrize(
    "call",
    [
        lambda: config_params("sketch", LONG_ARRAY, "where"),
        lambda: config_params("sketch", [1] * 5_000, "where"),
        lambda: admission_params("sketch", LONG_ARRAY),
    ],
)
def test_parameters_of_no_mapping_are_shown_cut_with_their_length(
    call: Callable[[], object],
) -> None:
    """An engine's extra-config admission parameters pasted as a JSON array (valid JSON, no
    object) were echoed whole: a 15,000-character error line for a 5,001-item array."""
    with pytest.raises(InvalidArgumentError, match="must be a mapping") as refused:
        call()
    assert "characters)" in str(refused.value) and len(str(refused.value)) < 300


PASTED = "k" * 100_000
"""A key or name pasted by mistake: a whole file's line, say."""


@pytest.mark.parametrize(
    "call",
    [
        lambda: admission_params("sketch", {PASTED: "1"}),
        lambda: admission_params("none", {PASTED: "1"}),
        lambda: parse_pairs([PASTED], "--admission-param"),
        lambda: parse_pairs([f"{PASTED}="], "--admission-param"),
        lambda: parse_pairs(PASTED, "--admission-param"),
        lambda: resolve_admission(PASTED),
        lambda: config_params("sketch", f'{{"{PASTED}": 1, "{PASTED}": 2}}', "where"),
    ],
)
def test_a_key_or_name_pasted_by_mistake_is_shown_cut_with_its_length(
    call: Callable[[], object],
) -> None:
    """Values were cut, but an unknown key, a pair without ``=``, a rule's name and a key
    named twice were echoed whole: ``--admission-param`` with a 100,000-character key made
    an error line of 100,000 characters."""
    with pytest.raises(InvalidArgumentError) as refused:
        call()
    assert "characters)" in str(refused.value) and len(str(refused.value)) < 400


def test_parameters_of_a_rule_that_takes_none_are_refused_whatever_their_keys() -> None:
    """``admission_params("none", {1: 2})`` was a bare ``TypeError`` (``sequence item 0:
    expected str instance``) from listing the keys, not the error it was listing them for."""
    for raw in ({1: 2}, {1: 2, "guard": 1}):
        with pytest.raises(InvalidArgumentError, match="'none' takes no parameters, got 1"):
            admission_params("none", raw)


def test_an_integer_parameter_takes_a_json_float_that_is_a_whole_number() -> None:
    """JSON writes 16 as ``16.0`` or ``1e4`` too (a tool's float, a config generator): an
    integer parameter takes it as the integer it is, and refuses a fraction naming the key."""
    assert admission_params("sketch", {"threshold": 3.0}).threshold == 3
    parsed = admission_params(
        "filter", dict(config_params("filter", '{"max_tracker_size": 1e4}', "w"))
    )
    assert parsed.max_tracker_size == 10_000 and type(parsed.max_tracker_size) is int
    with pytest.raises(
        InvalidArgumentError, match=r"'threshold' of 'sketch' must be an integer, got 3.5$"
    ):
        config_params("sketch", '{"threshold": 3.5}', "where")
    with pytest.raises(
        InvalidArgumentError, match=r"'threshold' of 'sketch' must be in \[1, 15\], got 16$"
    ):
        admission_params("sketch", {"threshold": 16.0})


def test_a_parameter_named_twice_in_json_text_is_refused_naming_it() -> None:
    """``json.loads`` keeps the last of two equal names: the 3 written first went unused."""
    twice = r"^where gives admission parameter 'threshold' twice$"
    with pytest.raises(InvalidArgumentError, match=twice):
        config_params("sketch", '{"threshold": 3, "threshold": 5}', "where")
    with pytest.raises(InvalidArgumentError, match=twice):
        config_params("sketch", '{"threshold": 3, "threshold": 3}', "where")


def parameter_table_mismatches() -> list[str]:
    """How docs/admission.md's parameter table differs from the registered rules'
    dataclasses: per rule, the keys each gives, or the key whose default differs. A rule
    without parameters needs no row."""
    documented: dict[str, dict[str, str]] = {}
    for rule, key, default, _ in parameter_rows():
        documented.setdefault(rule, {})[key] = default.replace(",", "")
    mismatches = []
    for rule in sorted({resolve_admission(name) for name in available_admissions()} - {"none"}):
        defaults = params_class(rule)()
        fields = {
            field.name: getattr(defaults, field.name) for field in dataclasses.fields(defaults)
        }
        rows = documented.get(rule, {})
        if set(rows) != set(fields):
            mismatches.append(f"{rule}: table {sorted(rows) or ['-']}, dataclass {sorted(fields)}")
            continue
        mismatches += [
            f"{rule}: {key} {rows[key]} in the table, {value} in the dataclass"
            for key, value in fields.items()
            if float(rows[key]) != value
        ]
    return mismatches


def parameter_rows() -> list[tuple[str, str, str, str]]:
    """docs/admission.md's parameter table: each row's canonical rule, key, default and
    range as written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "admission.md").read_text()
    table = text[text.index("## Parameters") :].split("\n## ")[0]
    rows = []
    for line in table.splitlines():
        if line.startswith("| `"):
            rule, key, default, bounds = (cell.strip() for cell in line.strip("|").split("|")[:4])
            rows.append((resolve_admission(rule.split("`")[1]), key.strip("`"), default, bounds))
    return rows


def documented_bound(text: str) -> float:
    """A bound as the table writes it (``1,048,576``, ``2^62``, ``2^59 - 1``); one that
    names another parameter (``prior_outcomes``) is checked by the dataclass itself, so its
    field has no upper bound."""
    text = text.strip().replace(",", "")
    if "`" in text:
        return math.inf
    if match := re.fullmatch(r"2\^(\d+)( - 1)?", text):
        return 2 ** int(match[1]) - (1 if match[2] else 0)
    return float(text)


def documented_range(text: str) -> tuple[float, float]:
    """``0 to 1``, ``0 or 1`` or ``>= 0.01`` as (low, high)."""
    if text.startswith(">="):
        return documented_bound(text[2:]), math.inf
    low, high = re.split(r" to | or ", text)
    return documented_bound(low), documented_bound(high)


def test_the_docs_parameter_table_lists_every_parameter_with_its_default() -> None:
    """docs/admission.md's table is what operators set parameters by: a key added,
    renamed or given a new default in a dataclass must show there too."""
    assert parameter_table_mismatches() == []


def test_the_docs_parameter_table_gives_every_parameter_s_range() -> None:
    """Its range column was checked against nothing: a bound moved in a dataclass left the
    table promising values the parameter refuses, or refusing values it takes."""
    mismatches = []
    for rule, key, _, bounds in parameter_rows():
        field = {field.name: field for field in dataclasses.fields(params_class(rule))}[key]
        declared = (field.metadata["low"], field.metadata["high"])
        if documented_range(bounds) != declared:
            mismatches.append(f"{rule}: {key} {bounds} in the table, {declared} declared")
    assert mismatches == []


@pytest.mark.parametrize(
    ("name", "given", "wanted"),
    [
        ("feedback", SketchParams(), "FeedbackParams"),
        ("recommended", FeedbackParams(), "OptimiserParams"),
        ("none", FeedbackParams(), "NoParams"),
    ],
)
def test_another_rule_s_parameters_are_named_as_the_wrong_rule_s(
    name: str, given: object, wanted: str
) -> None:
    """They were refused as no mapping of name to value, as though the rule's own dataclass
    were not taken either."""
    with pytest.raises(InvalidArgumentError, match=f"must be {wanted} or a mapping") as error:
        wrap_with_admission(name, CPUOffloadingManager(8), 8, params=given)
    assert type(given).__name__ in str(error.value)
