"""``--admission`` in ``simulate`` and ``--admissions`` in ``sweep``: names, JSON fields, errors."""

from __future__ import annotations

import json

import pytest

from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "120", "--seed", "3", "--no-progress", "--no-bound"]
TIER = ["--gpu-blocks", "1500", "--cpu-blocks", "3000"]


def test_recommended_resolves_and_the_json_carries_admission_and_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [*SMALL, *TIER, "--admission", "recommended", "--policy", "recommended", "--json", "-"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["admission"], report["policy"]) == ("feedback", "lru")
    assert report["admission_offers"] == report["admission_admitted"] + report["admission_rejected"]
    assert report["admission_offers"] == report["stores_offered"]
    assert 0.0 <= report["admission_control"] <= 1.0
    assert report["admission_bytes_per_key"] > 0


def test_the_table_shows_the_admission_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *TIER, "--admission", "sketch", "--policy", "s3fifo"]) == 0
    table = capsys.readouterr().out
    assert "s3fifo, no store filter, admission sketch" in table
    assert "admission sketch" in table and "bytes per tracked key" in table


def test_without_admission_the_json_says_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *TIER, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["admission"] == "none" and report["admission_control"] is None


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--admission", "unknown admission 'tiny'; known: feedback, none, recommended, sketch"),
        ("--policy", "unknown cache policy 'tiny'; known: arc, lru, "),
    ],
)
def test_bad_names_list_the_valid_ones(
    option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *TIER, option, "tiny"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    if option == "--policy":
        assert all(name in err for name in ("recommended", "s3fifo", "sieve", "slru"))


def test_sweep_over_admissions(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sweep", "--requests", "100", "--gpu-blocks", "1500", "--cpu-blocks", "1500"]
    args += ["--policies", "lru", "--thresholds", "0", "--admissions", "none,recommended"]
    args += ["--jobs", "1", "--no-progress", "--json", "-"]
    assert main(args) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["admission"] for r in reports] == ["none", "feedback"]
    assert reports[1]["admission_offers"] > 0
    assert main([*args[:-2], "--admissions", "nope"]) != 0
    assert "unknown admission 'nope'" in capsys.readouterr().err
