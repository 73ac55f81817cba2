"""Progress output: rate and time left, fitted to narrow terminals, plain lines in log files."""

from __future__ import annotations

import io

import pytest

from kvoffload.cli.main import main
from kvoffload.cli.progress import ProgressBar, status_line


def test_line_has_rate_and_time_left() -> None:
    line = status_line("simulate", 250, 1000, 5.0, 120)
    assert line.startswith("simulate [#######")
    assert "250/1,000" in line
    assert "50/s" in line
    assert "ETA 0:15" in line


@pytest.mark.parametrize(
    ("done", "elapsed", "rate"), [(3, 12.0, "0.25/s"), (1, 3600.0, "0.00028/s")]
)
def test_a_rate_below_one_a_second_is_not_shown_as_nought(
    done: int, elapsed: float, rate: str
) -> None:
    # A sweep of runs of a minute each read "3/12 0/s ETA 0:36": stalled, by its rate.
    assert f" {rate} " in status_line("sweep", done, 12, elapsed, 120)


def test_no_rate_nor_time_left_is_guessed_from_the_first_moment() -> None:
    """The first step, start-up costs and all, put ``1/20,000 9.4/s ETA 35:31`` on a
    12-second replay's first line."""
    line = status_line("simulate", 1, 20_000, 0.106, 120)
    assert line.endswith(" 1/20,000 -/s ETA -"), line
    assert status_line("simulate", 300, 300, 0.2, 120).endswith(" 1,500/s 0:00 elapsed")


def test_finished_line_shows_elapsed() -> None:
    assert status_line("sweep", 8, 8, 3725.0, 120).endswith("1:02:05 elapsed")


@pytest.mark.parametrize("width", [60, 40, 30, 20, 8, 3])
def test_line_fits_narrow_terminals(width: int) -> None:
    line = status_line("simulate", 12_345, 121_877, 2.0, width)
    assert 0 < len(line) <= width
    if width >= 30:
        assert "ETA" in line


def test_log_file_gets_plain_lines_without_carriage_returns() -> None:
    log = io.StringIO()
    bar = ProgressBar("simulate", True, log)
    for done in range(0, 1001):
        bar(done, 1000)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 11
    assert lines[-1].startswith("simulate [##############################] 1,000/1,000")


def test_disabled_bar_writes_nothing() -> None:
    log = io.StringIO()
    bar = ProgressBar("simulate", False, log)
    bar(1, 2)
    bar.close()
    assert log.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_draws_with_rich_when_installed() -> None:
    pytest.importorskip("rich")
    term = _Terminal()
    bar = ProgressBar("simulate", True, term)
    for done in (0, 500, 1000):
        bar(done, 1000)
    bar.close()
    assert "1000/1000" in term.getvalue()


def test_terminal_bar_never_told_anything_draws_nothing() -> None:
    """A trace read from a pipe (of unknown size) reports no progress: rich's display,
    started with the bar, left an empty "0/?" bar behind."""
    pytest.importorskip("rich")
    term = _Terminal()
    bar = ProgressBar("reading trace", True, term)
    bar.close()
    assert term.getvalue() == ""


def test_terminal_without_rich_redraws_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "rich.progress", None)
    monkeypatch.setenv("COLUMNS", "50")
    term = _Terminal()
    bar = ProgressBar("simulate", True, term)
    bar(1000, 1000)
    bar.close()
    text = term.getvalue()
    assert text.startswith("\rsimulate 100%")
    assert text.endswith("\n")
    assert max(len(part) for part in text.split("\r")) <= 50


ROWS = [
    ("workload", "synthetic(agent=0.2+chat=0.4+oneshot=0.15+rag=0.25, seed=0)"),
    ("", "2,000 requests, 560,599 block refs, 125,616 unique blocks of 16 tokens"),
    ("total hit ratio", "0.760   (Belady bound 0.776)"),
]


def test_tables_to_files_are_never_wrapped() -> None:
    from kvoffload.cli.output import key_value_table

    assert key_value_table(ROWS).splitlines()[0] == f"{'workload':<15}  {ROWS[0][1]}"


@pytest.mark.parametrize("width", [80, 60, 40, 24])
def test_tables_fit_narrow_terminals(width: int) -> None:
    from kvoffload.cli.output import key_value_table

    text = key_value_table(ROWS, width)
    assert all(len(line) <= width for line in text.splitlines())
    # Nothing lost or reordered: the same characters, only the white space differs.
    assert "".join(text.split()) == "".join("".join(pair).replace(" ", "") for pair in ROWS)


@pytest.mark.parametrize("bound", [True, False])
def test_simulate_shows_the_belady_bound_s_progress_after_the_replay_s(
    bound: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bound's passes, after the replay, take a fifth as long again: the replay's bar
    stood full and nothing moved until the table came."""
    argv = ["simulate", "--requests", "40", "--gpu-blocks", "3000", "--progress"]
    assert main(argv if bound else [*argv, "--no-bound"]) == 0
    labels = [line.split(" [")[0] for line in capsys.readouterr().err.splitlines()]
    replayed = len(labels) - labels[::-1].index("simulate")
    assert labels[replayed:] == (["Belady bound"] * (len(labels) - replayed) if bound else [])
    assert labels.count("Belady bound") > 1 if bound else "Belady bound" not in labels
