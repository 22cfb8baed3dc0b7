"""A task's return value: Celery's repr of it (log line, Flower) carries sizes, its JSON the output."""

from __future__ import annotations

from celery.utils.saferepr import saferepr
from kombu.utils.json import dumps, loads

from toolq.workers.summary import Summarised, returned, summary

RESULT = {"call_id": "c", "output": "SECRET=hunter2\n" * 100, "status": "completed", "success": True,
          "exit_code": 0, "tools": None}


def test_celerys_repr_shows_status_and_sizes_but_not_the_output():
    shown = saferepr(returned(RESULT, log_output=False), 1024)
    assert "hunter2" not in shown
    assert "'status': 'completed'" in shown and "'exit_code': 0" in shown
    assert f"'output_chars': {len(RESULT['output'])}" in shown


def test_kombus_json_is_the_whole_result():
    assert loads(dumps({"result": Summarised(RESULT)}))["result"] == RESULT


def test_opting_in_returns_the_result_itself():
    assert returned(RESULT, log_output=True) is RESULT
    assert "hunter2" in saferepr(returned(RESULT, log_output=True), 1024)


def test_structured_output_and_tool_search_are_counted():
    parts = {"output": [{"type": "input_text", "text": "abc"}, {"type": "input_image", "image_url": "x"}],
             "status": "completed", "tools": [{"name": "t"}]}
    assert summary(parts) == {"status": "completed", "output_parts": 2, "output_chars": 3, "tools": 1}
