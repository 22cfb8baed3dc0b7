"""Flower against the real fleet: tasks read `tool:<name>` with the call id, its metrics stay
low-cardinality, its API needs auth, and a revoke through it aborts one call while the turn goes on.

Flower knows only what worker events told it, and they arrive a moment after the result: every
check polls with a deadline.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from tests.integration.conftest import ROOT, SIGNING_KEY, TEST_TOOLS, WORKER_ENV
from toolq.cli.flower import FlowerProcess
from toolq.cli.status import status_cmd
from toolq.core.contracts import TASK, TASK_IDEMPOTENT
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.orchestrator.transport.ledger import Ledger

pytestmark = pytest.mark.integration

USER = "toolq-test"
PASSWORD = secrets.token_urlsafe(16)
AUTH = (USER, PASSWORD)


@pytest.fixture(scope="module")
def flower(redis_server, fleet, tmp_path_factory):
    settings = Settings(redis_url=redis_server.url, flower_user=USER, flower_password=PASSWORD)
    with FlowerProcess(settings, logdir=tmp_path_factory.mktemp("flower")) as proc:
        proc.wait_for_workers(w.name for w in fleet)
        yield proc


def final(text: str = "done") -> list:
    return [b.message(text)]


def eventually(check: Callable[[], Any], what: str, timeout: float = 15) -> Any:
    """Poll until `check()` returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def ledger_calls(redis_url: str, turn_id: str) -> list[dict[str, str]]:
    async def read() -> list[dict[str, str]]:
        ledger = Ledger.from_url(redis_url)
        try:
            return await ledger.calls(turn_id)
        finally:
            await ledger.aclose()

    return asyncio.run(read())


def test_flower_lists_a_turns_tasks_by_tool_name_with_call_id_state_worker_and_runtime(fleet, flower, drive,
                                                                                        redis_server):
    run = drive([
        [b.function_call("sleep_echo", {"ms": 100, "text": "arg-a"}, "call_flower_a"),
         b.function_call("sleep_echo", {"ms": 50, "text": "arg-b"}, "call_flower_b")],
        final(),
    ])
    assert run.outcome.status == "completed"
    turn_id = run.outcome.turn_id
    task_ids = {c["call_id"]: c["task_id"] for c in ledger_calls(redis_server.url, turn_id)}
    assert set(task_ids) == {"call_flower_a", "call_flower_b"}

    # `toolq status` reads the same turn from the ledger.
    out = io.StringIO()
    assert status_cmd(Settings(redis_url=redis_server.url), turn_id, as_json=True, out=out) == 0
    rows = {r["call_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert set(rows) == set(task_ids)
    for call_id, row in rows.items():
        assert row["task_id"] == task_ids[call_id] and row["tool"] == "sleep_echo"
        assert row["state"] == "completed" and row["worker"] in {w.name for w in fleet}
        assert row["run_time"] >= 0.04

    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        def listed() -> dict[str, Any] | None:
            tasks = client.get("/api/tasks").raise_for_status().json()
            mine = {tid: t for tid, t in tasks.items() if tid in task_ids.values()}
            return mine if len(mine) == 2 and all(t["state"] == "SUCCESS" for t in mine.values()) else None

        tasks = eventually(listed, "Flower to list both calls as SUCCESS")
        for call_id, task_id in task_ids.items():
            task = tasks[task_id]
            assert f"call_id={call_id!r}" in task["args"] and f"turn={turn_id!r}" in task["args"]
            assert task["kwargs"] == "{}", "the invocation's signature, or more, reached Flower"
            info = client.get(f"/api/task/info/{task_id}").raise_for_status().json()
            assert info["state"] == "SUCCESS"
            assert info["worker"] in {w.name for w in fleet}
            assert info["runtime"] > 0.04

        names = {task_id: t["name"] for task_id, t in tasks.items()}
        # A task-sent event would carry the real task name and could land after task-received,
        # overwriting the shadow name; toolq sends none (the ledger records "queued" instead).
        assert set(names.values()) == {"tool:sleep_echo"}
        by_name = client.get("/api/tasks", params={"taskname": "tool:sleep_echo"}).raise_for_status().json()
        assert set(task_ids.values()) <= set(by_name)


def test_flower_shows_the_arguments_a_user_tool_declares_and_no_others(fleet, flower, drive, redis_server):
    # Issue 25 item 4: `flower_args` is the declaration's, so a user tool is shown as exec_command is.
    run = drive([[b.function_call("ticker", {"label": "build-42", "ticks": 1}, "call_flower_tick")], final()])
    assert run.outcome.status == "completed"
    (call,) = ledger_calls(redis_server.url, run.outcome.turn_id)
    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        def listed() -> dict[str, Any] | None:
            task = client.get("/api/tasks").raise_for_status().json().get(call["task_id"])
            return task if task and task["state"] == "SUCCESS" else None

        task = eventually(listed, "Flower to list the ticker call")
    assert task["args"] == f"(call_id='call_flower_tick', turn='{run.outcome.turn_id}', label='build-42')", task
    assert "ticks" not in task["args"]


def test_flower_api_needs_auth_and_its_metrics_carry_no_call_ids(fleet, flower, drive):
    run = drive([[b.function_call("sleep_echo", {"ms": 10}, "call_metrics_probe")], final()])
    assert run.outcome.status == "completed"

    with httpx.Client(base_url=flower.url, timeout=5) as client:
        for path in ("/api/tasks", "/api/workers", f"/api/task/info/{run.outcome.turn_id}"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, auth=(USER, "wrong")).status_code == 401, path
        assert client.post("/api/task/revoke/anything").status_code in (401, 403)
        assert client.get("/api/tasks", auth=AUTH).status_code == 200

        def metrics() -> str | None:
            text = client.get("/metrics").raise_for_status().text  # open without auth, by Flower's design
            return text if 'task="tool:sleep_echo"' in text else None

        text = eventually(metrics, "a tool:sleep_echo label in /metrics")
    assert "call_metrics_probe" not in text and run.outcome.turn_id not in text
    # task-sent events come from the orchestrator, which names the real task rather than the shadow.
    labels = set(re.findall(r'task="([^"]*)"', text)) - {TASK, TASK_IDEMPOTENT}
    assert labels and all(label.startswith("tool:") for label in labels), labels


def test_a_revoke_through_flower_aborts_the_call_and_the_turn_goes_on(fleet, flower, drive, redis_server):
    revoked: dict[str, Any] = {}

    async def during(session, runtime):
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(base_url=flower.url, auth=AUTH, timeout=5) as client:
            while True:  # the call has started on a worker, and Flower has seen it start
                assert time.monotonic() < deadline, "the long call never showed up as started in Flower"
                turn_id = next((t for t, _ in await runtime.fleet.ledger.recent_turns(1)), None)
                task_id = turn_id and next((c["task_id"] for c in await runtime.fleet.ledger.calls(turn_id)
                                            if c.get("call_id") == "call_long" and c.get("state") == "running"), None)
                if task_id:
                    info = await client.get(f"/api/task/info/{task_id}")
                    if info.status_code == 200 and info.json().get("state") == "STARTED":
                        break
                await asyncio.sleep(0.05)
            r = await client.post(f"/api/task/revoke/{task_id}", params={"terminate": "true", "signal": "SIGTERM"})
            assert r.status_code == 200, r.text
            assert r.json() == {"message": f"Revoked '{task_id}'"}
            revoked.update(turn_id=turn_id, task_id=task_id, at=time.monotonic())

    started = time.monotonic()
    run = drive([[b.function_call("sleep_echo", {"ms": 20000, "text": "long"}, "call_long")],
                 final("went on")], during=during)

    assert run.outcome.status == "completed", run.outcome.error
    assert run.outcome.turn_id == revoked["turn_id"]
    assert len(run.requests) == 2, "the turn did not go on to the next request"
    (out,) = run.outputs_of(1)
    assert out["call_id"] == "call_long"
    assert re.fullmatch(r"aborted by user after \d+\.\ds", out["output"]), out["output"]
    assert time.monotonic() - started < 15, "the turn waited for the tool instead of the revoke"

    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        eventually(lambda: client.get(f"/api/task/info/{revoked['task_id']}").json().get("state") == "REVOKED",
                   "Flower to show the call REVOKED")
    eventually(lambda: [c["state"] for c in ledger_calls(redis_server.url, revoked["turn_id"])] == ["cancelled"],
               "the ledger to record the call as cancelled")


def test_status_of_an_unknown_turn_says_so_and_exits_1(redis_server):
    err = io.StringIO()
    assert status_cmd(Settings(redis_url=redis_server.url), "turn-never-ran", out=io.StringIO(), err=err) == 1
    assert "no turn 'turn-never-ran'" in err.getvalue() and "toolq turns" in err.getvalue()


def test_failed_calls_are_failure_in_flower_failed_in_the_events_and_unchanged_for_the_model(
        fleet, flower, drive, redis_server):
    """Issue 10 item 7: a command that exits non-zero and a file tool that fails end in Celery's
    FAILURE (Flower's "Failed" filter lists them), `status: "failed"` in the events and `failed`
    in the ledger, while the model reads the same output as before."""
    run = drive([
        [b.function_call("exec_command", {"cmd": "echo oops; exit 3"}, "call_exit3"),
         b.function_call("read_file", {"file_path": "no-such-file.txt"}, "call_nofile"),
         b.function_call("exec_command", {"cmd": "echo fine"}, "call_fine")],
        final(),
    ])
    assert run.outcome.status == "completed"
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert "Process exited with code 3" in outputs["call_exit3"] and "oops" in outputs["call_exit3"]
    assert outputs["call_nofile"] and "Process exited with code 0" in outputs["call_fine"]

    items = {e["item"]["id"]: e["item"] for e in run.events
             if e["type"] == "item.completed" and e["item"].get("type") in ("tool_call", "command_execution")}
    exit3, nofile, fine = items["call_exit3"], items["call_nofile"], items["call_fine"]
    assert (exit3["status"], exit3["state"], exit3["exit_code"], exit3["reason"]) == ("failed", "failed", 3,
                                                                                      "exit code 3")
    assert (nofile["status"], nofile["state"]) == ("failed", "failed")
    assert nofile["reason"] == outputs["call_nofile"].splitlines()[0][:200]
    assert (fine["status"], fine["state"]) == ("completed", "completed")

    task_ids = {c["call_id"]: c["task_id"] for c in ledger_calls(redis_server.url, run.outcome.turn_id)}
    states = {c["call_id"]: c["state"] for c in ledger_calls(redis_server.url, run.outcome.turn_id)}
    assert states == {"call_exit3": "failed", "call_nofile": "failed", "call_fine": "completed"}
    failed_ids = {task_ids["call_exit3"], task_ids["call_nofile"]}
    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        def listed_failed() -> set[str] | None:
            tasks = client.get("/api/tasks", params={"state": "FAILURE"}).raise_for_status().json()
            return failed_ids if failed_ids <= set(tasks) else None

        eventually(listed_failed, "Flower's Failed filter to list both failed calls")
        info = client.get(f"/api/task/info/{task_ids['call_exit3']}").raise_for_status().json()
        assert info["state"] == "FAILURE" and info["exception"] == "ToolCallFailed(failed, exit code 3)"
        assert "oops" not in info["exception"] + (info.get("traceback") or ""), "the call's output leaked into Flower"
        nofile = client.get(f"/api/task/info/{task_ids['call_nofile']}").raise_for_status().json()
        assert nofile["exception"] == "ToolCallFailed(failed)"
        # Expected outcomes (a command's exit code, a RespondToModel): their short reason, no traceback,
        # neither in the event Flower shows nor in the stored result.
        for task_id in failed_ids:
            assert not client.get(f"/api/task/info/{task_id}").json().get("traceback")
            stored = stored_meta(redis_server.url, task_id)
            assert stored["status"] == "FAILURE" and stored["traceback"] is None, stored["traceback"]
        eventually(lambda: client.get(f"/api/task/info/{task_ids['call_fine']}").json().get("state") == "SUCCESS",
                   "the successful call to stay SUCCESS")


# --- issue 26: every tool's arguments in short, cancels REVOKED, expected failures without a traceback


def stored_meta(redis_url: str, task_id: str) -> dict[str, Any]:
    """The result meta the worker stored (what the orchestrator reads)."""
    raw = redis.Redis.from_url(Settings(redis_url=redis_url).result_backend_url()).get(f"celery-task-meta-{task_id}")
    assert raw is not None, f"no stored result for {task_id}"
    return json.loads(raw)


def flower_task(client: httpx.Client, task_id: str, state: str | None = None, what: str = "") -> dict[str, Any]:
    """Flower's record of one task, once it has one (in `state`, when given)."""
    def seen() -> dict[str, Any] | None:
        r = client.get(f"/api/task/info/{task_id}")
        if r.status_code != 200:
            return None
        info = r.json()
        return info if state is None or info.get("state") == state else None

    return eventually(seen, what or f"Flower to show task {task_id}" + (f" {state}" if state else ""))


def test_every_tool_shows_its_arguments_in_short_built_ins_and_user_tools_alike(fleet, flower, drive, redis_server,
                                                                                tmp_path):
    """Issue 26 item 1: read_file, list_dir, apply_patch and a user tool that declares no
    `flower_args` showed only the call id; each argument is shown now, a long one cut short."""
    (tmp_path / "notes.txt").write_text("one\n")
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
    run = drive([
        [b.function_call("read_file", {"file_path": "notes.txt", "limit": 5}, "call_read"),
         b.function_call("list_dir", {"dir_path": "."}, "call_list"),
         b.function_call("sleep_echo", {"ms": 1, "text": "y" * 5000}, "call_user"),
         b.custom_tool_call("apply_patch", patch, "call_patch")],
        final(),
    ])
    assert run.outcome.status == "completed", run.outcome.error
    turn = run.outcome.turn_id
    task_ids = {c["call_id"]: c["task_id"] for c in ledger_calls(redis_server.url, turn)}
    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        args = {call: flower_task(client, task_id, "SUCCESS")["args"] for call, task_id in task_ids.items()}
    base = {call: f"call_id={call!r}, turn={turn!r}" for call in task_ids}
    assert args["call_read"] == f"({base['call_read']}, file_path='notes.txt', limit=5)"
    assert args["call_list"] == f"({base['call_list']}, dir_path='.')"
    assert args["call_patch"] == f"({base['call_patch']}, input={patch!r})"
    # A value is cut to the budget every shown argument shares (300 characters), never sent whole.
    assert args["call_user"].startswith(f"({base['call_user']}, ms=1, text='yyy") and args["call_user"].endswith("…')")
    assert len(args["call_user"]) <= len(base["call_user"]) + 300 + len("(, ms=, text='')"), len(args["call_user"])


def test_an_mcp_tool_shows_its_arguments_in_flower(flower, drive, redis_server, tmp_path):
    """Issue 26 item 1: an MCP server's tool declares no `flower_args`; the worker that hosts it
    shows each argument its inputSchema names."""
    from toolq.dev.bench.mcp import McpWorkerProcess

    edges = f"{sys.executable} {ROOT / 'tests' / 'mcp_servers' / 'edges.py'} edges {tmp_path}"
    worker = McpWorkerProcess(redis_server.url, name="mcpflower@test", queues=["mcp.edges"], concurrency=1,
                              tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path, mcp=[f"edges={edges}"])
    worker.start()
    try:
        flower.wait_for_workers([worker.name])
        run = drive([[b.function_call("search", {"query": "needle"}, "call_mcp", namespace="edges")], final()])
        assert run.outcome.status == "completed", run.outcome.error
        (call,) = ledger_calls(redis_server.url, run.outcome.turn_id)
        with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
            task = flower_task(client, call["task_id"], "SUCCESS")
        assert task["name"] == "tool:edges.search"
        assert task["args"] == f"(call_id='call_mcp', turn='{run.outcome.turn_id}', query='needle')", task["args"]
    finally:
        worker.stop()


def test_a_call_cancelled_on_its_worker_is_revoked_in_flower_and_its_output_is_unchanged(flower, drive, worker,
                                                                                         redis_server):
    """Issue 26 item 2: the durable cancel record (`toolq cancel --call`, whose revoke broadcast no
    worker holding the call heard) stops a queued call where it is taken; its worker answers it
    `cancelled`. Flower showed that as FAILURE, among the failures; it is REVOKED now, while the
    model and the ledger get the worker's own aborted output as before."""
    w = worker(["faults"], concurrency=1)  # one pool process: while one call runs, the other waits queued
    flower.wait_for_workers([w.name])
    cancelled: dict[str, str] = {}

    async def during(session, runtime):
        ledger = runtime.fleet.ledger
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "no call ever ran while the other waited"
            calls = await ledger.calls(session.turn_id) if session.turn_id else []
            by_state = {c.get("state"): c for c in calls}
            if len(calls) == 2 and {"running", "queued"} <= set(by_state):
                break
            await asyncio.sleep(0.05)
        queued = by_state["queued"]
        cancelled.update(turn_id=session.turn_id, task_id=queued["task_id"], call_id=queued["call_id"])
        await ledger.cancel_call(session.turn_id, queued["task_id"])  # the durable record, no revoke

    run = drive([[b.function_call("hang", {"seconds": 3}, "call_a"),
                  b.function_call("hang", {"seconds": 3}, "call_b")], final("went on")], during=during)
    assert run.outcome.status == "completed", run.outcome.error
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    ran = ({"call_a", "call_b"} - {cancelled["call_id"]}).pop()
    states = {c["call_id"]: c["state"] for c in ledger_calls(redis_server.url, cancelled["turn_id"])}
    assert states == {ran: "completed", cancelled["call_id"]: "cancelled"}
    assert outputs[ran] == "woke up"

    # The worker's own result, as it stored it: the model read exactly its output.
    stored = stored_meta(redis_server.url, cancelled["task_id"])
    (result,) = stored["result"]["exc_message"]
    assert result["status"] == "cancelled" and result["worker"] == w.name
    assert outputs[cancelled["call_id"]] == result["output"]
    assert re.fullmatch(r"aborted by user after \d+\.\ds", result["output"]), result["output"]

    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        info = flower_task(client, cancelled["task_id"], "REVOKED", "Flower to show the cancelled call REVOKED")
        assert not info.get("exception") and not info.get("traceback")
        failed = client.get("/api/tasks", params={"state": "FAILURE"}).raise_for_status().json()
        assert cancelled["task_id"] not in failed, "a cancel is listed among the failures"


def test_a_crash_in_toolq_keeps_its_traceback_in_flower(fleet, flower, redis_server):
    """Issue 26 item 2: an expected failure shows no traceback (the test above and
    `test_failed_calls_are_failure...`), but toolq's own crash must: here a signed invocation
    toolq cannot read (no payload, no deadline), which the task body raises on."""
    from toolq.core.contracts import TASK
    from toolq.core.signing import Signer
    from toolq.workers.config import make_app

    settings = Settings(redis_url=redis_server.url, signing_key=SIGNING_KEY)
    task_id = f"turn-crash{secrets.token_hex(4)}:0:0:0"
    invocation = {"turn_id": "turn-crash", "call_id": "call_crash", "tool_name": {"name": "noop"}}
    app = make_app(settings)
    app.send_task(TASK, args=[invocation], task_id=task_id, queue="toolq", shadow="tool:noop",
                  kwargs={"signature": Signer(SIGNING_KEY).sign_invocation(TASK, task_id, invocation)})
    with httpx.Client(base_url=flower.url, auth=AUTH, timeout=5) as client:
        info = flower_task(client, task_id, "FAILURE", "Flower to show the crash")
    assert "validation errors for ToolInvocation" in info["exception"], info["exception"]
    assert "Traceback (most recent call last)" in info["traceback"] and "execute" in info["traceback"]
