"""What `toolq run` shows (issue 4 item 6; issue 10 item 7): JSON lines like `codex exec --json`,
or a live view; a failed call looks failed in both."""

import io
import json

from toolq.orchestrator.states import CallState, codex_status
from toolq.orchestrator.turn_events import ItemCompleted, ItemUpdated, ToolCallView, TurnStarted
from toolq.orchestrator.view import JsonView, LiveView


class GoneReader(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def call(state: CallState, event=ItemUpdated, **kw):
    return event(item=ToolCallView(id="call_1", tool="exec_command", status=codex_status(state), state=state,
                                   step=0, **kw))


def test_json_view_writes_one_event_per_line():
    out = io.StringIO()
    view = JsonView(out)
    view(TurnStarted(turn_id="turn-1"))
    view(call(CallState.QUEUED))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"type": "turn.started", "turn_id": "turn-1"}
    assert lines[1]["item"] == {"id": "call_1", "type": "tool_call", "tool": "exec_command", "status": "in_progress",
                                "state": "queued", "step": 0}


def test_json_view_marks_a_command_that_exited_non_zero_failed_like_codex():
    out = io.StringIO()
    JsonView(out)(call(CallState.FAILED, ItemCompleted, exit_code=3, success=False, reason="exit code 3",
                       output="Process exited with code 3"))
    item = json.loads(out.getvalue())["item"]
    assert (item["status"], item["state"], item["exit_code"]) == ("failed", "failed", 3)


def test_every_terminal_state_but_completed_is_failed_in_codex_terms():
    assert {s: codex_status(s) for s in CallState} == {
        CallState.PENDING: "in_progress", CallState.THROTTLED: "in_progress", CallState.QUEUED: "in_progress",
        CallState.RUNNING: "in_progress", CallState.COMPLETED: "completed", CallState.FAILED: "failed", CallState.REJECTED: "failed",
        CallState.TIMED_OUT: "failed", CallState.LOST: "failed", CallState.CANCELLED: "failed"}


def test_a_reader_that_went_away_never_breaks_the_turn():
    view = JsonView(GoneReader())
    view(TurnStarted(turn_id="turn-1"))  # no exception
    view(call(CallState.RUNNING))
    assert view.out is None


def test_live_view_shows_state_durations_worker_and_why_a_call_failed():
    out = io.StringIO()
    view = LiveView(out)
    view(call(CallState.RUNNING, worker="w1@host"))
    view(call(CallState.LOST, ItemCompleted, round_trip=4.2, worker="w1@host",
              reason="worker w1@host stopped answering"))
    view(call(CallState.FAILED, ItemCompleted, run_time=0.012, queue_wait=0.5, exit_code=2, reason="exit code 2"))
    running, lost, failed = out.getvalue().splitlines()
    assert "running" in running and "on w1@host" in running
    assert "lost" in lost and "after 4.20s" in lost and "— worker w1@host stopped answering" in lost
    assert "✗" in failed and "failed" in failed and "ran 12ms" in failed and "waited 500ms" in failed
    assert failed.endswith("— exit code 2")
