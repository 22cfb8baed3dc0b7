"""A call that ran keeps its result when Redis goes away before its end is recorded, and one that
could not start says it was not run (toolq/workers/execute.py; found by the fault campaign: a Redis
restart just after a call finished answered it `failed`, "ConnectionError", although it had
completed, and one that met the restart as it started read the same)."""

from __future__ import annotations

import time

import redis
from pydantic import BaseModel

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.core.states import CallState
from toolq.local.embedded import RedisServer
from toolq.workers.execute import execute


class NoArgs(BaseModel):
    pass


def invocation(name: str, tmp_path, spec) -> dict:
    return ToolInvocation(turn_id="turn-1", step=0, output_index=0, call_id="call_1",
                          tool_name=ToolName.plain(name), payload=FunctionPayload(arguments="{}"),
                          deadline=time.time() + 30, workspace=str(tmp_path),
                          spec_digest=spec.digest()).model_dump(mode="json")


def test_a_call_that_ran_is_completed_though_redis_went_away_before_its_end_was_recorded(tmp_path):
    catalog = Catalog()
    with RedisServer(workdir=tmp_path) as server:
        r = redis.Redis.from_url(server.url)

        @tool(name="ran_then_redis_went", catalog=catalog)
        def ran_then_redis_went(args: NoArgs, ctx: ToolContext) -> str:
            server.stop()  # the call's work is done; the ledger's end write finds no Redis
            return "did it"

        result = execute(invocation("ran_then_redis_went", tmp_path, ran_then_redis_went.tool_spec), hostname="w@test",
                         r=r, catalog=catalog)
    assert result["status"] == CallState.COMPLETED and result["success"] is True
    assert "did it" in str(result["output"])


def test_a_call_that_meets_no_redis_as_it_starts_says_it_was_not_run(tmp_path):
    catalog = Catalog()
    ran = []

    @tool(name="never_reached", catalog=catalog)
    def never_reached(args: NoArgs, ctx: ToolContext) -> str:
        ran.append(1)
        return "ran"

    with RedisServer(workdir=tmp_path) as server:
        r = redis.Redis.from_url(server.url, socket_connect_timeout=1)
        server.stop()
        result = execute(invocation("never_reached", tmp_path, never_reached.tool_spec), hostname="w@test", r=r,
                         catalog=catalog)
    assert ran == []
    assert result["status"] == CallState.FAILED and result["success"] is False
    assert str(result["output"]).startswith("never_reached was not run: the worker could not reach Redis")
