"""The workspace store (toolq/workers/store) against a real Redis and a real S3 API (moto's server
on loopback): a blob is stored once, every read is checked against its id, a corrupt, missing or
too big blob is refused with one line, and Redis keeps a blob for the TTL after its last use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.integration.conftest import BUCKET
from toolq.core.environments import blob_id
from toolq.core.settings import Settings
from toolq.local.embedded import free_port
from toolq.workers.store import MIB, BlobStore, StoreError, open_store
from toolq.workers.store.redis_store import RedisStore, blob_key
from toolq.workers.store.s3_store import S3Store

pytestmark = pytest.mark.integration

WEEK = 7 * 86400


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


def redis_store(redis_server, **settings: Any) -> RedisStore:
    store = open_store(Settings(redis_url=redis_server.url, **settings))
    assert isinstance(store, RedisStore)
    return store


def s3_store(**settings: Any) -> S3Store:
    store = open_store(Settings(store=f"s3://{BUCKET}/ws/blobs", **settings))
    assert isinstance(store, S3Store)
    return store


# --- both backends: the BlobStore contract -------------------------------------------------------


@pytest.fixture(params=["redis", "s3"])
def store(request, redis_server) -> Iterator[BlobStore]:
    if request.param == "redis":
        made: Any = redis_store(redis_server, store_max_blob_mb=1)
    else:
        request.getfixturevalue("aws")
        made = s3_store(store_max_blob_mb=1)
    yield made
    made.close()


def test_a_blob_comes_back_as_it_went_in_under_its_sha256(store):
    data = os.urandom(300_000)
    blob = store.put(data)
    assert blob == blob_id(data)
    assert store.has(blob)
    assert store.get(blob) == data
    assert store.get(store.put(b"")) == b""  # an empty folder's checkpoint holds no file


def test_a_missing_blob_is_one_line_naming_it(store):
    blob = blob_id(os.urandom(32))
    assert not store.has(blob)
    with pytest.raises(StoreError) as e:
        store.get(blob)
    assert "\n" not in str(e.value) and blob[:12] in str(e.value) and "not in the workspace store" in str(e.value)


def test_an_id_that_is_not_a_sha256_never_names_a_key(store):
    for bad in ("../etc/passwd", "a" * 63, "A" * 64, "x:1", ""):
        with pytest.raises(StoreError, match="not a blob id"):
            store.get(bad)
        with pytest.raises(StoreError, match="not a blob id"):
            store.has(bad)


def test_a_blob_over_the_cap_is_refused_naming_its_size_and_the_setting(store):
    with pytest.raises(StoreError) as e:
        store.put(b"x" * (2 * MIB))
    assert str(e.value) == "blob of 2.0 MiB is over TOOLQ_STORE_MAX_BLOB_MB=1"


# --- Redis ----------------------------------------------------------------------------------------


def test_redis_stores_a_blob_once_and_a_second_put_only_renews_it(redis_server, raw):
    store = redis_store(redis_server)
    data = os.urandom(1000)
    blob = store.put(data)
    raw.set(blob_key(blob), b"sentinel-bytes", keepttl=True)  # what a rewrite would overwrite
    raw.pexpire(blob_key(blob), 60_000)
    assert store.put(data) == blob
    assert raw.get(blob_key(blob)) == b"sentinel-bytes"
    assert raw.pttl(blob_key(blob)) > 60_000
    store.close()


def test_redis_keeps_a_blob_the_ttl_after_its_last_get_or_has(redis_server, raw):
    store = redis_store(redis_server)
    blob = store.put(b"checkpoint")
    assert 60_000 < raw.pttl(blob_key(blob)) <= WEEK * 1000
    for use in (store.get, store.has):
        raw.pexpire(blob_key(blob), 60_000)
        use(blob)
        assert raw.pttl(blob_key(blob)) > 60_000, use.__name__
    redis_store(redis_server, store_ttl=30).put(b"checkpoint")  # the TTL is the putting store's
    assert 0 < raw.pttl(blob_key(blob)) <= 30_000
    store.close()


def test_redis_refuses_a_corrupt_blob_and_lets_the_next_put_store_it_again(redis_server, raw):
    store = redis_store(redis_server)
    data = b"the real tar"
    blob = blob_id(data)
    raw.set(blob_key(blob), b"the real taR")
    with pytest.raises(StoreError) as e:
        store.get(blob)
    assert str(e.value) == f"blob {blob[:12]} in the workspace store is corrupt (its bytes do not hash to its id)"
    assert not store.has(blob)
    store.put(data)
    assert store.get(blob) == data
    store.close()


def test_redis_refuses_to_read_a_stored_blob_over_the_cap(redis_server, raw):
    data = b"y" * (MIB + 1)
    blob = redis_store(redis_server).put(data)
    with pytest.raises(StoreError, match=r"^blob of 1\.0 MiB is over TOOLQ_STORE_MAX_BLOB_MB=1$"):
        redis_store(redis_server, store_max_blob_mb=1).get(blob)


def test_a_redis_that_is_down_is_one_line_not_a_traceback():
    store = open_store(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    with pytest.raises(StoreError) as e:
        store.put(b"x")
    assert str(e.value).startswith("workspace store (redis): ConnectionError") and "\n" not in str(e.value)


# --- S3 -------------------------------------------------------------------------------------------


def objects(prefix: str = "ws/blobs/") -> list[str]:
    import boto3

    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    s3.close()
    return [o["Key"] for o in listed]


def test_s3_stores_a_blob_once_under_prefix_slash_sha(aws):
    store = s3_store()
    data = os.urandom(5000)
    blob = store.put(data)
    key = f"ws/blobs/{blob}"
    assert key in objects()
    store.client.put_object(Bucket=BUCKET, Key=key, Body=data, Metadata={"mark": "first"})
    assert store.put(data) == blob
    assert store.client.head_object(Bucket=BUCKET, Key=key)["Metadata"] == {"mark": "first"}, "put again rewrote it"
    assert objects().count(key) == 1
    store.close()


def test_s3_refuses_a_corrupt_blob_and_lets_the_next_put_store_it_again(aws):
    store = s3_store()
    data = b"the real checkpoint"
    blob = blob_id(data)
    store.client.put_object(Bucket=BUCKET, Key=f"ws/blobs/{blob}", Body=b"the real checkpoinT")
    with pytest.raises(StoreError, match=f"^blob {blob[:12]} in the workspace store is corrupt"):
        store.get(blob)
    assert not store.has(blob)
    store.put(data)
    assert store.get(blob) == data
    store.close()


def test_s3_refuses_to_read_a_stored_blob_over_the_cap(aws):
    blob = s3_store().put(b"z" * (MIB + 1))
    with pytest.raises(StoreError, match=r"^blob of 1\.0 MiB is over TOOLQ_STORE_MAX_BLOB_MB=1$"):
        s3_store(store_max_blob_mb=1).get(blob)


def test_s3_without_its_bucket_is_one_line_naming_the_store(aws):
    store = open_store(Settings(store="s3://no-such-bucket/x"))
    with pytest.raises(StoreError) as e:
        store.put(b"x")
    assert str(e.value).startswith("workspace store (s3://no-such-bucket/x): ") and "NoSuchBucket" in str(e.value)
    assert "\n" not in str(e.value)
