"""The ledgers a command reads (`toolq cancel`, `status`, `turns`): REDIS_URL's, or every running
embedded stack's of this user."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from redis.exceptions import RedisError

from toolq.core.redis_target import RedisTarget
from toolq.local.runtime_dir import ledger_urls
from toolq.orchestrator.transport.ledger import Ledger

#: Seconds a running stack's server has to answer before `cancel/status/turns` pass it by.
PING_TIMEOUT = 2.0


async def ledgers(redis: RedisTarget | None) -> AsyncGenerator[tuple[str, Ledger], None]:
    """(url, ledger) for REDIS_URL (`Settings.redis_target()`), or for each running embedded stack
    that answers; each ledger is closed once the caller moves on (use it under
    `contextlib.aclosing`). A stack whose server does not answer is skipped: its run is going
    down, and the others still count."""
    for url in ledger_urls(redis.url if redis else None):
        ledger = Ledger.from_url(redis or url)
        try:
            if redis is None:
                try:
                    await asyncio.wait_for(ledger.r.ping(), PING_TIMEOUT)
                except (RedisError, OSError, TimeoutError):
                    continue
            yield url, ledger
        finally:
            await ledger.aclose()
