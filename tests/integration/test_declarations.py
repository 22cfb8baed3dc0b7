"""Declarations that used to change shape on the way to the model, run through real workers:
an argument named `title` under a strict schema, and a tool declared by `parameters=` alone."""

from __future__ import annotations

import pytest

from toolq.dev.fake_model import builders as b

pytestmark = pytest.mark.integration


def test_keyword_named_arguments_reach_the_tool_and_the_model_sees_them_in_the_schema(fleet, drive):
    run = drive([[b.function_call("file_note", {"title": "t", "type": "memo"}, "call_note", namespace="notes")],
                 [b.message("done")]])
    assert run.outcome.status == "completed", run.outcome.error
    notes = next(t for t in run.requests[0]["tools"] if t.get("name") == "notes")
    schema = notes["tools"][0]["parameters"]
    assert (list(schema["properties"]), schema["required"]) == (["title", "type"], ["title", "type"])
    assert [o["output"] for o in run.outputs_of(1)] == ["filed memo 't'"]


def test_a_tool_declared_by_its_parameters_is_a_function_tool_and_gets_a_dict(fleet, drive):
    run = drive([[b.function_call("count_tags", {"tags": ["a", "b"]}, "call_ok"),
                  b.function_call("count_tags", {"tags": "a"}, "call_bad")],
                 [b.message("done")]])
    assert run.outcome.status == "completed", run.outcome.error
    spec = next(t for t in run.requests[0]["tools"] if t.get("name") == "count_tags")
    assert (spec["type"], spec["parameters"]["required"]) == ("function", ["tags"])
    assert [o["output"] for o in run.outputs_of(1)] == [
        "dict with 2 tags",
        "failed to parse function arguments: invalid value at `tags`: 'a' is not of type 'array'",
    ]
