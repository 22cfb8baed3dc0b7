"""Traces over real parts: turns run by `toolq run` (and a `Session`) against the fake model over
real SSE, calls on real prefork workers over a real Redis, every process exporting OTLP/HTTP to a
loopback receiver that decodes the protobuf it gets (toolq/dev/otlp_sink.py). One trace per turn,
the turn's root and its chat and execute_tool children, the attributes, no content without the
switch and content with it, the trace id in `--json`, the link in the live view, the workers'
spans in the orchestrator's trace, and `toolq mcp-server` taking a client's `_meta.traceparent`.
The worker's own span tree is tests/integration/test_traces_worker.py's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import tests.integration.conftest as c
from toolq.core import tracing as names
from toolq.dev.fake_model import FakeModel
from toolq.dev.fake_model.builders import function_call, message, response
from toolq.dev.otlp_sink import OtlpSink, SinkSpan
from toolq.local.embedded import RedisServer
from toolq.telemetry import tracing

pytestmark = pytest.mark.integration

ORCHESTRATOR, WORKER, MCP_SERVER = "toolq-orchestrator", "toolq-worker", "toolq-mcp-server"
#: What no span may hold without the content switch: the prompt, an argument, a command's output.
PROMPT = "prompt-words-7f3a"
SECRET_ARG = "argument-words-91c2"
SECRET_OUT = "output-words-4d0e"
TRACE_URL = "http://jaeger.example:16686/trace/{trace_id}"
#: Whether the worker side records spans yet (TRACE-WORKER's part of issue 30).
WORKER_SPANS = importlib.util.find_spec("toolq.workers.spans") is not None


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as s:
        yield s


@pytest.fixture(scope="module")
def traced(sink, tmp_path_factory) -> Iterator[RedisServer]:
    """A Redis of this module's own and two traced workers on it (no untraced worker takes a call)."""
    with RedisServer() as server, c.worker_pair(server.url, tmp_path_factory.mktemp("traced-workers"), "traced",
                                                 {**sink.env(), "TOOLQ_TRACE_URL": TRACE_URL}):
        yield server


def toolq(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_", "OTEL_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]  # the tests' tool modules (tests/conftest.py)
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], capture_output=True, text=True,
                          env={**base, **env}, timeout=timeout)


def run_env(traced: RedisServer, fake: FakeModel, workspace, **more: str) -> dict[str, str]:
    return {"REDIS_URL": traced.url, "TOOLQ_WORKSPACE": str(workspace), "TOOLQ_SIGNING_KEY": c.SIGNING_KEY,
            "TOOLQ_TOOLS": c.TEST_TOOLS, "OPENAI_BASE_URL": fake.base_url, **more}


def calls_script() -> list:
    return [
        response(function_call("sleep_echo", {"ms": 0, "text": SECRET_ARG}, call_id="call_echo"),
                 function_call("exec_command", {"cmd": f"echo {SECRET_OUT}"}, call_id="call_cmd"),
                 function_call("no_such_tool", {}, call_id="call_unknown"),
                 usage={"input_tokens": 30, "output_tokens": 5, "total_tokens": 35}),
        [message("all done")],
    ]


def one_root(spans: list[SinkSpan]) -> SinkSpan:
    roots = [s for s in spans if s.name == names.INVOKE_AGENT]
    assert len(roots) == 1, [(s.name, s.parent_id) for s in spans]
    return roots[0]


def by_call(spans: list[SinkSpan]) -> dict[str, SinkSpan]:
    return {str(s.attributes[names.TOOL_CALL_ID]): s for s in spans if s.name.startswith(names.EXECUTE_TOOL)}


def assert_workers_join(sink: OtlpSink, trace_id: str, calls: dict[str, SinkSpan]) -> None:
    """The workers' spans of these calls are in the turn's trace, under the call's execute_tool span
    (directly, or under another worker span of the same call)."""
    tasks = {str(s.attributes[names.TASK_ID]): s for s in calls.values() if names.TASK_ID in s.attributes}
    if not WORKER_SPANS:  # the orchestrator's half alone: nothing to see yet
        return
    spans = sink.wait_for(lambda got: {str(s.attributes.get(names.TASK_ID)) for s in got if s.service == WORKER}
                          >= set(tasks), timeout=60)
    ours = [s for s in spans if s.service == WORKER and str(s.attributes.get(names.TASK_ID)) in tasks]
    assert ours
    in_trace = {s.span_id for s in spans if s.trace_id == trace_id}
    for s in ours:
        assert s.trace_id == trace_id, (s.name, s.attributes)
        assert s.parent_id in in_trace, (s.name, s.parent_id)
    for task_id, call in tasks.items():  # each call's worker spans hang under its own execute_tool span
        direct = [s for s in ours if str(s.attributes.get(names.TASK_ID)) == task_id and s.parent_id == call.span_id]
        assert direct, task_id


def content_in(spans: list[SinkSpan], *words: str) -> set[str]:
    text = json.dumps([[s.name, s.attributes] for s in spans], default=str)
    return {w for w in words if w in text}


# --- toolq run --json ---------------------------------------------------------------------------------

def test_a_turn_is_one_trace_with_its_requests_and_calls_and_no_content(traced, sink, tmp_path):
    with FakeModel(calls_script()) as fake:
        out = toolq("run", "--json", PROMPT, env={**run_env(traced, fake, tmp_path), **sink.env()})
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    started, completed = events[0], events[-1]
    assert (started["type"], completed["type"]) == ("turn.started", "turn.completed")
    trace_id = started["trace_id"]
    assert len(trace_id) == 32 and completed["trace_id"] == trace_id
    turn_id = started["turn_id"]

    spans = sink.wait_for(lambda got: any(s.trace_id == trace_id and s.name == names.INVOKE_AGENT for s in got))
    mine = [s for s in spans if s.trace_id == trace_id]
    root = one_root(mine)
    assert root.parent_id == "" and root.service == ORCHESTRATOR
    assert root.attributes[names.OPERATION] == "invoke_agent" and root.attributes[names.TURN_ID] == turn_id
    assert root.attributes[names.AGENT_NAME] == "toolq" and names.CONVERSATION_ID in root.attributes
    assert root.attributes["toolq.turn.status"] == "completed"
    assert {s.trace_id for s in spans if s.attributes.get(names.TURN_ID) == turn_id} == {trace_id}

    chats = sorted((s for s in mine if s.name.startswith(names.CHAT)), key=lambda s: s.start_ns)
    assert len(chats) == 2 and all(s.parent_id == root.span_id and s.service == ORCHESTRATOR for s in chats)
    first = chats[0].attributes
    assert first[names.OPERATION] == "chat" and first[names.REQUEST_MODEL]
    assert (first[names.INPUT_TOKENS], first[names.OUTPUT_TOKENS]) == (30, 5)
    assert list(first[names.FINISH_REASONS]) == ["tool_calls"] and first[names.RESPONSE_ID]
    assert list(chats[1].attributes[names.FINISH_REASONS]) == ["stop"]
    assert root.attributes[names.INPUT_TOKENS] == sum(s.attributes[names.INPUT_TOKENS] for s in chats)

    calls = by_call(mine)
    assert set(calls) == {"call_echo", "call_cmd", "call_unknown"}
    for call in calls.values():
        assert call.parent_id == root.span_id and call.attributes[names.OPERATION] == "execute_tool"
    echo, cmd, unknown = calls["call_echo"], calls["call_cmd"], calls["call_unknown"]
    assert echo.name == "execute_tool sleep_echo" and cmd.name == "execute_tool exec_command"
    assert echo.attributes[names.CALL_STATE] == "completed" and names.OUTPUT_REASON not in echo.attributes
    assert echo.attributes[names.TASK_ID].startswith(turn_id + ":")
    assert echo.attributes[names.QUEUE].startswith("toolq.t.sleep_echo.")
    assert (unknown.name, unknown.attributes[names.CALL_STATE], unknown.attributes[names.OUTPUT_REASON]) == \
        ("execute_tool", "rejected", "not run")
    assert content_in(mine, PROMPT, SECRET_ARG, SECRET_OUT) == set()  # no content without the switch
    assert not sink.errors
    assert_workers_join(sink, trace_id, {k: v for k, v in calls.items() if k != "call_unknown"})
    if WORKER_SPANS:
        assert content_in(sink.trace(trace_id), PROMPT, SECRET_ARG, SECRET_OUT) == set()


def test_the_live_view_shows_the_trace_link_once_and_tracing_off_says_no_trace(traced, sink, tmp_path):
    url = TRACE_URL
    with FakeModel([[message("hello")]]) as fake:
        shown = toolq("run", "hi", env={**run_env(traced, fake, tmp_path, TOOLQ_TRACE_URL=url), **sink.env()})
    assert shown.returncode == 0, shown.stderr
    links = [line for line in shown.stderr.splitlines() if "jaeger.example" in line]
    assert len(links) == 1 and links[0].startswith("trace http://jaeger.example:16686/trace/")
    trace_id = links[0].rsplit("/", 1)[1]
    sink.wait_for(lambda got: any(s.trace_id == trace_id and s.name == names.INVOKE_AGENT for s in got))

    with FakeModel([[message("hello")]]) as fake:  # no OTEL_*: no trace id, no link, nothing sent
        off = toolq("run", "--json", "hi", env=run_env(traced, fake, tmp_path, TOOLQ_TRACE_URL=url))
    assert off.returncode == 0, off.stderr
    events = [json.loads(line) for line in off.stdout.splitlines()]
    assert all("trace_id" not in e for e in events)
    assert not any(s.attributes.get(names.TURN_ID) == events[0]["turn_id"] for s in sink.snapshot())


# --- a Session of two turns, content on -----------------------------------------------------------------

@pytest.fixture
def traced_here(sink, monkeypatch):
    """This test process traces to the sink, with the content switch on; off again afterwards."""
    for k, v in sink.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "true")
    tracing.reset_for_tests()
    yield
    tracing.flush()
    tracing.reset_for_tests()


def test_each_turn_of_a_session_is_its_own_trace_and_the_switch_lets_content_in(traced, sink, traced_here, tmp_path):
    script = [[function_call("sleep_echo", {"ms": 0, "text": SECRET_ARG}, call_id="call_a")], [message("one")],
              [function_call("exec_command", {"cmd": f"echo {SECRET_OUT}"}, call_id="call_b")], [message("two")]]
    events: list = []
    with FakeModel(script) as fake:
        settings = c.settings_for(traced.url, fake, tmp_path)
        outcomes, _ = asyncio.run(asyncio.wait_for(c.run_session(settings, [PROMPT, "again"], events), 90))
    assert [o.status for o in outcomes] == ["completed", "completed"]
    assert tracing.flush()
    trace_ids = [e["trace_id"] for e in events if e["type"] == "turn.started"]
    assert len(set(trace_ids)) == 2 and [e["trace_id"] for e in events if e["type"] == "turn.completed"] == trace_ids
    spans = sink.wait_for(lambda got: all(any(s.trace_id == t and s.name == names.INVOKE_AGENT for s in got)
                                          for t in trace_ids))
    first, second = ([s for s in spans if s.trace_id == t] for t in trace_ids)
    root_a, root_b = one_root(first), one_root(second)
    assert root_a.attributes[names.CONVERSATION_ID] == root_b.attributes[names.CONVERSATION_ID]
    (a,) = by_call(first).values()
    (b,) = by_call(second).values()
    assert (a.parent_id, b.parent_id) == (root_a.span_id, root_b.span_id)
    assert SECRET_ARG in a.attributes[names.TOOL_ARGUMENTS] and SECRET_ARG in a.attributes[names.TOOL_RESULT]
    assert SECRET_OUT in b.attributes[names.TOOL_RESULT]
    chat = next(s for s in first if s.name.startswith(names.CHAT))
    assert PROMPT in chat.attributes["gen_ai.input.messages"]
    assert "call_a" in chat.attributes["gen_ai.output.messages"]
    assert_workers_join(sink, trace_ids[0], {"call_a": a})
    assert_workers_join(sink, trace_ids[1], {"call_b": b})


# --- toolq mcp-server --------------------------------------------------------------------------------------

CLIENT_TRACE = "5c0b7a1e2f3d4c5b6a79881726354433"
CLIENT_SPAN = "a1b2c3d4e5f60718"


def test_the_mcp_front_door_takes_the_clients_traceparent_and_no_argument_sets_one(traced, sink, tmp_path):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOOLQ_MCP_SERVER_TOKEN"))}
    env = {**env, **c.WORKER_ENV, **sink.env(), "REDIS_URL": traced.url}
    params = StdioServerParameters(command=sys.executable, args=["-m", "toolq.cli.main", "mcp-server", "--tools",
                                                                 c.TEST_TOOLS, "--workspace", str(tmp_path)], env=env)
    forged = "00-" + "f" * 32 + "-" + "e" * 16 + "-01"

    async def go() -> list[SinkSpan]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            traced_call = await session.call_tool("sleep_echo", {"ms": 0, "text": forged},
                                                  meta={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert not traced_call.isError
            bad = await session.call_tool("noop", {}, meta={"traceparent": "00-not-a-trace-01"})
            assert not bad.isError
            return await asyncio.to_thread(sink.wait_for, lambda got: sum(
                s.service == MCP_SERVER and s.name == "tools/call noop" for s in got) >= 1
                and any(s.trace_id == CLIENT_TRACE and s.name.startswith(names.EXECUTE_TOOL) for s in got))

    spans = asyncio.run(asyncio.wait_for(go(), 120))
    mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
    (call,) = [s for s in mine if s.name == "tools/call sleep_echo"]
    assert (call.parent_id, call.service, call.kind) == (CLIENT_SPAN, MCP_SERVER, 2)  # SERVER
    (tool,) = [s for s in mine if s.name == "execute_tool sleep_echo"]
    assert tool.parent_id == call.span_id and tool.attributes[names.CALL_STATE] == "completed"
    assert not any(s.trace_id == forged[3:35] for s in spans)  # an argument is never a parent
    (noop,) = [s for s in spans if s.name == "tools/call noop"]
    assert noop.parent_id == "" and noop.trace_id != CLIENT_TRACE  # a malformed traceparent: a root of its own
    assert_workers_join(sink, CLIENT_TRACE, {"t": tool})


# --- Flower ------------------------------------------------------------------------------------------------

def test_flower_links_a_traced_call_to_its_trace(traced, sink, traced_here, tmp_path, monkeypatch):
    import time

    import httpx

    from toolq.cli.flower import FlowerProcess
    from toolq.core.settings import Settings

    auth = ("toolq-test", "p" * 20)
    settings = Settings(redis_url=traced.url, flower_user=auth[0], flower_password=auth[1])
    with FlowerProcess(settings, logdir=tmp_path) as flower:
        flower.wait_for_workers(["traced0@test", "traced1@test"])
        events: list = []
        with FakeModel([[function_call("sleep_echo", {"ms": 0, "text": "x"}, call_id="call_flower")],
                        [message("done")]]) as fake:
            run_settings = c.settings_for(traced.url, fake, tmp_path, trace_url=TRACE_URL)
            (outcome,), _ = asyncio.run(asyncio.wait_for(c.run_session(run_settings, ["go"], events), 90))
        assert outcome.status == "completed"
        trace_id = events[0]["trace_id"]
        with httpx.Client(base_url=flower.url, auth=auth, timeout=5) as client:
            deadline = time.monotonic() + 60
            while True:
                tasks = client.get("/api/tasks").raise_for_status().json()
                mine = [t for t in tasks.values() if "call_flower" in (t.get("args") or "")
                        and t.get("state") == "SUCCESS"]
                if mine:
                    break
                assert time.monotonic() < deadline, tasks
                time.sleep(0.2)
    (task,) = mine
    assert task["args"].endswith(f"trace='http://jaeger.example:16686/trace/{trace_id}')"), task["args"]
