"""What `toolq run` shows (issue 4 item 6; issue 10 item 7): JSON lines like `codex exec --json`,
or a live view; a failed call looks failed in both."""

import io
import json
import time

from toolq.cli.view import JsonView, LiveView
from toolq.core.states import CallState, codex_status
from toolq.orchestrator.turn_events import (
    AgentMessageView,
    CommandExecutionView,
    ItemCompleted,
    ItemStarted,
    ItemUpdated,
    ReasoningView,
    ToolCallView,
    TurnStarted,
)


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
    stamps = [line.pop("timestamp") for line in lines]  # every event has one (Codex's have none)
    assert all(time.time() - 5 < t <= time.time() for t in stamps) and stamps == sorted(stamps)
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


def command(state: CallState, event=ItemUpdated, output: str = "", **kw):
    return event(item=CommandExecutionView(id="call_c", tool="exec_command", status=codex_status(state), state=state,
                                           step=0, command="bash -c 'make test'", aggregated_output=output, **kw))


def test_live_view_shows_a_running_commands_line_and_its_last_output_lines():
    out = io.StringIO()
    view = LiveView(out)
    view(command(CallState.QUEUED, ItemStarted))
    view(command(CallState.RUNNING, worker="w1@host"))
    view(command(CallState.RUNNING, output="one\n"))
    view(command(CallState.RUNNING, output="one\ntwo\nthree\nfour\nfive\n" + "x" * 500))
    view(command(CallState.COMPLETED, ItemCompleted, output="all of it", exit_code=0, run_time=1.5))
    lines = out.getvalue().splitlines()
    assert "queued" in lines[0] and lines[1] == "    $ bash -c 'make test'"
    assert "running" in lines[2] and "on w1@host" in lines[2]
    # Only the new output, its last three lines, each cut to a line; no call line for an output update.
    assert lines[3:7] == ["    │ one", "    │ four", "    │ five", "    │ " + "x" * 199 + "…"]
    assert "completed" in lines[7] and "ran 1.50s" in lines[7] and len(lines) == 8


def test_command_execution_items_have_codexs_fields():
    out = io.StringIO()
    JsonView(out)(command(CallState.RUNNING))
    running = json.loads(out.getvalue())["item"]
    assert (running["exit_code"], running["aggregated_output"], running["status"]) == (None, "", "in_progress")
    out = io.StringIO()
    JsonView(out)(command(CallState.FAILED, ItemCompleted, output="boom\n", exit_code=2))
    item = json.loads(out.getvalue())["item"]
    assert {k: item[k] for k in ("type", "command", "aggregated_output", "exit_code", "status")} == {
        "type": "command_execution", "command": "bash -c 'make test'", "aggregated_output": "boom\n",
        "exit_code": 2, "status": "failed"}


def test_a_commands_escape_sequences_never_reach_the_terminal():
    out = io.StringIO()
    view = LiveView(out)
    view(command(CallState.RUNNING, output="\x1b]0;pwned\x07ok\x1b[2J\r\x9bdone\n"))
    # A carriage return ends a line (a progress bar shows its latest state); each escape sequence
    # goes whole (the 8-bit CSI took "d" as its final byte, as a terminal would).
    assert out.getvalue().splitlines()[-2:] == ["    │ ok", "    │ one"]


def test_parallel_commands_lines_say_whose_they_are():
    out = io.StringIO()
    view = LiveView(out)
    other = CommandExecutionView(id="call_d", tool="exec_command", status="in_progress", state=CallState.RUNNING,
                                 step=0, command="bash -c 'make lint'")
    view(command(CallState.RUNNING))
    view(ItemUpdated(item=other))
    view(command(CallState.RUNNING, output="tests ok\n"))
    assert out.getvalue().splitlines()[-1] == "    call_c │ tests ok"


def test_a_polls_command_line_shows_once_its_session_is_known():
    """A write_stdin's item carries its session's command line once the call is routed."""
    out = io.StringIO()
    view = LiveView(out)

    def poll(state, event=ItemUpdated, command="", output=""):
        return event(item=CommandExecutionView(id="call_p", tool="write_stdin", status=codex_status(state),
                                               state=state, step=0, command=command, aggregated_output=output))

    view(poll(CallState.QUEUED, ItemStarted))
    view(poll(CallState.RUNNING, command="bash -c 'make test'"))
    view(poll(CallState.RUNNING, command="bash -c 'make test'", output="ok\n"))
    lines = out.getvalue().splitlines()
    assert "queued" in lines[0] and "running" in lines[1]
    assert lines[2:] == ["    $ bash -c 'make test'", "    │ ok"]


def test_a_write_stdin_call_is_a_command_execution_of_its_session():
    from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
    from toolq.orchestrator.call_items import call_view
    from toolq.workers.loader import load_catalog

    spec = load_catalog().get(ToolName(name="write_stdin"))
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName(name="write_stdin"),
                         payload=FunctionPayload(arguments='{"session_id": 1}'), deadline=0)
    view = call_view(spec, "write_stdin", inv, "tick 3\n", None, session_command="bash -c 'make test'", id="c",
                     status="in_progress", state=CallState.RUNNING, step=0)
    assert isinstance(view, CommandExecutionView)
    assert (view.command, view.aggregated_output, view.exit_code) == ("bash -c 'make test'", "tick 3\n", None)
    assert call_view(spec, "write_stdin", inv, "", None, id="c", status="in_progress", state=CallState.QUEUED,
                     step=0).command == ""


HOSTILE = "\x1b[2J\x1b[H\x1b]52;c;ZXZpbA==\x07\x1b]0;title\x1b\\\x9b31m\u202e\x1bP1$r\x1b\\\r"


def test_nothing_the_model_or_a_tool_says_reaches_the_terminal_as_a_control():
    """Issue 24: the model's message and reasoning, tool names, call ids and reasons were printed raw
    (screen clears, cursor moves, clipboard writes with OSC 52, bidi overrides)."""
    out = io.StringIO()
    view = LiveView(out)
    view(ItemCompleted(item=AgentMessageView(id="m" + HOSTILE, text=f"answer{HOSTILE}\nsecond line")))
    view(ItemCompleted(item=ReasoningView(id="r", text=f"thought{HOSTILE}")))
    view(ItemCompleted(item=ToolCallView(id="call" + HOSTILE, tool="tool" + HOSTILE, state=CallState.FAILED,
                                         status=codex_status(CallState.FAILED), step=0, reason="why" + HOSTILE)))
    shown = out.getvalue()
    for visible in ("answer", "second line", "thought", "tool", "call", "why"):
        assert visible in shown
    assert not [c for c in shown if c in "\x1b\x07\x9b\r\u202e" or 0x80 <= ord(c) <= 0x9f], repr(shown)


def test_status_and_turns_tables_are_printable():
    from toolq.cli.terminal import printable

    assert printable("a" + HOSTILE + "b\nc\td") == "a\ufffd\ufffdb\nc\td"
    assert "\n" not in printable("one\ntwo", lines=False)


def test_json_lines_keep_text_readable_and_escape_what_a_terminal_obeys():
    # JSON escapes C0 controls itself; with ensure_ascii=False it left C1 controls and bidi raw.
    from toolq.cli.status import render_json_lines

    out = io.StringIO()
    JsonView(out)(ItemCompleted(item=AgentMessageView(id="m", text="héllo" + HOSTILE)))
    for line in (out.getvalue(), render_json_lines([{"reason": "héllo" + HOSTILE}])):
        assert "héllo" in line
        assert not [c for c in line if c in "\x1b\x07\x9b\r\u202e" or 0x7f <= ord(c) <= 0x9f], repr(line)
    assert json.loads(render_json_lines([{"reason": HOSTILE}]))["reason"] == HOSTILE
