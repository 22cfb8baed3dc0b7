"""`toolq decode FILE`: committed items as JSON lines on stdout, a summary on stderr."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from toolq.orchestrator.decode_cmd import decode_file
from tests.paths import SSE_FIXTURES

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
        [sys.executable, "-m", "toolq.orchestrator.cli", "decode", str(path)], capture_output=True, text=True, check=True
    )
    items = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [i["type"] for i in items] == ["reasoning", "custom_tool_call"]
    assert items[1]["input"] == "SELECT * FROM users LIMIT 5;"
    assert proc.stderr.startswith("16 events, 2 items")
