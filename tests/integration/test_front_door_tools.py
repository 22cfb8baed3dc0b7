"""The front doors' tools on real workers (issue 29): `process_start`, `process_write`,
`process_terminate` and `fs`, called through `Fleet.run_calls` as `toolq exec-server` calls them
(one conversation, one turn), on a bubblewrap worker as root and as an unprivileged user, and on
a Landlock worker.

A process's events are read back from its Redis stream and checked as a front door checks them
(signed, numbered 1, 2, ... with no gap): `started` first, every output byte, then `exit`.
`fs` gets the hostile workspace: a symlink pointing out, `..`, `.git`, a FIFO, a huge file.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

import tests.integration.conftest as c
from tests.integration import unprivileged
from tests.integration.test_cancel import pids_matching, wait_until
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.core.front_doors import PROCESS_STREAM_BYTES, STREAM_CAP_NOTE, ProcessEvent, open_event, process_stream_key
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.dev.fake_model import builders as b
from toolq.orchestrator.fleet import Fleet
from toolq.orchestrator.transport.conversation import ConversationLease, new_conversation_id

pytestmark = pytest.mark.integration

SIGNER = Signer(c.SIGNING_KEY)
#: How long a test waits for an event it expects (a bound on a hang, not a timing assertion).
WAIT = 60.0


@pytest.fixture(scope="module", params=["bwrap-root", "bwrap-nobody", "landlock-root"])
def door_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    backend, user = request.param.split("-")
    yield from hostile_workers(backend, locked_redis, tmp_path_factory, user=user == "nobody",
                               TOOLQ_SANDBOX_CPU_SECONDS="30", TOOLQ_SANDBOX_FILE_MB="16")


class Door:
    """One front-door client session: a fleet, a conversation it holds, and one turn."""

    def __init__(self, worker: Any, workspace: Path) -> None:
        self.worker, self.workspace = worker, workspace
        self.turn = f"turn-{uuid.uuid4().hex[:12]}"
        self.r = redis.Redis.from_url(worker.redis.url)
        self.calls = 0

    async def __aenter__(self) -> Door:
        self.fleet = await Fleet.open(Settings(redis_url=self.worker.redis.url, workspace=self.workspace,
                                               tools=[c.TEST_TOOLS], signing_key=c.SIGNING_KEY))
        self.lease = ConversationLease(self.fleet.ledger.r, new_conversation_id())
        await self.lease.hold()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.lease.release()
        await self.fleet.aclose()
        self.r.close()

    async def call(self, name: str, args: dict[str, Any]) -> str:
        self.calls += 1
        item = b.function_call(name, args, f"call_{self.calls}")
        [out] = await self.fleet.run_calls([item], turn_id=self.turn, conversation=self.lease.id)
        return out["output"]

    async def start(self, key: str, argv: list[str], **kw: Any) -> dict[str, Any]:
        text = await self.call("process_start", {"argv": argv, "stream_key": self.key(key), **kw})
        return json.loads(text)

    def key(self, name: str) -> str:
        return process_stream_key(self.turn, name)

    def events(self, name: str) -> list[ProcessEvent]:
        """The stream's events, each checked genuine and numbered in order without a gap."""
        key = self.key(name)
        events = []
        for _, fields in self.r.xrange(key):
            event = open_event(SIGNER, key, fields)
            assert event is not None, f"a forged or malformed entry in {key}: {fields}"
            events.append(event)
        assert [e.n for e in events] == list(range(1, len(events) + 1))
        return events

    async def until(self, name: str, predicate: Any) -> list[ProcessEvent]:
        for _ in range(int(WAIT / 0.05)):
            events = self.events(name)
            if predicate(events):
                return events
            await asyncio.sleep(0.05)
        raise AssertionError(f"{name}: never got what was waited for; events: {self.events(name)}")

    async def fs(self, op: str, path: str, **kw: Any) -> dict[str, Any]:
        return json.loads(await self.call("fs", {"op": op, "path": path, **kw}))


def output(events: list[ProcessEvent], stream: str | None = None) -> bytes:
    return b"".join(base64.b64decode(e.data or "") for e in events
                    if e.kind == "output" and (stream is None or e.stream == stream))


def session_of(events: list[ProcessEvent]) -> int | None:
    return events[0].session_id if events and events[0].kind == "started" else None


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_events_come_started_output_exit_in_order_with_every_byte_and_stdin_closed(door_worker, tmp_path):
    ws = door_worker.workspace(tmp_path)

    async def scenario() -> None:
        async with Door(door_worker, ws) as door:
            results = await asyncio.gather(
                door.start("both", ["bash", "-c", "echo out; echo err >&2; exit 3"]),
                door.start("big", ["bash", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo end"]),
                door.start("stdin", ["bash", "-c", 'read line; echo "read=$? [$line]"']),
                door.start("argv", ["printf", "%s|", "a b", "$HOME"], env={"FD_MARK": "marked"}),
                door.start("env", ["sh", "-c", 'echo "$FD_MARK $HOME ${TOOLQ_SIGNING_KEY:-none}"'], env={"FD_MARK": "marked", "HOME": "/x", "-S": "x", "A=B": "c", "TOOLQ_SIGNING_KEY": "k"},
                           workdir="sub"),
                door.start("killed", ["bash", "-c", "kill -9 $$"]),
            )
            both = door.events("both")
            assert [e.kind for e in both][0] == "started" and both[-1].kind == "exit"
            assert {e.kind for e in both[1:-1]} == {"output"}
            assert both[0].session_id == results[0]["session_id"] and both[0].instance
            assert (output(both, "stdout"), output(both, "stderr")) == (b"out\n", b"err\n")
            assert both[-1].exit_code == 3 == results[0]["exit_code"]
            big = door.events("big")
            assert output(big) == b"x" * 3_000_000 + b"\nend\n"
            assert big[-1].exit_code == 0
            assert output(door.events("stdin")) == b"read=1 []\n"  # stdin is closed: EOF at once
            assert output(door.events("argv")) == b"a b|$HOME|"
            mark, home, key = output(door.events("env")).split()
            assert (mark, key) == (b"marked", b"none") and home != b"/x"  # HOME is the sandbox's; no fleet name
            assert results[5]["exit_code"] == 137 == door.events("killed")[-1].exit_code
            sessions = [r["session_id"] for r in results]
            assert len(set(sessions)) == len(sessions)
            text = await door.call("process_start", {"argv": ["true"], "workdir": "nope", "stream_key": door.key("bad")})
            assert text.startswith("process_start failed: workdir nope: ") and "(os error 2)" in text, text
            assert door.events("bad") == []
            assert (await door.start("missing", ["no-such-program-x"]))["exit_code"] == 127  # as Codex's: bash says so
            assert b"no-such-program-x" in output(door.events("missing"), "stderr")

    (ws / "sub").mkdir()
    if door_worker.user:
        os.chown(ws / "sub", *unprivileged.ids())
    run(scenario())


def test_output_past_16_mib_is_read_and_dropped_after_one_note_and_the_process_runs_on(door_worker, tmp_path):
    async def scenario() -> None:
        async with Door(door_worker, door_worker.workspace(tmp_path)) as door:
            result = await door.start("flood", ["bash", "-c", "head -c 18000000 /dev/zero; echo done >&2; exit 4"])
            events = door.events("flood")
            assert result["exit_code"] == 4 == events[-1].exit_code  # it ran to its end, never throttled dead
            assert output(events, "stdout") == bytes(PROCESS_STREAM_BYTES)
            assert output(events, "stderr") == STREAM_CAP_NOTE.encode()  # the note, then nothing (not "done")

    run(scenario())


def test_a_tty_takes_writes_a_pipe_takes_writes_and_terminate_kills_with_137(door_worker, tmp_path):
    ws = door_worker.workspace(tmp_path)

    async def scenario() -> None:
        async with Door(door_worker, ws) as door:
            python = asyncio.create_task(door.start("py", ["/bin/bash", "-lc", "python3 -i -q"], tty=True))
            events = await door.until("py", lambda ev: b">>>" in output(ev))
            session = session_of(events)
            assert session is not None and {e.stream for e in events if e.kind == "output"} == {"pty"}
            data = base64.b64encode(b"print(6 * 7)\n").decode()
            assert json.loads(await door.call("process_write", {"session_id": session, "data": data})) == {
                "status": "accepted"}
            await door.until("py", lambda ev: b"42" in output(ev))
            exit_ = base64.b64encode(b"exit()\n").decode()
            await door.call("process_write", {"session_id": session, "data": exit_})
            assert (await python)["exit_code"] == 0

            cat = asyncio.create_task(door.start("cat", ["cat"], pipe_stdin=True))
            session = session_of(await door.until("cat", lambda ev: bool(ev)))
            hello = base64.b64encode(b"hello\n").decode()
            assert json.loads(await door.call("process_write", {"session_id": session, "data": hello})) == {
                "status": "accepted"}
            await door.until("cat", lambda ev: output(ev) == b"hello\n")
            assert json.loads(await door.call("process_terminate", {"session_id": session})) == {"running": True}
            assert (await cat)["exit_code"] == 137
            assert door.events("cat")[-1].exit_code == 137
            assert json.loads(await door.call("process_terminate", {"session_id": session})) == {"running": False}
            assert json.loads(await door.call("process_write", {"session_id": session, "data": hello})) == {
                "status": "unknownProcess"}

            sleeper = asyncio.create_task(door.start("sleep", ["sleep", "60"]))
            session = session_of(await door.until("sleep", lambda ev: bool(ev)))
            assert json.loads(await door.call("process_write", {"session_id": session, "data": hello})) == {
                "status": "stdinClosed"}
            assert json.loads(await door.call("process_terminate", {"session_id": session})) == {"running": True}
            assert (await sleeper)["exit_code"] == 137

    run(scenario())


def test_toolq_cancel_of_the_turn_kills_the_process_and_ends_its_call(door_worker, tmp_path):
    marker = f"fdcancel-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with Door(door_worker, door_worker.workspace(tmp_path)) as door:
            started = asyncio.create_task(door.call("process_start", {
                "argv": ["bash", "-c", f"exec -a {marker} sleep 300"], "stream_key": door.key("long")}))
            await door.until("long", lambda ev: bool(ev))
            await wait_until(lambda: bool(pids_matching(marker)), WAIT, "the process to run")
            await door.fleet.ledger.cancel_turn(door.turn)
            text = await started
            assert "exit_code" not in text  # the call's aborted output, never a made-up exit
            await wait_until(lambda: not pids_matching(marker), WAIT, "the process to be killed")
            assert [e.kind for e in door.events("long")] == ["started"]

    run(scenario())


def test_fs_works_in_the_workspace_and_never_follows_a_way_out(door_worker, tmp_path):
    ws = door_worker.workspace(tmp_path)
    outside = Path(unprivileged.owned_dir("toolq-outside-") if door_worker.user else tmp_path.parent / "outside")
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("secret\n")
    (ws / "out").symlink_to(outside)
    (ws / "outfile").symlink_to(outside / "secret.txt")
    (ws / ".git").mkdir()
    (ws / ".git" / "config").write_text("[core]\n")
    (ws / "keep").mkdir()
    (ws / "keep" / ".git").mkdir()
    os.mkfifo(ws / "fifo")
    with open(ws / "huge", "wb") as f:
        f.truncate(65 << 20)  # sparse: over readFile's 64 MiB
    if door_worker.user:
        for p in [outside, *outside.iterdir(), *ws.rglob("*")]:
            os.chown(p, *unprivileged.ids(), follow_symlinks=False)
    hello = base64.b64encode(b"hello\n").decode()

    async def scenario() -> None:
        async with Door(door_worker, ws) as door:
            assert await door.fs("writeFile", "a/b.txt", data=hello) == {"ok": {}}
            assert await door.fs("readFile", "a/b.txt") == {"ok": {"dataBase64": hello}}
            meta = (await door.fs("getMetadata", "a/b.txt"))["ok"]
            assert (meta["isFile"], meta["isDirectory"], meta["isSymlink"], meta["size"]) == (True, False, False, 6)
            assert meta["modifiedAtMs"] > 0
            root = {e["fileName"]: e for e in (await door.fs("readDirectory", ""))["ok"]["entries"]}
            assert root["out"]["isSymlink"] and not root["out"]["isDirectory"] and root["a"]["isDirectory"]
            assert await door.fs("createDirectory", "d/e", recursive=True) == {"ok": {}}
            assert (await door.fs("createDirectory", "d"))["error"]["kind"] == "exists"
            assert await door.fs("copy", "a", to="c", recursive=True) == {"ok": {}}
            assert (ws / "c" / "b.txt").read_bytes() == b"hello\n"
            assert await door.fs("remove", "c", recursive=True) == {"ok": {}}
            assert not (ws / "c").exists()
            assert await door.fs("remove", "missing", force=True) == {"ok": {}}
            assert (await door.fs("remove", "missing"))["error"]["kind"] == "notFound"
            assert (await door.fs("readFile", "missing"))["error"]["kind"] == "notFound"
            assert (await door.fs("readFile", "a"))["error"]["kind"] == "isDirectory"
            big = os.urandom(3 << 20)  # far past what a model's history keeps of an output: whole anyway
            assert await door.fs("writeFile", "big.bin", data=base64.b64encode(big).decode()) == {"ok": {}}
            assert (ws / "big.bin").read_bytes() == big
            assert base64.b64decode((await door.fs("readFile", "big.bin"))["ok"]["dataBase64"]) == big

            # A symlink the workspace holds, pointing out: never followed out.
            for op, path, kw in (("readFile", "outfile", {}), ("readFile", "out/secret.txt", {}),
                                 ("writeFile", "outfile", {"data": hello}), ("writeFile", "out/new.txt", {"data": hello}),
                                 ("createDirectory", "out/made", {}), ("readDirectory", "out", {}),
                                 ("copy", "outfile", {"to": "stolen.txt"}), ("copy", "a/b.txt", {"to": "out/b.txt"})):
                got = await door.fs(op, path, **kw)
                assert got["error"]["kind"] == "denied", (op, path, got)
            link = (await door.fs("getMetadata", "outfile"))["ok"]
            assert link["isSymlink"] and not link["isFile"]  # the link itself, not the secret
            assert sorted(os.listdir(outside)) == ["secret.txt"]
            assert (outside / "secret.txt").read_text() == "secret\n"
            assert await door.fs("remove", "outfile") == {"ok": {}}  # the link, not what it names
            assert await door.fs("remove", "out", recursive=True) == {"ok": {}}
            assert (outside / "secret.txt").read_text() == "secret\n" and not (ws / "out").is_symlink()

            for path in ("../x", "a/../../x", "/etc/passwd", str(outside / "secret.txt")):
                assert (await door.fs("readFile", path))["error"]["kind"] == "denied", path
            for op, path, kw in (("writeFile", ".git/config", {"data": hello}), ("writeFile", ".git/hooks/x", {"data": hello}),
                                 ("createDirectory", ".git/hooks", {}), ("remove", ".git", {"recursive": True}),
                                 ("remove", ".git/config", {}), ("remove", "keep", {"recursive": True}),
                                 ("copy", "a/b.txt", {"to": ".GIT/x"})):
                assert (await door.fs(op, path, **kw))["error"]["kind"] == "denied", (op, path)
            assert (ws / ".git" / "config").read_text() == "[core]\n" and (ws / "keep" / ".git").is_dir()
            assert (await door.fs("readFile", "fifo"))["error"]["kind"] == "invalid"  # never blocks on it
            assert (await door.fs("readFile", "huge"))["error"]["kind"] == "tooLarge"
            assert (await door.fs("getMetadata", "huge"))["ok"]["size"] == 65 << 20

    try:
        run(scenario())
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    if door_worker.user:  # written as the worker's user, as its commands' files are
        assert (ws / "a" / "b.txt").stat().st_uid == unprivileged.ids()[0]


def test_front_door_tools_are_never_offered_to_a_model(door_worker, tmp_path):
    async def scenario() -> None:
        async with Door(door_worker, door_worker.workspace(tmp_path)) as door:
            names = {t.get("name") for t in door.fleet.tool_specs()}
            assert "exec_command" in names
            assert not names & {"process_start", "process_write", "process_terminate", "fs"}

    run(scenario())
