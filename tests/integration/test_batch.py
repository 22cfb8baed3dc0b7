"""`toolq batch` as a user runs it: a real process, real Redis and workers, the fake model over TCP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.integration.conftest as c
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.transport.ledger import Ledger

pytestmark = pytest.mark.integration


def toolq_process(*args: str, env: dict[str, str]) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]  # the tests' tool modules (tests/conftest.py)
    return subprocess.Popen([sys.executable, "-m", "toolq.cli.main", *args], cwd=c.ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**base, **env})


def echo_turn(k: int) -> list:
    calls = [b.function_call("sleep_echo", {"text": f"t{k}-{i}"}, f"call_{i}") for i in range(2)]
    return [calls, [b.message(f"done {k}")]]


HANG = [[b.function_call("hang", {"seconds": 60}, "call_hang")], [b.message("hung")]]


def results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def turn_with_prompt(redis_url: str, prompt: str) -> str:
    async def find() -> str | None:
        ledger = Ledger.from_url(redis_url)
        try:
            return next((t for t, rec in await ledger.recent_turns(200) if rec.get("prompt") == prompt), None)
        finally:
            await ledger.aclose()

    turn = None

    def found() -> bool:
        nonlocal turn
        turn = asyncio.run(find())
        return turn is not None

    wait_for(found, f"a turn with prompt {prompt!r}")
    return turn


@pytest.fixture
def env(redis_server, tmp_path):
    workspace = tmp_path / "ws"  # the results (in tmp_path) must lie outside it
    workspace.mkdir()
    return {"REDIS_URL": redis_server.url, "TOOLQ_SIGNING_KEY": c.SIGNING_KEY, "TOOLQ_TOOLS": c.TEST_TOOLS,
            "TOOLQ_WORKSPACE": str(workspace), "OPENAI_API_KEY": "test"}


def test_twenty_turns_one_failing_one_cancelled_then_a_rerun_skips_the_finished(fleet, worker, env, tmp_path):
    worker(["faults"], concurrency=2)
    hang_ws = tmp_path / "hang-ws"
    hang_ws.mkdir()
    lines = [json.dumps({"prompt": f"echo {k}"}) for k in range(18)]  # with the next two: 20 turns
    lines.insert(5, json.dumps({"prompt": "please fail"}))
    lines.insert(9, json.dumps({"prompt": "hang here", "workspace": str(hang_ws), "instructions": "be slow"}))
    lines.insert(12, '{"promt": "a typo"}')  # a bad line: a result with an error, not a crash
    lines.insert(13, "")  # blank lines are not turns
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    script = {"by_prompt": {**{f"echo {k}": echo_turn(k) for k in range(18)},
                            "please fail": [[b.http_error(400, {"error": {"message": "bad request, on purpose",
                                                                          "type": "invalid_request_error"}})]],
                            "hang here": HANG}}
    with FakeModel(script) as fake:
        proc = toolq_process("batch", str(batch), "--concurrency", "6", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        wait_for(lambda: (hang_ws / "hang-call_hang.pid").exists(), "the hanging call to start")
        turn = turn_with_prompt(env["REDIS_URL"], "hang here")
        cancel = subprocess.run([sys.executable, "-m", "toolq.cli.main", "cancel", turn], cwd=c.ROOT,
                                capture_output=True, text=True, env={**os.environ, **env}, timeout=30)
        assert cancel.returncode == 0, cancel.stderr
        stdout, stderr = proc.communicate(timeout=120)
        first_requests = list(fake.requests)
    assert proc.returncode == 1, stderr
    got = results(out)
    assert len(got) == 21 and sorted(r["line"] for r in got) == sorted({*range(1, 23)} - {14}), got
    by_status = {s: [r for r in got if r["status"] == s] for s in ("completed", "failed", "cancelled", "invalid")}
    assert [len(by_status[s]) for s in by_status] == [18, 1, 1, 1], [(r["line"], r["status"]) for r in got]
    assert "bad request, on purpose" in by_status["failed"][0]["error"]
    assert by_status["cancelled"][0]["turn_id"] == turn
    assert by_status["invalid"][0]["line"] == 13 and "promt" in by_status["invalid"][0]["error"]
    for r in by_status["completed"]:
        assert r["final_message"].startswith("done ") and r["calls"] == 2 and r["failed_calls"] == 0, r
    assert by_status["cancelled"][0]["calls"] == 1 and by_status["cancelled"][0]["failed_calls"] == 1
    hang_bodies = [body for body in first_requests if body.get("instructions") == "be slow"]
    assert len(hang_bodies) == 1  # its own instructions; cancelled before a second request
    assert "21/21 turns" in stderr.splitlines()[-2] and "1 cancelled" in stderr, stderr  # plain progress: no TTY
    assert "18 completed, 1 failed, 1 cancelled, 1 invalid" in stderr

    # Again with the same --out: only the cancelled and the invalid lines run (the hang now finishes).
    (hang_ws / "hang-call_hang.pid").unlink()
    script["by_prompt"]["hang here"] = [[b.message("not hanging now")]]
    with FakeModel(script) as fake:
        proc = toolq_process("batch", str(batch), "--concurrency", "6", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        stdout, stderr = proc.communicate(timeout=120)
        assert len(fake.requests) == 1, [r["input"][0] for r in fake.requests]
    assert "19 of 21 turns already done" in stderr, stderr
    again = results(out)[21:]
    assert sorted((r["line"], r["status"]) for r in again) == [(10, "completed"), (13, "invalid")]
    assert again[0]["turn_id"] != turn or again[1]["turn_id"] != turn  # a new turn, not the cancelled one
    assert proc.returncode == 1  # the failed and the invalid line are still there


def test_sigterm_cancels_the_running_turns_and_starts_no_more(fleet, worker, env, tmp_path, redis_server):
    worker(["faults"], concurrency=2)
    workspaces = [tmp_path / f"ws{k}" for k in range(4)]
    for ws in workspaces:
        ws.mkdir()
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": f"hang {k}", "workspace": str(ws)}) + "\n"
                             for k, ws in enumerate(workspaces)))
    out = tmp_path / "results.jsonl"
    with FakeModel({"by_prompt": {"*": HANG}}) as fake:
        proc = toolq_process("batch", str(batch), "--concurrency", "2", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        pids = [ws / "hang-call_hang.pid" for ws in workspaces[:2]]
        wait_for(lambda: all(p.exists() and p.read_text() for p in pids), "both hanging calls to start")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert len(fake.requests) == 2
    assert proc.returncode == 130, stderr
    got = results(out)
    assert sorted((r["line"], r["status"]) for r in got) == [(1, "cancelled"), (2, "cancelled")], got
    for r in got:
        assert r["failed_calls"] == 1  # the hanging call got its aborted output

    async def states():
        ledger = Ledger.from_url(redis_server.url)
        try:
            return [(await ledger.turn(r["turn_id"]), await ledger.calls(r["turn_id"])) for r in got]
        finally:
            await ledger.aclose()

    for record, calls in asyncio.run(states()):
        assert record["state"] == "cancelled"
        assert [x["state"] for x in calls] == ["cancelled"]
    for p in pids:  # the commands were killed, not left to run out their 60 s
        pid = p.read_text()
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the hanging pool child's call to stop", 15)  # noqa: B023 - called here
    assert not (workspaces[2] / "hang-call_hang.pid").exists()
