"""Where a Redis client connects: one server by URL, or the primary that Sentinel names.

Parsing only (no I/O): `toolq.workers.redis_clients` makes the clients. A Sentinel URL is Celery's
form, `sentinel://[:PASSWORD@]host:port[/DB];sentinel://...`: one part per sentinel, the password
being the data nodes'. Celery's backend and kombu read the password and database of the FIRST part
only, so `celery_url` repeats them on every part: both ends then agree whichever part they read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

SENTINEL_SCHEME = "sentinel://"
DEFAULT_SENTINEL_PORT = 26379
MASTER_ENV = "TOOLQ_SENTINEL_MASTER"
PASSWORD_ENV = "TOOLQ_SENTINEL_PASSWORD"


@dataclass(frozen=True)
class RedisTarget:
    """A plain URL (`sentinels` empty), or a Sentinel-managed primary."""

    url: str = field(repr=False)
    """As configured (a plain one is handed to redis-py unchanged)."""
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    """The name the sentinels monitor (`TOOLQ_SENTINEL_MASTER`)."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    """The data nodes' login (from the URL)."""
    db: int = 0
    sentinel_password: str | None = field(default=None, repr=False)
    """The sentinels' own `requirepass`, if they have one (`TOOLQ_SENTINEL_PASSWORD`)."""

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)

    def sentinel_kwargs(self) -> dict[str, str]:
        """Connection options for the sentinels themselves (redis-py's and kombu's `sentinel_kwargs`)."""
        return {"password": self.sentinel_password} if self.sentinel_password else {}

    def with_db(self, db: int) -> RedisTarget:
        if not self.is_sentinel:
            return RedisTarget(url_with_db(self.url, db))
        return RedisTarget(self.url, self.sentinels, self.master, self.username, self.password, db,
                           self.sentinel_password)

    def celery_url(self) -> str:
        """The URL Celery and kombu are given: a Sentinel one with the login and database on each part."""
        if not self.is_sentinel:
            return self.url
        login = f"{self.username or ''}:{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{login}{host}:{port}/{self.db}" for host, port in self.sentinels)


def parse_redis_url(url: str, master: str | None = None, sentinel_password: str | None = None) -> RedisTarget:
    """Raises ValueError (one line) for a malformed Sentinel URL or one without a master name."""
    if not url.startswith(SENTINEL_SCHEME):
        return RedisTarget(url)
    sentinels: list[tuple[str, int]] = []
    logins: set[tuple[str | None, str | None]] = set()
    dbs: set[int] = set()
    for part in url.split(";"):
        sentinels.append(_sentinel_part(part.strip(), logins, dbs))
    if len(logins) > 1:
        raise ValueError("the parts of a sentinel:// URL name different passwords: give the data nodes' on each, "
                         "or on the first only")
    if len(dbs) > 1:
        raise ValueError("the parts of a sentinel:// URL name different databases")
    if not master:
        raise ValueError(f"a sentinel:// URL needs the master's name: set {MASTER_ENV} to the name the "
                         "sentinels monitor")
    username, password = next(iter(logins), (None, None))
    return RedisTarget(url, tuple(sentinels), master, username, password, next(iter(dbs), 0), sentinel_password)


def target_from_env(url: str, env: Mapping[str, str]) -> RedisTarget:
    """For a process that has a URL and the environment (the session host) but no settings."""
    return parse_redis_url(url, env.get(MASTER_ENV) or None, env.get(PASSWORD_ENV) or None)


def _sentinel_part(part: str, logins: set[tuple[str | None, str | None]], dbs: set[int]) -> tuple[str, int]:
    if not part.startswith(SENTINEL_SCHEME):
        # Never echo the part: an unencoded ';' in a password splits it, and the rest is password.
        scheme = part.partition("://")[0][:20] if "://" in part else "no scheme"
        raise ValueError(f"each ';'-separated part of a Sentinel URL must start with sentinel:// (one starts with "
                         f"{scheme!r}; a password holding ';' must be percent-encoded as %3B)")
    try:
        split = urlsplit(part)
        host, port = split.hostname, split.port or DEFAULT_SENTINEL_PORT
    except ValueError:  # a port that is not a number
        # Not `e`: urlsplit reads the start of a password holding an unencoded '/' as the port.
        raise ValueError("malformed sentinel:// URL part: its port is not a number (a password holding '/' or "
                         "';' must be percent-encoded)") from None
    if not host:
        raise ValueError("a sentinel:// URL part names no host")
    if split.query or split.fragment:
        raise ValueError("a sentinel:// URL takes no ?options (TLS to a Sentinel-managed Redis is not supported)")
    if split.password is not None or split.username:
        logins.add((unquote(split.username) if split.username else None,
                    unquote(split.password) if split.password is not None else None))
    path = split.path.strip("/")
    if path:
        if not path.isdigit():
            raise ValueError(f"a sentinel:// URL's database must be a number (got {path!r})")
        dbs.add(int(path))
    return host, port


def url_with_db(url: str, db: int) -> str:
    """A redis://, rediss:// or unix:// URL on database `db`, its options kept."""
    base, _, query = url.partition("?")
    scheme, _, rest = base.partition("://")
    host, _, _ = rest.partition("/")
    return f"{scheme}://{host}/{db}" + (f"?{query}" if query else "")
