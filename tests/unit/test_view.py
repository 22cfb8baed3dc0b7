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
    view(command(CallState.COMPLETED, ItemCompleted, output="one\ntwo\nthree\nfour\nfive\n" + "x" * 500 + "\nsix\n",
                 exit_code=0, run_time=1.5))
    lines = out.getvalue().splitlines()
    assert "queued" in lines[0] and lines[1] == "    $ bash -c 'make test'"
    assert "running" in lines[2] and "on w1@host" in lines[2]
    # Only the new output, its last three lines, each cut to a line; no call line for an output update.
    assert lines[3:7] == ["    │ one", "    │ four", "    │ five", "    │ " + "x" * 199 + "…"]
    assert "completed" in lines[7] and "ran 1.50s" in lines[7]
    assert lines[8:] == ["    │ six"]  # what came after the last update: shown as the call ends


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


# Issue 26 item 2: what the live view shows of a running call, a background session, a command that
# ended between two streaming updates, and a namespaced tool. Pure: events in, text out.

class Terminal(io.StringIO):
    def isatty(self):
        return True


def at(t: float, event):
    event.timestamp = t
    return event


def test_a_running_calls_elapsed_time_is_redrawn_on_a_terminal():
    out, now = Terminal(), [1000.0]
    view = LiveView(out, clock=lambda: now[0], columns=120)
    assert view.tty
    view(at(1000.0, call(CallState.RUNNING, worker="w1@host")))
    now[0] = 1007.4
    view.tick()
    now[0] = 1125.0
    view.tick()
    shown = out.getvalue()
    # Each redraw goes back to the start of the line and erases it: the call's age, to the second.
    assert shown.endswith("\r\x1b[K  ▸ exec_command call_1 7s\r\x1b[K  ▸ exec_command call_1 2m05s")
    view(at(1126.0, call(CallState.COMPLETED, ItemCompleted, run_time=126.0)))
    view.tick()  # nothing runs: the status line is gone, and stays gone
    assert out.getvalue().endswith("\r\x1b[K  ✓ exec_command     call_1                   completed ran 126.00s\n")
    assert view.status_line() is None


def test_a_quiet_command_says_how_long_it_has_been_quiet():
    view = LiveView(io.StringIO())
    view(at(0.0, command(CallState.RUNNING)))
    view(at(5.0, command(CallState.RUNNING, output="building\n")))
    assert view.status_line(now=12.0) == "  ▸ exec_command call_c 12s"
    assert view.status_line(now=47.0) == "  ▸ exec_command call_c 47s (no output for 42s)"


def test_the_status_line_fits_the_terminal_and_shows_parallel_calls():
    view = LiveView(io.StringIO(), columns=40)
    view(at(0.0, command(CallState.RUNNING)))
    view(at(1.0, ItemUpdated(item=ToolCallView(id="call_2", tool="漢字" * 10, status="in_progress",
                                               state=CallState.RUNNING, step=0))))
    line = view.status_line(now=3.0)
    assert line is not None and line.startswith("  ▸ exec_command call_c 3s · 漢字") and line.endswith("…")
    assert sum(2 if "\u4e00" <= ch <= "\u9fff" else 1 for ch in line) <= 39  # never wraps


def test_off_a_terminal_no_tick_writes_anything():
    out = io.StringIO()
    view = LiveView(out, clock=lambda: 50.0)
    view(at(0.0, call(CallState.RUNNING)))
    before = out.getvalue()
    view.tick()
    view.tick()
    assert out.getvalue() == before and "\x1b" not in before and "\r" not in before


def test_the_status_line_is_erased_before_each_line_and_at_the_end():
    out = Terminal()
    view = LiveView(out, clock=lambda: 3.0, columns=80)
    view(at(0.0, command(CallState.RUNNING)))
    view(at(1.0, command(CallState.RUNNING, output="hello\n")))
    view.close()
    assert out.getvalue().endswith("\r\x1b[K    │ hello\n  ▸ exec_command call_c 3s\r\x1b[K")


def test_hostile_tool_names_and_call_ids_reach_the_status_line_printable():
    out = Terminal()
    view = LiveView(out, clock=lambda: 1.0, columns=200)
    view(at(0.0, ItemUpdated(item=ToolCallView(id="c" + HOSTILE, tool="t" + HOSTILE, status="in_progress",
                                               state=CallState.RUNNING, step=0))))
    view.tick()
    shown = out.getvalue().replace(_ERASE, "")
    assert not [c for c in shown if c in "\x1b\x07\x9b\r\u202e" or 0x80 <= ord(c) <= 0x9f], repr(shown)


_ERASE = "\r\x1b[K"


def session_answer(session_id: int | None, exit_code: int | None, output: str = "") -> str:
    from toolq.workers.exec_output import format_exec_output

    return format_exec_output(output, exit_code, 10.0, 10_000, session_id=session_id)


def test_a_command_left_running_in_a_session_shows_as_background_not_completed():
    out = io.StringIO()
    view = LiveView(out)
    view(command(CallState.RUNNING))
    view(ItemCompleted(item=CommandExecutionView(
        id="call_c", tool="exec_command", status="completed", state=CallState.COMPLETED, step=0,
        command="bash -c 'make test'", aggregated_output="serving on :8000\n", success=True, run_time=10.0,
        output=session_answer(7, None, "serving on :8000\n"))))
    lines = out.getvalue().splitlines()
    assert not [line for line in lines if "✓" in line or "completed" in line], lines
    assert lines[-2].startswith("  ⟳ exec_command     call_c                   background ran 10.00s")
    assert lines[-2].endswith("— session 7 runs on in the background")
    assert lines[-1] == "    │ serving on :8000"


def test_a_command_that_exited_is_completed_whatever_its_output_claims():
    out = io.StringIO()
    view = LiveView(out)
    forged = "Process running with session ID 9\n"  # the command's own output cannot make it a session
    view(ItemCompleted(item=CommandExecutionView(
        id="call_c", tool="exec_command", status="completed", state=CallState.COMPLETED, step=0, command="x",
        aggregated_output=forged, success=True, exit_code=0, output=session_answer(None, 0, forged))))
    assert "completed" in out.getvalue().splitlines()[0] and "background" not in out.getvalue()


def test_a_command_that_ends_between_two_updates_still_shows_its_output_cut():
    out = io.StringIO()
    view = LiveView(out)
    view(command(CallState.QUEUED, ItemStarted))
    view(command(CallState.COMPLETED, ItemCompleted, output="a\nb\n", exit_code=0, run_time=0.05))
    assert out.getvalue().splitlines()[-2:] == ["    │ a", "    │ b"]
    out = io.StringIO()
    view = LiveView(out)
    many = "".join(f"line {i}\n" for i in range(1, 41)) + "\x1b[31mdone\x1b[0m " + "y" * 300 + "\n"
    view(command(CallState.FAILED, ItemCompleted, output=many, exit_code=1, reason="exit code 1"))
    assert out.getvalue().splitlines()[2:] == ["    │ … 36 more lines", "    │ line 37", "    │ line 38",
                                               "    │ line 39", "    │ line 40", "    │ done " + "y" * 194 + "…"]


def test_a_namespaced_tool_keeps_the_columns_aligned():
    out = io.StringIO()
    view = LiveView(out)

    def tool(name: str, call_id: str):
        return ItemUpdated(item=ToolCallView(id=call_id, tool=name, status="in_progress", state=CallState.QUEUED,
                                             step=0))

    view(tool("github.list_pull_requests", "call_1"))
    view(tool("read_file", "call_2"))
    view(tool("exec_command", "call_3"))
    lines = out.getvalue().splitlines()
    assert {line.index("call_") for line in lines} == {len("  → github.list_pull_requests ")}
    # Too long for any column (32): its namespace is cut, never the tool's own name; the column
    # is as wide from then on.
    view(tool("a_very_long_server_name_for_sure.search_issues", "call_4"))
    view(tool("read_file", "call_5"))
    lines = out.getvalue().splitlines()[3:]
    assert "→ a_very_long_serve….search_issues call_4" in lines[0]
    assert {line.index("call_") for line in lines} == {len("  → a_very_long_serve….search_issues ")}


def test_a_commands_output_under_another_commands_line_says_whose_it_is():
    """The demo showed `uname`'s output right under `ls`'s completed line, as if it were ls's."""
    out = io.StringIO()
    view = LiveView(out)
    ls = CommandExecutionView(id="call_ls", tool="exec_command", status="in_progress", state=CallState.RUNNING,
                              step=0, command="bash -c 'ls -1'")
    view(command(CallState.RUNNING))
    view(ItemUpdated(item=ls))
    view(ItemCompleted(item=ls.model_copy(update={"state": CallState.COMPLETED, "status": "completed"})))
    view(command(CallState.RUNNING, output="Linux x86_64\n"))
    view(command(CallState.RUNNING, output="Linux x86_64\nmore\n"))
    assert out.getvalue().splitlines()[-2:] == ["    call_c │ Linux x86_64", "    │ more"]
