"""Reasoning survives `store: false` (issue 10 item 2): by default a reasoning model is asked for
encrypted reasoning, and a reasoning item the server could not resolve is never sent back."""

from __future__ import annotations

import pytest

from toolq.dev.fake_model import builders as b

pytestmark = pytest.mark.integration


def reason_then_call(encrypted_content: str | None) -> list:
    return [[b.reasoning("think", encrypted_content=encrypted_content, id="rs_1"),
             b.function_call("sleep_echo", {}, "call_1")],
            [b.message("done")]]


def test_a_reasoning_model_gets_encrypted_reasoning_by_default_and_it_is_carried_back(fleet, drive):
    run = drive(reason_then_call("gAAAA-blob"))  # the default model, gpt-5.5; TOOLQ_REASONING_EFFORT unset
    assert run.outcome.status == "completed", run.outcome.error
    for body in run.requests:
        assert (body["store"], body["reasoning"], body["include"]) == (
            False, {"effort": "medium"}, ["reasoning.encrypted_content"])
    replayed = [i for i in run.input_of(1) if i["type"] == "reasoning"]
    assert [(i["id"], i["encrypted_content"]) for i in replayed] == [("rs_1", "gAAAA-blob")]


def test_reasoning_without_encrypted_content_is_not_sent_back(fleet, drive):
    run = drive(reason_then_call(None))  # a server that ignored the include
    assert run.outcome.status == "completed", run.outcome.error
    second = run.input_of(1)
    assert [i["type"] for i in second] == ["message", "function_call", "function_call_output"]
    assert run.session.history.repairs["reasoning_without_encrypted_content_dropped"] == 1


@pytest.mark.parametrize("model, setting, expected", [
    ("gpt-4.1", "auto", None),  # not a reasoning model: no reasoning field, no include
    ("gpt-5.5", "off", None),
    ("gpt-4.1", "high", {"effort": "high"}),
])
def test_the_setting_decides_the_reasoning_field(fleet, drive, model, setting, expected):
    run = drive([[b.message("done")]], model=model, reasoning_effort=setting)
    body = run.requests[0]
    assert body.get("reasoning") == expected
    assert body.get("include") == (["reasoning.encrypted_content"] if expected else None)
