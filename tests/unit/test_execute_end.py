"""A call that ran keeps its result when Redis goes away before its end is recorded, and one that
could not start says it was not run (toolq/workers/execute.py; found by the fault campaign: a Redis
restart just after a call finished answered it `failed`, "ConnectionError", although it had
completed, and one that met the restart as it started read the same)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from pydantic import BaseModel

from toolq.core import keys
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.core.honest import INFRASTRUCTURE_TEXT, Known, known_form
from toolq.core.states import CallState
from toolq.local.embedded import RedisServer
from toolq.workers import execute as execute_module
from toolq.workers.execute import execute


class NoArgs(BaseModel):
    pass


def invocation(name: str, tmp_path, spec) -> dict:
    return ToolInvocation(turn_id="turn-1", step=0, output_index=0, call_id="call_1",
                          tool_name=ToolName.plain(name), payload=FunctionPayload(arguments="{}"),
                          deadline=time.time() + 30, workspace=str(tmp_path),
                          spec_digest=spec.digest()).model_dump(mode="json")


@pytest.fixture(autouse=True)
def brief_end_retries(monkeypatch):
    """The end record is retried for seconds in production; these tests keep Redis away for good."""
    monkeypatch.setattr(execute_module, "RECORD_END_FOR", 0.3)


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
    assert result["status"] == CallState.REJECTED and result["success"] is False
    assert str(result["output"]).startswith("never_reached was not run: the worker lost Redis as it started")


# --- Redis goes away at each of the worker's round trips (issue 27): the output never guesses ---

class GoesAwayAfter(redis.Redis):
    """A real Redis connection that stops its server once it has sent `n` commands: the fault lands
    at the worker's n-th round trip of the call, whichever point of its path that is."""

    def __init__(self, server: RedisServer, n: int) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(server.url, socket_connect_timeout=1,
                                                                       socket_timeout=2))
        self.server, self.left = server, n

    def execute_command(self, *args, **options):
        if self.left == 0:
            self.server.stop()
        self.left -= 1
        return super().execute_command(*args, **options)


def sweep_invocation(tmp_path, spec, *, permit: bool) -> dict:
    from toolq.core.permits import Permit

    inv = ToolInvocation.model_validate(invocation(spec.name, tmp_path, spec))
    if permit:
        inv = inv.model_copy(update={"permit": Permit(tool=spec.name, limit=2, lease=5.0)})
    return inv.model_dump(mode="json")


@pytest.mark.parametrize("permit", [False, True], ids=["plain", "max_concurrency"])
def test_redis_lost_at_any_round_trip_leaves_an_honest_output_and_one_run_at_most(tmp_path, permit):
    """For every k: Redis stops just before the worker's k-th command of the call (its start, a
    permit, each cancel poll while the tool runs, the end record, the permit's release). The
    output is the tool's own or toolq's "not run", never the exception's text, and the tool ran
    at most once; past the last round trip, nothing changes."""
    catalog = Catalog()
    runs: list[int] = []

    @tool(name="polls_for_cancel", catalog=catalog)
    def polls_for_cancel(args: NoArgs, ctx: ToolContext) -> str:
        runs.append(1)
        for _ in range(3):  # a long tool asks, as exec_command does while its command runs
            if ctx.cancelled():
                return "cancelled itself"
        return "the tool's own result"

    spec = polls_for_cancel.tool_spec
    seen = set()
    for k in range(12):
        runs.clear()
        (tmp_path / f"k{k}").mkdir()
        with RedisServer(workdir=tmp_path / f"k{k}") as server:
            r = GoesAwayAfter(server, k)
            result = execute(sweep_invocation(tmp_path, spec, permit=permit), hostname="w@test", r=r, catalog=catalog)
            r.close()
        output = str(result["output"])
        assert not INFRASTRUCTURE_TEXT.search(output), (k, output)
        assert len(runs) <= 1
        if runs:
            assert (result["status"], output) == (CallState.COMPLETED, "the tool's own result"), k
        else:
            assert result["status"] == CallState.REJECTED and known_form(output) is Known.NOT_RUN, (k, output)
        seen.add(result["status"])
    assert seen == {CallState.REJECTED, CallState.COMPLETED}  # the sweep reached both sides of the start


def test_the_end_of_a_call_is_recorded_once_redis_is_back(tmp_path, monkeypatch):
    """Redis away for a moment as the call ends (a failover): the end record is retried, so the
    ledger does not keep a completed call `running` (found by helper-28's Sentinel tests)."""
    monkeypatch.setattr(execute_module, "RECORD_END_FOR", 20.0)
    catalog = Catalog()
    with RedisServer(workdir=tmp_path) as server:
        r = redis.Redis.from_url(server.url, socket_connect_timeout=1)

        @tool(name="ends_in_an_outage", catalog=catalog)
        def ends_in_an_outage(args: NoArgs, ctx: ToolContext) -> str:
            server.kill()
            threading.Timer(1.0, server.start).start()  # back, on the same port, a second later
            return "done"

        inv = invocation("ends_in_an_outage", tmp_path, ends_in_an_outage.tool_spec)
        result = execute(inv, hostname="w@test", r=r, catalog=catalog)
        task_id = ToolInvocation.model_validate(inv).task_id
        state = r.hget(keys.call(task_id), "state")
    assert result["status"] == CallState.COMPLETED
    assert state == b"completed"
