"""Connection URLs of the shared tier: ``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``.

``scheme://[user[:password]@]host[:port][,host[:port]...][/db][?option=value&...]``.
Several hosts are the seed nodes of a Cluster (``cluster=no`` with them is
refused); one host is asked at start-up whether it runs in Cluster mode
unless ``cluster=`` says so. A Cluster takes a database past 0 from Valkey 9.0 on
(``cluster-databases``); an older one, or Redis, refuses it at start-up. Hosts are DNS
names (labels of 1 to 63 characters, 253 in all), IPv4 addresses or IPv6
ones in brackets; ports run from 1 to 65535.

User name and password are percent-encoded (RFC 3986), as ``redis-cli -u``
and the client libraries read them: any character works, and ``/ ? # @ %``
must be written ``%2F %3F %23 %40 %25``. An ``@`` past the host part (an
unencoded ``/``, ``?`` or ``#`` in a password) is an error whose message
hides everything before it; no message ever shows the password, nor any
option's value in the URL it quotes (a ``?password=`` meant for another client is
refused by name; a bad ``timeout_ms``, ``cluster`` or ``ssl_*`` value is quoted in
its own message).
Where the URL itself is logged (vLLM prints its connector's extra config as given),
the password can stay out of it: ``password_env=NAME`` reads it from the environment
variable ``NAME``, ``password_file=PATH`` from a file (one trailing newline dropped,
as a mounted secret has), when the tier opens (:meth:`RemoteAddress.secret`), not when
the URL is parsed: a process that only checks the configuration (vLLM's workers) needs
neither. A URL with either takes ``user@`` as the user name, and refuses a password of
its own.

Options: ``timeout_ms=N`` (default 250, from 1 to 600000): the deadline of each
whole operation (connect, send, the full reply), plus the time its bytes take
at 100 MB/s; ``cluster=yes|no``; and on a TLS URL (``rediss://``,
``valkeys://``) only:

- ``ssl_ca_certs=PATH``: the CA bundle (PEM) that signed the server's
  certificate; without it the system's trusted CAs are used;
- ``ssl_certfile=PATH`` and ``ssl_keyfile=PATH``: the client's certificate and
  key for mutual TLS (the key may also sit in the certificate file; an
  encrypted key is a start-up error: no pass phrase is asked for);
- ``ssl_cert_reqs=required|optional|none``: the server's certificate is
  verified, host name included, unless ``none`` is given explicitly;
  ``optional`` checks the chain but not the host name (a client always gets the
  server's certificate, so OpenSSL checks the chain as for ``required``), as
  ``ssl_check_hostname=no`` does (Cluster nodes that announce addresses their
  certificates do not name). Every node of a Cluster is checked alike.

Paths (percent-encoded where they hold ``&``, ``+``, ``%`` or ``@``) must name
existing files. An unknown option, or an ``ssl_*`` option on a plain URL, is
an error that names it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.tier_protocol import MAX_DEADLINE_S, MIN_DEADLINE_S

SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
"""Scheme to whether it means TLS."""
DEFAULT_PORT = 6379
DEFAULT_TIMEOUT_MS = 250.0
CERT_REQS = ("required", "optional", "none")
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
TLS_OPTIONS = (*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname")
MIN_TIMEOUT_MS, MAX_TIMEOUT_MS = MIN_DEADLINE_S * 1000, MAX_DEADLINE_S * 1000
MAX_PORT = 65_535
MAX_HOST_NAME = 253
MAX_LABEL = 63
ENCODE_HINT = "'/' '?' '#' '@' '%' as %2F %3F %23 %40 %25"
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_FLAGS = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PASSWORD_SOURCES = ("password_env", "password_file")
MAX_PASSWORD_FILE_BYTES = 64 * 1024
"""A password file past this is no password (a path given by mistake), refused unread."""


@dataclass(frozen=True)
class TLSOptions:
    """How a TLS connection trusts the server and proves who the client is."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True

    def client_kwargs(self) -> dict[str, object]:
        """The ``ssl_*`` arguments of a ``valkey`` client."""
        return {
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_cert_reqs": self.cert_reqs,
            # Python's ssl refuses a host name check without chain verification.
            "ssl_check_hostname": self.check_hostname and self.cert_reqs == "required",
        }


@dataclass(frozen=True)
class RemoteAddress:
    """A parsed URL. ``cluster`` is ``None`` when it should be detected."""

    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    """Never in a repr, so that no log of the address shows it."""
    db: int = 0
    tls: bool = False
    cluster: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000
    tls_options: TLSOptions | None = None
    """Set exactly when ``tls`` is."""
    password_from: tuple[str, str] | None = field(default=None, repr=False)
    """``("password_env", NAME)`` or ``("password_file", PATH)``: where :meth:`secret`
    reads the password, which the URL does not hold."""

    def redacted(self) -> str:
        """The address without its password, for messages."""
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.hosts
        )
        hidden = ":***" if self.password or self.password_from else ""
        user = f"{self.username or ''}{hidden}@" if (self.username or hidden) else ""
        return f"{'rediss' if self.tls else 'redis'}://{user}{hosts}/{self.db}"

    def secret(self) -> str | None:
        """The password to send: the URL's, or the one its ``password_env`` or
        ``password_file`` gives, read now (:class:`InvalidArgumentError`, naming neither
        the variable nor the path, where it gives none)."""
        if self.password_from is None:
            return self.password
        option, where = self.password_from
        shown = self.redacted()
        read = _password_env if option == "password_env" else _password_file
        password = read(where, shown)
        if not password:
            raise InvalidArgumentError(f"{option}= gives an empty password, in {shown!r}")
        return password


def parse_remote_url(url: str) -> RemoteAddress:
    """Parse ``url``; :class:`InvalidArgumentError` names what is wrong with it.

    Messages quote the URL with its user part and option values hidden
    (:func:`redact_url`): they end up in logs.
    """
    if not isinstance(url, str):
        raise InvalidArgumentError(f"a shared tier's URL is a string, got {type(url).__name__}")
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise InvalidArgumentError(
            f"remote tier URL {shown!r} must start with one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    end = _authority_end(rest)
    netloc, tail = rest[:end], rest[end:]
    if "@" in tail:
        raise InvalidArgumentError(
            f"remote tier URL {shown!r} has an '@' after its host part: percent-encode "
            f"{ENCODE_HINT} in a user name or password, and '@' in a path as %40"
        )
    if "#" in tail:
        raise InvalidArgumentError(f"remote tier URL {shown!r} has a '#': write it as %23")
    path, _, query = tail.partition("?")
    userinfo, at, hostlist = netloc.rpartition("@")
    options = parse_qs(query, keep_blank_values=True)
    twice = sorted(name for name, values in options.items() if len(values) > 1)
    if twice:
        raise InvalidArgumentError(
            f"option(s) {', '.join(twice)} given more than once in {shown!r}"
        )
    params = {name: values[0] for name, values in options.items()}
    kept = _password_source(params, shown)
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = _decode(user, shown) or None
        password = _decode(secret, shown) if colon else None
        if kept is not None and password:
            raise InvalidArgumentError(
                f"remote tier URL {shown!r} gives a password and {kept[0]}=: give it once"
            )
        if not colon and username is not None and kept is None:
            # "redis://secret@host" is a password alone, as redis-py reads it.
            username, password = None, username
        if username is None and not password:
            # "redis://:@host" (a template's empty password) asks for no AUTH, as redis-py
            # reads it: a server without a password refuses AUTH "", and one with a
            # password takes "" only if an ACL set the default user's to it.
            password = None
    hosts = tuple(_host(part, shown) for part in hostlist.split(","))
    db = _int(path.strip("/") or "0", "database number", shown)
    cluster = _flag(params.pop("cluster"), "cluster", shown) if "cluster" in params else None
    if len(hosts) > 1:
        if cluster is False:  # it was ignored: CLUSTER SLOTS, then "cluster support disabled"
            raise InvalidArgumentError(
                f"cluster=no with {len(hosts)} hosts in {shown!r}: several hosts are the seed "
                "nodes of a Cluster (a standalone server takes one host)"
            )
        cluster = True
    timeout_ms = _timeout_ms(params.pop("timeout_ms", None), shown)
    tls = SCHEMES[scheme.lower()]
    tls_options = _tls_options(params, shown) if tls else None
    if params:
        misplaced = sorted(name for name in params if name in TLS_OPTIONS)
        if misplaced:
            raise InvalidArgumentError(
                f"option(s) {', '.join(misplaced)} need a TLS URL (rediss:// or valkeys://), "
                f"in {shown!r}"
            )
        raise InvalidArgumentError(f"unknown option(s) {', '.join(sorted(params))} in {shown!r}")
    return RemoteAddress(
        hosts, username, password, db, tls, cluster, timeout_ms / 1000, tls_options, kept
    )


def redact_url(url: str) -> str:
    """``url`` with its user part and option values hidden: ``user:***@`` for a
    well-formed one; when an ``@`` stands past the host part (an unencoded ``/``, ``?``
    or ``#`` in a password), everything up to the last ``@`` is hidden, as it may all be
    secret. Options show as ``name=***``: other clients take ``?password=``, so a URL
    written for them holds its password there (the message that refuses it names it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = _authority_end(rest)
    if "@" in rest[end:]:
        rest = rest[rest.rindex("@") + 1 :]
        end = _authority_end(rest)
        return f"{scheme}{sep}***@{rest[:end]}{_hide_options(rest[end:])}"
    userinfo, at, hosts = rest[:end].rpartition("@")
    if not at:
        return f"{scheme}{sep}{hosts}{_hide_options(rest[end:])}"
    user, colon, _ = userinfo.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{hidden}@{hosts}{_hide_options(rest[end:])}"


def _hide_options(tail: str) -> str:
    """``tail`` (path, query, fragment) with every option's value and the fragment
    shown as ``***``."""
    path, question, query = tail.partition("?")
    query, hash_sign, fragment = query.partition("#")
    if not question:
        path, hash_sign, fragment = path.partition("#")
    shown = "&".join(
        f"{name}=***" if equals else name
        for name, equals, _ in (option.partition("=") for option in query.split("&"))
    )
    return f"{path}{question}{shown}{hash_sign}{'***' if fragment else ''}"


def _authority_end(rest: str) -> int:
    """Where the host part of ``rest`` (the URL after ``://``) ends: its first ``/?#``."""
    ends = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    return min(ends, default=len(rest))


def _decode(text: str, shown: str) -> str:
    """A percent-encoded user name or password (RFC 3986); a stray ``%`` is an error."""
    if _BAD_ESCAPE.search(text):
        raise InvalidArgumentError(
            f"remote tier URL {shown!r}: a '%' in its user part must start a percent-encoded "
            "byte such as %25 (for '%' itself)"
        )
    try:
        return unquote(text, errors="strict")
    except UnicodeDecodeError:
        raise InvalidArgumentError(
            f"remote tier URL {shown!r}: its user part must be UTF-8 once percent-decoded"
        ) from None


def _password_source(params: dict[str, str], shown: str) -> tuple[str, str] | None:
    """Pop ``password_env`` or ``password_file`` from ``params``: the option and its value,
    checked for shape only (``None`` without either); :meth:`RemoteAddress.secret` reads
    it. Errors show neither the variable's name nor the file's path: a password written
    there by mistake would be shown."""
    given = [name for name in PASSWORD_SOURCES if name in params]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgumentError(
            f"remote tier URL {shown!r} gives password_env= and password_file=: give one"
        )
    option = given[0]
    where = params.pop(option)
    if option == "password_env" and not _ENV_NAME.fullmatch(where):
        raise InvalidArgumentError(
            "password_env= must name an environment variable (letters, digits and '_', "
            f"not first a digit), in {shown!r}"
        )
    if not where:
        raise InvalidArgumentError(f"{option}= names no file, in {shown!r}")
    return option, where


def _password_env(name: str, shown: str) -> str:
    """The password in the environment variable ``name``, which must be UTF-8: the bytes of
    one that is not came back as surrogates, and encoding AUTH failed with a traceback
    that showed where the odd byte sat."""
    password = os.environ.get(name)
    if password is None:
        raise InvalidArgumentError(
            f"password_env= names a variable this process's environment does not have, in {shown!r}"
        )
    try:
        password.encode()
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"password_env= is not UTF-8 text, in {shown!r}") from None
    return password


def _password_file(path: str, shown: str) -> str:
    """The password in the file ``path``: its text, UTF-8, less one trailing newline. A
    regular file only, opened without waiting (a FIFO would wait for a writer forever),
    and closed whatever it is."""
    chunks: list[bytes] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            left = MAX_PASSWORD_FILE_BYTES + 1
            while regular and left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise InvalidArgumentError(
            f"password_file= cannot be read ({exc.strerror or type(exc).__name__}), in {shown!r}"
        ) from None
    if not regular:
        raise InvalidArgumentError(f"password_file= is not a regular file, in {shown!r}")
    data = b"".join(chunks)
    if len(data) > MAX_PASSWORD_FILE_BYTES:
        raise InvalidArgumentError(
            f"password_file= holds more than {MAX_PASSWORD_FILE_BYTES:,} bytes, no password, "
            f"in {shown!r}"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"password_file= is not UTF-8 text, in {shown!r}") from None
    return text.removesuffix("\n").removesuffix("\r")


def _timeout_ms(text: str | None, shown: str) -> float:
    if text is None:
        return DEFAULT_TIMEOUT_MS
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgumentError(
            f"timeout_ms must be a number, got {text!r} in {shown!r}"
        ) from None
    if not MIN_TIMEOUT_MS <= value <= MAX_TIMEOUT_MS:
        raise InvalidArgumentError(
            f"timeout_ms must be from {MIN_TIMEOUT_MS:.0f} to {MAX_TIMEOUT_MS:.0f} (10 minutes), "
            f"got {text!r} in {shown!r}"
        )
    return value


def _tls_options(params: dict[str, str], url: str) -> TLSOptions:
    """Pop the ``ssl_*`` options of a TLS URL from ``params``, checked."""
    files = {name: params.pop(name, None) for name in TLS_FILES}
    for name, path in files.items():
        if path is not None and not Path(path).is_file():
            raise InvalidArgumentError(f"{name}={path!r} is not a file, in {url!r}")
    if files["ssl_keyfile"] and not files["ssl_certfile"]:
        raise InvalidArgumentError(f"ssl_keyfile= needs ssl_certfile= too, in {url!r}")
    cert_reqs = params.pop("ssl_cert_reqs", "required").lower()
    if cert_reqs not in CERT_REQS:
        raise InvalidArgumentError(
            f"ssl_cert_reqs= must be one of {', '.join(CERT_REQS)} in {url!r}, got {cert_reqs!r}"
        )
    hostname = params.pop("ssl_check_hostname", "yes")
    return TLSOptions(
        files["ssl_ca_certs"],
        files["ssl_certfile"],
        files["ssl_keyfile"],
        cert_reqs,
        _flag(hostname, "ssl_check_hostname", url),
    )


def _flag(text: str, name: str, url: str) -> bool:
    try:
        return _FLAGS[text.lower()]
    except KeyError:
        raise InvalidArgumentError(f"{name}= must be yes or no in {url!r}, got {text!r}") from None


def _host(part: str, url: str) -> tuple[str, int]:
    """``host[:port]`` or ``[IPv6]:port``, both checked."""
    if part.startswith("["):
        host, bracket, after = part[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise InvalidArgumentError(f"bad IPv6 host {part!r} in {url!r}")
        host = host.replace("%25", "%", 1)  # a zone, fe80::1%25eth0 in a URL (RFC 6874)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidArgumentError(f"bad IPv6 address {host!r} in {url!r}") from None
        port = after[1:] if after else None
    else:
        if part.count(":") > 1:
            raise InvalidArgumentError(
                f"host {part!r} in {url!r}: an IPv6 address goes in brackets, [::1]:6379"
            )
        host, colon, text = part.partition(":")
        port = text if colon else None
        _check_host_name(host, url)
    if port is None:
        return host, DEFAULT_PORT
    number = _int(port, "port", url)
    if not 1 <= number <= MAX_PORT:
        raise InvalidArgumentError(f"port must be 1 to {MAX_PORT}, got {number} in {url!r}")
    return host, number


def _check_host_name(host: str, url: str) -> None:
    """A DNS name or IPv4 address: labels of 1 to 63 letters, digits, ``-`` or ``_``."""
    if not host:
        raise InvalidArgumentError(f"remote tier URL {url!r} names no host")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > MAX_HOST_NAME:
        raise InvalidArgumentError(
            f"host name of {len(name)} characters in {url!r}: at most {MAX_HOST_NAME}"
        )
    for label in name.split("."):
        if not label:
            raise InvalidArgumentError(f"host name {host!r} in {url!r} has an empty label")
        if len(label) > MAX_LABEL:
            raise InvalidArgumentError(
                f"host name {host!r} in {url!r} has a label of {len(label)} characters: "
                f"at most {MAX_LABEL}"
            )
        if not _LABEL.fullmatch(label):
            raise InvalidArgumentError(
                f"host name {host!r} in {url!r}: a label holds only letters, digits, '-' "
                "and '_' (write an international name in its xn-- form)"
            )


def _int(text: str, what: str, url: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise InvalidArgumentError(f"bad {what} {text!r} in {url!r}")
    return int(text)
