"""Where a front door listens and who may talk to it, for both front doors: the `--listen` address
(`stdio`, or SCHEME://HOST:PORT), whether it is loopback (off loopback a token is required), the
token read from `--token-file`, and the bearer check of a request's `Authorization` headers."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

#: `--listen stdio`: the client started the process and speaks on its stdin/stdout.
STDIO = "stdio"


@dataclass(frozen=True)
class Listen:
    host: str
    port: int
    """0: any free port (the server says which once it listens)."""

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_listen(text: str, scheme: str, paths: Iterable[str] = ("", "/")) -> Listen | None:
    """`SCHEME://HOST:PORT` (with one of `paths`) → Listen; `stdio` → None; ValueError (one sentence)."""
    if text == STDIO:
        return None
    parts = urlsplit(text)
    if parts.scheme != scheme or not parts.hostname or parts.path not in tuple(paths) or parts.query:
        raise ValueError(f"--listen takes {scheme}://HOST:PORT or stdio, not {text!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"--listen {text}: the port is not a number from 0 to 65535") from None
    if port is None:
        raise ValueError(f"--listen {text}: give a port (0 picks a free one)")
    return Listen(parts.hostname, port)


def read_token_file(path: str) -> str:
    """The token `--token-file` holds (surrounding whitespace dropped); ValueError (one sentence)."""
    try:
        token = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--token-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path} must hold one token (no spaces in it)")
    return token


def bearer_matches(authorization: Iterable[str], token: str) -> bool:
    """Whether one of a request's `Authorization` values is `Bearer TOKEN` (compared in constant time)."""
    for value in authorization:
        scheme, _, given = value.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return True
    return False
