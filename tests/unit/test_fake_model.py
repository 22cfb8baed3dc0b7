"""The scripted fake Responses server: real SSE over TCP, checked with raw httpx and the openai SDK."""

from __future__ import annotations

import json
import subprocess
import sys
import typing

import httpx
import openai
import pytest
from openai.types.responses.response_stream_event import ResponseStreamEvent

from tests.paths import SSE_FIXTURES
from toolq.dev.fake_model import FakeModel
from toolq.dev.fake_model.builders import (
    custom_tool_call,
    cut_after,
    error_event,
    failed,
    function_call,
    gate,
    http_error,
    incomplete,
    malformed_frame,
    message,
    reasoning,
    replay,
    response,
    tool_search_call,
    web_search_call,
)
from toolq.orchestrator.protocol.events import EventDecoder, iter_sse_data

SSE = SSE_FIXTURES

#: SDK 3.57.0 event class per `type`, from its own discriminated union.
SDK_EVENTS = {
    typing.get_args(c.model_fields["type"].annotation)[0]: c
    for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}

EVERY_ITEM = [
    reasoning(["Two lookups, then a patch."], encrypted_content="enc"),
    message("Working on it."),
    function_call("exec_command", {"cmd": "ls"}, "call_1"),
    function_call("create_event", {"title": "x"}, "call_2", namespace="mcp__calendar"),
    custom_tool_call("apply_patch", "*** Begin Patch\n*** End Patch\n", "call_3"),
    tool_search_call({"query": "calendar"}, "call_4"),
    web_search_call("weather"),
]


def post(fake: FakeModel, body: dict | None = None, **kw) -> httpx.Response:
    """A streamed request, as toolq's client sends it."""
    body = {**(body or {"model": "m", "input": []}), "stream": True}
    return httpx.post(fake.base_url + "/responses", json=body, timeout=10, **kw)


def frames(resp: httpx.Response) -> list[dict]:
    return [json.loads(d) for d in iter_sse_data(resp.content)]


def test_records_every_request_and_answers_past_the_script_with_an_http_error_saying_so():
    with FakeModel([[message("one")]]) as fake:
        replies = [
            post(fake, {"model": "m", "input": [{"role": "user", "content": f"q{i}"}]}, headers={"X-Probe": str(i)})
            for i in range(2)
        ]
    assert [r["input"][0]["content"] for r in fake.requests] == ["q0", "q1"]
    assert [h["X-Probe"] for h in fake.request_headers] == ["0", "1"]
    assert len(fake.request_times) == 2 and fake.request_times[0] <= fake.request_times[1]
    assert replies[0].status_code == 200
    # Past the end the model does not "speak": an error, so no run mistakes it for an answer.
    assert replies[1].status_code == 400
    error = replies[1].json()["error"]
    assert error["code"] == "script_exhausted"
    assert error["message"] == ("fake model: script exhausted: all 1 scripted responses were served; "
                                "restart `toolq fake-model`, or start it with --loop")


def test_the_toolq_client_ends_at_once_on_an_exhausted_script():
    import asyncio

    from toolq.orchestrator.model_client import ModelClient, ModelError, ModelSettings, build_request

    async def ask(base_url: str) -> ModelError:
        async with ModelClient(ModelSettings(base_url=base_url, api_key=None)) as client:
            with pytest.raises(ModelError) as info:
                async for _ in client.stream(build_request("m", [], [])):
                    pass
            return info.value

    with FakeModel([]) as fake:
        error = asyncio.run(ask(fake.base_url))
    assert not error.retryable and "script exhausted" in error.message and len(fake.requests) == 1


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def texts(resp: httpx.Response) -> list[str]:
    return [f["delta"] for f in frames(resp) if f["type"] == "response.output_text.delta"]


CALL_THEN_ANSWER = [[function_call("exec_command", {"cmd": "ls"}, "call_1")], [message("done")]]
CALL_ITEMS = [{"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "call_1"},
              {"type": "function_call_output", "call_id": "call_1", "output": "x"}]


def names(resp: httpx.Response) -> list[str | None]:
    return [f["item"].get("name") for f in frames(resp) if f["type"] == "response.output_item.done"]


def test_loop_serves_the_script_again_for_the_next_run():
    with FakeModel(CALL_THEN_ANSWER, loop=True) as fake:
        first_run = [post(fake, {"input": [user("a")]}), post(fake, {"input": [user("a"), *CALL_ITEMS]})]
        second_run = [post(fake, {"input": [user("a")]}), post(fake, {"input": [user("a"), *CALL_ITEMS]})]
    for run in (first_run, second_run):
        assert [r.status_code for r in run] == [200, 200]
        assert names(run[0]) == ["exec_command"] and texts(run[1]) == ["done"]


def test_loop_restarts_a_run_cut_short_and_a_session_that_goes_on():
    with FakeModel(CALL_THEN_ANSWER, loop=True) as fake:
        cut_short = post(fake, {"input": [user("a")]})  # Ctrl-C: the run never asked again
        continued = post(fake, {"input": [user("a"), *CALL_ITEMS, user("turn aborted"), user("b")]})
    assert names(cut_short) == names(continued) == ["exec_command"]


def test_loop_does_not_restart_a_retry_within_a_run():
    with FakeModel([[http_error(500)], [message("after the retry")]], loop=True) as fake:
        replies = [post(fake, {"input": [user("a")]}) for _ in range(2)]
    assert [r.status_code for r in replies] == [500, 200] and texts(replies[1]) == ["after the retry"]


def test_loop_wraps_around_when_a_run_outlasts_the_script():
    with FakeModel([[message("one")], [message("two")]], loop=True) as fake:
        got = [texts(post(fake, {"input": [user("a"), *CALL_ITEMS * k]})) for k in range(3)]  # one run, growing
    assert got == [["one"], ["two"], ["one"]]


def test_loop_restarts_when_a_run_cancelled_after_its_first_response_is_run_again():
    """A new user's second `toolq run` with the same prompt, after one cancelled mid-call, was taken
    for a retry of the first and got the script's second response."""
    with FakeModel(CALL_THEN_ANSWER, loop=True) as fake:
        runs = [post(fake, {"input": [user("a")]}) for _ in range(2)]
    assert names(runs[0]) == names(runs[1]) == ["exec_command"]


def test_an_empty_script_is_exhausted_even_with_loop():
    with FakeModel([], loop=True) as fake:
        resp = post(fake)
    assert resp.status_code == 400 and "the script is empty" in resp.json()["error"]["message"]


def test_each_request_replays_its_own_scripted_response():
    with FakeModel([[message("one")], [message("two")]]) as fake:
        got = [[f["delta"] for f in frames(post(fake)) if f["type"] == "response.output_text.delta"] for _ in range(2)]
    assert got == [["one"], ["two"]]


def test_sse_framing_event_lines_and_contiguous_sequence_numbers():
    with FakeModel([response(message("Hello there, this is a longer message."), chunk_size=10)]) as fake:
        resp = post(fake)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["transfer-encoding"] == "chunked"
    blocks = resp.text.split("\n\n")
    assert blocks[-1] == ""  # the last event is terminated by a blank line too
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line == f"event: {json.loads(data_line[len('data: '):])['type']}"
    events = frames(resp)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done, completed = events[-2]["item"], events[-1]["response"]
    assert completed["status"] == "completed" and completed["output"] == [done]
    assert completed["usage"]["total_tokens"] == completed["usage"]["input_tokens"] + completed["usage"]["output_tokens"]


def test_added_item_is_empty_and_done_item_is_final():
    with FakeModel([[function_call("f", {"a": 1}, "call_x")]]) as fake:
        events = frames(post(fake))
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    done = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    assert (added["arguments"], added["status"]) == ("", "in_progress")
    assert (done["arguments"], done["status"], done["call_id"]) == ('{"a": 1}', "completed", "call_x")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == done["arguments"]


def test_every_item_kind_comes_back_as_scripted_through_our_decoder():
    with FakeModel([EVERY_ITEM]) as fake:
        resp = post(fake)
    decoder = EventDecoder()
    done = [e.item.to_wire() for e in map(decoder.decode, iter_sse_data(resp.content)) if e and e.kind == "item_done"]
    assert [d["type"] for d in done] == [i["type"] for i in EVERY_ITEM]
    assert done[3]["namespace"] == "mcp__calendar" and done[3]["call_id"] == "call_2"
    assert done[4]["input"] == "*** Begin Patch\n*** End Patch\n"
    assert done[5]["arguments"] == {"query": "calendar"} and done[5]["execution"] == "client"
    assert decoder.skipped == {}


def test_failure_directives_end_with_the_matching_terminal_event():
    script = [
        [message("partial"), failed("server_error", "boom")],
        [incomplete("max_output_tokens")],
        [error_event("rate_limit_exceeded", "try again in 2s", type="tokens")],
    ]
    with FakeModel(script) as fake:
        ends = [frames(post(fake))[-2:] for _ in script]
    assert ends[0][-1]["type"] == "response.failed"
    assert ends[0][-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert ends[0][-1]["response"]["output"][0]["content"][0]["text"] == "partial"
    assert ends[1][-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    error, failed_event = ends[2]
    assert error["error"] == {"type": "tokens", "code": "rate_limit_exceeded", "message": "try again in 2s", "param": None}
    assert failed_event["type"] == "response.failed"


def test_http_error_sends_status_headers_and_openai_error_body():
    body = {"error": {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    with FakeModel([[http_error(429, body, {"Retry-After": "2"})], [http_error(503, "scripted unavailable")]]) as fake:
        first, second = post(fake), post(fake)
    assert (first.status_code, first.headers["retry-after"], first.json()) == (429, "2", body)
    assert (second.status_code, second.text) == (503, "scripted unavailable")


def test_clean_cut_ends_the_body_without_a_terminal_event():
    with FakeModel([[message("a"), cut_after()]]) as fake:
        types = [e["type"] for e in frames(post(fake))]
    assert types[-1] == "response.output_item.done"


def test_cut_after_n_events_counts_from_response_created():
    with FakeModel([[message("a"), cut_after(3)]]) as fake:
        types = [e["type"] for e in frames(post(fake))]
    assert types == ["response.created", "response.in_progress", "response.output_item.added"]


def test_unclean_cut_drops_the_connection_mid_body():
    with FakeModel([[message("a"), cut_after(2, clean=False)]]) as fake:
        with pytest.raises(httpx.RemoteProtocolError):
            post(fake)


def test_malformed_frame_is_written_where_it_sits():
    with FakeModel([[message("a"), malformed_frame(), message("b")]]) as fake:
        resp = post(fake)
    decoder = EventDecoder()
    kinds = [e.kind for e in map(decoder.decode, iter_sse_data(resp.content)) if e and e.kind == "item_done"]
    assert kinds == ["item_done", "item_done"]
    assert decoder.skipped == {"malformed_json": 1}
    assert resp.text.index("data: {\"type\": \"response.output_text.delta\", \"delta\": \n") < resp.text.index('"b"')


@pytest.mark.parametrize(
    "scripted",
    [[function_call("f", "{}", "call_1"), gate()], response(function_call("f", "{}", "call_1"), gate=True)],
    ids=["gate-step", "gate-option"],
)
def test_gate_holds_the_stream_until_released(scripted):
    with FakeModel([scripted]) as fake:
        with httpx.Client(timeout=10) as client, client.stream("POST", fake.base_url + "/responses",
                                                               json={"stream": True}) as resp:
            lines = resp.iter_lines()
            seen = []
            while "response.output_item.done" not in seen:
                line = next(lines)
                if line.startswith("event: "):
                    seen.append(line[len("event: "):])
            fake.release()
            rest = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    assert "response.completed" not in seen
    assert rest == ["response.completed"]


def test_replay_serves_a_recording_verbatim_with_its_last_blank_line(tmp_path):
    path = SSE / "sse-text-message.txt"
    with FakeModel([[replay(path)]]) as fake:
        resp = post(fake)
    assert resp.content == path.read_bytes() + b"\n\n"


def test_json_script_file_with_shorthands_and_a_relative_replay(tmp_path):
    (tmp_path / "rec.sse").write_text('event: response.created\ndata: {"type":"response.created","response":{"id":"r9"}}\n\n')
    (tmp_path / "script.json").write_text(
        json.dumps(
            {
                "responses": [
                    [{"type": "message", "text": "hi"}, {"type": "function_call", "name": "f", "arguments": {"x": 1}}],
                    [{"directive": "replay", "path": "rec.sse"}],
                    "just text",
                ]
            }
        )
    )
    with FakeModel(tmp_path / "script.json") as fake:
        first, second, third = frames(post(fake)), frames(post(fake)), frames(post(fake))
    done = [e["item"] for e in first if e["type"] == "response.output_item.done"]
    assert done[0]["content"][0]["text"] == "hi"
    assert (done[1]["arguments"], done[1]["call_id"]) == ('{"x": 1}', "call_fake0001_1")
    assert second == [{"type": "response.created", "response": {"id": "r9"}}]
    assert third[-2]["item"]["content"][0]["text"] == "just text"


def test_built_in_demo_is_the_documented_deterministic_conversation():
    bodies = []
    for _ in range(2):
        with FakeModel() as fake:
            bodies.append([post(fake, {"model": "m", "input": []}).content for _ in range(3)])
    assert bodies[0] == bodies[1]
    done = [[e["item"] for e in frames(httpx.Response(200, content=b)) if e["type"] == "response.output_item.done"]
            for b in bodies[0]]
    assert [i["type"] for i in done[0]] == ["reasoning", "function_call", "function_call"]
    assert [json.loads(i["arguments"]) for i in done[0][1:]] == [{"cmd": "uname -sm"}, {"cmd": "ls -1"}]
    patch, plan = done[1]
    assert (patch["type"], patch["name"]) == ("custom_tool_call", "apply_patch")
    assert patch["input"] == "*** Begin Patch\n*** Add File: hello.txt\n+Hello from toolq\n*** End Patch\n"
    assert (plan["name"], sorted(json.loads(plan["arguments"]))) == ("update_plan", ["explanation", "plan"])
    assert [i["type"] for i in done[2]] == ["message"]


@pytest.mark.parametrize("loop", [False, True])
def test_toolq_fake_model_prints_its_base_url_and_serves_the_demo(loop):
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolq.cli.main", "fake-model", "--port", "0", *(["--loop"] if loop else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base_url = proc.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        replies = [httpx.post(base_url + "/responses", json={"model": "m", "input": [], "stream": True}, timeout=10)
                   for _ in range(4)]
        assert names(replies[0]) == [None, "exec_command", "exec_command"]
        if loop:
            assert names(replies[3]) == names(replies[0])  # the demo (3 responses) starts again
        else:
            assert replies[3].json()["error"]["code"] == "script_exhausted"
        said = proc.stderr.readline()
        assert said.startswith("serving 3 scripted responses") and ("again for each run" in said) == loop
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_unknown_path_is_404_and_not_recorded():
    with FakeModel([]) as fake:
        resp = httpx.post(fake.base_url + "/chat/completions", json={})
    assert resp.status_code == 404 and fake.requests == []


# --- the official SDK as a conformance client --------------------------------------------------


def sdk(fake: FakeModel) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.base_url, api_key="x", max_retries=0)


def test_openai_sdk_parses_every_event_type_the_fake_emits():
    script = [EVERY_ITEM, [message("partial"), failed()], [incomplete("max_output_tokens")]]
    with FakeModel(script) as fake:
        client = sdk(fake)
        streams = [list(client.responses.create(model="gpt-test", input="hi", stream=True)) for _ in script]
    # The same requests again, read raw, to validate each event strictly against the SDK's models.
    with FakeModel(script) as again:
        raw = [frames(post(again, body)) for body in fake.requests]
    got = [e for stream in streams for e in stream]
    assert [type(e) for e in got] == [SDK_EVENTS[e.type] for e in got]
    emitted = {e["type"] for stream in raw for e in stream}
    assert emitted <= set(SDK_EVENTS)
    assert {e.type for e in got} == emitted
    for event in (e for stream in raw for e in stream):
        SDK_EVENTS[event["type"]].model_validate(event)  # raises if a field is missing or mistyped
    assert streams[0][-1].response.output[3].namespace == "mcp__calendar"
    assert streams[1][-1].type == "response.failed" and streams[1][-1].response.error.code == "server_error"
    assert streams[2][-1].response.incomplete_details.reason == "max_output_tokens"


def test_openai_sdk_stream_helper_rebuilds_the_final_response():
    # `responses.stream()` is the strictest SDK consumer: it wants `response.created` first and
    # one `output_item.added` per index, and it accumulates deltas into the final response.
    with FakeModel([EVERY_ITEM]) as fake:
        with sdk(fake).responses.stream(model="gpt-test", input="hi") as stream:
            final = stream.get_final_response()
    assert [o.type for o in final.output] == [i["type"] for i in EVERY_ITEM]
    assert final.output_text == "Working on it."


def test_openai_sdk_raises_api_error_on_the_real_nested_error_event():
    # The SDK raises on any event with an `error` key (docs/reference/responses-stream.md#what-the-official-sdk-does): real wire shape.
    with FakeModel([[error_event("insufficient_quota", "You exceeded your current quota")]]) as fake:
        with pytest.raises(openai.APIError, match="You exceeded your current quota") as info:
            list(sdk(fake).responses.create(model="gpt-test", input="hi", stream=True))
    assert info.value.code == "insufficient_quota"


def test_openai_sdk_sees_http_errors_with_their_status_and_code():
    body = {"error": {"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": "decimal_below_min_value"}}
    with FakeModel([[http_error(400, body)]]) as fake:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(fake).responses.create(model="gpt-test", input="hi", stream=True)
    assert (info.value.status_code, info.value.code, info.value.param) == (400, "decimal_below_min_value", "temperature")


# --- issue 26: a request without `"stream": true` gets one JSON response, as the Responses API gives --------------


def whole(fake: FakeModel, body: dict) -> httpx.Response:
    return httpx.post(fake.base_url + "/responses", json=body, timeout=10)


@pytest.mark.parametrize("stream", [False, None])
def test_a_request_without_stream_gets_the_response_object_its_stream_would_complete_with(stream):
    script = [EVERY_ITEM, [message("one"), incomplete("max_output_tokens")], [message("x"), failed()]]
    body = {"model": "m", "input": [user("hi")], **({} if stream is None else {"stream": stream})}
    with FakeModel(script) as fake:
        answers = [whole(fake, body) for _ in script]
    with FakeModel(script) as again:  # the same script streamed: request k gets the same ids
        ends = [frames(post(again, body))[-1] for _ in script]
    for answer, end in zip(answers, ends, strict=True):
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == end["response"]  # the same items, usage and status
    assert [e["type"] for e in ends] == ["response.completed", "response.incomplete", "response.failed"]
    first = answers[0].json()
    assert first["object"] == "response" and first["status"] == "completed"
    assert [i["type"] for i in first["output"]] == [i["type"] for i in EVERY_ITEM]
    assert first["usage"]["total_tokens"] == first["usage"]["input_tokens"] + first["usage"]["output_tokens"] > 0


def test_a_request_without_stream_waits_out_gates_and_loses_its_answer_to_a_cut():
    script = [response(message("late"), gate=True), [message("never"), cut_after(None)],
              [error_event("server_error", "boom")]]
    with FakeModel(script) as fake:
        fake.release()
        assert whole(fake, {"input": []}).json()["output"][0]["content"][0]["text"] == "late"
        with pytest.raises(httpx.RemoteProtocolError):
            whole(fake, {"input": []})  # no terminal event: the response never came
        failed_answer = whole(fake, {"input": []})
    assert failed_answer.status_code == 500 and failed_answer.json()["error"]["code"] == "server_error"


def test_the_openai_sdk_gets_a_response_object_without_stream_and_events_with_it():
    # The README's loop written without `stream=True` failed: `'str' object has no attribute 'output'`.
    script = [[function_call("exec_command", {"cmd": "ls"}, "call_1")], [message("Done.")]]
    with FakeModel(script) as fake:
        client = sdk(fake)
        first = client.responses.create(model="gpt-test", input="hi", store=False)
        second = client.responses.create(model="gpt-test", input="hi", store=False, stream=False)
    assert isinstance(first, openai.types.responses.Response)
    assert [(o.type, o.call_id, o.name) for o in first.output] == [("function_call", "call_1", "exec_command")]
    assert second.output_text == "Done." and second.usage.output_tokens > 0
    with FakeModel(script) as fake:
        events = list(sdk(fake).responses.create(model="gpt-test", input="hi", store=False, stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output == first.output and events[-1].response.usage == first.usage


def test_the_sdk_sees_a_scripted_error_without_stream_as_a_server_error():
    with FakeModel([[error_event("server_error", "overloaded")]]) as fake:
        with pytest.raises(openai.InternalServerError, match="overloaded"):
            sdk(fake).responses.create(model="gpt-test", input="hi")


def test_session_id_placeholder_becomes_the_session_the_last_tool_output_named():
    """Codex's session ids are random: `{{SESSION_ID}}` in a script is the last one a tool output said."""
    said = [{"type": "function_call_output", "call_id": "c1", "output": "Process running with session ID 7\n"},
            {"type": "function_call_output", "call_id": "c2", "output": "Process running with session ID 4242\n"}]
    script = [[function_call("write_stdin", {"session_id": "{{SESSION_ID}}", "chars": ""}, "c3")]]
    with FakeModel(script) as fake:
        body = httpx.post(fake.base_url + "/responses", json={"model": "m", "input": said}, timeout=10).json()
    assert json.loads(body["output"][0]["arguments"]) == {"session_id": 4242, "chars": ""}
