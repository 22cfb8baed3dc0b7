"""`toolq status` / `toolq turns` rendering: ledger records in, a table or JSON lines out."""

from __future__ import annotations

import io
import json

from toolq.cli.status import call_row, render_status, render_turns, status_cmd, turn_row, turns_cmd
from toolq.core.settings import Settings

NOW = 1_700_000_100.0

DONE = {"call_id": "call_a", "task_id": "turn-1:0:0:abc", "tool": "sleep_echo", "state": "completed",
        "worker": "w1@host", "queued_at": "1700000000.0", "started_at": "1700000000.5",
        "finished_at": "1700000002.75"}
RUNNING = {"call_id": "call_b", "task_id": "turn-1:0:1:def", "tool": "exec_command", "state": "running",
           "worker": "w2@host", "started_at": str(NOW - 4.0)}
REJECTED = {"call_id": "call_c", "task_id": "", "tool": "no_such_tool", "state": "rejected",
            "queued_at": "1700000000.0", "finished_at": "1700000000.0"}
CANCELLED_BEFORE_START = {"call_id": "call_d", "task_id": "turn-1:0:3:0a1", "tool": "sleep_echo",
                          "state": "cancelled", "worker": "w1@host", "finished_at": "1700000001.0"}
TURN = {"state": "running", "started_at": "1700000000.0", "prompt": "fix the tests", "workspace": "/w"}


def test_duration_is_finished_minus_started():
    assert call_row(DONE, NOW) == {"tool": "sleep_echo", "call_id": "call_a", "task_id": "turn-1:0:0:abc",
                                   "state": "completed", "worker": "w1@host", "queue_wait": 0.5,
                                   "run_time": 2.25}


def test_durations_keep_short_calls_visible():
    from toolq.cli.status import _cell

    assert [_cell("duration", {"duration": d}) for d in (0.0123, 2.25, 100.0)] == ["12ms", "2.25s", "100.0s"]


def test_a_running_call_counts_up_to_now():
    assert call_row(RUNNING, NOW)["run_time"] == 4.0


def test_a_call_that_never_started_has_no_duration_and_a_rejected_one_no_task_id():
    assert call_row(CANCELLED_BEFORE_START, NOW)["run_time"] is None
    row = call_row(REJECTED, NOW)
    assert row["task_id"] is None and row["worker"] is None and row["run_time"] is None


def test_status_table_has_one_aligned_row_per_call_and_dashes_for_missing_fields():
    text = render_status("turn-1", TURN, [DONE, RUNNING, REJECTED], NOW)
    head, header, *rows = text.splitlines()
    assert head == "turn turn-1  running  100.0s  3 call(s)"
    assert header.split() == ["TOOL", "CALL_ID", "TASK_ID", "STATE", "WORKER", "QUEUE_WAIT", "RUN_TIME"]
    assert rows[0].split() == ["sleep_echo", "call_a", "turn-1:0:0:abc", "completed", "w1@host", "500ms", "2.25s"]
    assert rows[1].split() == ["exec_command", "call_b", "turn-1:0:1:def", "running", "w2@host", "-", "4.00s"]
    assert rows[2].split() == ["no_such_tool", "call_c", "-", "rejected", "-", "-", "-"]
    # columns line up under their headers, and no line ends in spaces
    col = header.index("STATE")
    assert [r[col:].split()[0] for r in rows] == ["completed", "running", "rejected"]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_calls_are_listed_in_call_order_and_the_models_long_names_are_cut():
    """A new user's rows came as the ledger claimed them (_0,_1,_2,_5,_4,_3); a red-team helper's
    300 KB call_id made the table as wide."""
    calls = [{**DONE, "call_id": f"call_{i}", "step": str(step), "output_index": str(i)}
             for step, i in ((0, 0), (0, 1), (0, 5), (0, 4), (1, 0), (0, 3))]
    calls[-1]["call_id"] = "x" * 300_000
    rows = render_status("turn-1", TURN, calls, NOW).splitlines()[2:]
    assert [r.split()[1] for r in rows] == ["call_0", "call_1", "x" * 47 + "…", "call_4", "call_5", "call_0"]
    assert max(map(len, rows)) < 200
    assert json.loads(render_status("turn-1", TURN, calls, NOW, as_json=True).splitlines()[2])["call_id"] == "x" * 300_000


def test_status_shows_the_turns_error():
    text = render_status("turn-1", {**TURN, "state": "failed", "error": "model said no"}, [], NOW)
    assert text.splitlines()[1:] == ["error: model said no", "no calls"]


def test_status_json_is_one_object_per_call_with_the_turn_id():
    lines = render_status("turn-1", TURN, [DONE, REJECTED], NOW, as_json=True).splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows[0] == {"turn_id": "turn-1", **call_row(DONE, NOW)}
    assert rows[1]["task_id"] is None and rows[1]["run_time"] is None


def test_turns_table_cuts_long_prompts_to_one_line():
    long_prompt = "refactor\nthe whole " + "x" * 100
    rows = [turn_row("turn-2", {**TURN, "state": "completed", "finished_at": "1700000030.0",
                                "prompt": long_prompt}, 4, NOW),
            turn_row("turn-1", TURN, 0, NOW)]
    header, first, second = render_turns(rows).splitlines()
    assert header.split() == ["TURN_ID", "STATE", "STARTED", "DURATION", "CALLS", "PROMPT"]
    assert first.startswith("turn-2") and " completed " in first and " 30.0s " in first
    assert first.endswith("…") and "\n" not in first and "refactor the whole xxx" in first
    assert second.split()[-1] == "tests" and "100.0s" in second


def test_turns_json_keeps_timestamps_and_the_full_prompt():
    row = turn_row("turn-1", TURN, 2, NOW)
    (line,) = render_turns([row], as_json=True).splitlines()
    assert json.loads(line) == {"turn_id": "turn-1", "state": "running", "started_at": 1700000000.0,
                                "finished_at": None, "duration": 100.0, "calls": 2, "prompt": "fix the tests",
                                "error": None}
    assert render_turns([]) == "no turns in the ledger\n"


def test_status_and_turns_need_redis_url_or_a_running_embedded_stack(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # none announced there
    err = io.StringIO()
    assert status_cmd(Settings(), "turn-1", err=err) == 2
    assert "REDIS_URL" in err.getvalue()
    err = io.StringIO()
    assert turns_cmd(Settings(), err=err) == 2
    assert "REDIS_URL" in err.getvalue()


def test_turns_rejects_a_limit_below_one():
    err = io.StringIO()
    assert turns_cmd(Settings(redis_url="redis://127.0.0.1:1/0"), limit=0, err=err) == 2
    assert "--limit" in err.getvalue()


def test_an_orphaned_turn_has_no_duration_growing_with_the_clock():
    """Nobody drives it: counting up to now read as a turn still at work (a newcomer's report)."""
    from toolq.cli.status import elapsed

    assert elapsed({"state": "orphaned", "started_at": "100"}, now=5000.0) is None
    assert elapsed({"state": "running", "started_at": "100"}, now=5000.0) == 4900.0
