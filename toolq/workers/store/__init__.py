"""The workspace store: content-addressed blobs (uploads' and checkpoints' tars, checkpoint records).

A blob's id is the sha256 of its bytes (`toolq.core.environments.blob_id`), so a blob is stored
once however often it is put, and every read is checked against its id: bytes that do not hash
to it are refused, never returned. `TOOLQ_STORE` picks the backend: `redis` (the broker's Redis,
blobs kept `TOOLQ_STORE_TTL` seconds after their last use) or `s3://BUCKET/PREFIX`.

The API is sync (a worker's threads call it; the orchestrator through `asyncio.to_thread`).
"""

from __future__ import annotations

from typing import Protocol

from toolq.core.environments import BLOB_ID, blob_id
from toolq.core.settings import Settings, s3_store_location

MIB = 1024 * 1024


class StoreError(Exception):
    """A blob the store cannot give or take; `str(e)` is one line for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class BlobStore(Protocol):
    def put(self, data: bytes) -> str:
        """Stores `data` (once: a blob already there is not written again) and returns its id."""
        ...

    def get(self, blob: str) -> bytes:
        """The blob's bytes, checked against its id; StoreError if missing, corrupt or too big."""
        ...

    def has(self, blob: str) -> bool: ...


def open_store(settings: Settings) -> BlobStore:
    """The store `settings.store` names; Redis: the broker's (a Sentinel target follows failovers)."""
    location = s3_store_location(settings.store)
    max_bytes = settings.store_max_blob_mb * MIB
    if location is not None:
        from toolq.workers.store.s3_store import S3Store

        return S3Store(*location, max_bytes=max_bytes)
    from toolq.workers import redis_clients
    from toolq.workers.store.redis_store import RedisStore

    target = settings.redis_target()
    if target is None:
        raise StoreError("TOOLQ_STORE=redis needs REDIS_URL (the broker's Redis)")
    return RedisStore(redis_clients.sync_client(target, client_name="toolq-store"), ttl=settings.store_ttl,
                      max_bytes=max_bytes)


def checked_id(blob: str) -> str:
    """`blob` if it is a blob id: anything else could name another key or object."""
    if not isinstance(blob, str) or not BLOB_ID.match(blob):
        raise StoreError(f"not a blob id: {str(blob)[:80]!r} (64 lowercase hex digits)")
    return blob


def too_big(size: int, max_bytes: int) -> StoreError:
    return StoreError(f"blob of {size / MIB:.1f} MiB is over TOOLQ_STORE_MAX_BLOB_MB={max_bytes // MIB}")


def verified(blob: str, data: bytes) -> bytes:
    if blob_id(data) != blob:
        raise StoreError(f"blob {blob[:12]} in the workspace store is corrupt (its bytes do not hash to its id)")
    return data


__all__ = ["BlobStore", "StoreError", "open_store"]
