"""TOOLQ_STORE and the store's caps: a bad value is one line naming the variable, at startup, not at
the first upload (toolq/core/settings.py; toolq/workers/store)."""

from __future__ import annotations

import sys

import pytest

from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, s3_store_location
from toolq.workers.store import StoreError, open_store
from toolq.workers.store.s3_store import S3Store


@pytest.mark.parametrize(("store", "location"), [
    ("redis", None),
    ("s3://toolq-ws", ("toolq-ws", "")),
    ("s3://toolq-ws/", ("toolq-ws", "")),
    ("s3://toolq.ws-1/teams/a/", ("toolq.ws-1", "teams/a")),
])
def test_store_is_redis_or_an_s3_bucket_and_prefix(store, location):
    assert s3_store_location(store) == location
    assert Settings.load({"TOOLQ_STORE": store}).store == store


@pytest.mark.parametrize("store", [
    "s3://", "s3:///prefix", "s3://ab", "s3://Upper-Case", "s3://key:secret@bucket/p", "s3://bucket/p?x=1",
    "S3://bucket", "https://bucket.s3.amazonaws.com/p", "Redis", "redis://localhost", "/var/store",
])
def test_any_other_store_is_one_line_naming_the_variable(store):
    with pytest.raises(ConfigurationError) as e:
        Settings.load({"TOOLQ_STORE": store})
    assert str(e.value) == ("invalid setting store (TOOLQ_STORE): must be redis or s3://BUCKET/PREFIX (a bucket name "
                            "of 3 to 63 lowercase letters, digits, '.' and '-')")


def test_the_redis_store_takes_blobs_of_512_mib_at_most_a_redis_strings_limit():
    assert Settings.load({"TOOLQ_STORE_MAX_BLOB_MB": "512"}).store_max_blob_mb == 512
    with pytest.raises(ConfigurationError) as e:
        Settings.load({"TOOLQ_STORE_MAX_BLOB_MB": "513"})
    assert str(e.value) == ("invalid setting store_max_blob_mb (TOOLQ_STORE_MAX_BLOB_MB): at most 512 with "
                            "TOOLQ_STORE=redis (a Redis string's limit); use an s3:// store for larger blobs")
    assert Settings.load({"TOOLQ_STORE": "s3://bucket", "TOOLQ_STORE_MAX_BLOB_MB": "4096"}).store_max_blob_mb == 4096


def test_a_bad_store_is_the_error_reported_not_the_cap_it_would_allow():
    with pytest.raises(ConfigurationError, match=r"^invalid setting store \(TOOLQ_STORE\)"):
        Settings.load({"TOOLQ_STORE": "s3:/bucket", "TOOLQ_STORE_MAX_BLOB_MB": "1024"})


def test_an_s3_store_without_boto3_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` meets when it is not installed
    with pytest.raises(StoreError) as e:
        open_store(Settings(store="s3://bucket/prefix"))
    assert str(e.value) == "TOOLQ_STORE=s3://... needs boto3: pip install 'toolq[s3]'"


def test_the_redis_store_needs_the_brokers_redis():
    with pytest.raises(StoreError, match=r"^TOOLQ_STORE=redis needs REDIS_URL \(the broker's Redis\)$"):
        open_store(Settings())


def test_an_s3_key_is_prefix_slash_blob_id():
    blob = "ab" * 32
    assert S3Store("b", "/teams/a/", max_bytes=1, client=object()).key(blob) == f"teams/a/{blob}"
    assert S3Store("b", "", max_bytes=1, client=object()).key(blob) == blob
