"""The ``kvoffload`` command's parser and dispatch, loaded by :mod:`kvoffload.cli.main`
once Ctrl-C is handled.

Library errors (:class:`~kvoffload.core.errors.KVOffloadError`) and file
errors become one line on stderr and exit status 1, usage errors one line and
status 2, Ctrl-C or SIGTERM one line and status 130; never a traceback. A
reader of stdout that has gone before the output is written (``| true``) ends the
command quietly, status 1 (a command that failed or was interrupted keeps its own).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from kvoffload.admission.compiled import compiled_summary
from kvoffload.cli import bench, output, simulate, sweep, trace_stats
from kvoffload.cli.interrupts import INTERRUPTED, INTERRUPTED_STATUS
from kvoffload.core.errors import KVOffloadError
from kvoffload.integrations.vllm.versions import (
    SUPPORTED,
    UnsupportedVLLMError,
    installed_version,
    release_of,
)

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

PROG = "kvoffload"
NAMED_BY_TEXT = ("json", "csv", "plot_dir", "plot", "layout", "device", "trace", "path", "dir")
"""Arguments an empty string would silently turn off (no file, no plots, the default layout
or device) or point at the current directory (a trace, ``bench tiers --dir``), as ``--json "$OUT"``
does with ``OUT`` unset: refused instead."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (and status 2), like every other error of the CLI; an
    option is named in full (argparse's default takes a prefix of one for it, so that
    ``--remote-gb 50``, a size by analogy with ``--disk-gb``, set ``--remote-gb-per-s``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """Written as the rest of the command's output: argparse's own drops a failed write,
        so help cut short by a reader gone (``--help | head -1``) exited 0, not the quiet 1
        that :func:`run` gives any other output."""
        stream = file or sys.stdout
        if stream is not None:  # stdout closed (``>&-``)
            stream.write(self.format_help())

    def error(self, message: str) -> NoReturn:
        self.exit(2, output.one_line(f"{PROG}: error: {message} (see {self.prog} --help)") + "\n")


class _VersionAction(argparse.Action):
    """``--version``: one line per package, unwrapped (argparse's own action rewraps them)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        print(version_text())
        parser.exit(0)


def version_text() -> str:
    """Our version, the serving engines installed beside us and whether the admission
    layer's compiled modules run, for bug reports.

    Read from the installed packages' metadata, so nothing heavy is imported.
    """
    lines = [f"{PROG} {_version('kvoffload') or 'unknown (not installed)'}"]
    found = installed_version()
    if found is None:
        lines.append("vLLM: not installed")
    else:
        name, version = found
        try:
            release_of(version)
            note = "supported"
        except UnsupportedVLLMError:
            note = f"not supported: kvoffload supports vLLM {' and '.join(SUPPORTED)}"
        lines.append(f"vLLM {version} ({name}; {note})")
    sglang = _version("sglang")
    lines.append(f"SGLang {sglang}" if sglang else "SGLang: not installed")
    lines.append(compiled_summary())
    return "\n".join(lines)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The full parser, and the ``bench transfer`` sub-parser whose options load lazily."""
    parser = _Parser(
        prog=PROG,
        description="Replay LLM serving workloads through a GPU prefix cache and KV offload "
        "tiers, and report what an operator needs to size them.",
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        nargs=0,
        help="print kvoffload's version and the vLLM and SGLang versions found, and exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    simulate.register(commands)
    sweep.register(commands)
    trace_stats.register(commands)
    transfer = bench.register(commands)
    return parser, transfer


def _command_parser(
    parser: argparse.ArgumentParser, args_list: Sequence[str]
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args_list`` names, e.g. ``bench tiers``'s."""
    for word in args_list:
        commands = next(
            (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        if commands is None:
            break
        parser = commands.choices.get(word, parser)
    return parser


def _argument_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """How ``parser``'s usage errors name the argument stored in ``dest``: ``--plot-dir``,
    or a positional argument's name."""
    action = next(a for a in parser._actions if a.dest == dest)
    metavar = action.metavar if isinstance(action.metavar, str) else None
    return "/".join(action.option_strings) or metavar or dest


def _reader_gone(stream: TextIO) -> bool:
    """Whether ``stream``'s reader has gone (``kvoffload ... | true``): the output was cut
    short on purpose, so the exit is quiet, as other command-line tools'. The stream is
    pointed at ``/dev/null`` so that the interpreter's last flush does not fail once more."""
    try:
        fd = stream.fileno()
        poller = select.poll()
        poller.register(fd, 0)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no stream, or not a file
        return False
    return True


def _attach_negative_values(args_list: list[str], flags: set[str]) -> list[str]:
    """``--cpu-gb -1e-400`` as ``--cpu-gb=-1e-400``: argparse takes a word that starts with
    ``-`` for an option unless it looks like a plain negative number (``-1``, ``-1.5``), so
    ``-1e-400``, ``-inf`` or a list ``-1,2`` after an option left it without a value
    ("expected one argument") instead of saying what is wrong with the value. Attached, it
    is the option's value whatever its spelling, as ``--opt=value`` always was. Not after
    one of ``flags``, which take no value: the word is then a positional argument (a
    trace named ``-1`` after ``--no-progress``), which ``--flag=-1`` would refuse."""
    attached: list[str] = []
    for index, word in enumerate(args_list):
        if word == "--":  # the rest are positional arguments
            return attached + args_list[index:]
        previous = attached[-1] if attached else ""
        takes_value = previous.startswith("--") and "=" not in previous and previous not in flags
        if takes_value and _is_negative_value(word):
            attached[-1] = f"{previous}={word}"
        else:
            attached.append(word)
    return attached


def _is_negative_value(word: str) -> bool:
    """Whether ``word`` is a negative number, or a list that starts with one: never one of
    our options, whose names are words."""
    return bool(re.match(r"-\.?\d", word)) or word.lower() in ("-inf", "-infinity", "-nan")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser``'s options that take no value (``--no-progress``)."""
    return {
        name for action in parser._actions if action.nargs == 0 for name in action.option_strings
    }


def _error(message: str) -> None:
    print(output.one_line(f"{PROG}: error: {message}"), file=sys.stderr)


def parse_arguments(args_list: list[str]) -> argparse.Namespace:
    """``args_list`` parsed as the command line is, without running its command (the
    manual's tests check each documented line so). ``--help``, ``--version`` and a usage
    error, reported on stderr, raise :class:`SystemExit` with the status."""
    parser, transfer = build_parser()
    if args_list[:2] == ["bench", "transfer"]:
        bench.add_transfer_options(transfer)
    flags = _flags(parser) | _flags(_command_parser(parser, args_list))
    args_list = _attach_negative_values(args_list, flags)
    args, unknown = parser.parse_known_args(args_list)
    if unknown:  # named by the command's own parser, so the hint is its --help
        _command_parser(parser, args_list).error(f"unrecognized arguments: {' '.join(unknown)}")
    empty = next((dest for dest in NAMED_BY_TEXT if getattr(args, dest, None) == ""), None)
    if empty is not None:
        command = _command_parser(parser, args_list)
        command.error(f"argument {_argument_name(command, empty)}: must not be empty")
    for option in ("json", "csv"):
        if output.names_standard_output(getattr(args, option, None)):
            setattr(args, option, "-")
    return args


def _status(args_list: list[str]) -> int:
    """Parse ``args_list`` and run its command: the exit status, with ``--help``'s,
    ``--version``'s and a usage error's."""
    try:
        args = parse_arguments(args_list)
    except SystemExit as exc:  # --help, or a usage error already reported by argparse
        return exc.code if isinstance(exc.code, int) else 2
    status: int = args.run(args)
    return status


def run(args_list: list[str]) -> int:
    """The command line's exit status, every error reported on one line of stderr (Ctrl-C
    is :func:`~kvoffload.cli.main.main`'s to set up)."""
    try:
        status = _reported(args_list)
    except BrokenPipeError:  # stderr's reader gone too, as the error was said (2>&1 | true)
        status = 1
    return _flushed(status)


def _flushed(status: int) -> int:
    """``status`` once stdout and stderr are flushed: here, not at exit, however the command
    ended (--help, an error or Ctrl-C after a table too), as the interpreter's own last flush
    to a reader gone by then said "Exception ignored ..." and exited 120. A reader gone
    turns success into the quiet status 1; a failure or Ctrl-C keeps its own."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError as exc:
        if not _reader_gone(sys.stdout) and status == 0:
            with contextlib.suppress(BrokenPipeError):
                _error(exc.strerror or str(exc))
        status = status or 1
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except BrokenPipeError:  # nowhere left to say so
        _reader_gone(sys.stderr)
        status = status or 1
    return status


def _reported(args_list: list[str]) -> int:
    """The exit status of :func:`_status`, with each error it raises reported on one line."""
    try:
        return _status(args_list)
    except KVOffloadError as exc:
        _error(str(exc))
        return 1
    except BrokenPipeError as exc:
        if not _reader_gone(sys.stdout):
            _error(exc.strerror or str(exc))
        return 1
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _error(f"{exc.strerror or exc}{where}")
        return 1
    except MemoryError:
        _error("out of memory; use a smaller workload or cache")
        return 1
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_STATUS
