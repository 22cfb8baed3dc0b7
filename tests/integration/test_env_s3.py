"""Environments with the S3 store (issue 28 item 6): `TOOLQ_STORE=s3://...` on the orchestrator and
on two worker hosts, against moto's S3 server on loopback. An upload and a turn's checkpoint travel
through S3 only (nothing in Redis's blob keys), and another host takes the checkpoint up."""

from __future__ import annotations

import asyncio
import os

import boto3
import pytest
import redis

from tests.integration.conftest import BUCKET, TEST_TOOLS, catalog_of, settings_for
from tests.integration.test_environments import HOSTS, exec_call, output_of, unmount_under, uploaded, wait_hosts
from toolq.core.environments import EnvSource
from toolq.core.session_records import conversation_key
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer
from toolq.orchestrator.turn import Runtime, Session

pytestmark = pytest.mark.integration

STORE = f"s3://{BUCKET}/envs"


@pytest.fixture
def s3_hosts(aws, worker, tmp_path):
    """A Redis of its own and two worker hosts whose store is S3 (the AWS variables `aws` set here)."""
    with RedisServer() as server:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        started = [worker(["toolq"], concurrency=2, redis_url=server.url, name=f"{h}@s3",
                          env={**env, "TOOLQ_STORE": STORE, "TOOLQ_HOST_ID": h,
                               "TOOLQ_ENV_ROOT": str(tmp_path / f"root-{h}")}) for h in HOSTS]
        try:
            yield server
        finally:
            for w in started:
                w.stop(grace=3)
            unmount_under(tmp_path)


def test_an_upload_and_its_checkpoint_go_through_s3_and_another_host_takes_it_up(s3_hosts, tmp_path):
    folder = uploaded(tmp_path)
    script = {"by_prompt": {
        "first": [[exec_call("c1", "cat notes.txt && echo 'from the first host' > made.txt")], [b.message("ok")]],
        "second": [[exec_call("c2", "cat made.txt notes.txt")], [b.message("read")]],
    }}

    async def go():
        with FakeModel(script) as fake:
            settings = settings_for(s3_hosts.url, fake, tmp_path / "unused", store=STORE)
            runtime = await Runtime.create(settings, catalog=catalog_of([TEST_TOOLS]))
            first = second = None
            try:
                await wait_hosts(runtime, 2)
                first = Session(runtime, upload=folder)
                one = await first.run_turn("first", lambda e: None)
                made = await runtime.fleet.environments.record(first.environment.id)
                other = next(h for h in HOSTS if h != made.host)
                second = Session(runtime, environment=await runtime.fleet.environments.create(
                    one_source(one.diff.checkpoint), owner=conversation_key(first.conversation.id), host=other))
                two = await second.run_turn("second", lambda e: None)
                return one, two, made, other, fake.requests
            finally:
                for s in (first, second):
                    if s is not None:
                        await s.close()
                await runtime.aclose()

    one, two, made, other, requests = asyncio.run(asyncio.wait_for(go(), 180))
    assert one.status == "completed" and two.status == "completed", (one.error, two.error)
    assert "hello from the upload" in output_of(requests[1], "c1")
    assert "from the first host" in output_of(requests[3], "c2") and "hello from the upload" in output_of(
        requests[3], "c2"), "the second host did not get the checkpoint's files"
    s3 = boto3.client("s3")
    stored = {o["Key"].rsplit("/", 1)[1] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="envs/")["Contents"]}
    s3.close()
    assert made.base in stored and one.diff.checkpoint in stored
    r = redis.Redis.from_url(s3_hosts.url)
    try:
        assert list(r.scan_iter("toolq:blob:*")) == [], "a blob went to Redis with TOOLQ_STORE=s3"
    finally:
        r.close()


def one_source(checkpoint: str) -> EnvSource:
    return EnvSource(kind="checkpoint", checkpoint=checkpoint, label=checkpoint[:12])
