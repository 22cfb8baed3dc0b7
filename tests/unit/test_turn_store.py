"""Issue 24 item 10: what a turn's items cost in Redis is never counted short (durable.py's
`StoreBudget`, TOOLQ_TURN_STORE_MB).

A hostile model server picks its items to cost toolq the most per byte it sends: non-ASCII text
(Celery's JSON escapes each character to 6 or 12 bytes, then base64 adds a third), a call_id that
toolq copies into the ledger, the task message and the output. Each such item is written here as
toolq writes it, on a real redis-server: into the turn's item list (`TurnStore.append`), and for a
call its claim, indexes and task message (`Ledger.claim_and_send` with `Dispatcher._message`) and
its output with the worker's result; what Redis then holds (MEMORY USAGE of every key) must not
pass what the budget counted for it from the event alone.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis

from tests.unit.test_permits import r, server  # noqa: F401 - a real redis-server, flushed per test
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import ToolSpec
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.orchestrator.protocol.events import EventDecoder, OutputItemDone
from toolq.orchestrator.transport.dispatch import Dispatcher
from toolq.orchestrator.transport.durable import (
    MIB,
    Committed,
    StoreBudget,
    TurnStore,
    item_cost,
    store_error,
    wire_cost,
)
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.transport.task_message import queue_key

KEY = "k" * 32
N = 60_000

HOSTILE = {
    "ascii": "x" * N,
    "quotes": '"\\' * (N // 2),
    "latin": "é" * N,
    "euro": "€" * N,
    "astral": "😀" * N,
    "controls": "\x01" * N,
}


def done_event(item: dict, ensure_ascii: bool) -> OutputItemDone:
    data = json.dumps({"type": "response.output_item.done", "output_index": 0, "item": item},
                      ensure_ascii=ensure_ascii, separators=(",", ":"))
    event = EventDecoder().decode(data)
    assert isinstance(event, OutputItemDone), data[:200]
    return event


def keys_memory(client) -> int:
    return sum(client.memory_usage(k, samples=0) or 0 for k in client.scan_iter(count=1000))


def store_as_toolq_does(server_url: str, item: dict, call: bool) -> None:
    """The item into a turn's list; a call also claimed, queued with its task message, answered."""

    async def go() -> None:
        client = aioredis.Redis.from_url(server_url)
        try:
            await TurnStore(client, 15).append("turn-x", [Committed(item=item, step=0, output_index=0)])
            if call:
                ledger = Ledger(client)
                inv = ToolInvocation(turn_id="turn-x", step=0, output_index=0, call_id=item["call_id"],
                                     tool_name=ToolName.plain("exec_command"),
                                     payload=FunctionPayload(arguments=item["arguments"]),
                                     deadline=time.time() + 300, workspace="/w", spec_digest="abc")
                spec = ToolSpec(name="exec_command", description="d", parameters={"type": "object"}, timeout=30.0)
                dispatcher = Dispatcher(Settings(redis_url=server_url, signing_key=KEY), ledger, Signer(KEY))
                await ledger.claim_and_send(inv, spec.queue, queue_key("q"), dispatcher._message(inv, spec, "q"))
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("ensure_ascii", [False, True], ids=["raw-utf8", "escaped"])
@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_call_costs_redis_no_more_than_counted(server, r, text, ensure_ascii):  # noqa: F811
    item = {"type": "function_call", "id": "fc_1", "status": "completed", "name": "exec_command",
            "arguments": json.dumps({"cmd": text}, ensure_ascii=False), "call_id": "call_" + text[:2000]}
    event = done_event(item, ensure_ascii)
    counted = item_cost(event.size, event.escaped, event.item.type, event.item.call_id)
    store_as_toolq_does(server.url, event.item.to_wire(), call=True)
    held = keys_memory(r)
    assert held <= counted, f"Redis holds {held} bytes, {counted} counted"
    assert wire_cost(event.item.to_wire()) <= counted  # a resumed turn counts it no higher
    assert held <= wire_cost(event.item.to_wire())


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_reasoning_item_costs_redis_no_more_than_counted(server, r, text):  # noqa: F811
    item = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": text}],
            "encrypted_content": text}
    event = done_event(item, ensure_ascii=False)
    counted = item_cost(event.size, event.escaped, event.item.type, None)
    store_as_toolq_does(server.url, event.item.to_wire(), call=False)
    assert keys_memory(r) <= counted


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_output_costs_its_item_and_the_workers_escaped_copy(text):
    from kombu.utils.json import dumps as celery_json

    out = {"type": "function_call_output", "call_id": "call_1", "output": text}
    stored = len(Committed(item=out).model_dump_json(exclude_none=True).encode())
    result = len(celery_json({"status": "SUCCESS", "result": {"call_id": "call_1", "output": text}}))
    assert stored + result <= wire_cost(out) + 512  # the result's envelope is small and fixed


def test_the_budget_refuses_what_would_pass_it_and_says_so_in_one_line():
    budget = StoreBudget(2)
    assert budget.take(MIB) and budget.take(MIB)
    assert not budget.take(1) and budget.full and budget.used == 2 * MIB
    line = budget.error
    assert "\n" not in line and "TOOLQ_TURN_STORE_MB" in line and "2 MiB" in line, line
    assert line == store_error(2)
    carried = StoreBudget(1)
    carried.add(2 * MIB)  # a conversation bigger than the bound: kept, and the turn must stop
    assert carried.full


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_earlier_turns_call_costs_only_its_copy_in_the_item_list(text):
    # A conversation's past calls have no task message or result in this turn: counting them as
    # new calls filled the bound ~55 times too soon (a long session stopped after ~10,000 calls).
    call = {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": text}
    stored = len(Committed(item=call).model_dump_json(exclude_none=True).encode())
    assert stored <= wire_cost(call, history=True) < wire_cost(call)
    plain = {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{}"}
    assert wire_cost(plain) > 20 * wire_cost(plain, history=True)
