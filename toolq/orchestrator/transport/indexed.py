"""Records kept under their own keys (each with a TTL) and listed in a Redis set: the fleet
catalog's workers, the environments. A record whose key expired leaves its id in the set; a
reader drops it there."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from toolq.core import keys


async def read_indexed(r: aioredis.Redis, index: str, key_of: Callable[[str], str]) -> list[tuple[str, bytes | str]]:
    """(id, raw record) for every id in the set `index` whose record is still there, by id;
    the ids whose record expired are removed from the set (two round trips and one more if any)."""
    ids = sorted(keys.text(i) for i in await r.smembers(index))
    raws = await r.mget([key_of(i) for i in ids]) if ids else []
    gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
    if gone:
        await r.srem(index, *gone)
    return [(i, raw) for i, raw in zip(ids, raws, strict=True) if raw is not None]
