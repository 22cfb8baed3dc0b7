"""A call's task message as dispatch builds it without Celery (task_message.py), against what
Celery's own `send_task` publishes for the same call, and the ledger script that claims, queues
and marks it sent in one round trip (`Ledger.claim_and_send`) on a real redis-server."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.unit.test_permits import r, server  # noqa: F401 - a real redis-server, flushed per test
from toolq.core import keys
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import ToolSpec
from toolq.core.contracts import TIME_LIMIT_MARGIN, task_name
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.local.embedded import RedisServer
from toolq.orchestrator.transport.dispatch import Dispatcher, flower_args
from toolq.orchestrator.transport.ledger import Ledger, Sent
from toolq.orchestrator.transport.task_message import anon_nodename
from toolq.workers.config import make_app

KEY = "k" * 32


def invocation(call_id: str = "call_1", turn_id: str = "turn-msg", step: int = 0) -> ToolInvocation:
    return ToolInvocation(turn_id=turn_id, step=step, output_index=0, call_id=call_id,
                          tool_name=ToolName.plain("exec_command"),
                          payload=FunctionPayload(arguments=json.dumps({"cmd": "echo 'hé'"})),
                          deadline=time.time() + 300, workspace="/w", spec_digest="abc")


def spec(idempotent: bool = False) -> ToolSpec:
    return ToolSpec(name="exec_command", description="d", parameters={"type": "object"}, timeout=30.0,
                    idempotent=idempotent)


def celery_published(inv: ToolInvocation, sp: ToolSpec, queue: str, signer: Signer, reply_to: str) -> dict[str, Any]:
    """What Celery's send_task put on the broker for this call: the arguments dispatch gave it
    before it built the message itself, on kombu's in-memory transport (the virtual channel that
    shapes the envelope is the Redis transport's too)."""
    from kombu.transport import memory

    app = make_app(Settings(redis_url="redis://127.0.0.1:1/0", signing_key=KEY))
    app.conf.update(broker_url="memory://", result_backend="cache+memory://")
    sent: list[dict[str, Any]] = []
    put = memory.Channel._put
    memory.Channel._put = lambda self, q, message, **kw: sent.append({"queue": q, **message})  # type: ignore
    try:
        task, body = task_name(sp.idempotent), inv.model_dump(mode="json")
        app.send_task(task, args=[body], kwargs={"signature": signer.sign_invocation(task, inv.task_id, body)},
                      task_id=inv.task_id, queue=queue,
                      expires=datetime.fromtimestamp(inv.deadline, tz=UTC),
                      soft_time_limit=sp.timeout + TIME_LIMIT_MARGIN / 2, time_limit=sp.timeout + TIME_LIMIT_MARGIN,
                      shadow=f"tool:{sp.tool_name}", argsrepr=flower_args(inv, sp), kwargsrepr="{}", reply_to=reply_to)
    finally:
        memory.Channel._put = put  # type: ignore
        app.close()
    (message,) = sent
    return message


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its body decoded, and the two fields that differ between any two sends
    (a random delivery tag; the TTL in ms, counted from the moment of sending) set apart."""
    m = json.loads(json.dumps(message))
    m["body"] = json.loads(base64.b64decode(m["body"]))
    props = m["properties"]
    return {**m, "properties": {**props, "delivery_tag": "?", "expiration": "?"},
            "ttl_ms": int(props["expiration"]), "tag_len": len(props["delivery_tag"])}


@pytest.mark.parametrize("idempotent", [False, True])
def test_the_message_is_the_one_celery_send_task_publishes(idempotent):
    signer = Signer(KEY)
    dispatcher = Dispatcher(Settings(redis_url="redis://127.0.0.1:1/0", signing_key=KEY),
                            Ledger(aioredis.Redis()), signer)
    inv, sp = invocation(), spec(idempotent)
    ours = comparable({"queue": "toolq.t.q", **json.loads(dispatcher._message(inv, sp, "toolq.t.q"))})
    sent = inv.model_copy(update={"sent_at": ours["body"][0][0]["sent_at"]})  # stamped at the send, signed
    theirs = comparable(celery_published(sent, sp, "toolq.t.q", signer, dispatcher._reply_to))
    assert abs(ours.pop("ttl_ms") - theirs.pop("ttl_ms")) < 2000
    assert ours == theirs
    assert ours["headers"]["origin"] == anon_nodename()
    assert signer.invocation_refusal(ours["headers"]["task"], inv.task_id, ours["body"][0][0],
                                     ours["body"][1]["signature"]) is None


def ledger_run(server: RedisServer, fn):  # noqa: F811 - the fixture, passed on
    async def go():
        ledger = Ledger.from_url(server.url)
        try:
            return await fn(ledger)
        finally:
            await ledger.aclose()

    return asyncio.run(go())


def test_a_call_is_claimed_queued_and_marked_sent_at_once_and_never_twice(server, r):  # noqa: F811
    inv = invocation()

    async def twice(ledger: Ledger) -> list[Sent]:
        return [await ledger.claim_and_send(inv, "toolq", "q", f"m{i}") for i in range(2)]

    assert ledger_run(server, twice) == [Sent.NOW, Sent.BEFORE]
    assert r.lrange("q", 0, -1) == [b"m0"]
    record = r.hgetall(keys.call(inv.task_id))
    assert (record[b"state"], record[b"sent"], record[b"queue"]) == (b"queued", b"1", b"toolq")
    assert r.lrange(keys.turn_calls(inv.turn_id), 0, -1) == [inv.task_id.encode()]
    assert r.ttl(keys.call(inv.task_id)) > 0


def test_a_call_claimed_and_never_sent_is_sent_once_and_one_past_queued_not_at_all(server, r):  # noqa: F811
    unsent, throttled, running = invocation("call_a"), invocation("call_b"), invocation("call_c")

    async def go(ledger: Ledger) -> list[Sent]:
        assert await ledger.claim(unsent, "toolq")  # and its orchestrator died
        await ledger.mark_throttled(throttled, "a limit")  # listed while it waited
        assert await ledger.claim(running, "toolq")
        await ledger.set_state(running.task_id, "running")  # sent by an orchestrator that died before its mark
        return [await ledger.claim_and_send(i, "toolq", "q", i.call_id) for i in (unsent, unsent, throttled, running)]

    assert ledger_run(server, go) == [Sent.CLAIMED_BEFORE, Sent.BEFORE, Sent.NOW, Sent.BEFORE]
    assert sorted(r.lrange("q", 0, -1)) == [b"call_a", b"call_b"]
    listed = r.lrange(keys.turn_calls(unsent.turn_id), 0, -1)
    assert sorted(listed) == sorted(i.task_id.encode() for i in (unsent, throttled, running))  # each once
    assert r.hget(keys.call(throttled.task_id), "state") == b"queued"
