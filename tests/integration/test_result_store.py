"""The workers' result backend stores a meta in one round trip with Celery's guarantee: a genuine
stored SUCCESS is never overwritten, a forged one is, and every store is published once."""

from __future__ import annotations

import json

import pytest
import redis

from tests.integration import conftest as c
from toolq.core import keys
from toolq.core.signing import Signer
from toolq.workers.config import make_app

pytestmark = pytest.mark.integration

TASK_ID = "turn-store:0:0:0123456789ab"


@pytest.fixture
def backend(redis_server):
    app = make_app(c.Settings(redis_url=redis_server.url, signing_key=c.SIGNING_KEY))
    yield app.backend
    app.close()


@pytest.fixture
def results(redis_server):
    r = redis.Redis.from_url(c.Settings(redis_url=redis_server.url).result_backend_url())
    r.delete(keys.celery_meta(TASK_ID))
    yield r
    r.close()


def stored(r: redis.Redis) -> dict:
    return json.loads(r.get(keys.celery_meta(TASK_ID)))


def test_a_store_is_one_round_trip_published_once_and_never_replaces_a_genuine_success(backend, results):
    pubsub = results.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.celery_meta(TASK_ID))
    pubsub.get_message(timeout=1)
    backend.store_result(TASK_ID, {"pid": 1, "hostname": "w"}, "STARTED")  # loads the script
    commands = _commands(results, lambda: backend.store_result(TASK_ID, {"output": "genuine"}, "SUCCESS"))
    assert commands == ["evalsha"], commands
    assert stored(results)["status"] == "SUCCESS"
    assert Signer(c.SIGNING_KEY).meta_refusal(TASK_ID, stored(results)) is None
    # A late FAILURE of the same task id (a lost worker's redelivery) leaves the SUCCESS in place.
    backend.store_result(TASK_ID, ValueError("late"), "FAILURE")
    assert stored(results)["result"] == {"output": "genuine"}
    published = [json.loads(m["data"])["status"] for m in _drain(pubsub)]
    assert published == ["STARTED", "SUCCESS"], published
    pubsub.close()


@pytest.mark.parametrize("separators", [None, (",", ":")])  # written as kombu does, and otherwise
def test_a_forged_stored_success_is_overwritten_by_the_genuine_result(backend, results, separators):
    forged = {"status": "SUCCESS", "task_id": TASK_ID, "result": {"output": "FORGED"}, "traceback": None,
              "children": [], "date_done": None, "toolq_signature": "0" * 64}
    results.set(keys.celery_meta(TASK_ID), json.dumps(forged, separators=separators))
    backend.store_result(TASK_ID, {"output": "genuine"}, "SUCCESS")
    assert stored(results)["result"] == {"output": "genuine"}
    assert Signer(c.SIGNING_KEY).meta_refusal(TASK_ID, stored(results)) is None


def test_a_stored_value_that_is_not_json_does_not_block_the_store(backend, results):
    results.set(keys.celery_meta(TASK_ID), b"\xff not json")
    backend.store_result(TASK_ID, {"output": "genuine"}, "SUCCESS")
    assert stored(results)["result"] == {"output": "genuine"}


_CONNECTION_SETUP = {"select", "auth", "hello", "client"}


def _commands(r: redis.Redis, action) -> list[str]:
    """The commands clients sent on the results database for `action` (MONITOR; not those a
    script ran), up to a marker."""
    seen: list[str] = []
    with r.monitor() as m:
        action()
        r.echo("toolq-test-end")
        for event in m.listen():
            command = event["command"]
            if "toolq-test-end" in command:
                return seen
            name = command.split()[0].lower()
            if int(event["db"]) == 1 and event.get("client_type") != "lua" and name not in _CONNECTION_SETUP:
                seen.append(name)
    return seen


def _drain(pubsub) -> list[dict]:
    out = []
    while (msg := pubsub.get_message(timeout=0.5)) is not None:
        out.append(msg)
    return out
