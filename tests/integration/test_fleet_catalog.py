"""The fleet catalog and capability routing on real workers (issue 14, items 1 and 2): a call
reaches only a worker that serves its tool's exact declaration; a call nobody serves is answered
within seconds; `toolq workers` lists the live instances; a killed worker drops out after its TTL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis

import tests.integration.joining_tools as joining_tools
from tests.integration.conftest import JOINING_TOOLS, ROOT, SIGNING_KEY, TEST_TOOLS, WORKER_ENV, settings_for
from tests.integration.test_faults import wait_for_pid
from tests.integration.test_flower import eventually
from tests.integration.test_hostile_fleet import push
from tests.integration.upgrade_tools import VERSION_ENV, declare
from toolq.core import keys
from toolq.core.advert import WorkerAdvert, tool_queue
from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.catalog import Catalog
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.transport.catalog_reader import UNSERVED_GRACE, FleetCatalog
from toolq.orchestrator.transport.results import outcome_from_meta
from toolq.orchestrator.turn import Runtime, Session
from toolq.workers.app import TASK
from toolq.workers.loader import load_catalog
from toolq.workers.presence import TTL

pytestmark = pytest.mark.integration

UPGRADE_TOOLS = "tests.integration.upgrade_tools"


def completed_items(events) -> dict[str, dict]:
    events = [e if isinstance(e, dict) else e.to_json() for e in events]  # typed events from Session
    return {e["item"]["id"]: e["item"] for e in events if e["type"] == "item.completed"}


def fleet_records(url: str) -> list[WorkerAdvert]:
    r = redis.Redis.from_url(url)
    try:
        raws = [r.get(keys.fleet_worker(i.decode())) for i in r.smembers(keys.FLEET_WORKERS)]
        return [WorkerAdvert.model_validate_json(raw) for raw in raws if raw is not None]
    finally:
        r.close()


def record_of(url: str, hostname: str) -> WorkerAdvert | None:
    return next((w for w in fleet_records(url) if w.hostname == hostname), None)


def test_a_joining_worker_gets_every_call_to_its_new_tool_and_the_fleet_none(fleet, joining_worker, drive):
    calls = [b.function_call("joined_echo", {"text": f"hi{k}"}, f"call_j{k}") for k in range(4)]
    run = drive([calls, [b.message("done")]], tools=[TEST_TOOLS, "tests.integration.joining_tools"])
    items = completed_items(run.events)
    assert [items[f"call_j{k}"]["worker"] for k in range(4)] == ["joiner@test"] * 4
    assert [items[f"call_j{k}"]["status"] for k in range(4)] == ["completed"] * 4, items
    outputs = [o["output"] for o in run.outputs_of(1)]
    assert all(re.fullmatch(rf"hi{k} from \d+", out) for k, out in enumerate(outputs)), outputs
    # The fleet's workers were never offered the calls: their logs never name the tool.
    for w in fleet:
        assert "joined_echo" not in w.log.read_text(errors="replace")


def test_a_rolling_upgrade_routes_each_declaration_to_its_own_workers(fleet, worker, tmp_path):
    for version in ("1", "2"):
        worker(["toolq"], concurrency=2, tools=[UPGRADE_TOOLS], env={VERSION_ENV: version},
               name=f"upgrade-v{version}@test")
    builtins = list(load_catalog([TEST_TOOLS]))
    for version in ("1", "2"):
        catalog = Catalog([*builtins, declare(version, Catalog())])  # an orchestrator with this version
        calls = [b.function_call("upgraded", {"text": f"t{k}"}, f"call_u{k}") for k in range(4)]
        with FakeModel([calls, [b.message("done")]]) as fake:
            outcome, events = asyncio.run(asyncio.wait_for(run_turn(settings_for(fleet[0].redis_url, fake, tmp_path),
                                                                     catalog), 60))
            bodies = fake.requests
        assert outcome.status == "completed"
        assert all(pairing_problems(body["input"]) == [] for body in bodies)
        outputs = [i["output"] for i in bodies[1]["input"] if i.get("type") == "function_call_output"]
        assert outputs == [f"v{version}: t{k}" for k in range(4)]
        items = completed_items(events)
        assert {items[f"call_u{k}"]["worker"] for k in range(4)} == {f"upgrade-v{version}@test"}


async def run_turn(settings, catalog: Catalog):
    runtime = await Runtime.create(settings, catalog=catalog)
    try:
        events: list[dict] = []
        return await Session(runtime).run_turn("go", events.append), events
    finally:
        await runtime.aclose()


def test_a_call_no_live_worker_serves_is_answered_within_seconds_with_what_to_start(drive, tmp_path):
    # A private broker whose only worker has the search tools loaded but serves `toolq`, not `search`.
    with RedisServer() as server:
        with WorkerProcess(server.url, name="toolq-only@test", queues=["toolq"], concurrency=2,
                           tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path):
            started = time.monotonic()
            run = drive([[b.function_call("joined_echo", {"text": "x"}, "call_stranded"),
                          b.function_call("sleep_echo", {"text": "alive"}, "call_alive")], [b.message("done")]],
                        redis_url=server.url, tools=[TEST_TOOLS, "tests.integration.joining_tools"])
            elapsed = time.monotonic() - started
            r = redis.Redis.from_url(server.url)
            queued = r.llen(tool_queue(joining_tools.joined_echo.tool_spec))
            r.close()
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_stranded"] == (
        "joined_echo was not run: no live worker serves tool `joined_echo` (declared in module "
        f"`{JOINING_TOOLS}`): start one with `toolq worker --tools {JOINING_TOOLS}`")
    assert json.loads(outputs["call_alive"])["text"] == "alive"
    assert UNSERVED_GRACE <= elapsed < UNSERVED_GRACE + 10, elapsed
    assert queued == 0, "an unserved call must not be left on a queue"
    items = completed_items(run.events)
    assert items["call_stranded"]["success"] is False and "worker" not in items["call_stranded"]
    assert run.outcome.status == "completed"  # the model reads why and the turn goes on


def toolq_workers(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", "workers", *args], env=env,
                          capture_output=True, text=True, timeout=30)


def test_toolq_workers_lists_each_live_instance_with_its_tools(fleet):
    table = toolq_workers(fleet[0].redis_url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["WORKER", "INSTANCE", "STATE", "PID", "HOST", "CONCURRENCY", "UP", "SANDBOX", "TOOLS"]
    for w in fleet:
        (line,) = [line for line in lines if line.startswith(w.name + " ")]
        assert " ready " in line and f" {w.pid} " in line, line

    listed = toolq_workers(fleet[0].redis_url, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["hostname"]: row for row in map(json.loads, listed.stdout.splitlines())}
    exec_spec = next(s for s in load_catalog() if s.name == "exec_command")
    for w in fleet:
        row = rows[w.name]
        assert (row["pid"], row["concurrency"], row["state"], row["queues"]) == (w.pid, 2, "ready", ["toolq"])
        tools = {t["name"]: t for t in row["tools"]}
        assert tools["exec_command"]["digest"] == exec_spec.digest()
        assert tools["exec_command"]["route"] == tool_queue(exec_spec)
        assert "hang" not in tools  # declared on the `faults` queue, which `--queues toolq` leaves out
        assert len(row["instance"]) == 32 and row["started_at"] <= time.time()


def test_toolq_workers_without_redis_url_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    done = subprocess.run([sys.executable, "-m", "toolq.cli.main", "workers"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith("toolq workers: set REDIS_URL")


def test_a_killed_worker_leaves_the_catalog_after_its_ttl_and_comes_back_as_a_new_instance(worker, redis_server):
    first = worker(["faults"], name="phoenix@test")
    before = record_of(redis_server.url, "phoenix@test")
    assert before is not None and before.pid == first.pid
    first.kill()  # SIGKILL: no clean exit, so the record outlives the process until its TTL
    assert record_of(redis_server.url, "phoenix@test") is not None
    killed_at = time.monotonic()
    while record_of(redis_server.url, "phoenix@test") is not None:
        assert time.monotonic() - killed_at < TTL + 5, "the killed worker's record never expired"
        time.sleep(0.2)
    assert time.monotonic() - killed_at >= TTL - 4  # it lived on until (about) its TTL, not less

    second = worker(["faults"], name="phoenix@test")
    after = record_of(redis_server.url, "phoenix@test")
    assert after is not None and after.instance != before.instance and after.pid == second.pid
    second.stop()  # a clean exit withdraws the record at once
    assert record_of(redis_server.url, "phoenix@test") is None


def test_a_call_on_the_plain_queue_for_a_tool_the_worker_lacks_is_still_refused_there(fleet, tmp_path):
    """The worker's own check stays the second line: an orchestrator from before capability routing
    sends to the tool's declared queue (`toolq`), which the fleet still consumes."""
    registry = Registry(load_catalog([TEST_TOOLS]))
    call = ToolCall(tool_name=ToolName.plain("joined_echo"), call_id="call_old",
                    payload=FunctionPayload(arguments=json.dumps({"text": "x"})))
    inv = registry.bind(call, StepContext("turn-old" + secrets.token_hex(4), 0, time.time() + 60, str(tmp_path)), 0)
    invocation = inv.model_dump(mode="json")
    push(fleet[0].redis_url, inv.task_id, invocation,
         signature=Signer(SIGNING_KEY).sign_invocation(TASK, inv.task_id, invocation))
    r = redis.Redis.from_url(Settings(redis_url=fleet[0].redis_url).result_backend_url())
    def answered() -> bytes | None:
        raw = r.get(keys.celery_meta(inv.task_id))
        return raw if raw and json.loads(raw).get("status") in ("SUCCESS", "FAILURE") else None

    try:
        meta = eventually(answered, "the worker's answer")
    finally:
        r.close()
    result = outcome_from_meta(json.loads(meta)).result  # a refusal ends in FAILURE, carrying the result
    assert result is not None and result.status == "rejected"
    assert re.fullmatch(r"tool joined_echo is not loaded on worker fleet[01]@test; not run", result.output)


def test_a_worker_in_warm_shutdown_is_listed_draining_and_offered_no_new_call(worker, drive, tmp_path):
    w = worker(["faults"], name="drainer@test")
    hang = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "hang")
    seen: dict[str, object] = {}

    def draining() -> WorkerAdvert | None:
        record = record_of(w.redis_url, "drainer@test")
        return record if record is not None and record.draining else None

    async def during(session, runtime):
        await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_drain.pid")
        w.proc.send_signal(signal.SIGTERM)  # warm shutdown: the running call finishes
        seen["record"] = await asyncio.to_thread(eventually, draining, "the record to say draining")
        snapshot = await FleetCatalog(runtime.fleet.ledger.r).read()
        seen["servers"] = [s.hostname for s in snapshot.servers(hang)]

    run = drive([[b.function_call("hang", {"seconds": 4}, "call_drain")], [b.message("done")]], during=during)
    assert run.outputs_of(1)[0]["output"] == "woke up"
    assert seen["record"].pid == w.pid and "drainer@test" not in seen["servers"]
    eventually(lambda: record_of(w.redis_url, "drainer@test") is None, "the drained worker to withdraw")


def test_an_orchestrator_can_build_every_served_tool_from_the_catalog_alone(fleet):
    """What a worker serves can be shown to the model without loading its module (tools whose
    specs are known only at runtime): each declaration rebuilds to the spec the worker loaded."""

    async def read():
        r = aioredis.Redis.from_url(fleet[0].redis_url)
        try:
            return await FleetCatalog(r).declarations()
        finally:
            await r.aclose()

    adverts = {a.digest: a for a in asyncio.run(read())}
    local = {s.digest(): s for s in load_catalog([TEST_TOOLS])}
    served = record_of(fleet[0].redis_url, fleet[0].name).tools
    assert len(served) > 10
    for spec in (local[t.digest] for t in served):
        rebuilt = adverts[spec.digest()].to_spec()
        assert rebuilt is not None and rebuilt.model_spec() == spec.model_spec() and rebuilt.handler is None
        assert adverts[spec.digest()].module == spec.handler.__module__


def test_a_worker_advertises_again_after_redis_restarts_empty(worker, tmp_path):
    with RedisServer() as server:
        w = worker(["toolq"], redis_url=server.url, name="survivor@test")
        before = record_of(server.url, "survivor@test")
        server.restart()  # nothing is persisted: the catalog is gone
        assert record_of(server.url, "survivor@test") is None
        after = eventually(lambda: record_of(server.url, "survivor@test"), "the worker to advertise again",
                           timeout=TTL + 5)
        assert after.instance == before.instance and after.pid == w.pid  # the same process, not a new one
