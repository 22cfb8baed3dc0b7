"""The orchestrator's Redis clients: pools that wait for a free connection instead of failing.

redis-py's default pool raises `Too many connections` (`MaxConnectionsError`) past 100 connections
in use; with many turns in one process that failed calls and turn starts (issue 14). A blocking
pool makes a command wait for a connection instead. Nothing holds a connection per turn (the
result and cancel subscriptions are one each per runtime), so a bounded pool serves any number
of turns: its size bounds the commands in flight at once, not the turns.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from toolq.core.redis_target import RedisTarget
from toolq.core.settings import Settings
from toolq.workers.redis_clients import async_client

#: Connections one client may open (`TOOLQ_REDIS_CONNECTIONS`); more commands at once wait for one.
DEFAULT_CONNECTIONS: int = Settings.model_fields["redis_connections"].default


def blocking_client(where: RedisTarget | str, name: str, max_connections: int = DEFAULT_CONNECTIONS,
                    **connection: object) -> aioredis.Redis:
    """A client named `name` (CLIENT LIST shows it) whose pool waits rather than fails; closing
    the client closes its pool. `connection`: redis-py connection options (timeouts). On a
    Sentinel target it follows the primary (toolq/workers/redis_clients.py)."""
    return async_client(where, max_connections=max_connections, blocking=True, client_name=name, **connection)
