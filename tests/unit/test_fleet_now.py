"""`toolq queues` and `toolq calls` (toolq/cli/fleet_now.py): what the fleet is doing now, read
from a real redis-server holding what workers advertise, what waits on their queues and what the
ledger records of running turns."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator

import pytest
import redis

from tests.unit.test_advert import declared, only
from tests.unit.test_catalog_reader import worker
from toolq.cli.fleet_now import calls_cmd, queue_rows, queues_cmd, unanswered_rows
from toolq.core import keys
from toolq.core.advert import ToolAdvert, ToolRef
from toolq.core.settings import Settings
from toolq.local.embedded import RedisServer
from toolq.orchestrator.transport.ledger import Ledger
from toolq.workers.presence import Advertiser


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def url(server: RedisServer) -> str:
    redis.Redis.from_url(server.url).flushall()
    return server.url


def test_queues_are_listed_deepest_first_with_the_live_workers_that_consume_them():
    spec = only(declared())
    route = ToolRef.of(spec).route
    rows = queue_rows([worker(spec), worker(spec, instance="f" * 32, draining=True)], {route: 3})
    assert rows == [{"queue": route, "tool": "echo", "waiting": 3, "workers": 1}]  # a draining one serves nothing


def test_toolq_queues_counts_the_messages_waiting_on_each_tool_queue(url):
    spec = only(declared())
    r = redis.Redis.from_url(url)
    Advertiser(r, worker(spec), [ToolAdvert.of(spec)]).publish()
    route = ToolRef.of(spec).route
    r.lpush(route, b"m1", b"m2")
    out = io.StringIO()
    assert queues_cmd(Settings(redis_url=url), as_json=True, out=out) == 0
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"queue": route, "tool": "echo", "waiting": 2, "workers": 1}]
    table = io.StringIO()
    queues_cmd(Settings(redis_url=url), out=table)
    assert table.getvalue().splitlines()[1].split() == [route, "echo", "2", "1"]


def test_toolq_calls_lists_the_unanswered_calls_of_running_turns_only(url):
    async def record() -> None:
        ledger = Ledger.from_url(url)
        try:
            for turn, states in (("turn-live", ["running", "completed", "throttled"]), ("turn-done", ["queued"])):
                await ledger.start_turn(turn, "p", "/w")
                for k, state in enumerate(states):
                    task = f"{turn}:0:{k}:x"
                    await ledger.r.hset(keys.call(task), mapping={"state": state, "tool": "echo",
                                                                   "call_id": f"call_{k}", "task_id": task})
                    await ledger.r.rpush(keys.turn_calls(turn), task)
            await ledger.finish_turn("turn-done", "completed")
        finally:
            await ledger.aclose()

    asyncio.run(record())
    out = io.StringIO()
    assert calls_cmd(Settings(redis_url=url), as_json=True, out=out) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["turn_id"], r["call_id"], r["state"]) for r in rows] == [
        ("turn-live", "call_0", "running"), ("turn-live", "call_2", "throttled")]


def test_a_turn_whose_calls_are_all_answered_lists_no_call():
    assert unanswered_rows([("turn-a", [{"state": "completed"}])], 0.0) == []
