"""The workspace store (toolq/workers/store) against a real Redis and a real S3 API (moto's server
on loopback): a blob is stored once, every read is checked against its id, a corrupt, missing or
too big blob is refused with one line, and Redis keeps a blob for the TTL after its last use."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from toolq.core.environments import blob_id
from toolq.core.settings import Settings
from toolq.local.embedded import free_port, wait_for
from toolq.workers.store import MIB, BlobStore, StoreError, open_store
from toolq.workers.store.redis_store import RedisStore, blob_key
from toolq.workers.store.s3_store import S3Store

pytestmark = pytest.mark.integration

BUCKET = "toolq-test"
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


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory) -> Iterator[str]:
    pytest.importorskip("moto.server", reason="moto is not installed: pip install 'toolq[test]'")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "moto server", log)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def aws(moto_endpoint, monkeypatch, tmp_path) -> str:
    """The standard AWS variables only: boto3 finds moto's endpoint and fake keys as it would a real
    service's (no config file of the machine's is read)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    import boto3

    s3 = boto3.client("s3")
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    s3.close()
    return moto_endpoint


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
