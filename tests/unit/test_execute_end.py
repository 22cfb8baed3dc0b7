"""A call that ran keeps its result when Redis goes away before its end is recorded
(toolq/workers/execute.py; found by the fault campaign: a Redis restart just after a call
finished answered it `failed`, "ConnectionError", although it had completed)."""

from __future__ import annotations

import time

import redis
from pydantic import BaseModel

from toolq.orchestrator.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.orchestrator.embedded import RedisServer
from toolq.orchestrator.states import CallState
from toolq.workers.catalog import Catalog, ToolContext, tool
from toolq.workers.execute import execute


class NoArgs(BaseModel):
    pass


def test_a_call_that_ran_is_completed_though_redis_went_away_before_its_end_was_recorded(tmp_path):
    catalog = Catalog()
    with RedisServer(workdir=tmp_path) as server:
        r = redis.Redis.from_url(server.url)

        @tool(name="ran_then_redis_went", catalog=catalog)
        def ran_then_redis_went(args: NoArgs, ctx: ToolContext) -> str:
            server.stop()  # the call's work is done; the ledger's end write finds no Redis
            return "did it"

        inv = ToolInvocation(turn_id="turn-1", step=0, output_index=0, call_id="call_1",
                             tool_name=ToolName.plain("ran_then_redis_went"), payload=FunctionPayload(arguments="{}"),
                             deadline=time.time() + 30, workspace=str(tmp_path),
                             spec_digest=ran_then_redis_went.tool_spec.digest())
        result = execute(inv.model_dump(mode="json"), hostname="w@test", r=r, catalog=catalog)
    assert result["status"] == CallState.COMPLETED and result["success"] is True
    assert "did it" in str(result["output"])
