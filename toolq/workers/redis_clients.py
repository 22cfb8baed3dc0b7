"""Every Redis client toolq makes, sync or async, from a URL or a `RedisTarget`.

A plain URL gets what `from_url` gives. A Sentinel target gets a client on a Sentinel-managed pool:
each new connection asks the sentinels for the current primary, and a connection to a primary
that was demoted fails (READONLY is a connection error there), so a client that reconnects after
a failover reaches the promoted replica with no restart. Both the workers and the orchestrator
use these (the import-layer test allows this module above the workers).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel as sentinel

from toolq.core.redis_target import RedisTarget, parse_redis_url

#: How long a command may wait for a free connection of a blocking pool. Commands take well under
#: a millisecond, so only a leak could make one wait this long; it then fails as a Redis fault.
POOL_WAIT = 60.0


#: A sentinel's answer is a few bytes: one that takes longer is skipped for the next.
SENTINEL_TIMEOUTS = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}


def target(url_or_target: RedisTarget | str) -> RedisTarget:
    """A bare URL names no Sentinel master: a sentinel:// one raises ValueError here."""
    return url_or_target if isinstance(url_or_target, RedisTarget) else parse_redis_url(url_or_target)


def _master(t: RedisTarget) -> str:
    assert t.master, "parse_redis_url gives every Sentinel target a master"
    return t.master


def sync_client(where: RedisTarget | str, **options: Any) -> redis.Redis:
    """`options`: redis-py's connection options (timeouts, `client_name`)."""
    t = target(where)
    if not t.is_sentinel:
        return redis.Redis.from_url(t.url, **options)
    manager = sentinel.Sentinel(list(t.sentinels), sentinel_kwargs=_sentinel_options(t, options))
    return redis.Redis.from_pool(_SyncSentinelPool(_master(t), manager, **_login(t), **options))


def async_client(where: RedisTarget | str, *, max_connections: int | None = None, blocking: bool = False,
                 **options: Any) -> aioredis.Redis:
    """`blocking`: a command waits up to `POOL_WAIT` for a free connection rather than fail past
    `max_connections`. Closing the client closes its pool (and its connections to the sentinels)."""
    t = target(where)
    size: dict[str, Any] = {"max_connections": max_connections} if max_connections is not None else {}
    if not t.is_sentinel:
        if blocking:
            return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
                t.url, timeout=POOL_WAIT, **size, **options))
        return aioredis.Redis.from_url(t.url, **size, **options)
    manager = asentinel.Sentinel(list(t.sentinels), sentinel_kwargs=_sentinel_options(t, options))
    pool_class = _BlockingSentinelPool if blocking else _SentinelPool
    wait: dict[str, Any] = {"timeout": POOL_WAIT} if blocking else {}
    return aioredis.Redis.from_pool(pool_class(_master(t), manager, **_login(t), **size, **wait, **options))


def dedicated_pool(r: aioredis.Redis, name: str) -> aioredis.ConnectionPool:
    """One connection of its own, named `name`, to where `r` connects (a subscription that must
    never wait behind `r`'s commands); on a Sentinel client it follows the primary too."""
    pool = r.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    kwargs["client_name"] = name
    if isinstance(pool, asentinel.SentinelConnectionPool):
        return _SentinelPool(pool.service_name, pool.sentinel_manager, owns_manager=False, max_connections=1,
                             connection_class=pool.connection_class, **kwargs)
    return aioredis.ConnectionPool(connection_class=pool.connection_class, max_connections=1, **kwargs)


class _SyncSentinelPool(sentinel.SentinelConnectionPool):
    """Closes its sentinels' connections with its own (the client's `close()`)."""

    def close(self) -> None:
        super().close()
        self.sentinel_manager.close()


class _SentinelPool(asentinel.SentinelConnectionPool):
    """Closes its sentinels' connections with its own, unless another pool owns them."""

    def __init__(self, service_name: str, manager: asentinel.Sentinel, *, owns_manager: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(service_name, manager, **kwargs)
        self._owns_manager = owns_manager

    async def aclose(self) -> None:
        await super().aclose()
        if self._owns_manager:
            await self.sentinel_manager.aclose()


class _BlockingSentinelPool(_SentinelPool, aioredis.BlockingConnectionPool):
    """A Sentinel pool whose commands wait for a free connection (redis-py has none)."""


def _login(t: RedisTarget) -> dict[str, Any]:
    login: dict[str, Any] = {"db": t.db}
    if t.username:
        login["username"] = t.username
    if t.password is not None:
        login["password"] = t.password
    return login


def _sentinel_options(t: RedisTarget, options: dict[str, Any]) -> dict[str, Any]:
    """The sentinels get the clients' timeouts (a dead sentinel must not hang discovery), and
    their own password: the data nodes' is not theirs."""
    timeouts = {k: v for k, v in options.items() if k in ("socket_timeout", "socket_connect_timeout")}
    return {**SENTINEL_TIMEOUTS, **timeouts, **t.sentinel_kwargs()}
