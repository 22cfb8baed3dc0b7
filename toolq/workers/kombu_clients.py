"""One redis-py client per kombu channel's pool, not one per Redis command.

kombu's Redis transport builds a new `redis.Redis` for every operation that does not hold one
(`Channel.conn_or_acquire`): each message received (the unacked record), each ack, each event
published, each task sent. A `redis.Redis` fills a case-insensitive table of ~170 response
callbacks when it is made; in a worker's main process that was a quarter of its CPU per call
(three clients per task). Such a client holds no connection of its own (it takes one from the
channel's pool per command) and redis-py clients are thread-safe, so one per pool is the same
client: it is made again when kombu replaces the pool (a reconnect, a fork).
"""

from __future__ import annotations

from typing import Any

_CACHE = "_toolq_sync_client"


def install() -> None:
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    original = channel._create_client
    if getattr(original, "_toolq_cached", False):
        return

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:  # the polling client: kombu pins a connection on it
            return original(self, asynchronous=True)
        pool = self.pool
        cached = self.__dict__.get(_CACHE)
        if cached is not None and cached[0] is pool:
            return cached[1]
        client = original(self, asynchronous=False)
        self.__dict__[_CACHE] = (pool, client)
        return client

    _create_client._toolq_cached = True  # type: ignore[attr-defined]
    channel._create_client = _create_client  # type: ignore[method-assign]  # wrapping kombu's on purpose
