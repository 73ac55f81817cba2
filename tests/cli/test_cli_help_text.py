"""The options' help says what the manual says they take and do."""

from __future__ import annotations

import argparse

from kvoffload.cli.main import build_parser


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
