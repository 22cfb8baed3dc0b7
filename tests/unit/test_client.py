"""ModelClient against the fake server over real TCP: events, retries, delays and final messages.

The client's `sleep` is replaced by a recorder, so backoff delays are asserted, not waited for.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import socket
import time

import httpx
import pytest

from tests.paths import CODEX_FIXTURES, SSE_FIXTURES
from toolq.core.items import CustomToolCallItem, FunctionCallItem, MessageItem, ReasoningItem
from toolq.core.settings import Settings
from toolq.dev.fake_model import FakeModel
from toolq.dev.fake_model.builders import (
    cut_after,
    error_event,
    failed,
    function_call,
    http_error,
    incomplete,
    malformed_frame,
    message,
    raw_frame,
    replay,
    stall,
)
from toolq.orchestrator.model_client import (
    CONTEXT_WINDOW,
    HIGH_DEMAND,
    MISSING_KEY,
    QUOTA_EXCEEDED,
    ModelClient,
    ModelError,
    ModelSettings,
    backoff,
    build_request,
    is_local,
    retry_after,
    try_again_in,
)
from toolq.orchestrator.protocol.events import Completed, ErrorEvent, Failed, Incomplete, OutputItemDone, Usage

BODY = build_request("gpt-test", [{"role": "user", "content": "hi"}], [])


class Run:
    """One `stream()` call: the events it yielded, the error it raised, the sleeps it asked for."""

    def __init__(self, base_url: str, body: dict = BODY, **settings) -> None:
        self.events: list = []
        self.error: ModelError | None = None
        self.delays: list[float] = []
        self.client_skipped = None
        asyncio.run(self._run(base_url, body, settings))

    async def _run(self, base_url: str, body: dict, settings: dict) -> None:
        async def sleep(seconds: float) -> None:
            self.delays.append(seconds)

        settings = {"api_key": "sk-test", **settings}
        async with ModelClient(ModelSettings(base_url=base_url, **settings), sleep=sleep) as client:
            try:
                async for event in client.stream(body):
                    self.events.append(event)
            except ModelError as e:
                self.error = e
            self.client_skipped = dict(client.skipped)

    @property
    def items(self) -> list:
        return [e.item for e in self.events if isinstance(e, OutputItemDone)]


def run(script: list, body: dict = BODY, **settings) -> tuple[Run, FakeModel]:
    with FakeModel(script) as fake:
        result = Run(fake.base_url, body, **settings)
    return result, fake


def assert_backoff(delays: list[float]) -> None:
    """Codex's schedule: 0.2, 0.4, 0.8, 1.6 ... seconds, each within +-10 %."""
    for attempt, delay in enumerate(delays, start=1):
        base = 0.2 * 2 ** (attempt - 1)
        assert base * 0.9 <= delay <= base * 1.1, (attempt, delay)


# --- success ---------------------------------------------------------------------------------


def test_stream_yields_typed_events_and_ends_at_completed():
    r, fake = run([[function_call("exec_command", {"cmd": "ls"}, "call_1"), message("done")]])
    assert r.error is None and r.delays == []
    assert [type(i) for i in r.items] == [FunctionCallItem, MessageItem]
    assert r.items[0].call_id == "call_1" and json.loads(r.items[0].arguments) == {"cmd": "ls"}
    assert isinstance(r.events[-1], Completed) and r.events[-1].usage.total_tokens > 0
    assert "".join(e.delta for e in r.events if e.kind == "text_delta") == "done"
    assert "".join(e.delta for e in r.events if e.kind == "tool_input_delta") == r.items[0].arguments
    assert len(fake.requests) == 1


def test_request_is_a_stateless_streaming_post_with_auth_and_extra_headers():
    body = build_request("gpt-test", [{"role": "user", "content": "hi"}], [{"type": "function", "name": "f"}])
    with FakeModel([[message("ok")]]) as fake:
        Run(fake.base_url, body, extra_headers={"OpenAI-Project": "proj_1"})
    assert fake.requests == [body]
    headers = {k.lower(): v for k, v in fake.request_headers[0].items()}
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["accept"] == "text/event-stream"
    assert headers["openai-project"] == "proj_1"


def test_build_request_is_stateless_and_asks_for_encrypted_reasoning_only_with_reasoning():
    plain = build_request("m", [], [])
    assert plain == {
        "model": "m",
        "input": [],
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "stream": True,
    }
    full = build_request("m", [], [], instructions="be brief", reasoning={"effort": "low"}, parallel_tool_calls=False)
    assert full["instructions"] == "be brief" and full["parallel_tool_calls"] is False
    assert full["reasoning"] == {"effort": "low"} and full["include"] == ["reasoning.encrypted_content"]


def test_completed_ends_iteration_even_if_the_socket_stays_open():
    completed = json.dumps({"type": "response.completed", "response": {"id": "r1"}})
    # After the completed frame the server goes quiet for longer than the idle timeout: a client
    # that kept reading would fail with the idle-timeout error instead of returning.
    r, _ = run([[message("hi"), raw_frame(f"event: response.completed\ndata: {completed}\n\n"), stall(30)]],
               stream_idle_timeout=1.0)
    assert r.error is None
    assert r.events[-1] == Completed(response_id="r1")


def test_every_recorded_fixture_goes_through_the_client():
    expected = {
        "sse-text-message.txt": [MessageItem],
        "sse-reasoning-then-function-call.txt": [ReasoningItem, FunctionCallItem],
        "sse-parallel-function-calls.txt": [FunctionCallItem, FunctionCallItem],
        "sse-custom-tool-call.txt": [ReasoningItem, CustomToolCallItem],
    }
    folder = SSE_FIXTURES
    with FakeModel([[replay(folder / name)] for name in expected]) as fake:
        runs = {name: Run(fake.base_url) for name in expected}
    for name, types in expected.items():
        assert runs[name].error is None, name
        assert [type(i) for i in runs[name].items] == types, name
        assert isinstance(runs[name].events[-1], Completed)
    assert runs["sse-text-message.txt"].events[-1].usage == Usage(input_tokens=114, output_tokens=15, total_tokens=129)


def test_any_httpx_transport_can_serve_the_stream():
    path = SSE_FIXTURES / "sse-parallel-function-calls.txt"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=path.read_bytes())

    async def main() -> list:
        settings = ModelSettings(base_url="http://recorded.invalid/v1", api_key="x")
        async with ModelClient(settings, transport=httpx.MockTransport(handler)) as client:
            return [e async for e in client.stream(BODY)]

    events = asyncio.run(main())
    assert [e.item.name for e in events if isinstance(e, OutputItemDone)] == ["search", "weather"]
    assert isinstance(events[-1], Completed)


def test_recorded_quota_failure_ends_the_turn_after_its_events():
    path = SSE_FIXTURES / "sse-response-failed.txt"
    r, fake = run([[replay(path)]])
    assert [e.kind for e in r.events] == ["created", "error", "failed"]
    assert (r.error.message, r.error.retryable, r.error.code) == (QUOTA_EXCEEDED, False, "insufficient_quota")
    assert r.error.detail.startswith("You exceeded your current quota")
    assert len(fake.requests) == 1 and r.delays == []


def test_malformed_frames_are_skipped_and_counted_and_the_stream_completes():
    r, _ = run([[message("a"), malformed_frame(), raw_frame('data: {"no": "type"}\n\n'), message("b")]])
    assert r.error is None and [i.text() for i in r.items] == ["a", "b"]
    assert r.client_skipped == {"malformed_json": 1, "missing_type": 1}


def test_a_non_sse_success_body_is_an_error_naming_status_and_body_start():
    r, _ = run([[http_error(200, {"id": "resp_1", "object": "response", "output": []})]])
    assert r.error is not None and not r.error.retryable and r.error.status == 200
    assert "status 200" in r.error.message and "application/json" in r.error.message
    assert '{"id": "resp_1"' in r.error.message


# --- stream failures: retryable, for the caller's outer loop -----------------------------------


def test_stream_closed_before_completed_is_retryable_and_keeps_committed_items():
    r, fake = run([[function_call("f", "{}", "call_1"), message("partial"), cut_after()]])
    assert [type(i) for i in r.items] == [FunctionCallItem, MessageItem]
    assert r.error.message == "stream disconnected before completion: stream closed before response.completed"
    assert r.error.retryable and r.error.delay is None
    assert len(fake.requests) == 1 and r.delays == []  # stream errors are the outer layer's to retry


def test_codex_incomplete_fixture_is_stream_closed_before_completed():
    path = CODEX_FIXTURES / "incomplete_sse.json"
    r, _ = run([[replay(path)]])
    assert r.events == [] and r.error.retryable
    assert r.error.message.endswith("stream closed before response.completed")


def test_connection_dropped_mid_stream_is_a_retryable_transport_error():
    r, fake = run([[function_call("f", "{}", "call_1"), cut_after(clean=False)]])
    assert [type(i) for i in r.items] == [FunctionCallItem]
    assert r.error.retryable
    assert r.error.message.startswith("stream disconnected before completion: transport error: RemoteProtocolError")
    assert r.error.message.endswith(f", url: {fake.base_url}/responses")
    assert len(fake.requests) == 1


def test_idle_timeout_is_retryable():
    r, _ = run([[message("a"), stall(30)]], stream_idle_timeout=0.3)
    assert [type(i) for i in r.items] == [MessageItem]
    assert r.error.message == "stream disconnected before completion: idle timeout waiting for SSE"
    assert r.error.retryable


def test_response_failed_server_error_is_retryable_with_the_server_message():
    r, fake = run([[message("partial"), failed("server_error", "scripted response.failed")]])
    assert isinstance(r.events[-1], Failed) and [type(i) for i in r.items] == [MessageItem]
    assert r.error.message == "the model server failed this response: scripted response.failed"  # not a disconnect
    assert r.error.retryable and r.error.delay is None and len(fake.requests) == 1


def test_rate_limit_failure_is_retryable_after_exactly_the_delay_in_the_message():
    text = "Rate limit reached for gpt-5.5. Please try again in 1.5s. Visit https://platform.openai.com."
    r, _ = run([[failed("rate_limit_exceeded", text)]])
    assert r.error.message == f"rate limit exceeded: {text}"
    assert (r.error.retryable, r.error.delay, r.error.code) == (True, 1.5, "rate_limit_exceeded")


@pytest.mark.parametrize(
    "code,server_text,message",
    [
        ("context_length_exceeded", "Your input exceeds the context window of this model.", CONTEXT_WINDOW),
        ("insufficient_quota", "You exceeded your current quota.", QUOTA_EXCEEDED),
        ("invalid_prompt", "Invalid prompt: limited access.", "Invalid prompt: limited access."),
        ("cyber_policy", "   ", "This request has been flagged for possible cybersecurity risk."),
        ("server_is_overloaded", "busy", "Selected model is at capacity. Please try a different model."),
    ],
)
def test_fatal_failure_codes_end_the_turn_with_a_clear_message(code, server_text, message):
    r, fake = run([[failed(code, server_text)]])
    assert (r.error.message, r.error.retryable, r.error.code) == (message, False, code)
    assert r.error.detail == server_text and len(fake.requests) == 1


def test_codex_failed_samples_classify_like_codex():
    path = CODEX_FIXTURES / "response_failed_samples.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    with FakeModel([[raw_frame(f"event: response.failed\ndata: {line}\n\n")] for line in lines]) as fake:
        errors = [Run(fake.base_url).error for _ in lines]
    assert [(e.retryable, e.delay) for e in errors] == [(True, 11.054)] + [(False, None)] * 6
    assert [e.message for e in errors[1:4]] == [CONTEXT_WINDOW, CONTEXT_WINDOW, QUOTA_EXCEEDED]
    assert errors[4].message == "This request was flagged for cyber policy."
    assert errors[5].message == "This request has been flagged for possible cybersecurity risk."
    assert errors[6].message.startswith("Invalid prompt")


def test_incomplete_ends_the_turn_after_yielding_the_partial_items():
    r, fake = run([[message("half an answ"), incomplete("max_output_tokens")]])
    assert [type(i) for i in r.items] == [MessageItem] and isinstance(r.events[-1], Incomplete)
    assert r.error.message == "Incomplete response returned, reason: max_output_tokens"
    assert not r.error.retryable and len(fake.requests) == 1


def test_error_event_then_failed_is_classified_by_its_code():
    r, _ = run([[error_event("insufficient_quota", "You exceeded your current quota")]])
    assert [e.kind for e in r.events][-2:] == ["error", "failed"]
    assert r.events[-2] == ErrorEvent(code="insufficient_quota", message="You exceeded your current quota")
    assert (r.error.message, r.error.retryable) == (QUOTA_EXCEEDED, False)


def test_error_event_then_end_of_stream_raises_the_error_event():
    frame = json.dumps({"type": "error", "error": {"code": "rate_limit_exceeded", "message": "Try again in 35 seconds"}})
    r, _ = run([[raw_frame(f"event: error\ndata: {frame}\n\n"), cut_after()]])
    assert (r.error.retryable, r.error.delay) == (True, 35.0)
    assert r.error.message == "rate limit exceeded: Try again in 35 seconds"


# --- HTTP failures: the inner retry layer ------------------------------------------------------


def test_5xx_is_retried_inside_with_codex_backoff_then_succeeds():
    r, fake = run([[http_error(500)], [http_error(503, "scripted unavailable")], [message("ok")]])
    assert r.error is None and [i.text() for i in r.items] == ["ok"]
    assert len(fake.requests) == 3 and len(r.delays) == 2
    assert_backoff(r.delays)


def test_500_storm_exhausts_request_retries_with_the_high_demand_message():
    r, fake = run([[http_error(500, "boom")]] * 5, request_max_retries=4)
    assert len(fake.requests) == 5 and len(r.delays) == 4
    assert_backoff(r.delays)
    assert (r.error.message, r.error.retryable, r.error.status, r.error.detail) == (HIGH_DEMAND, True, 500, "boom")


def test_503_after_retries_names_status_body_and_url():
    r, fake = run([[http_error(503, "scripted unavailable")]] * 2, request_max_retries=1)
    assert len(fake.requests) == 2 and len(r.delays) == 1
    assert r.error.message == f"unexpected status 503 Service Unavailable: scripted unavailable, url: {fake.base_url}/responses"
    assert r.error.retryable


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_is_retried_inside_and_named_in_the_error():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    r = Run(url, request_max_retries=2)
    assert len(r.delays) == 2
    assert_backoff(r.delays)
    assert r.error.retryable  # Codex's class: the server may be starting
    assert r.error.message.startswith(f"cannot reach {url}/responses (ConnectError: ")
    assert r.error.message.endswith("): is the server running? check OPENAI_BASE_URL")


def test_429_with_retry_after_is_retryable_after_exactly_that_delay_and_not_retried_inside():
    r, fake = run([[http_error(429, headers={"Retry-After": "2"})]])
    assert len(fake.requests) == 1 and r.delays == []
    assert r.error.message == "exceeded retry limit, last status: 429 Too Many Requests"
    assert (r.error.retryable, r.error.delay, r.error.status) == (True, 2.0, 429)


def test_429_retry_after_ms_wins_over_retry_after():
    r, _ = run([[http_error(429, headers={"Retry-After": "2", "retry-after-ms": "1500"})]])
    assert r.error.delay == 1.5


def test_429_without_retry_after_ends_the_turn():
    r, fake = run([[http_error(429)]])
    assert len(fake.requests) == 1
    assert r.error.message == "exceeded retry limit, last status: 429 Too Many Requests"
    assert (r.error.retryable, r.error.delay) == (False, None)


def test_429_rate_limit_body_with_try_again_in_is_retryable_after_that_delay():
    body = {"error": {"message": "Rate limit reached. Please try again in 28ms.", "type": "requests", "code": "rate_limit_exceeded", "param": None}}
    r, _ = run([[http_error(429, body)]])
    assert (r.error.retryable, r.error.delay) == (True, 0.028)


def test_429_insufficient_quota_ends_the_turn():
    body = {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota", "param": None}}
    r, fake = run([[http_error(429, body, {"Retry-After": "1"})]])
    assert (r.error.message, r.error.retryable, r.error.code) == (QUOTA_EXCEEDED, False, "insufficient_quota")
    assert len(fake.requests) == 1


def test_400_ends_the_turn_with_the_raw_body():
    body = {"error": {"message": "No tool output found for function call call_1.", "type": "invalid_request_error", "param": "input", "code": None}}
    r, fake = run([[http_error(400, body)]])
    assert r.error.message == json.dumps(body)
    assert (r.error.retryable, r.error.status) == (False, 400)
    assert len(fake.requests) == 1 and r.delays == []


def test_401_ends_at_once_naming_the_url_the_server_message_and_the_fix():
    body = {"error": {"message": "Incorrect API key provided: sk-test.\nYou can find your API key at "
                                 "https://platform.openai.com/account/api-keys.",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    r, fake = run([[http_error(401, body)]] * 3)
    assert r.error.message == (
        f"401 Unauthorized from {fake.base_url}/responses: Incorrect API key provided: sk-test. You can find your "
        "API key at https://platform.openai.com/account/api-keys.; set OPENAI_API_KEY to a valid key for this server")
    assert (r.error.retryable, r.error.status, r.error.code) == (False, 401, "invalid_api_key")
    assert len(fake.requests) == 1 and r.delays == []


def test_403_ends_at_once_and_says_the_key_may_not_use_this_model():
    r, fake = run([[http_error(403, "project has no access\nto model gpt-test")]] * 3)
    assert "\n" not in r.error.message
    assert r.error.message == (
        f"403 Forbidden from {fake.base_url}/responses: project has no access to model gpt-test; the key in "
        "OPENAI_API_KEY may not use this model or endpoint: check its project and --model")
    assert not r.error.retryable and len(fake.requests) == 1


def test_a_remote_endpoint_without_a_key_fails_before_any_request():
    sent: list[httpx.Request] = []

    async def main() -> ModelError:
        settings = ModelSettings(base_url="https://api.openai.com/v1", api_key=None)
        transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500))
        async with ModelClient(settings, transport=transport) as client:
            with pytest.raises(ModelError) as info:
                async for _ in client.stream(BODY):
                    pass
            return info.value

    error = asyncio.run(main())
    assert error.message == MISSING_KEY.format(url="https://api.openai.com/v1")
    assert "OPENAI_API_KEY" in error.message and not error.retryable and sent == []


def test_a_local_server_needs_no_key_and_gets_no_authorization_header():
    with FakeModel([[message("ok")]]) as fake:
        r = Run(fake.base_url, api_key=None)
    assert r.error is None and [i.text() for i in r.items] == ["ok"]
    assert "authorization" not in {k.lower() for k in fake.request_headers[0]}


@pytest.mark.parametrize("url", ["http://localhost:11434/v1", "http://127.0.0.1:8000/v1", "http://127.9.9.9/v1",
                                 "http://[::1]:8000/v1", "http://ollama.localhost/v1"])
def test_loopback_urls_are_local(url):
    assert is_local(url)


@pytest.mark.parametrize("url", ["https://api.openai.com/v1", "http://10.0.0.7:8000/v1", "http://gpu-box:8000/v1",
                                 "http://localhost.evil.example/v1", "http://127.0.0.1.nip.io/v1",
                                 "http://user@127.0.0.1@evil.example/v1", "not a url"])
def test_names_that_only_look_local_are_not(url):
    assert not is_local(url)


# --- pure helpers --------------------------------------------------------------------------


def test_backoff_doubles_from_200ms_with_ten_percent_jitter():
    samples = [[backoff(n) for _ in range(200)] for n in range(1, 6)]
    assert_backoff([min(s) for s in samples])
    assert_backoff([max(s) for s in samples])
    assert len(set(samples[0])) > 1  # jittered, not constant


def test_retry_after_reads_seconds_milliseconds_and_http_dates():
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after-ms": "250"}) == 0.25
    assert retry_after({}) is None and retry_after({"retry-after": "soon"}) is None
    in_ten = email.utils.formatdate(time.time() + 10, usegmt=True)
    assert 8.0 <= retry_after({"retry-after": in_ten}) <= 10.0


def test_try_again_in_parses_codex_examples():
    assert try_again_in("Please try again in 11.054s.") == 11.054
    assert try_again_in("please try again in 28ms") == 0.028
    assert try_again_in("Try again in 35 seconds") == 35.0
    assert try_again_in("try later") is None


def test_the_model_endpoint_is_read_from_toolqs_settings_alone(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:11434/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    s = ModelSettings.from_settings(Settings.load(model="qwen3", stream_idle_timeout=5.0))
    assert (s.base_url, s.api_key, s.model, s.stream_idle_timeout) == ("http://localhost:11434/v1/", "sk-env", "qwen3", 5.0)
    assert s.responses_url == "http://localhost:11434/v1/responses"
    assert ModelSettings().base_url == "https://api.openai.com/v1"  # no second reader of the environment
    assert ModelSettings().api_key is None
    assert (ModelSettings().request_max_retries, ModelSettings().stream_max_retries) == (4, 5)
