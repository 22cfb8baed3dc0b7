"""The semaphore and the rate limiter on a real redis-server (toolq/core/permits.py, limits.py,
toolq/workers/permit.py): leases that lapse, renewals, releases of one's own only, waits that are
woken rather than spun, and a worker confirming the permit its orchestrator took."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from tests.unit.test_barrier import sync
from toolq.core import keys
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import ToolSpec
from toolq.core.permits import ACQUIRE, RATE, RELEASE, RENEW, Permit
from toolq.core.tool_limits import ToolLimit
from toolq.local.embedded import RedisServer
from toolq.orchestrator.limits import FleetLimits
from toolq.workers import permit as worker_permit


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def r(server):
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    yield client
    client.close()


def scripts(r):
    return {name: r.register_script(src) for name, src in
            (("acquire", ACQUIRE), ("renew", RENEW), ("release", RELEASE), ("rate", RATE))}


KEY = keys.limit_holders("gpu")


def test_a_semaphore_of_2_admits_2_and_taking_it_again_is_a_renewal(r):
    s = scripts(r)
    assert [s["acquire"](keys=[KEY], args=[t, 2, 10_000]) for t in ("a", "b", "c")] == [1, 1, 0]
    assert s["acquire"](keys=[KEY], args=["a", 2, 10_000]) == 1  # held: renewed, not a third permit
    assert r.zcard(KEY) == 2
    assert s["release"](keys=[KEY], args=["a", keys.LIMIT_RELEASED, "gpu"]) == 1
    assert s["acquire"](keys=[KEY], args=["c", 2, 10_000]) == 1


def test_a_lease_nobody_renews_lapses_and_its_permit_goes_to_the_next_call(r):
    s = scripts(r)
    assert s["acquire"](keys=[KEY], args=["crashed", 1, 300]) == 1
    assert s["acquire"](keys=[KEY], args=["next", 1, 300]) == 0
    time.sleep(0.35)
    assert s["acquire"](keys=[KEY], args=["next", 1, 300]) == 1
    assert [m.decode() for m in r.zrange(KEY, 0, -1)] == ["next"]


def test_a_renewed_lease_lives_on_and_a_released_one_is_never_renewed_back(r):
    s = scripts(r)
    s["acquire"](keys=[KEY], args=["a", 1, 300])
    for _ in range(4):
        time.sleep(0.15)
        assert s["renew"](keys=[KEY], args=["a", 300]) == 1
    assert s["acquire"](keys=[KEY], args=["b", 1, 300]) == 0  # 600 ms on, still held
    s["release"](keys=[KEY], args=["a", keys.LIMIT_RELEASED, "gpu"])
    assert s["renew"](keys=[KEY], args=["a", 300]) == 0 and r.zcard(KEY) == 0


def test_releasing_a_permit_one_does_not_hold_removes_nothing_and_tells_nobody(r):
    s = scripts(r)
    s["acquire"](keys=[KEY], args=["holder", 1, 10_000])
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.LIMIT_RELEASED)
    assert s["release"](keys=[KEY], args=["stranger", keys.LIMIT_RELEASED, "gpu"]) == 0
    assert pubsub.get_message(timeout=0.2) is None and r.zcard(KEY) == 1
    assert s["release"](keys=[KEY], args=["holder", keys.LIMIT_RELEASED, "gpu"]) == 1
    assert pubsub.get_message(timeout=1.0)["data"] == b"gpu"
    pubsub.close()


def test_a_rate_of_3_per_second_admits_3_then_says_how_long_to_wait(r):
    s, key = scripts(r), keys.limit_starts("api")
    assert [s["rate"](keys=[key], args=[f"t{k}", 3, 1000]) for k in range(3)] == [0, 0, 0]
    wait = s["rate"](keys=[key], args=["t3", 3, 1000])
    assert 900 <= wait <= 1000
    assert s["rate"](keys=[key], args=["t0", 3, 1000]) == 0  # already counted: not counted twice
    time.sleep(wait / 1000 + 0.01)
    assert s["rate"](keys=[key], args=["t3", 3, 1000]) == 0


# --- the orchestrator's FleetLimits -----------------------------------------------------------------


def spec(name: str = "gpu", **limit) -> ToolSpec:
    return ToolSpec(name=name, limit=ToolLimit.model_validate(limit))


def inv(task: str, deadline: float = 30.0) -> ToolInvocation:
    return ToolInvocation(turn_id=f"turn-{task}", step=0, output_index=0, call_id=task, tool_name=ToolName.plain("gpu"),
                          payload=FunctionPayload(arguments="{}"), deadline=time.time() + deadline)


def limits_on(server, **kw) -> FleetLimits:
    kw.setdefault("overrides", {})
    return FleetLimits(aioredis.Redis.from_url(server.url), max_parallel_calls=None, lease=kw.pop("lease", 10.0), **kw)


def evalsha_calls(r) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@sync
async def test_a_waiting_call_is_woken_by_a_release_in_another_process_without_polling(server, r):
    holder, waiter = limits_on(server), limits_on(server)  # two orchestrators
    try:
        first = await holder.admit(inv("a"), spec(max_concurrency=1), time.time() + 30, lambda why: None)
        assert first is not None and first.invocation.permit == Permit(tool="gpu", limit=1, lease=10.0)
        told: list[str] = []
        second = asyncio.create_task(waiter.admit(inv("b"), spec(max_concurrency=1), time.time() + 30, told.append))
        await asyncio.sleep(0.3)
        assert not second.done() and told == ["max_concurrency=1 of gpu"]
        before = evalsha_calls(r)
        await asyncio.sleep(2.0)
        assert evalsha_calls(r) - before <= 4, "a waiter retries about once a second, not in a loop"
        released = time.monotonic()
        first.release()
        got = await asyncio.wait_for(second, 5)
        assert got is not None and time.monotonic() - released < 0.3, "the release woke it"
        assert [m.decode() for m in r.zrange(KEY, 0, -1)] == [got.invocation.task_id]
    finally:
        await holder.aclose()
        await waiter.aclose()


@sync
async def test_cancelling_a_waiting_call_gives_back_nothing_it_did_not_hold(server, r):
    limits = limits_on(server)
    try:
        held = await limits.admit(inv("a"), spec(max_concurrency=1), time.time() + 30, lambda why: None)
        waiting = asyncio.create_task(limits.admit(inv("b"), spec(max_concurrency=1), time.time() + 30,
                                                   lambda why: None))
        await asyncio.sleep(0.2)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert [m.decode() for m in r.zrange(KEY, 0, -1)] == [held.invocation.task_id]
    finally:
        await limits.aclose()


@sync
async def test_a_call_whose_deadline_passes_while_it_waits_gets_none_and_holds_nothing(server, r):
    limits = limits_on(server)
    try:
        await limits.admit(inv("a"), spec(max_concurrency=1), time.time() + 30, lambda why: None)
        assert await limits.admit(inv("b"), spec(max_concurrency=1), time.time() + 0.3, lambda why: None) is None
        assert r.zcard(KEY) == 1
    finally:
        await limits.aclose()


@sync
async def test_the_orchestrator_renews_what_it_holds_until_it_releases(server, r):
    limits = limits_on(server, lease=1.0)
    try:
        held = await limits.admit(inv("a"), spec(max_concurrency=1), time.time() + 30, lambda why: None)
        await asyncio.sleep(1.6)  # past one lease: renewed every third of it
        assert r.zcard(KEY) == 1
        held.release()
        await asyncio.sleep(0.1)
        assert r.zcard(KEY) == 0
    finally:
        await limits.aclose()


@sync
async def test_settings_override_a_declared_limit_and_an_unlimited_tool_is_let_through_at_once(server, r):
    limits = limits_on(server, overrides={"gpu": ToolLimit(max_concurrency=3)})
    try:
        assert limits.limit_for(spec(max_concurrency=1)) == ToolLimit(max_concurrency=3)
        for k in range(3):
            assert await limits.admit(inv(f"t{k}"), spec(max_concurrency=1), time.time() + 5, lambda why: None)
        free = await limits.admit(inv("x"), spec("other"), time.time() + 5, lambda why: None)
        assert free is not None and free.invocation.permit is None and r.zcard(KEY) == 3
    finally:
        await limits.aclose()


# --- the worker's side -----------------------------------------------------------------------------


def test_a_worker_confirms_the_permit_its_orchestrator_took_at_once(r):
    call = inv("a").model_copy(update={"permit": Permit(tool="gpu", limit=1, lease=10.0)})
    scripts(r)["acquire"](keys=[KEY], args=[call.task_id, 1, 10_000])  # the orchestrator's
    assert worker_permit.confirm(r, call) == 0.0
    worker_permit.release(r, call)
    assert r.zcard(KEY) == 0


def test_a_worker_whose_call_lost_its_lease_waits_for_a_permit_rather_than_run_one_too_many(r):
    other = scripts(r)
    other["acquire"](keys=[KEY], args=["someone-else", 1, 400])  # and nobody renews it: it lapses
    call = inv("a").model_copy(update={"permit": Permit(tool="gpu", limit=1, lease=10.0)})
    waited: list[bool] = []
    took = worker_permit.confirm(r, call, on_wait=lambda: waited.append(True))
    assert took is not None and took >= 0.3 and waited == [True]
    assert [m.decode() for m in r.zrange(KEY, 0, -1)] == [call.task_id]
    worker_permit.release(r, call)


def test_a_worker_waiting_for_a_permit_stops_at_the_call_deadline(r):
    scripts(r)["acquire"](keys=[KEY], args=["someone-else", 1, 10_000])
    call = inv("a", deadline=0.3).model_copy(update={"permit": Permit(tool="gpu", limit=1, lease=10.0)})
    assert worker_permit.confirm(r, call) is None
    assert [m.decode() for m in r.zrange(KEY, 0, -1)] == ["someone-else"]
