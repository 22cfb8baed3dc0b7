"""The front doors' shared names (toolq/core/front_doors.py), and how a pool child writes a
process's events: signed entries a forger cannot make, move or renumber; chunks of at most
CHUNK_BYTES; one note past PROCESS_STREAM_BYTES and nothing after it."""

from __future__ import annotations

import base64
import json

import pytest

from toolq.core import front_doors as fd
from toolq.core.signing import Signer
from toolq.workers.sessions.host import Watcher
from toolq.workers.sessions.protocol import OutputFrame
from toolq.workers.tools.front_door import EventStream, shell_command

SIGNER = Signer("k" * 40)
KEY = fd.process_stream_key("turn-1", "7-abc")


def test_the_stream_key_names_the_turn_and_the_process_and_refuses_anything_else():
    assert KEY == "toolq:proc:turn-1:7-abc"
    for bad in ("", "a b", "x/y", "k" * 201, "é"):
        with pytest.raises(ValueError):
            fd.process_stream_key("turn-1", bad)
    with pytest.raises(ValueError):
        fd.process_stream_key("", "p")


def test_a_sealed_event_opens_from_the_bytes_redis_returns():
    event = fd.ProcessEvent(kind="started", n=1, session_id=3, instance="w1")
    fields = fd.seal_event(SIGNER, KEY, event)
    assert set(fields) == {fd.EVENT_FIELD, fd.SIG_FIELD}
    as_read = {k.encode(): v.encode() for k, v in fields.items()}
    assert fd.open_event(SIGNER, KEY, as_read) == event
    assert fd.open_event(SIGNER, KEY, fields) == event


def test_a_forged_moved_renumbered_or_malformed_entry_opens_as_none():
    event = fd.ProcessEvent(kind="output", n=2, stream="stdout", data=base64.b64encode(b"hi").decode())
    fields = fd.seal_event(SIGNER, KEY, event)
    assert fd.open_event(Signer("x" * 40), KEY, fields) is None  # another key
    assert fd.open_event(SIGNER, fd.process_stream_key("turn-1", "8-abc"), fields) is None  # moved
    body = json.loads(fields[fd.EVENT_FIELD])
    body["n"] = 3
    assert fd.open_event(SIGNER, KEY, {**fields, fd.EVENT_FIELD: json.dumps(body)}) is None  # renumbered
    assert fd.open_event(SIGNER, KEY, {fd.EVENT_FIELD: fields[fd.EVENT_FIELD]}) is None  # unsigned
    assert fd.open_event(SIGNER, KEY, {fd.EVENT_FIELD: b"\xff", fd.SIG_FIELD: "x"}) is None
    assert fd.open_event(SIGNER, KEY, {fd.EVENT_FIELD: "not json", fd.SIG_FIELD: "x"}) is None
    bad = {"kind": "exit", "n": 0}  # genuinely signed, but no valid event
    assert fd.open_event(SIGNER, KEY, {fd.EVENT_FIELD: json.dumps(bad),
                                       fd.SIG_FIELD: SIGNER.seal_process_event(KEY, bad)}) is None


def test_fs_results_are_ok_or_one_error():
    assert fd.FsResult(ok={}).to_json() == '{"ok":{}}'
    assert json.loads(fd.FsResult.failed("notFound", "gone").to_json()) == {
        "error": {"kind": "notFound", "message": "gone"}}
    with pytest.raises(ValueError):
        fd.FsRequest(op="chmod", path="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        fd.ProcessStartArgs(argv=[], stream_key=KEY)


def test_a_shell_argv_runs_its_command_and_any_other_argv_runs_quoted_under_bash():
    assert shell_command(["/bin/bash", "-lc", "echo hi"]) == ("/bin/bash", "echo hi")
    assert shell_command(["sh", "-c", "true"]) == ("sh", "true")
    assert shell_command(["printf", "%s\n", "a b", "$HOME"]) == ("bash", "printf '%s\n' 'a b' '$HOME'")


class _Pipe:
    def __init__(self, r: _Redis) -> None:
        self.r = r

    def __enter__(self) -> _Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def xadd(self, key: str, fields: dict[str, str]) -> None:
        self.r.entries.append((key, fields))

    def expire(self, key: str, ttl: int) -> None:
        self.r.ttl = ttl

    def execute(self) -> None:
        pass


class _Redis:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, str]]] = []
        self.ttl = 0

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return _Pipe(self)


def _events(r: _Redis) -> list[fd.ProcessEvent]:
    out = []
    for key, fields in r.entries:
        event = fd.open_event(SIGNER, key, fields)
        assert event is not None
        out.append(event)
    return out


def test_output_is_cut_in_chunks_numbered_without_gaps_and_capped_with_one_note(monkeypatch):
    monkeypatch.setattr("toolq.workers.tools.front_door.PROCESS_STREAM_BYTES", 3 * fd.CHUNK_BYTES + 5)
    r = _Redis()
    stream = EventStream(r, SIGNER, KEY)  # type: ignore[arg-type]
    stream.frame(OutputFrame(progress="", session_id=4, instance="w"))
    big = bytes(range(256)) * (2 * fd.CHUNK_BYTES // 256) + b"tail"
    stream.frame(OutputFrame(progress=base64.b64encode(big).decode(), stream="stdout"))
    stream.frame(OutputFrame(progress=base64.b64encode(b"e" * (fd.CHUNK_BYTES + 10)).decode(), stream="stderr"))
    stream.frame(OutputFrame(progress=base64.b64encode(b"dropped").decode(), stream="stdout"))
    stream.append({"kind": "exit", "exit_code": 0})
    events = _events(r)
    assert [e.n for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind == "started" and events[0].session_id == 4 and events[0].instance == "w"
    outputs = [e for e in events if e.kind == "output"]
    assert all(len(base64.b64decode(e.data or "")) <= fd.CHUNK_BYTES for e in outputs)
    stdout = b"".join(base64.b64decode(e.data or "") for e in outputs if e.stream == "stdout")
    assert stdout == big
    stderr = b"".join(base64.b64decode(e.data or "") for e in outputs if e.stream == "stderr")
    assert stderr == b"e" * (fd.CHUNK_BYTES + 1) + fd.STREAM_CAP_NOTE.encode()  # cut at the cap, then the note
    assert events[-1].kind == "exit" and r.ttl == fd.STREAM_TTL


def test_a_front_door_watcher_keeps_every_byte_tagged_with_its_stream_and_a_poll_watcher_its_budget():
    w = Watcher(None)
    w.add("stdout", b"a")
    w.add("stdout", b"b")
    w.add("stderr", b"c")
    assert w.size == 3 and w.take() == [("stdout", b"ab"), ("stderr", b"c")] and w.size == 0
    capped = Watcher(2)
    capped.add("stdout", b"abc")
    capped.add("stdout", b"d")
    assert capped.take() == [("stdout", b"ab")]
