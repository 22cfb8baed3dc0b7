"""Hostile input from the model or a tool never raises out of the turn loop (issue 13, item 5).

Real Redis, real prefork workers, the fake model over TCP. Each turn must end normally, with
every request paired (the `drive` fixture checks every body) and the bad call answered.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.integration.hostile_tools as hostile_tools
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import WorkerProcess

pytestmark = pytest.mark.integration

DEPTH = 100_000


def final(text="done"):
    return [b.message(text)]


def test_arguments_nested_100k_deep_get_a_parse_error_and_the_turn_goes_on(fleet, drive):
    nested = '{"text": ' + "[" * DEPTH + "]" * DEPTH + "}"
    run = drive([
        [b.function_call("sleep_echo", nested, "call_deep"),
         b.function_call("sleep_echo", {"text": "fine"}, "call_fine")],
        final(),
    ])
    assert run.outcome.status == "completed", run.outcome.error
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_deep"] == "failed to parse function arguments: nesting too deep (more than 128 levels)"
    assert json.loads(outputs["call_fine"])["text"] == "fine"
    assert run.outcome.final_message == "done"


def test_a_lone_surrogate_in_a_path_argument_gets_a_parse_error(fleet, drive, tmp_path):
    (tmp_path / "real.txt").write_text("hello\n")
    # The JSON escape is valid JSON; the string it makes is not valid Unicode.
    run = drive([
        [b.function_call("read_file", '{"file_path": "real\\ud800.txt"}', "call_sur"),
         b.function_call("list_dir", '{"dir_path": "\\udcff"}', "call_sur2"),
         b.function_call("read_file", {"file_path": "real.txt"}, "call_ok")],
        final(),
    ], workspace=tmp_path)
    assert run.outcome.status == "completed", run.outcome.error
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_sur"] == ("failed to parse function arguments: lone surrogate \\ud800 in a string: "
                                   "not valid Unicode")
    assert outputs["call_sur2"].endswith("lone surrogate \\udcff in a string: not valid Unicode")
    assert "hello" in outputs["call_ok"]


def test_a_lone_surrogate_in_an_item_is_replaced_and_the_history_stays_sendable(fleet, drive):
    # A raw `\ud800` escape in the frame itself: in the call_id, a message and the custom input.
    run = drive([
        [b.message("half a pair: \ud83d"),
         b.function_call("sleep_echo", {"text": "x"}, "call_\udc00")],
        final(),
    ])
    assert run.outcome.status == "completed", run.outcome.error
    second = run.input_of(1)
    assert [o["call_id"] for o in run.outputs_of(1)] == ["call_\ufffd"]
    assert any("half a pair: \ufffd" in json.dumps(i, ensure_ascii=False) for i in second)


def test_a_non_utf8_file_name_in_a_tool_output_becomes_a_replacement_character(redis_server, drive, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    w = WorkerProcess(redis_server.url, name="hostile1@test", queues=[hostile_tools.QUEUE], concurrency=1,
                      tools=[TEST_TOOLS, "tests.integration.hostile_tools"], env=WORKER_ENV, logdir=tmp_path)
    with w:
        run = drive([[b.function_call("list_raw_names", {}, "call_names")], final()], workspace=workspace,
                    tools=[TEST_TOOLS, "tests.integration.hostile_tools"])
    assert run.outcome.status == "completed", run.outcome.error
    output = run.outputs_of(1)[0]["output"]
    assert output == "caf\ufffd-latin1.txt"
    output.encode("utf-8")  # what Redis, the next request and the terminal all do with it


#: A bound for the cut tests: far over any event the fake model sends here (its `response.created`
#: and `response.completed` repeat the request's tools, about 12 KB), far under the 64 KB cut one.
BOUND = 32 * 1024


def oversized_frame(type_: str, size: int, **fields) -> dict:
    event = {"type": type_, **fields, "pad": "x" * size}
    return b.raw_frame(f"event: {type_}\ndata: {json.dumps(event)}\n\n")


def test_an_sse_event_over_the_default_bound_is_dropped_and_counted(fleet, drive):
    # 20 MiB of one text delta: the default bound is 8 MiB, and the live view only loses a piece.
    run = drive([
        [oversized_frame("response.output_text.delta", 20 * 1024 * 1024, item_id="msg_1", output_index=0,
                         delta="never seen"),
         b.function_call("sleep_echo", {"text": "after"}, "call_after")],
        final(),
    ])
    assert run.outcome.status == "completed", run.outcome.error
    assert run.session.rt.client.skipped["oversize"] == 1
    assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "after"
    assert len(run.requests) == 2  # nothing was retried


def test_a_cut_output_item_done_breaks_the_stream_and_the_request_is_retried(fleet, drive):
    cut_call = {"type": "function_call", "call_id": "call_cut", "name": "sleep_echo", "arguments": "{}"}
    run = drive([
        [b.function_call("sleep_echo", {"text": "committed"}, "call_kept"),
         oversized_frame("response.output_item.done", 64 * 1024, output_index=1, item=cut_call)],
        [b.message("retried")],
    ], max_sse_event_bytes=BOUND)
    assert run.outcome.status == "completed", run.outcome.error
    assert run.outcome.final_message == "retried"
    assert run.session.rt.client.skipped["oversize"] == 1
    # The committed call ran and its output went back with the retried request; the cut one never
    # committed, so it appears nowhere (and needs no output).
    retried = run.input_of(1)
    assert [i.get("call_id") for i in retried if i["type"].startswith("function_call")] == ["call_kept"] * 2
    assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "committed"
    reconnect = [e["message"] for e in run.events if e["type"] == "error"]
    assert len(reconnect) == 1 and reconnect[0].startswith("Reconnecting... 1/5 (stream disconnected before "
                                                           "completion: a response.output_item.done event of ")
    assert "TOOLQ_MAX_SSE_EVENT_BYTES" in reconnect[0]


def test_a_cut_response_completed_still_completes_the_response(fleet, drive):
    # It repeats the whole output, so it is the event most likely to pass the bound: no retry.
    run = drive([
        [b.function_call("sleep_echo", {"text": "kept"}, "call_kept"),
         oversized_frame("response.completed", 64 * 1024, response={"id": "resp_big", "output": []})],
        final(),
    ], max_sse_event_bytes=BOUND)
    assert run.outcome.status == "completed", run.outcome.error
    assert len(run.requests) == 2
    assert not [e for e in run.events if e["type"] == "error"]
    assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "kept"


def test_calls_repeating_an_output_index_and_call_id_each_run_and_answer_for_themselves(fleet, drive):
    """A server that repeats both: the task id is toolq's own count, so each call is its own task."""
    def done_at(index: int, text: str) -> dict:
        call = {"type": "function_call", "call_id": "dup", "name": "sleep_echo", "arguments": json.dumps({"text": text})}
        event = {"type": "response.output_item.done", "output_index": index, "item": call}
        return b.raw_frame(f"event: response.output_item.done\ndata: {json.dumps(event)}\n\n")

    run = drive([[done_at(0, "A"), done_at(0, "B"), done_at(0, "C")], final()])
    assert run.outcome.status == "completed", run.outcome.error
    assert [json.loads(o["output"])["text"] for o in run.outputs_of(1)] == ["A", "B", "C"]


def test_a_deeply_nested_sse_frame_is_skipped_and_counted(fleet, drive):
    deep = '{"type": "response.output_item.done", "item": ' + "[" * DEPTH + "]" * DEPTH + "}"
    run = drive([
        [b.raw_frame(f"event: response.output_item.done\ndata: {deep}\n\n"),
         b.function_call("sleep_echo", {"text": "after"}, "call_after")],
        final(),
    ])
    assert run.outcome.status == "completed", run.outcome.error
    assert run.session.rt.client.skipped["too_deep"] == 1
    assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "after"


# --- random hostile responses through the real turn loop -----------------------------------------

HOSTILE_ARGS = st.sampled_from([
    '{"text": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"text": "\\ud800"}',
    '{"file_path": "\\udcff"}',
    '{"text": "\ud83d"}',
    "{not json",
    '{"ms": "soon"}',
    '{"text": "ok"}',
    "",
])
HOSTILE_TEXT = st.sampled_from(["plain", "half a pair \ud83d", "\udcff\udcfe", "caf\u00e9"])


@st.composite
def hostile_steps(draw):
    kind = draw(st.sampled_from(["call", "call", "custom", "message", "deep_frame", "huge_delta", "garbage"]))
    n = draw(st.integers(0, 99))
    if kind == "call":
        name = draw(st.sampled_from(["sleep_echo", "read_file", "list_dir", "no_such_tool"]))
        return b.function_call(name, draw(HOSTILE_ARGS), draw(st.sampled_from([f"call_{n}", f"call_{n}\udc00"])))
    if kind == "custom":
        return b.custom_tool_call(draw(st.sampled_from(["apply_patch", "no_such_custom"])), draw(HOSTILE_TEXT),
                                  f"call_c{n}")
    if kind == "message":
        return b.message(draw(HOSTILE_TEXT))
    if kind == "deep_frame":
        return b.raw_frame("data: {\"type\": \"response.output_item.done\", \"item\": " + "[" * 3000 + "]" * 3000
                           + "}\n\n")
    if kind == "huge_delta":
        return oversized_frame("response.output_text.delta", 20_000, delta="x")
    return b.raw_frame("data: \udcff\x00{\n\n".encode("utf-8", "surrogateescape").decode("utf-8", "replace"))


@settings(max_examples=6, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.lists(hostile_steps(), min_size=1, max_size=4), min_size=1, max_size=2))
def test_random_hostile_responses_end_the_turn_normally_with_every_call_answered(fleet, drive, responses):
    # One sound call per response, so the turn goes on to the final message whatever else is in it.
    script = [[*steps, b.function_call("sleep_echo", {"text": "ok"}, f"call_ok{k}")]
              for k, steps in enumerate(responses)]
    run = drive([*script, final()], max_sse_event_bytes=8 * 1024)
    # `drive` checked that every request was paired; the turn ended on its own terms.
    assert run.outcome.status == "completed", run.outcome.error
    assert run.outcome.final_message == "done"
    assert len(run.requests) == len(script) + 1
    for k in range(1, len(run.requests)):
        body = run.input_of(k)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        calls = [i for i in body if i["type"] in ("function_call", "custom_tool_call")]
        outputs = [i for i in body if i["type"] in ("function_call_output", "custom_tool_call_output")]
        assert len(calls) == len(outputs)
