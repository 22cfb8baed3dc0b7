"""`toolq decode FILE`: committed items as JSON lines on stdout, a summary on stderr."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from tests.paths import SSE_FIXTURES
from toolq.cli.decode import decode_file

SSE = SSE_FIXTURES


def decode(path: Path) -> tuple[int, list[dict], str]:
    out, err = io.StringIO(), io.StringIO()
    rc = decode_file(str(path), out, err)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def recording(name: str) -> Path:
    return SSE / name


def test_prints_each_committed_item_as_its_wire_json():
    rc, items, err = decode(recording("sse-parallel-function-calls.txt"))
    assert rc == 0
    assert [(i["type"], i["name"], i["call_id"]) for i in items] == [
        ("function_call", "search", "call_GXd80NWdsX8ng3xdeNLeA42o"),
        ("function_call", "weather", "call_qfdHN9tTntv02109c9RNnGGe"),
    ]
    assert items[1]["arguments"] == '{"city":"Detroit"}' and items[1]["status"] == "completed"
    assert err == "29 events, 2 items, end: completed; skipped: none\n"


def test_last_event_of_a_file_without_trailing_blank_line_is_decoded():
    path = recording("sse-text-message.txt")
    assert not path.read_bytes().endswith(b"\n\n")
    rc, items, err = decode(path)
    assert rc == 0 and [i["type"] for i in items] == ["message"]
    assert err.startswith("19 events, 1 item, end: completed")


def test_failed_recording_prints_no_items_and_names_the_failure():
    rc, items, err = decode(recording("sse-response-failed.txt"))
    assert rc == 0 and items == []
    assert "end: failed (insufficient_quota: You exceeded your current quota" in err


def test_malformed_frames_are_skipped_and_counted_by_reason(tmp_path):
    good = json.dumps({"type": "response.output_item.done", "item": {"type": "message", "role": "assistant", "content": "hi"}})
    body = (
        "data: {broken\n\n"
        'data: {"no_type": 1}\n\n'
        'data: {"type": "response.future_event"}\n\n'
        "data: [DONE]\n\n"
        f"data: {good}"  # unterminated last frame
    )
    path = tmp_path / "bad.sse"
    path.write_text(body)
    rc, items, err = decode(path)
    assert rc == 0 and items == [{"type": "message", "role": "assistant", "content": "hi"}]
    assert err == (
        "5 events, 1 item, end: none (stream ended without a terminal event); "
        "skipped: done_marker=1, malformed_json=1, missing_type=1, unknown_type:response.future_event=1\n"
    )


def test_missing_file_is_an_error_not_a_traceback(tmp_path):
    rc, items, err = decode(tmp_path / "nope.sse")
    assert rc == 1 and items == [] and err.startswith("toolq decode: ")


def test_cli_runs_decode():
    path = recording("sse-custom-tool-call.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "toolq.cli.main", "decode", str(path)], capture_output=True, text=True, check=True
    )
    items = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [i["type"] for i in items] == ["reasoning", "custom_tool_call"]
    assert items[1]["input"] == "SELECT * FROM users LIMIT 5;"
    assert proc.stderr.startswith("16 events, 2 items")


def test_what_the_server_wrote_reaches_the_terminal_shown_never_obeyed(tmp_path):
    # A hostile server's failure text and item text: screen clears, an OSC 52 clipboard write, a
    # C1 CSI and a bidi override must not reach the terminal raw; the JSON still means the same.
    evil = "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\x9b31m\u202eend"
    item = {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": evil, "annotations": []}]}
    body = (f"event: response.output_item.done\ndata: {json.dumps({'type': 'response.output_item.done', 'output_index': 0, 'item': item})}\n\n"
            f"event: response.failed\ndata: {json.dumps({'type': 'response.failed', 'response': {'error': {'code': 'x', 'message': evil}}})}\n\n")
    path = tmp_path / "evil.sse"
    path.write_text(body)
    out, err = io.StringIO(), io.StringIO()
    assert decode_file(str(path), out, err) == 0
    for text in (out.getvalue(), err.getvalue()):
        assert not any(ch in text for ch in "\x1b\x07\x9b\u202e"), repr(text)
    assert json.loads(out.getvalue())["content"][0]["text"] == evil
    assert "failed" in err.getvalue()
