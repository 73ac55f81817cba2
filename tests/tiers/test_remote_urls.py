"""Shared-tier URLs: credentials never shown, percent-encoded passwords, and one clear
line for every odd URL, at parse time or against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from kvoffload import block_id_key
from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import layout_preset
from kvoffload.core.tier_protocol import MAX_IO_THREADS
from kvoffload.tiers import RemoteTier, RemoteTierError, layout_fingerprint, parse_remote_url
from kvoffload.tiers.url import redact_url
from tier_servers import TEST_TIMEOUT_MS, ValkeyProcess

SECRET = "hunt3r-Two"
"""In every password below: no message may hold it, or any part of it."""


def shows_no_secret(text: str) -> bool:
    return all(part not in text for part in ("hunt3r", "Two"))


def stores_and_finds_a_block(url: str, fp: bytes) -> bool:
    """Whether a tier opened on ``url`` (so authenticated) stores a block and finds it."""
    tier = RemoteTier(url, fp)
    try:
        tier.write([block_id_key(1)], [b"12345678"])
        tier.poll(wait=True)
        return tier.present([block_id_key(1)]) == 1
    finally:
        tier.close()


CLI = [sys.executable, "-m", "kvoffload", "simulate", "--requests", "5", "--no-bound"]
CLI += ["--no-progress"]


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (f"redis://user:{SECRET[:6]}/{SECRET[6:]}@h:1/0", "an '@' after its host part"),
        (f"redis://:{SECRET[:6]}?{SECRET[6:]}@h:1/0", "an '@' after its host part"),
        (f"redis://:{SECRET[:6]}#{SECRET[6:]}@h:1", "an '@' after its host part"),
        (f"redis://:{SECRET}%zz@h:1", "a '%' in its user part must start a percent-encoded"),
        (f"redis://:{SECRET}%ff@h:1", "must be UTF-8"),
        (f"redis://:{SECRET}@h:0", "port must be 1 to 65535, got 0"),
        (f"redis://:{SECRET}@h:65536", "port must be 1 to 65535, got 65536"),
        (f"redis://:{SECRET}@h:-1", "bad port '-1'"),
        (f"redis://:{SECRET}@a..b:1", "has an empty label"),
        (f"redis://:{SECRET}@.a:1", "has an empty label"),
        (f"redis://:{SECRET}@{'x' * 64}.example:1", "has a label of 64 characters: at most 63"),
        (f"redis://:{SECRET}@{'a.' * 130}b:1", "at most 253"),
        (f"redis://:{SECRET}@ho st:1", "a label holds only letters"),
        (f"redis://:{SECRET}@::1:6379", "an IPv6 address goes in brackets"),
        (f"redis://:{SECRET}@[::g]:6379", "bad IPv6 address"),
        (f"redis://:{SECRET}@h:1?timeout_ms=1e300", "from 1 to 600000"),
        (f"redis://:{SECRET}@h:1?timeout_ms=inf", "timeout_ms must be from 1 to 600000"),
        (f"redis://:{SECRET}@h:1?timeout_ms=", "timeout_ms must be a number"),
        (f"redis://:{SECRET}@h:1/0#frag", "has a '#': write it as %23"),
        (f"redis://:{SECRET}@h:1?colour=red", "unknown option"),
        (f"redis://h:1/0?password={SECRET}", r"unknown option\(s\) password in"),
        (f"redis://alice@h:1/0?timeout_ms=9&password={SECRET}", "unknown option"),
        (f"redis://h:1/0?timeout_ms=9&password={SECRET}#x", "has a '#'"),
        (f"redis://{SECRET}@:1", "names no host"),
        # cluster=no was ignored: the servers were asked for CLUSTER SLOTS.
        (f"redis://:{SECRET}@a:1,b:2?cluster=no", "several hosts are the seed nodes"),
        # The last one won: timeout_ms=1&timeout_ms=250 ran with 1 ms.
        (f"redis://:{SECRET}@h:1?timeout_ms=1&timeout_ms=250", "timeout_ms given more than"),
    ],
)
def test_bad_urls_say_what_is_wrong_and_never_show_the_user_part(url: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as error:
        parse_remote_url(url)
    assert shows_no_secret(str(error.value)), str(error.value)


def test_ipv6_hosts_take_a_zone_and_show_in_brackets() -> None:
    """A zone is written %25 in a URL (RFC 6874): it was kept as '25eth0', which no
    interface is; messages showed IPv6 hosts unbracketed (::1:6379)."""
    address = parse_remote_url(f"redis://:{SECRET}@[fe80::1%25eth0]:7000,[::1]")
    assert address.hosts == (("fe80::1%eth0", 7000), ("::1", 6379))
    assert address.redacted() == "redis://:***@[fe80::1%eth0]:7000,[::1]:6379/0"


@pytest.mark.parametrize("url", [None, b"redis://h:1", 6379])
def test_a_url_that_is_no_string_is_refused(url: object) -> None:
    """Not an ``AttributeError`` from ``partition``."""
    with pytest.raises(InvalidArgumentError, match="URL is a string"):
        parse_remote_url(url)  # type: ignore[arg-type]


UNREACHABLE = "redis://127.0.0.1:1/0?timeout_ms=100"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"fingerprint": b""}, "fingerprint"),  # every write then failed as corrupt
        ({"fingerprint": 1.5}, "fingerprint"),  # float.hex() made a key prefix of it
        ({"fingerprint": None}, "fingerprint"),
        ({"io_threads": 0.5}, "io_threads"),
        ({"io_threads": None}, "io_threads"),  # the pool's own default
        ({"io_threads": MAX_IO_THREADS + 1}, "io_threads"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": None}, "chunk_bytes"),
    ],
)
def test_a_bad_argument_is_refused_before_start_up_connects(
    fields: dict[str, object], named: str
) -> None:
    """Not taken, nor found only after connecting (the pool's ValueError left the
    connection open): no server is there, and the error is still the argument's."""
    arguments: dict[str, object] = {"fingerprint": bytes(16), **fields}
    with pytest.raises(InvalidArgumentError, match=named):
        RemoteTier(UNREACHABLE, **arguments)  # type: ignore[arg-type]


def test_every_character_works_in_a_password_when_percent_encoded() -> None:
    password = "p/w?x@y#z%1 :+&=é"
    encoded = quote(password, safe="")
    address = parse_remote_url(f"redis://alice:{encoded}@h:7/2?timeout_ms=5")
    assert (address.username, address.password, address.hosts, address.db) == (
        "alice",
        password,
        (("h", 7),),
        2,
    )
    assert password not in address.redacted() and encoded not in address.redacted()
    assert password not in repr(address)  # a logged address shows no password either
    hosts = parse_remote_url("redis://[::1]:7000,h.example.:7001,h-1_b").hosts
    assert hosts == (("::1", 7000), ("h.example.", 7001), ("h-1_b", 6379))


def test_option_values_are_hidden_wherever_a_url_is_shown() -> None:
    """Other clients take ``?password=``: a URL written for them must not show it."""
    shown = redact_url(f"redis://alice:{SECRET}@h:1/0?password={SECRET}&timeout_ms=5#{SECRET}")
    assert shown == "redis://alice:***@h:1/0?password=***&timeout_ms=***#***"
    shown = redact_url(f"redis://:{SECRET[:6]}?x@h:1/0?password={SECRET[6:]}")
    assert shown == "redis://***@h:1/0?password=***"
    shown = redact_url(f"redis://h:1?password={SECRET}&cluster")
    assert shown == "redis://h:1?password=***&cluster"


def test_a_password_option_is_refused_by_name_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis://alice@127.0.0.1:1/0?password={SECRET}"
    argv = ["simulate", "--requests", "5", "--no-bound", "--no-progress", "--remote", url]
    assert main(argv) == 1
    line = one_line(capsys)
    assert line.startswith("kvoffload: error: --remote: unknown option(s) password in ")
    assert shows_no_secret(line), line


def test_an_empty_password_without_a_user_asks_for_no_auth(tmp_path: Path) -> None:
    """``redis://:@host``, as a template with an empty password writes it, sent AUTH "",
    which a server without a password refuses too: start-up failed with "authentication
    failed" under a URL that showed no credentials. A user's empty password is still sent."""
    server = ValkeyProcess(tmp_path / "no-password").start()
    fp = layout_fingerprint("empty", layout_preset("tiny"), 8)
    try:
        assert stores_and_finds_a_block(f"redis://:@127.0.0.1:{server.port}/0", fp)
    finally:
        server.stop()
    assert parse_remote_url("redis://kv:@h").password == ""


def test_a_percent_encoded_password_authenticates_against_a_real_server(tmp_path: Path) -> None:
    password = f"{SECRET}/?@#%:"
    server = ValkeyProcess(tmp_path / "pw", password=password).start()
    fp = layout_fingerprint("password", layout_preset("tiny"), 8)
    try:
        assert stores_and_finds_a_block(server.url, fp)  # the URL percent-encodes the password
        wrong = server.url.replace(quote(password, safe=""), quote(password[:-1], safe=""))
        with pytest.raises(RemoteTierError, match="authentication failed") as error:
            RemoteTier(wrong, fp)
        assert shows_no_secret(str(error.value))
    finally:
        server.stop()


@pytest.mark.parametrize("username", ["", "kv"])
@pytest.mark.parametrize("password", [SECRET, f"{SECRET}{'x' * 130}"])
def test_a_server_that_quotes_auth_back_never_shows_the_password(
    tmp_path: Path, username: str, password: str
) -> None:
    """A server without AUTH (``rename-command AUTH ""``, or one that lacks it) answers
    ``unknown command 'AUTH', with args beginning with: 'pw'``, the quote cut at 128
    bytes: start-up's error showed the password, or its first part."""
    server = ValkeyProcess(tmp_path / "renamed", "--rename-command", "AUTH", "").start()
    url = f"redis://{username}:{quote(password, safe='')}@127.0.0.1:{server.port}/0"
    try:
        with pytest.raises(RemoteTierError, match="unknown command 'AUTH'") as error:
            RemoteTier(url, layout_fingerprint("quoted", layout_preset("tiny"), 8))
        assert shows_no_secret(str(error.value)), str(error.value)
    finally:
        server.stop()


def test_no_output_of_a_run_holds_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that works, one with a wrong password and one with no server: stdout,
    stderr and the JSON report hold no part of the password."""
    server = ValkeyProcess(tmp_path / "run", password=SECRET).start()
    try:
        path = tmp_path / "run.json"
        argv = ["simulate", "--requests", "10", "--gpu-blocks", "1500", "--cpu-blocks", "100"]
        argv += ["--layout", "tiny", "--no-bound", "--no-progress"]
        assert main([*argv, "--remote", server.url, "--json", str(path)]) == 0
        out = capsys.readouterr()
        report = path.read_text()
        assert json.loads(report)["tiers"]["remote"]["stored_blocks"] > 0
        assert shows_no_secret(out.out + out.err + report)
        assert main([*argv, "--remote", server.url.replace(SECRET, SECRET + "x")]) == 1
        assert "authentication failed" in (line := one_line(capsys)) and shows_no_secret(line)
    finally:
        server.stop()
    assert main([*argv, "--remote", server.url]) == 1
    assert "is not reachable" in (line := one_line(capsys)) and shows_no_secret(line)


def test_rediss_against_a_plain_server_says_the_tls_handshake_failed(
    valkey_server: ValkeyProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"rediss://:{SECRET}@127.0.0.1:{valkey_server.port}/0?timeout_ms=500"
    argv = ["simulate", "--requests", "5", "--no-bound", "--no-progress", "--remote", url]
    assert main(argv) == 1
    line = one_line(capsys)
    assert "TLS handshake failed" in line and "does that port speak TLS?" in line
    assert shows_no_secret(line)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:{port}/0?timeout_ms=1e300", "from 1 to 600000"),
        ("redis://127.0.0.1:{port}/0?timeout_ms=99999999999999999999", "from 1 to 600000"),
        ("redis://127.0.0.1:{port}/0?timeout_ms=1e-300", "from 1 to 600000"),
        ("redis://a..b:1", "has an empty label"),
        (f"redis://{'x' * 64}:1", "a label of 64 characters"),
        ("redis://h:0", "port must be 1 to 65535"),
        ("redis://h:70000", "port must be 1 to 65535"),
    ],
)
def test_odd_urls_end_in_one_line_from_the_command_line(
    url: str, message: str, valkey_server: ValkeyProcess
) -> None:
    done = subprocess.run(
        [*CLI, "--remote", url.format(port=valkey_server.port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvoffload: error: --remote: ") and message in lines[0]


def _kept_apart(server: ValkeyProcess, user: str, option: str) -> str:
    """``server``'s URL with no password in it, ``user@`` and ``option`` instead."""
    return f"redis://{user}127.0.0.1:{server.port}/0?timeout_ms={TEST_TIMEOUT_MS}&{option}"


@pytest.mark.parametrize("user", ["", "default@"])
def test_a_password_kept_out_of_the_url_authenticates_against_a_real_server(
    tmp_path: Path, user: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM logs its connector's extra config as given, a URL's password with it: from
    the environment or a file (a mounted secret, with its trailing newline) the URL holds
    none. ``user@`` is then the user name, not a password alone."""
    password = f"{SECRET}/?@#%:"
    server = ValkeyProcess(tmp_path / "apart", password=password).start()
    fp = layout_fingerprint("apart", layout_preset("tiny"), 8)
    monkeypatch.setenv("KVO_TEST_PASSWORD", password)
    secret_file = tmp_path / "secret"
    secret_file.write_text(password + "\n")
    try:
        for option in ("password_env=KVO_TEST_PASSWORD", f"password_file={secret_file}"):
            url = _kept_apart(server, user, option)
            address = parse_remote_url(url)
            assert shows_no_secret(repr(address)) and shows_no_secret(address.redacted())
            assert stores_and_finds_a_block(url, fp)
        monkeypatch.setenv("KVO_TEST_PASSWORD", password[:-1])
        with pytest.raises(RemoteTierError, match="authentication failed") as error:
            RemoteTier(_kept_apart(server, user, "password_env=KVO_TEST_PASSWORD"), fp)
        assert shows_no_secret(str(error.value))
    finally:
        server.stop()
    assert parse_remote_url("redis://kv@h?password_env=KVO_TEST_PASSWORD").username == "kv"


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        ("password_env=hunt3r-Two", "must name an environment variable"),
        ("password_file=", "password_file= names no file"),
        ("password_env=PATH&password_file={tmp}/big", "gives password_env= and password_file="),
    ],
)
def test_a_password_source_of_the_wrong_shape_is_refused_as_the_url_is_parsed(
    tmp_path: Path, tail: str, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as error:
        parse_remote_url(f"redis://h:6379/0?{tail.format(tmp=tmp_path)}")
    assert shows_no_secret(str(error.value)) and str(tmp_path) not in str(error.value)


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        ("password_env=NO_SUCH_VAR_KVO", "names a variable this process's environment does not"),
        ("password_env=EMPTY_KVO", "password_env= gives an empty password"),
        ("password_env=LATIN1_KVO", "password_env= is not UTF-8 text"),
        ("password_file={tmp}/hunt3r-Two", "password_file= cannot be read (No such file"),
        ("password_file={tmp}", "password_file= is not a regular file"),
        ("password_file={tmp}/fifo", "password_file= is not a regular file"),
        ("password_file={tmp}/big", "holds more than 65,536 bytes"),
        ("password_file={tmp}/latin1", "password_file= is not UTF-8 text"),
        ("password_file={tmp}/newline", "password_file= gives an empty password"),
    ],
)
def test_a_password_source_that_gives_none_is_refused_as_the_tier_opens_never_showing_it(
    tmp_path: Path, tail: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsed alike (a process that only checks the configuration, as vLLM's workers do,
    reads nothing), refused in one line as the tier opens, naming neither the variable nor
    the path (a password written there by mistake would be shown); a FIFO is refused, not
    waited on; a variable of bytes no UTF-8 (surrogates in Python) ended in a traceback
    from AUTH's encoding, which showed where its odd byte sat."""
    monkeypatch.setenv("EMPTY_KVO", "")
    monkeypatch.setenv("LATIN1_KVO", "hunt3r-Two\udce9")
    monkeypatch.delenv("NO_SUCH_VAR_KVO", raising=False)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * (64 * 1024 + 1))
    (tmp_path / "latin1").write_bytes(b"hunt3r-Two\xe9")
    (tmp_path / "newline").write_text("\n")
    url = f"redis://127.0.0.1:1/0?{tail.format(tmp=tmp_path)}"
    address = parse_remote_url(url)
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as error:
        address.secret()
    with pytest.raises(RemoteTierError, match=re.escape(message)) as opened:
        RemoteTier(url, layout_fingerprint("apart", layout_preset("tiny"), 8))
    for text in (str(error.value), str(opened.value)):
        assert shows_no_secret(text) and str(tmp_path) not in text


def test_a_password_file_that_is_a_directory_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """Each read of one left its descriptor open."""
    address = parse_remote_url(f"redis://h:6379/0?password_file={tmp_path}")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(InvalidArgumentError, match="is not a regular file"):
            address.secret()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_url_with_a_password_and_a_password_source_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVO_TEST_PASSWORD", "other")
    with pytest.raises(InvalidArgumentError, match="gives a password and password_env=") as error:
        parse_remote_url("redis://kv:hunt3r-Two@h?password_env=KVO_TEST_PASSWORD")
    assert shows_no_secret(str(error.value))
