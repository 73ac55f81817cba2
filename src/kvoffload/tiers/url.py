"""Connection URLs of the shared tier: ``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``.

``scheme://[user[:password]@]host[:port][,host[:port]...][/db][?timeout_ms=N&cluster=yes|no]``.
Several hosts are the seed nodes of a Cluster; one host is asked at start-up
whether it runs in Cluster mode unless ``cluster=`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from kvoffload.core.errors import InvalidArgumentError

SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
"""Scheme to whether it means TLS."""
DEFAULT_PORT = 6379
DEFAULT_TIMEOUT_MS = 250.0


@dataclass(frozen=True)
class RemoteAddress:
    """A parsed URL. ``cluster`` is ``None`` when it should be detected."""

    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: bool = False
    cluster: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000

    def redacted(self) -> str:
        """The address without its password, for messages."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.hosts)
        user = (
            f"{self.username or ''}{':***' if self.password else ''}@"
            if (self.username or self.password)
            else ""
        )
        return f"{'rediss' if self.tls else 'redis'}://{user}{hosts}/{self.db}"


def parse_remote_url(url: str) -> RemoteAddress:
    """Parse ``url``; :class:`InvalidArgumentError` names what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise InvalidArgumentError(
            f"remote tier URL {url!r} must start with one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon and username is not None:
            # "redis://secret@host" is a password alone, as redis-py reads it.
            username, password = None, username
    hosts = tuple(_host(part, url) for part in hostlist.split(","))
    db = _int(path.strip("/") or "0", "database number", url)
    params = {name: values[-1] for name, values in parse_qs(query).items()}
    cluster = None
    if "cluster" in params:
        flag = params.pop("cluster").lower()
        if flag not in ("yes", "no", "true", "false", "1", "0"):
            raise InvalidArgumentError(f"cluster= must be yes or no in {url!r}, got {flag!r}")
        cluster = flag in ("yes", "true", "1")
    if len(hosts) > 1:
        cluster = True
    timeout_ms = float(params.pop("timeout_ms", DEFAULT_TIMEOUT_MS))
    if params:
        raise InvalidArgumentError(f"unknown option(s) {', '.join(sorted(params))} in {url!r}")
    if timeout_ms <= 0:
        raise InvalidArgumentError(f"timeout_ms must be > 0 in {url!r}")
    if cluster and db != 0:
        raise InvalidArgumentError(f"a Cluster has only database 0, got {db} in {url!r}")
    return RemoteAddress(
        hosts, username, password, db, SCHEMES[scheme.lower()], cluster, timeout_ms / 1000
    )


def _host(part: str, url: str) -> tuple[str, int]:
    host, colon, port = part.rpartition(":") if ":" in part else (part, "", "")
    host = host.strip("[]")
    if not host:
        raise InvalidArgumentError(f"remote tier URL {url!r} names no host")
    return host, _int(port, "port", url) if colon else DEFAULT_PORT


def _int(text: str, what: str, url: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"bad {what} {text!r} in {url!r}") from None
    if value < 0:
        raise InvalidArgumentError(f"bad {what} {text!r} in {url!r}")
    return value
