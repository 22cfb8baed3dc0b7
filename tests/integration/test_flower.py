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
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

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
        [b.function_call("sleep_echo", {"ms": 100, "text": "secret-arg-a"}, "call_flower_a"),
         b.function_call("sleep_echo", {"ms": 50, "text": "secret-arg-b"}, "call_flower_b")],
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
            assert "secret-arg" not in task["args"] + task["kwargs"], "the call's arguments leaked into Flower"
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
        assert info["state"] == "FAILURE" and "exit code 3" in info["exception"]
        assert "oops" not in info["exception"] + (info.get("traceback") or ""), "the call's output leaked into Flower"
        nofile = client.get(f"/api/task/info/{task_ids['call_nofile']}").raise_for_status().json()
        assert nofile["exception"] == "ToolCallFailed(failed)"
        eventually(lambda: client.get(f"/api/task/info/{task_ids['call_fine']}").json().get("state") == "SUCCESS",
                   "the successful call to stay SUCCESS")
