"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from toolq.local.embedded import RedisServer


@pytest.fixture(scope="module")
def r() -> Iterator[redis.Redis]:
    """A Redis server of the test module's own (a module that defines `r` itself uses its own)."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        yield client
        client.close()
