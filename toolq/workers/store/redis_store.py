"""The workspace store in Redis: one string per blob, `toolq:blob:<sha256>`, kept `TOOLQ_STORE_TTL`
seconds after its last put, get or has (each renews it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from toolq.core.environments import blob_id
from toolq.workers.store import StoreError, checked_id, too_big, verified


def blob_key(blob: str) -> str:
    return f"toolq:blob:{blob}"


class RedisStore:
    """`client`: a sync client on the broker's Redis (`redis_clients.sync_client`, so a Sentinel
    target follows failovers); `max_bytes` at most 512 MiB, a Redis string's limit (settings check it)."""

    def __init__(self, client: redis.Redis, *, ttl: float, max_bytes: int) -> None:
        self.client = client
        self.ttl_ms = max(1, int(ttl * 1000))
        self.max_bytes = max_bytes

    def put(self, data: bytes) -> str:
        if len(data) > self.max_bytes:
            raise too_big(len(data), self.max_bytes)
        blob = blob_id(data)
        key = blob_key(blob)
        with _faults():
            # Stored once: a blob already there only gets its TTL renewed. Should it expire between
            # the two commands (PEXPIRE answers 0), it is written again.
            while not self.client.set(key, data, nx=True, px=self.ttl_ms):
                if self.client.pexpire(key, self.ttl_ms):
                    break
        return blob

    def get(self, blob: str) -> bytes:
        key = blob_key(checked_id(blob))
        with _faults():
            size = self.client.strlen(key)
            if size > self.max_bytes:
                raise too_big(size, self.max_bytes)
            data = self.client.getex(key, px=self.ttl_ms)
            if data is None:
                raise StoreError(f"blob {blob[:12]} is not in the workspace store (expired or never stored)")
            assert isinstance(data, bytes), "the store's client must give bytes (decode_responses off)"
            try:
                return verified(blob, data)
            except StoreError:
                # No put rewrites a blob that is there (SET NX): dropping the bad bytes lets the next
                # put of the real ones store them.
                self.client.delete(key)
                raise

    def has(self, blob: str) -> bool:
        with _faults():
            return bool(self.client.pexpire(blob_key(checked_id(blob)), self.ttl_ms))

    def delete(self, blob: str) -> None:
        with _faults():
            self.client.delete(blob_key(checked_id(blob)))

    def close(self) -> None:
        self.client.close()


@contextmanager
def _faults() -> Iterator[None]:
    try:
        yield
    except redis.RedisError as e:
        raise StoreError(f"workspace store (redis): {type(e).__name__}: {e}") from e
