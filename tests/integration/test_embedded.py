"""The embedded default as a user meets it: a real `toolq run` with no REDIS_URL, its private
server and real workers, the fake model over TCP, and other `toolq` processes in "another shell".

Issue 12 item 3 (the server is its owner's only), issue 10 items 12 (nothing piles up) and 13
(cancel, status and turns find the running stack).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests import markers
from tests.integration.conftest import ROOT
from tests.integration.test_cancel import pids_matching
from toolq.cli.cancel import UnknownTarget, cancel
from toolq.cli.status import status_cmd, turns_cmd
from toolq.core import keys
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local import runtime_dir
from toolq.local.embedded import RedisServer
from toolq.orchestrator.transport.ledger import Ledger

pytestmark = pytest.mark.integration


def test_the_private_server_refuses_a_client_without_its_password():
    with RedisServer() as server:
        assert redis.Redis.from_url(server.url).ping()
        for password in (None, "guess", server.password[:-1]):
            with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
                redis.Redis(port=server.port, password=password, socket_timeout=2).set("owned", "1")
        assert len(server.password) >= 32
        # ps shows every user each process's command line: the password is not on it
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline
        conf = server.dir / "redis.conf"
        assert conf.stat().st_mode & 0o777 == 0o600 and server.dir.stat().st_mode & 0o777 == 0o700


class Shell:
    """The environment of one user's shells: no REDIS_URL, a private runtime dir and TMPDIR."""

    def __init__(self, tmp_path: Path, fake: FakeModel) -> None:
        self.xdg = tmp_path / "xdg"
        self.tmp = tmp_path / "tmp"
        self.workspace = tmp_path / "ws"
        for d in (self.xdg, self.tmp, self.workspace):
            d.mkdir(mode=0o700)
        self.env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
        self.env.update(XDG_RUNTIME_DIR=str(self.xdg), TMPDIR=str(self.tmp), OPENAI_BASE_URL=fake.base_url,
                        OPENAI_API_KEY="test", TOOLQ_REQUEST_MAX_RETRIES="0", TOOLQ_STREAM_MAX_RETRIES="0",
                        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "toolq.cli.main", *args]

    def toolq(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=60)

    def start_run(self, prompt: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv("run", "--json", "--workspace", str(self.workspace), prompt), env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def leftovers(self) -> list[str]:
        return sorted(os.listdir(self.tmp)) + sorted(os.listdir(self.xdg / "toolq"))


def read_events_until(proc: subprocess.Popen, predicate, timeout: float = 90) -> list[dict]:
    events, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"toolq run ended early: {proc.wait()} {proc.stderr.read()[-2000:]}")
        events.append(json.loads(line))
        if predicate(events[-1]):
            return events
    pytest.fail("timed out reading toolq run's events")


def test_cancel_status_and_turns_find_a_running_embedded_run_from_another_shell(tmp_path):
    marker = f"sleep 120.{markers.PROCESS}7"
    script = [[b.function_call("exec_command", {"cmd": marker}, "call_long")], [b.message("after the cancel")]]
    with FakeModel(script) as fake:
        shell = Shell(tmp_path, fake)
        run = shell.start_run("sleep a long time")
        try:
            events = read_events_until(run, lambda e: e["type"] == "item.started")
            turn_id = events[0]["turn_id"]
            deadline = time.monotonic() + 30
            while not pids_matching(marker):
                assert time.monotonic() < deadline, "the long call never started"
                time.sleep(0.05)

            turns = shell.toolq("turns", "--json")
            assert turns.returncode == 0, turns.stderr
            (row,) = [json.loads(line) for line in turns.stdout.splitlines()]
            assert (row["turn_id"], row["state"]) == (turn_id, "running")
            status = shell.toolq("status", turn_id)
            assert status.returncode == 0 and "exec_command" in status.stdout, status.stderr

            started = time.monotonic()
            cancel = shell.toolq("cancel", turn_id)
            assert cancel.returncode == 0, cancel.stderr
            assert f"cancelled turn {turn_id}" in cancel.stdout
            rest, err = run.communicate(timeout=60)
            cancelled_in = time.monotonic() - started
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    final = json.loads(rest.splitlines()[-1])
    assert (final["type"], final["turn_id"]) == ("turn.aborted", turn_id)
    assert len(fake.requests) == 1  # the model was not asked again after the cancel
    assert cancelled_in < 30
    assert not pids_matching(marker), "the cancelled command is still running"
    # a cancel is not a failure: the logs went with the stack, and so did its announcement
    assert shell.leftovers() == [], err
    gone = shell.toolq("turns")
    assert gone.returncode == 2 and "no embedded `toolq run` of yours is running" in gone.stderr


def test_a_run_leaves_nothing_behind_and_a_failed_run_keeps_its_logs_and_says_where(tmp_path):
    with FakeModel([[b.message("all done")], b.http_error(400, {"error": {"message": "bad request"}})]) as fake:
        shell = Shell(tmp_path, fake)
        ok = shell.toolq("run", "--workspace", str(shell.workspace), "hello")
        assert ok.returncode == 0, ok.stderr
        assert shell.leftovers() == []
        assert "logs are kept" not in ok.stderr

        failed = shell.toolq("run", "--workspace", str(shell.workspace), "hello again")
    assert failed.returncode != 0
    (line,) = [x for x in failed.stderr.splitlines() if "logs are kept in" in x]
    kept = Path(line.rsplit(" ", 1)[1])
    assert kept.parent == shell.tmp and kept.is_dir()
    assert sorted(p.name for p in kept.glob("embedded*.log")) and (kept / "redis").is_dir()
    assert os.listdir(shell.xdg / "toolq") == []  # the stack stopped: no longer announced


def test_a_killed_run_takes_its_embedded_stack_with_it(tmp_path):
    """SIGKILL leaves no handler to run: the server and the workers die by their parent-death signal."""
    marker = f"sleep 120.{markers.PROCESS}9"
    with FakeModel([[b.function_call("exec_command", {"cmd": marker}, "call_long")], [b.message("x")]]) as fake:
        shell = Shell(tmp_path, fake)
        run = shell.start_run("sleep a long time")
        try:
            read_events_until(run, lambda e: e["type"] == "item.started")
            (entry,) = [json.loads(p.read_text()) for p in (shell.xdg / "toolq").glob("stack-*.json")]
            port = entry["redis_url"].rsplit(":", 1)[1].split("/")[0]
            # redis-server's title; the workers' --name (their pool processes too). The call's own
            # command is the sandbox's to stop (it dies with its pool process under bubblewrap).
            stack = [f"127.0.0.1:{port}", f"-{port}@"]
            deadline = time.monotonic() + 30
            while not (all(pids_matching(m) for m in stack) and pids_matching(marker)):
                assert time.monotonic() < deadline, "the stack or its call never showed up"
                time.sleep(0.05)
            run.kill()
            run.wait(5)
        finally:
            if run.poll() is None:
                run.kill()
        deadline = time.monotonic() + 2
        while any(pids_matching(m) for m in stack) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {m: pids_matching(m) for m in stack}
        for pid in pids_matching(marker):  # not this test's subject (see above): just clean up
            os.kill(pid, signal.SIGKILL)
        assert not any(left.values()), f"still running 2 s after the SIGKILL: {left}"
        # its announcement is stale now: dropped by the next reader
        gone = shell.toolq("turns")
        assert gone.returncode == 2 and list((shell.xdg / "toolq").iterdir()) == []


def test_with_two_running_stacks_each_command_finds_the_one_that_holds_the_turn(tmp_path, monkeypatch):
    """Two embedded runs of one user: `turns` lists both, `status` and `cancel` act on the right one."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with RedisServer() as first, RedisServer() as second:
        entries = [runtime_dir.register(s.url, tmp_path) for s in (first, second)]

        async def start(server: RedisServer, turn_id: str) -> None:
            ledger = Ledger.from_url(server.url)
            await ledger.start_turn(turn_id, f"prompt of {turn_id}", str(tmp_path))
            await ledger.aclose()

        asyncio.run(start(first, "turn-first"))
        asyncio.run(start(second, "turn-second"))
        settings = Settings()  # no REDIS_URL

        out = io.StringIO()
        assert turns_cmd(settings, as_json=True, out=out) == 0
        assert [json.loads(line)["turn_id"] for line in out.getvalue().splitlines()] == ["turn-second", "turn-first"]
        out = io.StringIO()
        assert status_cmd(settings, "turn-first", out=out) == 0 and "turn turn-first  running" in out.getvalue()
        err = io.StringIO()
        assert status_cmd(settings, "turn-nowhere", err=err) == 1 and "2 running embedded stack(s)" in err.getvalue()

        report = asyncio.run(cancel(settings, "turn-second"))
        assert report.turn_id == "turn-second"
        assert redis.Redis.from_url(second.url).exists(keys.cancel_turn("turn-second"))
        assert not redis.Redis.from_url(first.url).exists(keys.cancel_turn("turn-second"))
        with pytest.raises(UnknownTarget, match="no turn turn-nowhere in your running embedded"):
            asyncio.run(cancel(settings, "turn-nowhere"))

        first.stop()  # a run whose server died while the run lives on: skipped, the other still counts
        out = io.StringIO()
        assert turns_cmd(settings, as_json=True, out=out) == 0
        assert [json.loads(line)["turn_id"] for line in out.getvalue().splitlines()] == ["turn-second"]
        assert asyncio.run(cancel(settings, "turn-second")).turn_id == "turn-second"
        for entry in entries:
            runtime_dir.unregister(entry)


def test_the_first_request_goes_out_while_the_embedded_workers_boot(tmp_path):
    """Issue 14 item 6: the first model request needs no worker, so it does not wait for them; the
    first tool call does, and gets its real output once they are up, with one line saying what it
    waits for."""
    script = [[b.function_call("exec_command", {"cmd": "echo real output"}, "call_1")], [b.message("done")]]
    with FakeModel(script) as fake:
        shell = Shell(tmp_path, fake)
        booted = tmp_path / "booted"
        shell.env.update(TOOLQ_TEST_WORKER_BOOT_DELAY="3", TOOLQ_TEST_WORKER_BOOT_MARK=str(booted))
        run = shell.toolq("run", "--workspace", str(shell.workspace), "--tools", "tests.integration.slow_boot_tools",
                          "go")
    assert run.returncode == 0, run.stderr
    ready = [float(t) for t in booted.read_text().split()]
    assert len(ready) == 2 and fake.request_times[0] < min(ready), "the first request waited for the workers"
    (output,) = [i["output"] for i in fake.requests[1]["input"] if i["type"] == "function_call_output"]
    assert "Process exited with code 0" in output and "real output" in output
    assert "waiting for a worker to serve exec_command (embedded workers starting)" in run.stderr
    assert shell.leftovers() == []
