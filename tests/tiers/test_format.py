"""The block format, the layout fingerprint, URLs and the circuit breaker."""

from __future__ import annotations

import pytest

from kvoffload import block_id_key
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import CircuitBreaker, CorruptBlockError, layout_fingerprint, parse_remote_url
from kvoffload.tiers.breaker import Pass
from kvoffload.tiers.format import HEADER_BYTES, decode_block, encode_block

FP = layout_fingerprint("m", layout_preset("tiny"), 16)
KEY = block_id_key(7)


def test_a_block_round_trips_and_its_header_is_where_expected() -> None:
    payload = bytes(range(16))
    block = encode_block(KEY, FP, payload)
    assert len(block) == HEADER_BYTES + len(KEY) + len(payload)
    assert block[:4] == b"KVOB"
    assert bytes(decode_block(block, KEY, FP)) == payload


@pytest.mark.parametrize("position", [0, 5, HEADER_BYTES + 2, HEADER_BYTES + 12 + 3, -1])
def test_any_flipped_byte_is_caught(position: int) -> None:
    block = bytearray(encode_block(KEY, FP, bytes(range(16))))
    block[position] ^= 0x40
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(block), KEY, FP)


@pytest.mark.parametrize("position", range(HEADER_BYTES - 4, HEADER_BYTES))
def test_a_flipped_byte_in_the_headers_own_checksum_is_caught(position: int) -> None:
    block = bytearray(encode_block(KEY, FP, bytes(range(16))))
    block[position] ^= 0x01
    with pytest.raises(CorruptBlockError, match="header fails its checksum"):
        decode_block(bytes(block), KEY, FP)


def test_a_torn_block_is_caught() -> None:
    block = encode_block(KEY, FP, bytes(range(16)))
    for cut in (3, HEADER_BYTES - 1, HEADER_BYTES + 5, len(block) - 1):
        with pytest.raises(CorruptBlockError):
            decode_block(block[:cut], KEY, FP)


def test_another_key_or_fingerprint_is_refused_by_name() -> None:
    block = encode_block(KEY, FP, b"x" * 16)
    with pytest.raises(CorruptBlockError, match="expected"):
        decode_block(block, block_id_key(8), FP)
    other = layout_fingerprint("other-model", layout_preset("tiny"), 16)
    with pytest.raises(CorruptBlockError, match="fingerprint"):
        decode_block(block, KEY, other)


def test_fingerprints_separate_models_layouts_block_sizes_and_payloads() -> None:
    tiny = layout_preset("tiny")
    prints = {
        layout_fingerprint("a", tiny, 16),
        layout_fingerprint("b", tiny, 16),
        layout_fingerprint("a", tiny.with_block_size(32), 16),
        layout_fingerprint("a", layout_preset("llama-3.2-1b"), 16),
        layout_fingerprint("a", tiny, 0),
    }
    assert len(prints) == 5
    assert layout_fingerprint("a", tiny, 16) == layout_fingerprint("a", tiny, 16)


def test_urls_of_every_scheme() -> None:
    a = parse_remote_url("redis://127.0.0.1:7000/3")
    assert (a.hosts, a.db, a.tls, a.cluster, a.password) == (
        (("127.0.0.1", 7000),),
        3,
        False,
        None,
        None,
    )
    b = parse_remote_url("rediss://alice:s%40cret@cache.example:6380/0?timeout_ms=50")
    assert (b.username, b.password, b.tls, b.timeout_s) == ("alice", "s@cret", True, 0.05)
    assert "s@cret" not in b.redacted()
    c = parse_remote_url("valkey://h1:1,h2:2,h3")
    assert c.cluster is True and c.hosts == (("h1", 1), ("h2", 2), ("h3", 6379))
    assert parse_remote_url("valkey://h1:1,h2:2/3").db == 3  # Valkey 9: cluster-databases
    d = parse_remote_url("valkeys://:pw@h?cluster=no")
    assert (d.password, d.username, d.cluster, d.tls) == ("pw", None, False, True)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "must start with"),
        ("redis://h:port", "bad port"),
        ("redis://h:1/x", "database number"),
        ("redis://h:1?colour=red", "unknown option"),
        ("redis://:1", "names no host"),
        ("redis://h:1?timeout_ms=abc", "timeout_ms must be a number"),
        ("redis://h:1?timeout_ms=nan", "timeout_ms must be from 1 to 600000"),
        ("redis://h:1?timeout_ms=0", "timeout_ms must be from 1 to 600000"),
        ("redis://h:1?timeout_ms=0.5", "timeout_ms must be from 1 to 600000"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_remote_url(url)
    assert issubclass(InvalidArgumentError, KVOffloadError)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:hunter2@h:port/0", "redis://alice:***@h:port/0"),
        ("rediss://hunter2@h/x", "rediss://***@h/x"),
        ("redis://:hunter2@h:1?colour=red", "redis://:***@h:1?colour=***"),
        ("http://bob:hunter2@h:1", "http://bob:***@h:1"),
    ],
)
def test_url_errors_never_show_the_password(url: str, shown: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        parse_remote_url(url)
    assert "hunter2" not in str(error.value) and shown in str(error.value)


def test_the_breaker_opens_cools_down_and_closes_on_a_good_trial() -> None:
    now = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown_s=1.0, clock=lambda: now[0])
    first = breaker.allow()
    assert first is not None and not breaker.failing
    breaker.failure(first)
    assert breaker.failing and not breaker.is_open  # asked last by a Cluster operation
    second = breaker.allow()
    assert second is not None
    breaker.failure(second)
    assert breaker.is_open and breaker.allow() is None
    now[0] = 1.5
    trial = breaker.allow()  # the one trial
    assert trial is not None
    assert breaker.allow() is None  # no second one while it runs
    breaker.failure(trial)  # the trial failed: open again, cooling down from now
    now[0] = 2.0
    assert breaker.allow() is None
    now[0] = 2.6
    trial = breaker.allow()
    assert trial is not None
    breaker.success(trial)
    assert not breaker.is_open and breaker.allow() and breaker.times_opened == 1
    assert not breaker.failing


def _opened_with_a_call_under_way(now: list[float], threshold: int) -> tuple[CircuitBreaker, Pass]:
    """A breaker opened at 0 by ``threshold`` failures, and the pass of a call let through
    before, still under way."""
    breaker = CircuitBreaker(threshold=threshold, cooldown_s=1.0, clock=lambda: now[0])
    passes = [breaker.allow() for _ in range(threshold + 1)]
    assert all(passes)
    for failed in passes[:threshold]:
        assert failed is not None
        breaker.failure(failed)
    late = passes[threshold]
    assert breaker.is_open and late is not None
    return breaker, late


def test_a_late_failure_does_not_restamp_the_opening() -> None:
    """A call let through before the breaker opened, failing near the end of the cool-down,
    leaves the trial due at the end of it. (It restamped the opening: the breaker stayed
    open a cool-down longer, and as long again for each such call.)"""
    now = [0.0]
    breaker, late = _opened_with_a_call_under_way(now, threshold=2)
    now[0] = 0.9
    breaker.failure(late)
    now[0] = 1.5
    assert breaker.allow() is not None


def test_a_late_failure_or_excuse_does_not_end_the_trial_under_way() -> None:
    """While the trial runs, a call let through before the opening failing or excused is
    not the trial's outcome: no second trial is let through. (Either cleared the trial,
    and the next call went through as a second one beside it.)"""
    for outcome in (CircuitBreaker.failure, CircuitBreaker.excuse):
        now = [0.0]
        breaker, late = _opened_with_a_call_under_way(now, threshold=1)
        now[0] = 1.5
        assert breaker.allow() is not None  # the trial
        outcome(breaker, late)
        now[0] = 3.0
        assert breaker.allow() is None


def test_a_late_failure_does_not_reopen_what_a_trial_closed() -> None:
    """A call let through before the opening failing after the trial closed the breaker
    leaves it closed. (With threshold 1 it opened it again: the trial's success was
    overruled by a failure older than it.)"""
    now = [0.0]
    breaker, late = _opened_with_a_call_under_way(now, threshold=1)
    now[0] = 1.5
    trial = breaker.allow()
    assert trial is not None
    breaker.success(trial)
    breaker.failure(late)
    assert not breaker.is_open and breaker.times_opened == 1
