"""Redis unreachable, told as one line that names the server (exit 2), never as a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolq.core.errors import ConfigurationError
from toolq.core.settings import mask_url_password
from toolq.orchestrator.transport.dispatch import BROKER_ERRORS

#: What a Redis that is down, restarting or refusing us raises (redis-py, kombu, the socket).
REDIS_FAULTS = (RedisConnectionError, RedisTimeoutError, *BROKER_ERRORS, ConnectionError, TimeoutError)


class RedisUnreachable(ConfigurationError):
    """The CLI prints it as one line and exits 2 (like any `ConfigurationError`)."""

    def __init__(self, url: str | None, cause: BaseException) -> None:
        where = mask_url_password(url) if url else "your embedded stack"
        if isinstance(cause, AuthenticationError):  # it answered: the credentials are wrong, not the network
            super().__init__(f"Redis at {where} refused the credentials: {cause} (check REDIS_URL's user and "
                             "password)")
        else:
            super().__init__(f"cannot reach Redis at {where}: {cause}")


@contextmanager
def reaching(url: str | None) -> Iterator[None]:
    """Turn a Redis fault inside the block into `RedisUnreachable` naming `url`."""
    try:
        yield
    except REDIS_FAULTS as e:
        raise RedisUnreachable(url, e) from None


def redis_refusal(e: BaseException) -> str | None:
    """Redis answered with an error before any work (a database number it does not have, an ACL
    that denies a command): the one line the command line prints instead of a traceback."""
    if isinstance(e, ResponseError):
        return f"Redis refused: {e} (check REDIS_URL: its database number, user and password)"
    return None
