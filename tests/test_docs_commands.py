"""Every command line, option and engine config the README and the manual show is still
accepted: a flag or key renamed since a page was written fails here, not in the terminal
of the operator who copied it. Nothing is run: each is parsed as its program parses it.

Command lines: each ``kvoffload simulate|sweep|trace-stats|bench|--version ...`` and each
``python benchmarks/<script>.py ...`` (or ``cd benchmarks && python <script>.py ...``) in a
fenced block (``\\`` continuations joined, ``$`` prompts, environment settings, ``nice``
and ``# comments`` dropped, ``&&``/``|``/``;`` split; in a block with ``$`` prompts the
other lines are output) or in inline backticks (line breaks inside them joined), parsed by
the command's own parser, the job stopped before it starts. The names a ``kvoffload`` line
gives (policy, admission rule, layout, admission parameters) and the workloads a script's
line gives are checked too, as the run checks them before its work.

* A ``$`` sample followed by a usage error (``kvoffload: error: ... (see kvoffload
  simulate --help)``) shows a refusal: it must still be refused with that line. An error of
  the run itself (a refused directory) is not the parser's: that line must parse.
* An inline span that ends in an option (``kvoffload simulate --write-budget``'s units)
  names that option: the parser must know it and want its value.
* An inline path to a script alone, without ``python`` (``benchmarks/manager.py``'s
  replay), names the script: it must exist.
* Placeholders, the only words replaced: ``...`` (words left out) is dropped; ``$T``,
  ``$OUT`` and the upper-case words of :data:`PLACEHOLDERS` become a value of their kind; a
  usage synopsis's ``[--opt VALUE]`` is read as given, and ``[a|b|c]`` as each of ``a``,
  ``b`` and ``c``.

Options: each ``--option`` in inline backticks must be one of our commands' or scripts'
options, or one of :data:`FOREIGN_OPTIONS` (the engines', servers' and tools' own).

Configs: the JSON of each ``--kv-transfer-config`` (its ``kv_connector_extra_config``),
of each ``--hicache-storage-backend-extra-config`` and of each ``json`` block, and the
``kv_connector_extra_config={...}`` of each ``python`` block, checked by the settings
parser the engine's start-up calls (no engine, file or server touched); and each key of a
``| key | ...`` table, which that parser must know.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import itertools
import json
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvoffload.admission import resolve_admission
from kvoffload.cli import app, bench, options
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import layout_preset
from kvoffload.integrations.sglang import settings as sglang_settings
from kvoffload.integrations.sglang.settings import parse_settings as parse_sglang_settings
from kvoffload.integrations.vllm import secondary_settings
from kvoffload.integrations.vllm import settings as spec_settings
from kvoffload.integrations.vllm.secondary_settings import (
    parse_disk_settings,
    parse_shared_settings,
)
from kvoffload.integrations.vllm.settings import parse_settings as parse_spec_settings
from kvoffload.policies import resolve_policy
from sim.benchmark_scripts import BENCHMARKS, load_benchmark

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIG_PAGES = ("README.md", "vllm.md", "vllm-secondary.md", "sglang.md", "vllm-cpu.md")

CLI_COMMANDS = ("simulate", "sweep", "trace-stats", "bench")
SCRIPT = re.compile(r"^(?:\./)?benchmarks/(\w+)\.py$")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
USAGE_ERROR = re.compile(r"^kvoffload: error: .* \(see kvoffload [a-z -]+ --help\)$")
"""A usage error, as the parser words it; any other error is the run's."""
SEPARATORS = {"&&", "||", "|", ";"}
PROGRAM_PREFIXES = {"python", "python3", "nice", "-n", "10"}
"""Words before the command itself: the interpreter, ``nice -n 10``."""

PLACEHOLDERS = {
    "$T": "trace.jsonl",
    "$OUT": "out.json",
    "DIR": "baselines",
    "PATH": "out.json",
    "PORT": "9400",
    "URL": "redis://127.0.0.1:6379/0",
    "RULE": "recommended",
    "NAME": "recommended",
    "KEY=VALUE": "threshold=0.4",
    "MS": "1000",
    "W": "0.2",
    "N": "3",
    "S": "1",
}
"""A page's stand-in for a value, and a value of that kind."""
IN_WORDS = ("PORT", "URL", "PATH", "DIR")
"""Stand-ins also replaced inside a word (``redis://127.0.0.1:PORT/0``)."""

FOREIGN_OPTIONS = frozenset(
    {
        "--appendonly",  # valkey-server
        "--save",
        "--dp-size",  # SGLang's server
        "--enable-metrics",
        "--hicache-storage-backend-extra-config",
        "--kv-cache-dtype",
        "--kv-events-config",  # vLLM's and SGLang's
        "--model",  # vLLM's server
        "--prefix-caching-hash-algo",
        "--served-model-name",
        "--shm-size",  # docker
        "--inplace",  # setup.py build_ext
        "--strict",  # mkdocs build
        "--dist",  # pytest-xdist
        "--no-compile",  # pip
    }
)
"""Options the pages name that are not ours."""

OPTIONAL_MODULE = re.compile(r"No module named '(torch|vllm|sglang)[.']?")
"""Engines and torch are optional: a script that needs one is skipped where it is absent."""


@contextlib.contextmanager
def skipped_without_engine(what: str) -> Iterator[None]:
    """Skip, naming ``what`` and the module, where an engine or torch is not installed."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = OPTIONAL_MODULE.search(str(exc))
        if missing is None:
            raise
        pytest.skip(f"{what} needs {missing.group(1)}")


@dataclass(frozen=True)
class Command:
    """One documented command line: where it is, its words as a shell splits them, the
    refusal its sample shows (``None``: it must be accepted), and whether it only names an
    option of the command or the script itself."""

    page: str
    line: int
    words: tuple[str, ...]
    refused_with: str | None = None
    names_option: bool = False
    names_script: bool = False

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.words)}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _without_fences(text: str) -> str:
    """``text`` with each fenced block blanked (its lines kept, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _inline_spans(text: str) -> Iterator[tuple[int, str]]:
    """Each inline code span of a page outside its fenced blocks: its line, and its text
    with line breaks joined."""
    prose = _without_fences(text)
    for span in INLINE.finditer(prose):
        yield _line_of(prose, span.start()), " ".join(span.group(1).split())


def _shell_lines(block: str) -> Iterator[tuple[int, str, str | None]]:
    """Each command line of a fenced block (continuations joined), its line offset in the
    block and the usage error shown under it."""
    lines = block.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    index = 0
    while index < len(lines):
        start = index
        line = lines[index]
        while line.endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line[:-1] + " " + lines[index].strip()
        index += 1
        if prompted and not line.startswith("$ "):
            continue
        shown = lines[index] if index < len(lines) else ""
        refused = shown if USAGE_ERROR.match(shown) else None
        yield start, line.removeprefix("$ "), refused


def _commands_in(
    text: str, page: str, line: int, refused: str | None = None, inline: bool = False
) -> Iterator[Command]:
    """The documented commands in one shell line or inline span."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: prose, not a command line
        return
    in_benchmarks = False  # after ``cd benchmarks``, a script is run by its bare name
    for is_separator, group in itertools.groupby(words, SEPARATORS.__contains__):
        part = list(group)
        in_benchmarks = in_benchmarks or part == ["cd", "benchmarks"]
        run_by = part[0]
        while part and (re.match(r"^[A-Z_]+=", part[0]) or part[0] in PROGRAM_PREFIXES):
            part = part[1:]
        if is_separator or not part:
            continue
        program = part[0].removeprefix(".venv/bin/")
        if in_benchmarks and re.match(r"^\w+\.py$", program):
            program = f"benchmarks/{program}"
        names_option = inline and part[-1].startswith("--")
        if program == "kvoffload" and len(part) > 1 and part[1] in (*CLI_COMMANDS, "--version"):
            yield Command(page, line, ("kvoffload", *part[1:]), refused, names_option)
        elif SCRIPT.match(program):
            names_script = inline and len(part) == 1 and run_by == program
            yield Command(page, line, (program, *part[1:]), refused, names_option, names_script)


def documented_commands(pages: list[Path]) -> list[Command]:
    """Every command line shown in ``pages``, fenced or inline."""
    found: list[Command] = []
    for path in pages:
        text = path.read_text()
        for fence in FENCE.finditer(text):
            first = _line_of(text, fence.start(2))
            for offset, shell_line, refused in _shell_lines(fence.group(2)):
                found.extend(_commands_in(shell_line, path.name, first + offset, refused))
        for number, span in _inline_spans(text):
            found.extend(_commands_in(span, path.name, number, inline=True))
    return found


def _alternatives(word: str) -> list[str]:
    """A synopsis's ``[a|b]`` as its choices, ``[--opt`` / ``VALUE]`` as given."""
    bare = word.strip("[]")
    return bare.split("|") if word.startswith("[") and "|" in bare else [bare]


def _concrete(word: str) -> str:
    concrete = PLACEHOLDERS.get(word, word)
    for name in IN_WORDS:
        concrete = re.sub(rf"(?<![A-Za-z_]){name}(?![A-Za-z_])", PLACEHOLDERS[name], concrete)
    return concrete


def concrete_arguments(words: tuple[str, ...]) -> list[list[str]]:
    """The arguments (after the program) of each run the documented ``words`` stand for,
    placeholders replaced."""
    choices = [
        [_concrete(choice) for choice in _alternatives(word)]
        for word in words[1:]
        if word not in ("...", "…")
    ]
    return [list(run) for run in itertools.product(*choices)]


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments are parsed: its parser
    and what it parsed (``None``: not asked to parse)."""

    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace | None) -> None:
        super().__init__(parser.prog)
        self.parser = parser
        self.namespace = args


def parse_cli(arguments: list[str]) -> tuple[int, str]:
    """``kvoffload arguments`` parsed as the command parses them, and the names and
    admission parameters it gives checked as its run checks them first: 0, or argparse's
    status and the usage error it wrote (1 and the error for a name or parameter)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = app.parse_arguments(arguments)
        except SystemExit as exc:
            return (exc.code if isinstance(exc.code, int) else 2), stderr.getvalue().strip()
    try:
        check_names(args)
    except InvalidArgumentError as exc:
        return 1, str(exc)
    return 0, ""


NAMED = {
    "policy": resolve_policy,
    "disk_policy": resolve_policy,
    "admission": resolve_admission,
    "disk_admission": resolve_admission,
    "remote_admission": resolve_admission,
    "layout": layout_preset,
}
"""Options whose value is a registry's name, checked by ``simulate`` (and the tier options
of ``sweep``) only as the run starts."""


def check_names(args: argparse.Namespace) -> None:
    """Refuse a policy, admission rule or layout no registry knows, and admission
    parameters their rule does not take, as the run would before reading a trace."""
    for dest, resolve in NAMED.items():
        value = getattr(args, dest, None)
        if isinstance(value, str):
            options.check_name(value, f"--{dest.replace('_', '-')}", resolve)
    for tier in ("", "disk", "remote"):
        prefix = f"{tier}_" if tier else ""
        rule = getattr(args, f"{prefix}admission", None)
        given = getattr(args, f"{prefix}admission_param", None)
        if isinstance(rule, str) and given and options.PARAM_LIST not in given:
            options.admission_param_pairs(args, tier)


def _script_parser(name: str, arguments: list[str] | None, patch: pytest.MonkeyPatch) -> _Parsed:
    """``python benchmarks/<name>.py arguments`` as far as its parser: the parser and what
    it parsed (``None``: stopped as soon as it is asked to parse), the job stopped there. A
    usage error raises :class:`SystemExit`."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parsed = None if arguments is None else original(self, *args, **kwargs)
        raise _Parsed(self, parsed)

    patch.syspath_prepend(str(BENCHMARKS))  # as ``python benchmarks/x.py`` has it
    module = load_benchmark(name)
    patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    patch.setattr(sys, "argv", [f"{name}.py", *(arguments or [])])
    try:
        module.main()
    except _Parsed as parsed:
        unknown = _unknown_workloads(getattr(module, "WORKLOADS", None), parsed.namespace)
        if unknown:
            known = ", ".join(module.WORKLOADS)
            parsed.parser.error(f"unknown workload {unknown[0]!r}; known: {known}")
        return parsed
    raise AssertionError(f"benchmarks/{name}.py ran without parsing its arguments")


def script_parser(name: str, patch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``python benchmarks/<name>.py`` builds, built in this process."""
    return _script_parser(name, None, patch).parser


WORKLOAD_ARGUMENTS = ("workloads", "workload", "rows")
"""The scripts' arguments that name workloads (``rows``: ``workload:share``), checked
against the script's ``WORKLOADS`` only once it has parsed them."""


def _unknown_workloads(
    workloads: Mapping[str, object] | None, args: argparse.Namespace | None
) -> list[str]:
    """The workloads ``args`` names that ``workloads`` does not have."""
    if workloads is None or args is None:
        return []
    named: list[str] = []
    for dest in WORKLOAD_ARGUMENTS:
        value = getattr(args, dest, None)
        for text in [value] if isinstance(value, str) else value or []:
            named += [str(part).rpartition(":")[0] or str(part) for part in str(text).split(",")]
    return [name.strip() for name in named if name.strip() not in workloads]


def parse_script(
    name: str, arguments: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    """``python benchmarks/<name>.py arguments`` parsed by the script's own parser: 0, or
    argparse's status and its error."""
    stderr = io.StringIO()
    with (
        monkeypatch.context() as patch,
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            _script_parser(name, arguments, patch)
        except SystemExit as exc:
            return (exc.code if isinstance(exc.code, int) else 2), stderr.getvalue().strip()
    return 0, ""


def command_problem(command: Command, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """What is stale in ``command`` (``None``: nothing). Skips a script whose engine or
    torch is not installed."""
    for arguments in concrete_arguments(command.words):
        if command.words[0] == "kvoffload":
            if arguments[:2] == ["bench", "transfer"]:  # its options come from its torch code
                pytest.importorskip("torch")
            status, error = parse_cli(arguments)
        else:
            script = SCRIPT.match(command.words[0])
            assert script is not None
            if not (BENCHMARKS / f"{script.group(1)}.py").exists():
                return "no such script"
            if command.names_script:
                return None
            with skipped_without_engine(f"{script.group(1)}.py"):
                status, error = parse_script(script.group(1), arguments, monkeypatch)
        if command.names_option and status != 0:
            if f"argument {arguments[-1]}: expected one argument" not in error:
                return f"does not name an option: {error}"
        elif command.refused_with is None and status != 0:
            return f"is refused: {error}"
        elif command.refused_with is not None and (status, error) != (2, command.refused_with):
            return f"shows the refusal {command.refused_with!r}, got {error!r}"
    return None


COMMANDS = documented_commands(PAGES)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_line_is_accepted(
    command: Command, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = command_problem(command, monkeypatch)
    assert problem is None, f"{command}\n  {problem}"


def test_each_command_and_script_is_shown() -> None:
    """The extraction finds what the pages show: every command, and a refusal sample."""
    shown = {c.words[1] if c.words[0] == "kvoffload" else "script" for c in COMMANDS}
    assert shown == {*CLI_COMMANDS, "--version", "script"}
    assert any(command.refused_with for command in COMMANDS)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser`` and of its sub-commands."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found |= _option_strings(command)
    return found


def our_options(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every option of ``kvoffload``'s commands and of the scripts of ``benchmarks/``
    (those whose engine or torch is installed)."""
    parser, transfer = app.build_parser()
    with contextlib.suppress(KVOffloadError):  # torch not installed: its options unknown
        bench.add_transfer_options(transfer)
    found = _option_strings(parser)
    for path in sorted(BENCHMARKS.glob("*.py")):
        if "__main__" in path.read_text():
            with monkeypatch.context() as patch, contextlib.suppress(ModuleNotFoundError):
                found |= _option_strings(_script_parser(path.stem, None, patch).parser)
    return found


def unknown_options(pages: list[Path], known: set[str]) -> list[str]:
    """Each ``--option`` of an inline span of ``pages`` that is neither in ``known`` nor
    foreign; a stem (``--remote-…``) must start one of ``known``."""
    unknown = []
    for path in pages:
        for line, span in _inline_spans(path.read_text()):
            for option in OPTION.findall(span):
                stem = option.endswith("-") and any(name.startswith(option) for name in known)
                if option not in known | FOREIGN_OPTIONS and not stem:
                    unknown.append(f"{path.name}:{line}: {option}")
    return unknown


def test_every_option_the_pages_name_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    unknown = unknown_options(PAGES, our_options(monkeypatch))
    assert not unknown, "options no command or script has:\n" + "\n".join(unknown)


VLLM_TIER_PARSERS: dict[str, Callable[[str, Mapping[str, Any]], object]] = {
    "KVOffloadDiskTier": parse_disk_settings,
    "KVOffloadSharedTier": parse_shared_settings,
}
"""What each of our secondary tier classes checks its entry with at start-up."""

CONFIG_FLAGS = ("--kv-transfer-config", "--hicache-storage-backend-extra-config")

SPEC_BASE = {
    "spec_name": "KVOffloadSpec",
    "spec_module_path": "kvoffload.integrations.vllm",
    "cpu_bytes_to_use": 2**30,
}
"""What a ``json`` block of kvoffload's keys is added to (the page's command line)."""


@dataclass(frozen=True)
class Config:
    """One documented engine config: where it is, the flag or form it is given in, and
    the mapping."""

    page: str
    line: int
    given_as: str
    value: dict[str, Any]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.given_as}"


def _extra_config_literals(code: str) -> Iterator[dict[str, Any]]:
    """Each ``kv_connector_extra_config={...}`` of a Python example, as its value."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.keyword) and node.arg == "kv_connector_extra_config":
            yield ast.literal_eval(node.value)


def documented_configs(pages: list[Path]) -> list[Config]:
    """Every engine config shown in ``pages``' fenced blocks."""
    found: list[Config] = []
    for path in pages:
        text = path.read_text()
        for fence in FENCE.finditer(text):
            language, block = fence.group(1).strip(), fence.group(2)
            line = _line_of(text, fence.start(2))
            if language == "json":
                found.append(Config(path.name, line, "json block", json.loads(block)))
            elif language == "python":
                for literal in _extra_config_literals(block):
                    found.append(Config(path.name, line, "kv_connector_extra_config=", literal))
            elif any(flag in block for flag in CONFIG_FLAGS):
                words = shlex.split(block.replace("\\\n", " "), comments=True)
                for flag, value in itertools.pairwise(words):
                    if flag in CONFIG_FLAGS:
                        found.append(Config(path.name, line, flag, json.loads(value)))
    return found


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def config_problem(config: Config) -> str | None:
    """What is stale in ``config`` (``None``: nothing), parsed as the engine's start-up
    parses it."""
    value = config.value
    try:
        if config.given_as == "--hicache-storage-backend-extra-config":
            if not _findable(value["module_path"]):
                return f"no module {value['module_path']!r}"
            parse_sglang_settings(value)
            return None
        if config.given_as == "--kv-transfer-config":
            extra = value["kv_connector_extra_config"]
        else:
            extra = {**SPEC_BASE, **value}
        if extra["spec_name"] == "KVOffloadSpec":
            if not _findable(extra["spec_module_path"]):
                return f"no module {extra['spec_module_path']!r}"
            parse_spec_settings(extra)
            return None
        if extra["spec_name"] != "TieringOffloadingSpec":
            return f"unknown spec {extra['spec_name']!r}"
        for tier in extra["secondary_tiers"]:
            if tier["type"] not in VLLM_TIER_PARSERS or not _findable(tier["module_path"]):
                return f"no secondary tier {tier['type']!r} in {tier['module_path']!r}"
            VLLM_TIER_PARSERS[tier["type"]](tier["type"], tier)
    except InvalidArgumentError as exc:
        return str(exc)
    return None


CONFIGS = documented_configs([ROOT / "README.md", *(ROOT / "docs" / n for n in CONFIG_PAGES[1:])])


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_documented_config_is_accepted(config: Config) -> None:
    problem = config_problem(config)
    assert problem is None, f"{config}\n  {problem}"


def test_every_config_page_shows_a_config() -> None:
    shown = {config.page for config in CONFIGS}
    assert shown == set(CONFIG_PAGES)
    assert {config.given_as for config in CONFIGS} >= {*CONFIG_FLAGS, "json block"}


KEY_PARSERS: dict[str, Callable[[str, str], object]] = {
    "vllm.md": lambda key, _: parse_spec_settings({**SPEC_BASE, key: None}),
    "sglang.md": lambda key, _: parse_sglang_settings({key: None}),
    "vllm-secondary.md": lambda key, tier: [
        VLLM_TIER_PARSERS[kind](kind, {key: None})
        for kind, name in (("KVOffloadDiskTier", "disk"), ("KVOffloadSharedTier", "shared"))
        if tier in (name, "both")
    ],
}
"""For each page with a ``| key |`` table: the parser of those keys, given one key (its
value ``null``) and the row's second cell (the secondary tiers' ``tier`` column)."""


def table_keys(page: Path) -> list[tuple[int, str, str]]:
    """Each key of ``page``'s ``| key | ...`` tables: its line, the key and the row's
    second cell."""
    keys: list[tuple[int, str, str]] = []
    in_table = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif cells[0] == "key":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            second = cells[1] if len(cells) > 1 else ""
            keys.extend((number, key, second) for key in re.findall(r"`([^`]+)`", cells[0]))
    return keys


def key_problem(parse: Callable[[str, str], object], key: str, second: str) -> str | None:
    """``key``'s refusal as unknown by ``parse`` (``None``: it is known; any other error is
    about its ``null`` value or a key that goes with it)."""
    try:
        parse(key, second)
    except InvalidArgumentError as exc:
        if "unknown" in str(exc) and repr(key) in str(exc):
            return str(exc)
    return None


@pytest.mark.parametrize("page", sorted(KEY_PARSERS))
def test_every_key_a_table_lists_is_known(page: str) -> None:
    keys = table_keys(ROOT / "docs" / page)
    assert keys, f"{page} has no | key | table"
    stale = [
        f"{page}:{line}: {key}: {problem}"
        for line, key, second in keys
        if (problem := key_problem(KEY_PARSERS[page], key, second)) is not None
    ]
    assert not stale, "\n".join(stale)


OWN_KEYS = {
    "vllm.md": spec_settings.OWN_KEYS,
    "sglang.md": sglang_settings.OWN_KEYS,
    "vllm-secondary.md": secondary_settings.DISK_KEYS | secondary_settings.SHARED_KEYS,
}
"""The keys each page's tables document: kvoffload's own, not the engine's."""


@pytest.mark.parametrize("page", sorted(OWN_KEYS))
def test_every_key_a_parser_takes_is_in_its_page_s_table(page: str) -> None:
    """A key added to a parser and not to its page is one no operator finds."""
    listed = {key for _, key, _ in table_keys(ROOT / "docs" / page)}
    assert not OWN_KEYS[page] - listed, f"{page} lists no row for {sorted(OWN_KEYS[page] - listed)}"


STALE_PAGE = """\
```bash
kvoffload simulate --gpu-blocks 878 \\
    --cpu-blocks 4392 --store-treshold 2
vllm serve m --kv-transfer-config '{"kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
  "spec_module_path": "kvoffload.integrations.vllm", "cpu_bytes_to_use": 1,
  "kvoffload.disk": "/d"}}'
```

A run of `python benchmarks/manager.py --repeats
3` per `kvoffload sweep --capacity`'s rows, `benchmarks/no_such.py` and `--remote-gib`.
Or `kvoffload simulate --admission feedback --admission-param tresh=0.4`, `kvoffload simulate
--policy lur`. And `python benchmarks/admission_diagnostics.py rag:0.25 agnet:0.05`.

| key | default |
|---|---|
| `kvoffload.disk_admission` / `kvoffload.disk_admision` | `none` |
"""
"""A page of stale lines, each of the kinds the checks look for."""


def test_stale_lines_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check fails on a stale line: a misspelt flag in a fenced command (continued
    over two lines), in an inline one and as a named option, a missing script, a renamed
    admission parameter, policy or workload, an unknown option, an unknown extra-config key and an
    unknown table key."""
    page = tmp_path / "stale.md"
    page.write_text(STALE_PAGE)
    problems = {str(c): command_problem(c, monkeypatch) for c in documented_commands([page])}
    assert problems.keys() == {
        "stale.md:2: kvoffload simulate --gpu-blocks 878 --cpu-blocks 4392 --store-treshold 2",
        "stale.md:9: benchmarks/manager.py --repeats 3",
        "stale.md:10: kvoffload sweep --capacity",
        "stale.md:10: benchmarks/no_such.py",
        "stale.md:11: kvoffload simulate --admission feedback --admission-param tresh=0.4",
        "stale.md:11: kvoffload simulate --policy lur",
        "stale.md:12: benchmarks/admission_diagnostics.py rag:0.25 agnet:0.05",
    }
    assert all(problem is not None for problem in problems.values()), problems
    assert "unrecognized arguments: --store-treshold 2" in str(problems)
    assert "unknown workload 'agnet'" in str(problems)
    (config,) = documented_configs([page])
    assert "'kvoffload.disk'" in (config_problem(config) or "")
    known = {"--remote-gb", "--repeat", "--admission", "--admission-param", "--policy"}
    assert unknown_options([page], known) == [
        "stale.md:9: --repeats",
        "stale.md:10: --capacity",
        "stale.md:10: --remote-gib",
    ]
    keys = [key for _, key, _ in table_keys(page)]
    assert keys == ["kvoffload.disk_admission", "kvoffload.disk_admision"]
    assert [key_problem(KEY_PARSERS["vllm.md"], key, "") is None for key in keys] == [True, False]
