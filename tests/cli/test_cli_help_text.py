"""The options' help says what the manual says they take and do."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from kvoffload.admission import available_admissions
from kvoffload.cli import bench
from kvoffload.cli.app import build_parser
from kvoffload.core.layout import LAYOUT_PRESETS
from kvoffload.policies import available_policies
from kvoffload.tiers.url import parse_remote_url


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(f"no subcommand {name!r}")


def _help(parser: argparse.ArgumentParser, option: str) -> str:
    return parser._option_string_actions[option].help or ""


def test_a_tier_budget_names_every_unit_it_takes() -> None:
    """docs/simulate.md: a tier's budget takes every unit of --write-budget."""
    parser, _ = build_parser()
    for command in ("simulate", "sweep"):
        for option in ("--disk-write-budget", "--remote-write-budget"):
            text = _help(_subcommand(parser, command), option)
            assert "200MB/s" in text and "1dwpd" in text, (command, option, text)


def test_bench_tiers_sglang_names_the_shared_tiers_baseline() -> None:
    """docs/sglang.md: the shared tier's pages run against plain SET/GET on a raw socket."""
    parser, _ = build_parser()
    tiers = _subcommand(_subcommand(parser, "bench"), "tiers")
    text = _help(tiers, "--sglang")
    assert "SET/GET on a raw socket" in text and "same tier's plain path" not in text, text


def test_name_options_list_their_names_and_what_an_alias_stands_for() -> None:
    """The report shows the name an alias resolves to (``recommended`` runs as
    ``optimiser``): the help names every valid one and says which an alias is."""
    parser, _ = build_parser()
    simulate, sweep = _subcommand(parser, "simulate"), _subcommand(parser, "sweep")
    for text in (_help(simulate, "--policy"), _help(sweep, "--policies")):
        assert all(name in text for name in available_policies()), text
        assert "recommended (= lru)" in text, text
    for command, option in (
        (simulate, "--admission"),
        (sweep, "--admissions"),
        (simulate, "--disk-admission"),
        (sweep, "--remote-admission"),
    ):
        text = _help(command, option)
        assert all(name in text for name in available_admissions()), (option, text)
        assert "recommended (= optimiser)" in text and "reuse (= filter)" in text, text
    assert all(name in _help(simulate, "--layout") for name in LAYOUT_PRESETS)


def test_sweep_says_it_compares_admission_layers_too() -> None:
    parser, _ = build_parser()
    [listed] = [
        choice.help or ""
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for choice in action._choices_actions
        if choice.dest == "sweep"
    ]
    assert "admission" in listed, listed
    assert "admission" in (_subcommand(parser, "sweep").description or "")


def test_no_bound_promises_no_speed_up() -> None:
    """The bound is one more pass, about a sixth of a default run, not half of it."""
    parser, _ = build_parser()
    assert "halves" not in _help(_subcommand(parser, "simulate"), "--no-bound")


def test_trace_stats_reads_a_trace_as_simulate_does() -> None:
    """Its --format and --block-size said nothing of the detection or the defaults."""
    parser, _ = build_parser()
    stats, simulate = _subcommand(parser, "trace-stats"), _subcommand(parser, "simulate")
    assert _help(stats, "--format") == _help(simulate, "--format")
    assert "default: the trace format's" in _help(stats, "--block-size")


def test_simulate_lists_the_gpu_cache_with_its_tiers() -> None:
    """The GPU cache's size sat under the generic "options:" heading, away from the
    section named after it."""
    parser, _ = build_parser()
    simulate = _subcommand(parser, "simulate")
    (section,) = [
        group for group in simulate._action_groups if group.title == "GPU cache and offload tier"
    ]
    options = {option for action in section._group_actions for option in action.option_strings}
    assert {"--gpu-blocks", "--gpu-gb", "--cpu-blocks", "--cpu-gb"} <= options


def test_the_remote_help_shows_only_urls_the_tier_takes() -> None:
    """docs/tiers.md: a Cluster's seed nodes follow the scheme (redis://h1:6379,h2:6379);
    every URL the --remote help shows parses once its placeholders are filled in."""
    parser, _ = build_parser()
    for command in ("simulate", "sweep"):
        text = _help(_subcommand(parser, command), "--remote")
        shown = [url.rstrip(",") for url in re.findall(r"\S*host:port\S*", text)]
        assert len(shown) == 2, (command, text)
        for url in shown:
            filled = url.replace("[user:pass@]", "").replace(",...", "")
            parse_remote_url(filled.replace("host:port", "127.0.0.1:6379"))


def _options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """Every option of ``parser`` and of its subcommands, each with its command's name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings:
            yield parser.prog, action


def test_every_default_shown_is_worded_default() -> None:
    """``bench transfer --help`` ended its options with a bare "(512)" where every other
    command says "(default: 512)"; a reader could take it for a limit (--threads' was one)."""
    pytest.importorskip("kvoffload.dataplane.bench")
    parser, transfer = build_parser()
    bench.add_transfer_options(transfer)
    for command, action in _options(parser):
        remark = re.search(r"\(([^()]*)\)$", action.help or "")
        if remark is None or action.default in (None, False, [], argparse.SUPPRESS):
            continue
        shown = f"{action.default:g}" if isinstance(action.default, float) else action.default
        if re.search(rf"\b{re.escape(str(shown))}\b", remark[1]):
            assert remark[1].startswith("default: "), (command, action.help)
    transfer_help = {action.dest: action.help or "" for _, action in _options(transfer)}
    assert "(default: torch's own" in transfer_help["threads"], transfer_help["threads"]
    assert "(default: 5)" in transfer_help["rounds"], transfer_help["rounds"]
