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


def base_env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]  # the tests' tool modules (tests/conftest.py)
    return base


def toolq_process(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "toolq.cli.main", *args], cwd=c.ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**base_env(), **env})


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
    invalid = by_status["invalid"][0]
    assert invalid["line"] == 13 and invalid["error"] == "line 13: prompt: Field required", invalid
    assert invalid["promt"] == "a typo"  # an unknown field passes through, even on an invalid line
    for r in by_status["completed"]:
        assert r["final_message"].startswith("done ") and r["calls"] == 2 and r["failed_calls"] == 0, r
    assert by_status["cancelled"][0]["calls"] == 1 and by_status["cancelled"][0]["failed_calls"] == 1
    hang_bodies = [body for body in first_requests if body.get("instructions") == "be slow"]
    assert len(hang_bodies) == 1  # its own instructions; cancelled before a second request
    # Plain progress (no TTY): its last line counts every turn. Under load a log line (an honest
    # warning, such as a conversation lease that Redis dropped) may come after it.
    progress = [line for line in stderr.splitlines() if "/21 turns" in line]
    assert progress and "21/21 turns" in progress[-1] and "1 cancelled" in stderr, stderr
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
    rewritten = results(out)  # one line per key still: the re-run replaced two lines' results
    assert [r["line"] for r in rewritten] == sorted({*range(1, 23)} - {14}), rewritten
    assert [r for r in rewritten if r["line"] not in (10, 13)] == [r for r in got if r["line"] not in (10, 13)]
    again = [r for r in rewritten if r["line"] in (10, 13)]
    assert [(r["line"], r["status"]) for r in again] == [(10, "completed"), (13, "invalid")]
    assert again[0]["turn_id"] != turn  # a new turn, not the cancelled one
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


def patched_toolq(patch: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    """`toolq ARGS` as a real process, with `patch` run first: how a test makes a part of toolq
    misbehave as a library bug would, in the process a user runs (`python -c`: nothing imported
    from a test folder, which toolq would refuse as lying on its import path)."""
    code = f"import sys\n{patch}\nfrom toolq.cli.main import main\nsys.exit(main())\n"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=c.ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**base_env(), **env})


def one_call_turns(n: int, tmp_path: Path) -> Path:
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": f"p{k}", "id": f"task-{k}"}) + "\n" for k in range(n)))
    return batch


ONE_CALL = {"by_prompt": {"*": [[b.function_call("noop", {}, "call_1")], [b.message("done")]]}}


def assert_each_line_once(out: Path, n: int, status: str = "completed") -> list[dict]:
    got = results(out)
    assert sorted(r["line"] for r in got) == list(range(1, n + 1)), "a line without a result, or with two"
    assert {r["status"] for r in got} == {status}, [(r["line"], r["status"], r["error"]) for r in got if
                                                    r["status"] != status][:5]
    assert all(r["id"] == f"task-{r['line'] - 1}" for r in got)
    return got


@pytest.mark.timeout(1000)  # the suite's 120 s is too short for 1,024 turns on a loaded 2-core machine
def test_1024_one_call_turns_at_concurrency_256_each_get_exactly_one_result(fleet, env, tmp_path):
    """A user's 1,024 lines at 256 wrote 1,020 results, then hung for good: four lanes waited on
    a conversation lease's beat whose cancel redis-py had swallowed."""
    batch, out = one_call_turns(1024, tmp_path), tmp_path / "results.jsonl"
    with FakeModel(ONE_CALL) as fake:
        proc = toolq_process("batch", str(batch), "--concurrency", "256", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        try:
            _, stderr = proc.communicate(timeout=900)  # generous: a loaded 2-core machine; a hang is forever
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            pytest.fail(f"toolq batch never ended; {len(results(out))} results written; stderr ends {stderr[-500:]}")
        assert len(fake.requests) == 2048
    assert proc.returncode == 0, stderr[-2000:]
    got = assert_each_line_once(out, 1024)
    assert all(r["calls"] == 1 and r["final_message"] == "done" for r in got)
    assert "1024 completed, 0 failed" in stderr and "stuck" not in stderr and "Traceback" not in stderr


#: What redis-py on Python 3.11 does to the conversation lease's beat now and then: the first
#: cancel that reaches it is swallowed, and it goes on beating.
SWALLOWED_CANCEL = '''
import asyncio
import toolq.orchestrator.transport.conversation as conversation
async def _run(self):
    swallowed = False
    while True:
        try:
            await asyncio.sleep(conversation.CONVERSATION_BEAT)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
conversation.ConversationLease._run = _run
'''


def test_a_cancel_swallowed_while_a_lane_closes_its_session_does_not_hang_the_batch(fleet, env, tmp_path):
    batch, out = one_call_turns(4, tmp_path), tmp_path / "results.jsonl"
    with FakeModel(ONE_CALL) as fake:
        proc = patched_toolq(SWALLOWED_CANCEL, "batch", str(batch), "--concurrency", "2", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"toolq batch hung; {len(results(out)) if out.exists() else 0} results written")
    assert proc.returncode == 0, stderr
    assert_each_line_once(out, 4)


#: A turn's loop that hears no cancel at all, for the prompts that say "deaf".
DEAF_TURN = '''
import asyncio, json
from toolq.orchestrator.turn import Session
sample = Session._sample
async def _sample(self, body, *args):
    if "deaf" in json.dumps(body["input"]):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    return await sample(self, body, *args)
Session._sample = _sample
'''


def test_sigterm_ends_a_batch_whose_lane_hears_no_cancel_and_writes_each_running_line_once(
        fleet, worker, env, tmp_path, redis_server):
    worker(["faults"], concurrency=2)
    workspaces = [tmp_path / f"ws{k}" for k in range(5)]
    for ws in workspaces:
        ws.mkdir()
    prompts = ["hang 0", "hang 1", "deaf 2", "hang 3", "hang 4"]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p, "workspace": str(ws), "id": p}) + "\n"
                             for p, ws in zip(prompts, workspaces, strict=True)))
    out = tmp_path / "results.jsonl"
    with FakeModel({"by_prompt": {"*": HANG}}) as fake:
        proc = patched_toolq(DEAF_TURN, "batch", str(batch), "--concurrency", "3", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        pids = [ws / "hang-call_hang.pid" for ws in workspaces[:2]]
        wait_for(lambda: all(p.exists() and p.read_text() for p in pids), "both hanging calls to start", 60)
        deaf = turn_with_prompt(env["REDIS_URL"], "deaf 2")
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=60)  # STOP_GRACE (5 s) and the cleanup's bounds, with room
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("toolq batch did not end after SIGTERM")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    got = results(out)
    assert sorted((r["line"], r["status"]) for r in got) == [(1, "cancelled"), (2, "cancelled"), (3, "cancelled")], got
    stuck = next(r for r in got if r["line"] == 3)
    assert stuck["turn_id"] == deaf and stuck["id"] == "deaf 2"
    assert stuck["error"].startswith("turn cancelled by SIGTERM after ") and "its lane was stuck at " in stuck["error"]
    assert "in _sample" in stuck["error"], stuck  # where the deaf loop waits
    for p in pids:  # the other lanes cancelled their turns as `toolq run` does: the commands were killed
        pid = p.read_text()
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the hanging call to stop", 30)  # noqa: B023 - called here
    assert not (workspaces[3] / "hang-call_hang.pid").exists()


#: A turn that ends but whose lane then waits for ever (releasing its lease hears no cancel),
#: for the prompts that say "stuck"; the watchdog looks after 1 s instead of 30.
STUCK_AFTER_ITS_END = '''
import asyncio
import toolq.cli.batch
from toolq.orchestrator.turn import Session
toolq.cli.batch.STUCK_AFTER = 1.0
release = Session._release
async def _release(self, turn_id):
    if "stuck" in str(self.history.to_json()[0]):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    await release(self, turn_id)
Session._release = _release
'''


def test_the_watchdog_names_a_lane_stuck_after_its_turn_ended_once_and_the_batch_goes_on(fleet, env, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("fine 1", "stuck 2", "fine 3", "fine 4")))
    out = tmp_path / "results.jsonl"
    with FakeModel(ONE_CALL) as fake:
        proc = patched_toolq(STUCK_AFTER_ITS_END, "batch", str(batch), "--concurrency", "2", "--out", str(out),
                             env={**env, "OPENAI_BASE_URL": fake.base_url})
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("toolq batch hung on a lane stuck after its turn ended")
    assert proc.returncode == 0, stderr
    got = results(out)
    assert [(r["line"], r["status"]) for r in got] == [(k, "completed") for k in (1, 2, 3, 4)], got
    named = [line for line in stderr.splitlines() if "stuck at" in line]
    assert len(named) == 1, stderr
    assert named[0].startswith(f"toolq batch: line 2 ({got[1]['turn_id']}) ended ") and "_release" in named[0], named


def test_results_carry_the_line_s_own_fields_the_turn_s_figures_and_its_transcript_and_a_rerun_replaces_them(
        fleet, env, tmp_path):
    batch = tmp_path / "batch.jsonl"
    metadata = {"split": "dev", "tags": ["a", "b"], "weight": 2.5, "nested": {"ok": None}}
    batch.write_text(json.dumps({"prompt": "echo 0", "id": "a", "instance_id": "django-1", "metadata": metadata})
                     + "\n" + json.dumps({"prompt": "please fail", "id": "b"}) + "\n")
    out, transcripts = tmp_path / "results.jsonl", tmp_path / "transcripts"
    script = {"by_prompt": {"echo 0": echo_turn(0),
                            "please fail": [[b.http_error(400, {"error": {"message": "no, on purpose",
                                                                          "type": "invalid_request_error"}})]]}}
    args = ("batch", str(batch), "--out", str(out), "--model", "eval-model")
    with FakeModel(script) as fake:
        proc = toolq_process(*args, "--transcripts", str(transcripts), env={**env, "OPENAI_BASE_URL": fake.base_url})
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    done, failed = results(out)
    assert (done["id"], done["instance_id"], done["metadata"]) == ("a", "django-1", metadata)  # untouched
    assert (done["status"], done["prompt"], done["model"], done["final_message"]) == (
        "completed", "echo 0", "eval-model", "done 0")
    assert done["usage"]["total_tokens"] > 0 and isinstance(done["duration"], float) and done["duration"] >= 0
    assert done["workspace"] == env["TOOLQ_WORKSPACE"]
    assert Path(done["transcript"]) == transcripts / f"{done['turn_id']}.jsonl"
    items = [json.loads(line) for line in Path(done["transcript"]).read_text().splitlines()]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call", "function_call_output",
                                          "function_call_output", "message"], items
    assert items[0]["role"] == "user" and items[0]["content"][0]["text"] == "echo 0"
    assert (failed["id"], failed["status"], failed["prompt"]) == ("b", "failed", "please fail")
    assert "no, on purpose" in failed["error"]

    # Nothing left to run: the same exit as before, and one line naming the failed line.
    with FakeModel(script) as fake:
        proc = toolq_process(*args, env={**env, "OPENAI_BASE_URL": fake.base_url})
        _, stderr = proc.communicate(timeout=60)
        assert fake.requests == []
    assert proc.returncode == 1
    assert stderr.splitlines() == [f"toolq batch: all 2 turns already have a result in {out}; nothing to run; "
                                   "1 failed (line 2): --retry-failed runs them again"], stderr

    # --retry-failed runs line 2 again; its new result replaces the old one (one line per line).
    script["by_prompt"]["please fail"] = [[b.message("fine now")]]
    with FakeModel(script) as fake:
        proc = toolq_process(*args, "--retry-failed", env={**env, "OPENAI_BASE_URL": fake.base_url})
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    again = results(out)
    assert again[0] == done and len(again) == 2
    assert (again[1]["id"], again[1]["status"], again[1]["final_message"]) == ("b", "completed", "fine now")
    assert again[1]["turn_id"] != failed["turn_id"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".results.jsonl")]  # no temporary file left


def test_out_dash_writes_the_results_to_stdout_and_only_there(fleet, env, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": f"echo {k}", "id": k}) + "\n" for k in range(3)))
    with FakeModel({"by_prompt": {f"echo {k}": echo_turn(k) for k in range(3)}}) as fake:
        proc = toolq_process("batch", str(batch), "--out", "-", env={**env, "OPENAI_BASE_URL": fake.base_url})
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    got = [json.loads(line) for line in stdout.splitlines()]  # nothing but result lines
    assert sorted((r["id"], r["status"], r["final_message"]) for r in got) == [
        (k, "completed", f"done {k}") for k in range(3)]
    assert "3/3 turns" in stderr and "results in stdout" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.jsonl", "ws"]  # no results file anywhere


def test_a_transcripts_folder_in_the_workspace_and_a_link_at_out_are_refused_in_one_line(env, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "hi"}) + "\n")
    workspace = Path(env["TOOLQ_WORKSPACE"])
    inside = toolq_process("batch", str(batch), "--out", str(tmp_path / "r.jsonl"), "--transcripts",
                           str(workspace / "t"), env=env)
    (tmp_path / "target").write_text("")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "target")  # what a model's command could plant
    link = toolq_process("batch", str(batch), "--out", str(tmp_path / "link.jsonl"), env=env)
    for proc, said in ((inside, f"--transcripts {workspace / 't'} is inside the workspace {workspace}"),
                       (link, f"--out {tmp_path / 'link.jsonl'} is a symbolic link")):
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2 and len(stderr.splitlines()) == 1 and said in stderr, stderr
    assert not (workspace / "t").exists() and (tmp_path / "target").read_text() == ""
