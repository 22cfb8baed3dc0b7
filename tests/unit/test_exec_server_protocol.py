"""toolq exec-server's protocol layer alone (issue 29): frames, params as Codex's server words their
errors, file URIs against the workspace root, the client's sandbox policy against toolq's cell, a
process's numbered events (one seq from 1 over output/exited/closed, retained for process/read),
and a connection's framing (pipelined requests, one answer each), with a stand-in session."""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace
from typing import Any

import pytest

from toolq.core.front_doors import ProcessEvent, seal_event
from toolq.core.signing import Signer
from toolq.frontdoors.exec_server import policy
from toolq.frontdoors.exec_server.paths import Root, file_uri, local_path
from toolq.frontdoors.exec_server.processes import ProcessLog
from toolq.frontdoors.exec_server.protocol import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    NOT_FOUND,
    PARSE_ERROR,
    Notification,
    ProcessStartParams,
    ProcessWriteParams,
    Request,
    RpcError,
    Undecodable,
    decode,
    decode_base64,
    parse_params,
)
from toolq.frontdoors.exec_server.server import Connection, parse_listen, token_accepted
from toolq.frontdoors.exec_server.session import Context, ExecSession, Process, process_key

# ---- frames ------------------------------------------------------------------------------------


def test_a_frame_with_an_id_is_a_request_and_one_without_a_notification():
    assert decode('{"id":1,"method":"initialize","params":{"clientName":"codex-environment"}}') == \
        Request(1, "initialize", {"clientName": "codex-environment"})
    assert decode(b'{"method":"initialized","params":{}}') == Notification("initialized", {})
    assert decode('{"jsonrpc":"2.0","id":"a","method":"x"}') == Request("a", "x", None)


@pytest.mark.parametrize("frame, code, id_", [
    ("{not json", PARSE_ERROR, None),
    ("[1,2]", INVALID_REQUEST, None),
    ('{"id":true,"method":"x"}', INVALID_REQUEST, None),
    ('{"id":7}', INVALID_REQUEST, 7),
    ('{"id":7,"method":""}', INVALID_REQUEST, 7),
    ("[" * 100_000, PARSE_ERROR, None),
])
def test_a_bad_frame_is_undecodable_with_its_id_when_it_has_one(frame, code, id_):
    with pytest.raises(Undecodable) as e:
        decode(frame)
    assert (e.value.error.code, e.value.id) == (code, id_)


def test_params_errors_are_worded_as_codexs_server_words_them():
    with pytest.raises(RpcError) as e:
        parse_params(ProcessStartParams, {"processId": "x"})
    assert (e.value.code, e.value.message) == (INVALID_PARAMS, "missing field `argv`")
    with pytest.raises(RpcError) as e:
        parse_params(ProcessStartParams, {"processId": "empty", "argv": [], "cwd": "file:///tmp"})
    assert (e.value.code, e.value.message) == (INVALID_PARAMS, "argv must not be empty")
    with pytest.raises(RpcError) as e:
        parse_params(ProcessStartParams, None)
    assert e.value.code == INVALID_PARAMS


def test_codexs_process_start_params_are_read_and_unknown_fields_ignored():
    p = parse_params(ProcessStartParams, {
        "processId": "21999-20be717c", "metadata": {"threadId": "t"}, "argv": ["/bin/bash", "-lc", "echo hi"],
        "cwd": "file:///ws", "envPolicy": {"inherit": "all"}, "env": {"TERM": "dumb"}, "tty": True,
        "pipeStdin": False, "arg0": None, "sandbox": None, "enforceManagedNetwork": False})
    assert (p.process_id, p.argv, p.tty, p.pipe_stdin, p.env) == \
        ("21999-20be717c", ["/bin/bash", "-lc", "echo hi"], True, False, {"TERM": "dumb"})
    w = parse_params(ProcessWriteParams, {"processId": "p", "chunk": "eAo=", "writeId": "1"})
    assert decode_base64(w.chunk, "chunk") == b"x\n"
    with pytest.raises(RpcError) as e:
        decode_base64("not base64!", "chunk")
    assert e.value.code == INVALID_PARAMS


# ---- paths -------------------------------------------------------------------------------------------


def test_file_uris_map_to_workspace_paths_and_outside_is_none():
    root = Root("/tmp/run/ws")
    assert root.relative("file:///tmp/run/ws") == ""
    assert root.relative("file:///tmp/run/ws/") == ""
    assert root.relative("file:///tmp/run/ws/sub/dir/new.txt") == "sub/dir/new.txt"
    assert root.relative("file:///tmp/run/ws/a%20b.txt") == "a b.txt"
    assert root.relative("file:///tmp/run/.git") is None
    assert root.relative("file:///.git") is None
    assert root.relative("file:///tmp/run/wsx/a") is None  # a prefix of the name is not the folder
    assert root.relative("file:///tmp/run/ws/../ws2/a") is None  # `..` folded before the test
    assert root.relative("file:///tmp/run/ws/sub/../../ws/a") == "a"
    assert root.uri == "file:///tmp/run/ws"
    assert Root("/").relative("file:///etc/passwd") == "etc/passwd"


@pytest.mark.parametrize("uri", ["/tmp", "tmp/x", "http://host/x", "file://otherhost/x", "file:///a%00b",
                                 "file:///a?q=1"])
def test_a_path_that_is_no_local_file_uri_is_invalid_params(uri):
    with pytest.raises(RpcError) as e:
        local_path(uri)
    assert e.value.code == INVALID_PARAMS


def test_file_uri_quotes_what_a_uri_cannot_hold():
    assert file_uri("/a b/c#d") == "file:///a%20b/c%23d"
    assert local_path(file_uri("/a b/c#d")) == "/a b/c#d"


# ---- the client's sandbox policy ---------------------------------------------------------------------

def _restricted(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"permissions": {"type": "managed", "file_system": {"type": "restricted", "entries": list(entries)},
                            "network": "restricted"}}


def test_a_policy_the_cell_keeps_is_run_and_a_read_only_workspace_refused():
    root_read = {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"}
    project_write = {"path": {"type": "special", "value": {"kind": "project_roots"}}, "access": "write"}
    assert policy.refusal(None, "/ws") is None
    assert policy.refusal({"permissions": {"file_system": {"type": "unrestricted"}}}, "/ws") is None
    assert policy.refusal(_restricted(root_read, project_write), "/ws") is None
    assert policy.refusal(_restricted({"path": {"type": "path", "value": "/"}, "access": "write"}), "/ws") is None
    assert policy.refusal(_restricted(root_read), "/ws") == policy.READ_ONLY
    assert policy.refusal(_restricted({"path": {"type": "path", "value": "/elsewhere"}, "access": "write"}),
                          "/ws") == policy.READ_ONLY


# ---- a process's events --------------------------------------------------------------------------------

def test_output_exited_and_closed_share_one_seq_from_1():
    log = ProcessLog("p")
    out = log.output("stdout", b"hi\n")
    exited = log.exit(0)
    closed = log.close()
    assert [(e.seq, e.kind) for e in [*out, *exited, *closed]] == [(1, "output"), (2, "exited"), (3, "closed")]
    assert out[0].notification("p") == ("process/output", {"processId": "p", "seq": 1, "stream": "stdout",
                                                           "chunk": base64.b64encode(b"hi\n").decode()})
    assert exited[0].notification("p") == ("process/exited", {"processId": "p", "seq": 2, "exitCode": 0,
                                                              "sandboxDenied": False})
    assert closed[0].notification("p") == ("process/closed", {"processId": "p", "seq": 3})


def test_closed_is_sent_once_after_an_exited_and_nothing_follows_it():
    log = ProcessLog("p")
    assert [(e.kind, e.exit_code) for e in log.close(-1)] == [("exited", -1), ("closed", None)]
    assert log.close() == [] and log.exit(0) == [] and log.output("stdout", b"late") == []
    log2 = ProcessLog("q")
    log2.exit(137)
    assert log2.exit(0) == []  # the first exit stands
    log2.output("stdout", b"after exit")  # the reference sends output after exited too
    assert [e.kind for e in log2.close()] == ["closed"]
    assert log2.exit_code == 137 and log2.last_seq == 3


def test_output_is_cut_into_chunks_of_at_most_8192_bytes():
    log = ProcessLog("p")
    events = log.output("pty", b"a" * 20000)
    assert [len(e.data) for e in events] == [8192, 8192, 3616]
    assert [e.seq for e in events] == [1, 2, 3]


def test_unsent_gives_each_event_once_in_order():
    log = ProcessLog("p")
    log.output("stdout", b"1")
    assert [e.seq for e in log.unsent()] == [1]
    log.output("stderr", b"2")
    log.close(3)
    assert [e.seq for e in log.unsent()] == [2, 3, 4]
    assert log.unsent() == []


def test_read_returns_output_after_a_seq_and_where_the_process_stands():
    log = ProcessLog("p")
    log.output("stdout", b"done\n")
    first = log.read(None, None)
    assert first == {"chunks": [{"seq": 1, "stream": "stdout", "chunk": "ZG9uZQo="}], "nextSeq": 2,
                     "exited": False, "exitCode": None, "closed": False, "failure": None, "sandboxDenied": False}
    log.close(0)
    assert log.read(0, None)["nextSeq"] == 4 and log.read(0, None)["closed"] is True
    assert log.read(1, None)["chunks"] == [] and log.read(1, None)["exitCode"] == 0


def test_read_with_max_bytes_still_returns_one_whole_chunk():
    log = ProcessLog("p")
    log.output("stdout", b"a" * 20000)
    page = log.read(0, 1000)
    assert [c["seq"] for c in page["chunks"]] == [1] and page["nextSeq"] == 2
    assert [c["seq"] for c in log.read(1, 100_000)["chunks"]] == [2, 3]


def test_retention_drops_the_oldest_output_past_its_bytes():
    log = ProcessLog("p", retain_bytes=10_000)
    log.output("stdout", b"a" * 20000)
    log.close(0)
    assert [c["seq"] for c in log.read(0, None)["chunks"]] == [3]
    assert log.read(0, None)["nextSeq"] == 6


def test_a_resumed_read_marks_what_the_client_has():
    log = ProcessLog("p")
    log.output("stdout", b"started\n")
    assert [e.seq for e in log.unsent()] == [1]
    log.output("stdout", b"after-drop\n")  # produced while detached
    assert [c["seq"] for c in log.read(1, None)["chunks"]] == [2]
    log.output("stdout", b"end\n")
    assert [e.seq for e in log.unsent()] == [3]  # pushes go on after what the read returned


def test_a_long_poll_returns_at_the_next_event():
    async def scenario() -> dict[str, Any]:
        log = ProcessLog("p")
        waiter = asyncio.create_task(log.wait(None, 30))
        await asyncio.sleep(0)
        log.output("stdout", b"x")
        await asyncio.wait_for(waiter, 5)
        await log.wait(None, 30)  # already there: at once
        return log.read(None, None)

    assert asyncio.run(scenario())["nextSeq"] == 2


def test_process_keys_are_stream_safe_and_distinct():
    assert process_key("21999-20be717c-ff0c") == "21999-20be717c-ff0c"
    a, b = process_key("a/b"), process_key("a b")
    assert a != b and a.startswith("a_b-") and b.startswith("a_b-")
    assert len(process_key("x" * 1000)) <= 200


# ---- listening and the token ---------------------------------------------------------------------------

def test_listen_addresses():
    assert parse_listen("stdio") is None
    where = parse_listen("ws://127.0.0.1:0")
    assert where is not None and (where.host, where.port, where.loopback) == ("127.0.0.1", 0, True)
    assert parse_listen("ws://[::1]:80").loopback and parse_listen("ws://localhost:1").loopback
    assert not parse_listen("ws://0.0.0.0:8765").loopback
    for bad in ("http://127.0.0.1:1", "ws://127.0.0.1", "ws://127.0.0.1:99999", "ws://h:1/path", "nonsense"):
        with pytest.raises(ValueError):
            parse_listen(bad)


class _Headers:
    def __init__(self, **values: str) -> None:
        self.values = values

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self.values.items() if k.lower() == name.lower()]


def test_the_token_is_taken_from_the_header_or_the_query():
    assert token_accepted(None, _Headers(), "/")
    assert token_accepted("s3cret", _Headers(Authorization="Bearer s3cret"), "/")
    assert token_accepted("s3cret", _Headers(), "/?token=s3cret")
    assert not token_accepted("s3cret", _Headers(), "/")
    assert not token_accepted("s3cret", _Headers(Authorization="Bearer wrong"), "/?token=nope")


# ---- a connection's framing, with a stand-in session ---------------------------------------------------

class _Session:
    id = "sess-1"
    closed = False

    def __init__(self) -> None:
        self.attached: list[bool] = []
        self.gate = asyncio.Event()

    def attach(self, push: Any, *, resumed: bool) -> None:
        self.attached.append(resumed)

    def detach(self, push: Any) -> None:
        self.attached.append(False)

    def environment_info(self) -> dict[str, Any]:
        return {"shell": {"name": "bash", "path": "/bin/bash"}, "cwd": "file:///ws"}

    async def handle(self, method: str, params: Any) -> Any:
        if method == "slow":
            await self.gate.wait()
            return {"slow": True}
        if method == "fs/getMetadata":
            self.gate.set()
            raise RpcError(NOT_FOUND, "No such file or directory (os error 2)")
        if method == "boom":
            raise RuntimeError("worker fell over")
        raise RpcError(-32601, f"toolq exec-server does not implement `{method}`")


class _Sessions:
    def __init__(self) -> None:
        self.session = _Session()
        self.connections: set[Any] = set()

    def open(self, resume: str | None) -> tuple[_Session, bool]:
        return self.session, resume == self.session.id


def _converse(frames: list[str]) -> list[dict[str, Any]]:
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    async def scenario() -> None:
        gate = asyncio.Event()

        async def incoming() -> Any:
            for f in frames:
                yield f
            await asyncio.sleep(0.05)  # the pipelined tasks answer before the connection ends
            gate.set()

        connection = Connection(_Sessions(), send, keep=True)  # type: ignore[arg-type]
        await connection.serve(incoming())

    asyncio.run(scenario())
    return [json.loads(s) for s in sent]


def test_every_request_gets_one_answer_in_any_order_and_notifications_none():
    answers = _converse([
        '{"id":1,"method":"process/start","params":{}}',
        '{"id":2,"method":"initialize","params":{"clientName":"codex-environment","resumeSessionId":null}}',
        '{"method":"initialized","params":{}}',
        '{"method":"something/else","params":{}}',
        '{"id":3,"method":"slow","params":{}}',
        '{"id":4,"method":"fs/getMetadata","params":{"path":"file:///.git"}}',
        '{"id":5,"method":"no/such/method","params":{}}',
        '{"id":6,"method":"boom","params":{}}',
        "{broken",
        '{"id":7,"method":"initialize","params":{}}',
    ])
    by_id = {a["id"]: a for a in answers}
    assert len(answers) == 8 and set(by_id) == {1, 2, 3, 4, 5, 6, 7, None}
    assert by_id[1]["error"]["code"] == INVALID_REQUEST  # before initialize
    assert by_id[2]["result"] == {"sessionId": "sess-1", "environmentInfo": {
        "shell": {"name": "bash", "path": "/bin/bash"}, "cwd": "file:///ws"}}
    assert by_id[4]["error"] == {"code": NOT_FOUND, "message": "No such file or directory (os error 2)"}
    assert by_id[5]["error"]["code"] == -32601
    assert by_id[6]["error"]["code"] == -32603 and "worker fell over" in by_id[6]["error"]["message"]
    assert by_id[None]["error"]["code"] == PARSE_ERROR
    assert by_id[7]["error"]["code"] == INVALID_REQUEST  # one initialize per connection
    assert by_id[3]["result"] == {"slow": True}
    # pipelined: the slow request (3) was answered after the one sent after it (4)
    order = [a["id"] for a in answers]
    assert order.index(4) < order.index(3)


# ---- a process's stream read into its events, with stand-in calls and Redis ------------------------------

class _Streams:
    """XREAD over one list of entries (the worker's XADDs), handed out once."""

    def __init__(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        self.entries = entries
        self.deleted: list[str] = []

    async def xread(self, streams: dict[str, str], count: int | None = None, block: int | None = None) -> Any:
        (key, after), = streams.items()
        found = [(i, f) for i, f in self.entries if int(i.split("-")[0]) > int(after.split("-")[0])]
        if not found:
            await asyncio.sleep(0.001)
            return []
        return [(key, found)]

    async def delete(self, key: str) -> None:
        self.deleted.append(key)


class _Calls:
    turn_id = "turn-abc"

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def run(self, tool: str, args: dict[str, Any], *, control: bool = True,
                  call_id: str | None = None) -> tuple[str, Any]:
        await asyncio.sleep(0.01)
        try:
            return self.reply, json.loads(self.reply)
        except ValueError:
            return self.reply, None


SIGNER = Signer("k" * 40)


def _session_with_a_process(streams: _Streams, reply: str = "{}") -> tuple[ExecSession, Process]:
    """A session on stand-in fleet parts (no Redis, no workers), holding process p-1."""
    fleet = SimpleNamespace(ledger=SimpleNamespace(r=None), environments=None)
    session = ExecSession(Context(fleet, Root("/ws"), None, streams, SIGNER, 60.0),  # type: ignore[arg-type]
                          lambda s: None)
    session.calls = _Calls(reply)  # type: ignore[assignment]
    params = parse_params(ProcessStartParams, {"processId": "p-1", "argv": ["/bin/bash", "-lc", "x"],
                                               "cwd": "file:///ws"})
    proc = session.processes["p-1"] = Process(params, "turn-abc")
    return session, proc


def _process_events(reply: str, events: list[dict[str, Any]], forged: bool = False) -> list[dict[str, Any]]:
    pushed: list[dict[str, Any]] = []

    async def scenario() -> None:
        streams = _Streams([])
        session, proc = _session_with_a_process(streams, reply)
        streams.entries = [(f"{n}-0", seal_event(SIGNER if not (forged and n == 2) else Signer("x" * 40),
                                                 proc.stream_key, ProcessEvent(n=n, **e)))
                           for n, e in enumerate(events, 1)]
        session.attach(pushed.append, resumed=False)
        await asyncio.wait_for(session._run(proc, {}), 10)
        assert streams.deleted == [proc.stream_key]

    asyncio.run(scenario())
    return pushed


def test_a_process_stream_becomes_output_exited_and_closed():
    pushed = _process_events('{"exit_code": 0, "session_id": 3}', [
        {"kind": "started", "session_id": 3, "instance": "w1"},
        {"kind": "output", "stream": "stdout", "data": base64.b64encode(b"hi\n").decode()},
        {"kind": "exit", "exit_code": 0}])
    assert [(m["method"], m["params"]["seq"]) for m in pushed] == \
        [("process/output", 1), ("process/exited", 2), ("process/closed", 3)]
    assert pushed[1]["params"]["exitCode"] == 0


def test_a_call_that_ends_with_no_exit_says_why_and_exits_minus_1_never_a_made_up_code():
    pushed = _process_events("aborted: the turn was cancelled (toolq cancel)", [
        {"kind": "started", "session_id": 3, "instance": "w1"}])
    assert [m["method"] for m in pushed] == ["process/output", "process/exited", "process/closed"]
    assert pushed[0]["params"]["stream"] == "stderr"
    assert b"[toolq: aborted: the turn was cancelled" in base64.b64decode(pushed[0]["params"]["chunk"])
    assert pushed[1]["params"]["exitCode"] == -1


def test_a_limit_note_is_a_stderr_line_before_the_exit_and_a_forged_entry_is_skipped():
    pushed = _process_events('{"exit_code": 137, "session_id": 3}', [
        {"kind": "started", "session_id": 3, "instance": "w1"},
        {"kind": "output", "stream": "stdout", "data": base64.b64encode(b"forged\n").decode()},
        {"kind": "exit", "exit_code": 137, "note": "the sandbox's memory cap (512 MiB) was hit"}], forged=True)
    assert [m["method"] for m in pushed] == ["process/output", "process/exited", "process/closed"]
    assert b"memory cap" in base64.b64decode(pushed[0]["params"]["chunk"])
    assert pushed[1]["params"]["exitCode"] == 137


def test_a_resumed_session_holds_its_pushes_until_the_clients_catch_up_read():
    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        session, proc = _session_with_a_process(_Streams([]))
        first: list[dict[str, Any]] = []
        second: list[dict[str, Any]] = []
        session.attach(first.append, resumed=False)
        session._emit(proc, proc.log.output("stdout", b"started\n"))
        session.detach(first.append)
        session._emit(proc, proc.log.output("stdout", b"after-drop\n"))  # detached: kept, not pushed
        session.attach(second.append, resumed=True)
        session._emit(proc, proc.log.output("stdout", b"end\n"))  # held for the catch-up read
        assert second == []
        read = await session.process_read({"processId": "p-1", "afterSeq": 1, "maxBytes": None, "waitMs": 0})
        session._emit(proc, proc.log.close(0))
        return first, second, read

    first, second, read = asyncio.run(scenario())
    assert [m["params"]["seq"] for m in first] == [1]
    assert [c["seq"] for c in read["chunks"]] == [2, 3]
    assert [(m["method"], m["params"]["seq"]) for m in second] == [("process/exited", 4), ("process/closed", 5)]


def test_the_payload_budget_lets_what_fits_travel_and_holds_the_rest_until_some_returns():
    from toolq.frontdoors.exec_server.calls import PayloadBudget

    async def scenario() -> list[str]:
        budget, order = PayloadBudget(limit=100), []

        async def carry(name: str, size: int, until: asyncio.Event) -> None:
            async with budget.hold(size):
                order.append(f"{name} in")
                await until.wait()
            order.append(f"{name} out")

        first, second, big = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(carry("a", 60, first))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(carry("b", 60, second)))  # does not fit beside a
        tasks.append(asyncio.create_task(carry("huge", 500, big)))  # larger than the whole budget: alone
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["a in"] and budget.used == 60
        first.set()
        second.set()
        big.set()
        await asyncio.gather(*tasks)
        assert budget.used == 0
        return order

    order = asyncio.run(scenario())
    assert order.index("a out") < order.index("b in")
    assert order.index("b out") < order.index("huge in") or order.index("huge out") < order.index("b in")


def test_pipelined_large_writes_go_to_the_fleet_two_at_a_time():
    """Each fs/writeFile's data travels through the fleet's Redis as its call's arguments (several
    copies: the message, kombu's unacked copy): eight pipelined writes of 24 MiB must not all be
    calls at once (they held 344 MiB of arguments), only what PAYLOAD_BUDGET (64 MiB) lets by."""
    data = base64.b64encode(b"\0" * (24 << 20)).decode()

    class Counting(_Calls):
        def __init__(self) -> None:
            super().__init__('{"ok": {}}')
            self.now = self.most = 0

        async def run(self, tool: str, args: dict[str, Any], *, control: bool = True,
                      call_id: str | None = None) -> tuple[str, Any]:
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                return await super().run(tool, args, control=control, call_id=call_id)
            finally:
                self.now -= 1

    async def scenario() -> int:
        session, _ = _session_with_a_process(_Streams([]))
        calls = session.calls = Counting()  # type: ignore[assignment]
        session._ready = asyncio.get_running_loop().create_future()
        session._ready.set_result(None)  # type: ignore[attr-defined]
        await asyncio.gather(*(session.fs_write_file({"path": f"file:///ws/big{i}", "dataBase64": data})
                               for i in range(8)))
        return calls.most

    assert asyncio.run(scenario()) == 2
