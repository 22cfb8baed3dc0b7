"""Environments on real workers (issue 28): a folder uploaded to a worker host, a turn's changes as
its diff, a host SIGKILLed between two turns and the conversation going on on the other host from
its checkpoint, and a fork whose environments never see each other's writes.

Two hosts are simulated by two workers with their own `TOOLQ_HOST_ID` and `TOOLQ_ENV_ROOT`, on a
Redis of this module's own (so no other test's worker is a host placement could choose).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.conftest import SIGNING_KEY, TEST_TOOLS, WORKER_ENV, catalog_of, settings_for
from toolq.core.environments import host_key
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.turn import Runtime, Session

pytestmark = pytest.mark.integration

HOSTS = ("env-a", "env-b")


@pytest.fixture
def hosts(redis_env, worker, tmp_path):
    """Two worker hosts on this module's Redis: host id -> its worker. At the end, whatever a
    killed host left mounted under the test's folder (its base cache, an overlay) is unmounted."""
    started = {h: worker(["toolq"], concurrency=2, redis_url=redis_env.url, name=f"{h}@test",
                         env={"TOOLQ_HOST_ID": h, "TOOLQ_ENV_ROOT": str(tmp_path / f"root-{h}")}) for h in HOSTS}
    yield started
    for w in started.values():  # stopped before their mounts go (the `worker` fixture's stop is then a no-op)
        w.stop(grace=3)
    unmount_under(tmp_path)


def unmount_under(top: Path) -> None:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(f"{top}/")), reverse=True):  # deepest first
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def exec_call(call_id: str, cmd: str):
    return b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 5000}, call_id)


def output_of(body: dict, call_id: str) -> str:
    (out,) = [i["output"] for i in body["input"] if i.get("type") == "function_call_output"
              and i.get("call_id") == call_id]
    return out if isinstance(out, str) else json.dumps(out)


def uploaded(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello from the upload\n")
    return folder


async def wait_hosts(runtime: Runtime, n: int) -> None:
    """Until `n` hosts advertise environments (a worker's agent starts at `worker_ready`)."""
    end = time.monotonic() + 60
    while len(await runtime.fleet.environments.hosts()) < n:
        assert time.monotonic() < end, "the hosts never advertised environments (60 s)"
        await asyncio.sleep(0.2)


async def wait_gone(runtime: Runtime, host: str) -> None:
    """Until the killed host's advert and its worker's catalog record have expired."""
    r, end = runtime.fleet.ledger.r, time.monotonic() + 60
    while await r.exists(host_key(host)) or any(
            w.env_host == host for w in await runtime.fleet.dispatcher.fleet.workers()):
        assert time.monotonic() < end, f"host {host} still advertised 60 s after its worker was killed"
        await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def runtime_on_hosts(redis_env, fake: FakeModel, tmp_path: Path) -> AsyncIterator[Runtime]:
    """A Runtime on this module's Redis, once both hosts advertise environments; closed after."""
    settings = settings_for(redis_env.url, fake, tmp_path / "unused", tools=[TEST_TOOLS])
    runtime = await Runtime.create(settings, catalog=catalog_of([TEST_TOOLS]))
    try:
        await wait_hosts(runtime, 2)
        yield runtime
    finally:
        await runtime.aclose()


@contextlib.asynccontextmanager
async def session_on_hosts(redis_env, fake: FakeModel, tmp_path: Path,
                           folder: Path) -> AsyncIterator[tuple[Runtime, Session]]:
    """A Session with `folder` uploaded, on a runtime as `runtime_on_hosts` makes; both closed after."""
    async with runtime_on_hosts(redis_env, fake, tmp_path) as runtime:
        session = Session(runtime, upload=folder)
        try:
            yield runtime, session
        finally:
            await session.close()


def test_an_uploaded_folder_is_read_and_changed_on_a_worker_host_and_the_outcome_carries_the_diff(
        redis_env, hosts, tmp_path):
    """The command reads an uploaded file and writes one; the turn's diff names both, and the user's
    folder is untouched (the environment lives on the host)."""
    folder = uploaded(tmp_path)
    script = [[exec_call("c1", "cat notes.txt && echo 'edited on the host' >> notes.txt && echo new > made.txt")],
              [b.message("done")]]

    async def go():
        with FakeModel(script) as fake:
            async with session_on_hosts(redis_env, fake, tmp_path, folder) as (runtime, session):
                events: list = []
                outcome = await session.run_turn("go", lambda e: events.append(e.to_json()))
                record = await runtime.fleet.environments.record(session.environment.id)
                return outcome, fake.requests, events, record

    outcome, requests, events, record = asyncio.run(asyncio.wait_for(go(), 120))
    assert outcome.status == "completed", outcome.error
    assert "hello from the upload" in output_of(requests[1], "c1")
    assert outcome.environment == record.id and record.host in HOSTS and record.state == "ready"
    diff = outcome.diff
    assert diff is not None and diff.checkpoint == record.checkpoint
    assert "b/notes.txt" in diff.patch and "+edited on the host" in diff.patch
    assert "b/made.txt" in diff.patch and "+new" in diff.patch
    completed = [e for e in events if e["type"] == "turn.completed"][-1]
    assert completed["environment"] == record.id and completed["checkpoint"] == diff.checkpoint
    assert "made.txt" in completed["diff"]["patch"]
    assert (folder / "notes.txt").read_text() == "hello from the upload\n" and not (folder / "made.txt").exists()
    for body in requests:
        assert pairing_problems(body["input"]) == []


def test_a_host_killed_between_two_turns_the_next_goes_on_on_the_other_host_from_the_checkpoint(
        redis_env, hosts, tmp_path):
    folder = uploaded(tmp_path)
    script = {"by_prompt": {
        "first": [[exec_call("c1", "echo 'turn one' > one.txt")], [b.message("wrote")]],
        "second": [[exec_call("c2", "cat one.txt notes.txt")], [b.message("read")]],
    }}

    async def go():
        with FakeModel(script) as fake:
            async with session_on_hosts(redis_env, fake, tmp_path, folder) as (runtime, session):
                first = await session.run_turn("first")
                assert first.status == "completed", first.error
                doomed = session.environment.host
                hosts[doomed].kill()  # SIGKILL: the machine dies, its environment with it
                await wait_gone(runtime, doomed)
                # A call still routed to the dead host is answered not run, naming it (never left queued).
                (stale,) = await runtime.fleet.run_calls(
                    [{"type": "function_call", "call_id": "stale", "name": "exec_command",
                      "arguments": json.dumps({"cmd": "true"})}], environment=session.environment.model_copy())
                second = await session.run_turn("second")
                return first, second, doomed, session.environment, fake.requests, stale["output"]

    first, second, doomed, env, requests, stale = asyncio.run(asyncio.wait_for(go(), 180))
    assert stale.startswith("exec_command was not run: ") and f"host `{doomed}`" in stale
    assert second.status == "completed", second.error
    assert env.host != doomed and env.host in HOSTS
    out = output_of(requests[-1], "c2")
    assert "turn one" in out and "hello from the upload" in out  # the checkpoint's files and the upload's
    notes = [i for i in requests[-2]["input"] if i.get("type") == "message" and i.get("role") == "developer"]
    assert len(notes) == 1 and re.search(r"lost.*running.*checkpoint", json.dumps(notes[0]), re.S)
    assert first.diff is not None and env.start == first.diff.checkpoint
    for body in requests:
        assert pairing_problems(body["input"]) == []


def test_fork_gives_environments_with_the_checkpoints_files_that_never_see_each_others_writes(
        redis_env, hosts, tmp_path):
    folder = uploaded(tmp_path)

    def call(call_id: str, cmd: str) -> dict:
        return {"type": "function_call", "call_id": call_id, "name": "exec_command",
                "arguments": json.dumps({"cmd": cmd, "yield_time_ms": 5000})}

    async def go():
        with FakeModel([]) as fake:  # no model here: the calls are run as an own agent loop would
            async with runtime_on_hosts(redis_env, fake, tmp_path) as runtime:
                fleet = runtime.fleet
                async with fleet.environment(upload=folder) as env:
                    await fleet.run_calls([call("seed", "echo seeded > seed.txt")], environment=env)
                    forks = await env.fork(4)
                    try:
                        assert len({f.id for f in forks}) == 4 and len({f.record.host for f in forks}) == 1
                        await asyncio.gather(*(fleet.run_calls([call(f"w{i}", f"echo {i} > fork{i}.txt")],
                                                               environment=f) for i, f in enumerate(forks)))
                        seen = [await fleet.run_calls([call(f"ls{i}", "ls; cat seed.txt")], environment=f)
                                for i, f in enumerate(forks)]
                    finally:
                        await asyncio.gather(*(f.destroy() for f in forks))
                    records = {r.id: r.state for r in await fleet.environments.records()}
                return seen, [f.id for f in forks], records

    seen, ids, records = asyncio.run(asyncio.wait_for(go(), 180))
    for i, (out,) in enumerate(seen):
        text = out["output"]
        assert "seeded" in text and "notes.txt" in text and f"fork{i}.txt" in text
        assert [f"fork{j}.txt" for j in range(4) if j != i and f"fork{j}.txt" in text] == []
    assert all(records[i] == "destroyed" for i in ids)


def test_a_host_killed_mid_turn_the_next_request_runs_on_the_other_host_from_the_last_checkpoint(
        redis_env, hosts, tmp_path):
    """Between two model requests of one turn: the calls after the kill run on the other host, in
    the environment as the last checkpoint left it (the write since is lost, and the model told)."""
    folder = uploaded(tmp_path)
    script = {"by_prompt": {
        "first": [[exec_call("c1", "echo kept > kept.txt")], [b.message("wrote")]],
        # the call runs while the response is held; the host dies before the next request
        "second": [b.response(exec_call("c2", "echo lost > lost.txt"), gate=True),
                   [exec_call("c3", "ls")], [b.message("listed")]],
    }}

    async def go():
        with FakeModel(script) as fake:
            async with session_on_hosts(redis_env, fake, tmp_path, folder) as (runtime, session):
                assert (await session.run_turn("first")).status == "completed"
                doomed = session.environment.host
                events: list = []
                turn = asyncio.create_task(session.run_turn("second", lambda e: events.append(e.to_json())))
                end = time.monotonic() + 60
                while not any(e["type"] == "item.completed" and e["item"].get("id") == "c2" for e in events):
                    assert time.monotonic() < end and not turn.done(), "c2 never completed"
                    await asyncio.sleep(0.1)
                hosts[doomed].kill()
                await wait_gone(runtime, doomed)
                fake.release()
                second = await turn
                return second, doomed, session.environment, fake.requests

    second, doomed, env, requests = asyncio.run(asyncio.wait_for(go(), 180))
    assert second.status == "completed", second.error
    assert env.host != doomed
    listing = output_of(requests[-1], "c3")
    assert "kept.txt" in listing and "notes.txt" in listing and "lost.txt" not in listing
    notes = [i for i in requests[-2]["input"] if i.get("role") == "developer"]
    assert len(notes) == 1 and doomed in json.dumps(notes[0])
    for body in requests:
        assert pairing_problems(body["input"]) == []


def test_a_resumed_turn_takes_its_environment_up_from_the_last_checkpoint(redis_env, hosts, tmp_path):
    """`toolq run --upload` SIGKILLed mid-turn: its environment ends with its owner, and `toolq
    resume` goes on in a new one made from the last checkpoint, the model told."""
    folder = uploaded(tmp_path)
    script = {"by_prompt": {"go": [[exec_call("c1", "echo started; sleep 4; echo finished")],
                                   [exec_call("c2", "cat notes.txt")], [b.message("all done")]]}}
    with FakeModel(script) as fake:
        env = {**os.environ, "REDIS_URL": redis_env.url, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test",
               "TOOLQ_SIGNING_KEY": SIGNING_KEY, "TOOLQ_TURN_LEASE": "5",
               "PYTHONPATH": WORKER_ENV["PYTHONPATH"]}
        cli = [sys.executable, "-m", "toolq.cli.main"]
        proc = subprocess.Popen([*cli, "run", "--json", "--upload", str(folder), "go"], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True)
        try:
            turn_id = json.loads(proc.stdout.readline())["turn_id"]
            end = time.monotonic() + 60
            while not fake.requests:
                assert time.monotonic() < end, "the run never asked the model"
                time.sleep(0.1)
            time.sleep(1)  # the call is on its way or running
        finally:
            proc.send_signal(signal.SIGKILL)  # no handler runs: only Redis knows the turn now
            proc.wait(10)
            proc.stdout.close()
        end = time.monotonic() + 60
        while True:
            resumed = subprocess.run([*cli, "resume", turn_id, "--json"], env=env, cwd=tmp_path,
                                     capture_output=True, text=True, timeout=120)
            if "another orchestrator" not in resumed.stderr or time.monotonic() > end:
                break
            time.sleep(1)  # the dead run's lease has not lapsed yet
        assert resumed.returncode == 0, resumed.stderr
        events = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
        requests = fake.requests
    completed = events[-1]
    assert completed["type"] == "turn.completed" and completed["environment"], events[-3:]
    assert "hello from the upload" in output_of(requests[-1], "c2")
    notes = [i for i in requests[-1]["input"] if i.get("role") == "developer"]
    assert len(notes) == 1 and "orchestrator driving this turn stopped" in json.dumps(notes[0])
    for body in requests:
        assert pairing_problems(body["input"]) == []
