"""What `toolq run` shows (issue 4 item 6): JSON lines like `codex exec --json`, or a live view."""

import io
import json

from toolq.orchestrator.view import JsonView, LiveView


class GoneReader(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def call(status, **kw):
    return {"type": "item.updated", "item": {"id": "call_1", "type": "tool_call", "tool": "exec_command",
                                             "status": status, **kw}}


def test_json_view_writes_one_event_per_line():
    out = io.StringIO()
    view = JsonView(out)
    view({"type": "turn.started", "turn_id": "turn-1"})
    view(call("queued"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"type": "turn.started", "turn_id": "turn-1"}
    assert lines[1]["item"]["status"] == "queued"


def test_a_reader_that_went_away_never_breaks_the_turn():
    view = JsonView(GoneReader())
    view({"type": "turn.started", "turn_id": "turn-1"})  # no exception
    view(call("running"))
    assert view.out is None


def test_live_view_shows_state_duration_worker_and_why_a_call_failed():
    out = io.StringIO()
    view = LiveView(out)
    view(call("running", worker="w1@host"))
    view({"type": "item.completed", "item": {"id": "call_1", "type": "tool_call", "tool": "exec_command",
                                             "status": "lost", "duration": 4.2, "worker": "w1@host",
                                             "output": "worker w1@host stopped answering\nmore"}})
    running, lost = out.getvalue().splitlines()
    assert "running" in running and "on w1@host" in running
    assert "4.20s" in lost and "— worker w1@host stopped answering" in lost and "more" not in lost
