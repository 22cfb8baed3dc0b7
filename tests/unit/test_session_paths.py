"""`Session`'s retry, deadline and cancel paths (toolq/orchestrator/turn.py), in this process.

The pieces are real where they are cheap: a `Runtime` on a redis-server this module starts on a
free port (the ledger, the durable turn store, the cancel channel), the scripted fake model over
real SSE on TCP, and a fleet whose transport is swapped for the in-memory one
(toolq/orchestrator/transport/memory.py), so calls run as asyncio tasks through the worker's own
checks and handler call. No Celery worker process runs.

What each path must leave behind, whatever ended the turn: exactly one terminal event, a history
in which every call has exactly one output (in this process and in Redis), and no hang.
- retry: a stream cut mid-way or a 5xx is retried with the outputs of the calls it had already
  committed; once the retries are spent the turn fails with one line;
- deadline: TOOLQ_TURN_TIMEOUT passing while a call runs stops the call, gives it an output saying
  so, and ends the turn without another model request;
- cancel: `Session.cancel()` (or `toolq cancel` through the ledger) while a call runs, while the
  model streams or while the turn waits to retry ends the turn `cancelled` at once, aborts the
  unfinished calls, and the next turn on the same session goes on from a paired history.

The same paths run on real workers in tests/integration/test_turn_loop.py and test_cancel.py.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import BaseModel

from toolq.core import keys
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer
from toolq.orchestrator.barrier import flush_background
from toolq.orchestrator.fleet import Fleet
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.model_client import HIGH_DEMAND, STREAM_DISCONNECTED, ModelClient, ModelSettings
from toolq.orchestrator.transport.memory import MemoryTransport, catalog_runner
from toolq.orchestrator.turn import TURN_ABORTED, Runtime, Session, TurnOutcome

#: Generous on a loaded 2-core machine: a condition that holds comes in milliseconds.
PATIENCE = 30.0
#: The most one test's turns may take before it fails as hung.
HUNG = 90.0
TERMINAL = ("turn.completed", "turn.failed", "turn.aborted")
#: What an unfinished call that is not a shell call gets when its turn is cancelled.
ABORTED_OUTPUT = re.compile(r"aborted by user after [0-9]+\.[0-9]s")


# --- the tools, run in-process by the memory transport ---------------------------------------------


class EchoArgs(BaseModel):
    text: str


class HangArgs(BaseModel):
    note: str = ""


@dataclass
class Tools:
    """`echo` answers at once; `hang` runs until it is stopped. Each records what happened to it."""

    catalog: Catalog = field(default_factory=Catalog)
    ran: list[str] = field(default_factory=list)
    """Call ids, in the order their handlers started (each call must run at most once)."""
    hanging: set[str] = field(default_factory=set)
    """Calls whose `hang` handler is running now."""
    stopped: list[str] = field(default_factory=list)
    """Calls whose handler was cancelled (revoked) while it ran."""

    def __post_init__(self) -> None:
        @tool(catalog=self.catalog)
        async def echo(args: EchoArgs, ctx: ToolContext) -> str:
            """Say the text back."""
            self.ran.append(ctx.invocation.call_id)
            return args.text

        @tool(catalog=self.catalog, timeout=600)  # longer than any turn here: the turn's deadline stops it
        async def hang(args: HangArgs, ctx: ToolContext) -> str:
            """Run until stopped (a slow build, a stuck command)."""
            call_id = ctx.invocation.call_id
            self.ran.append(call_id)
            self.hanging.add(call_id)
            try:
                await asyncio.Event().wait()  # never set
            except asyncio.CancelledError:
                self.stopped.append(call_id)
                raise
            finally:
                self.hanging.discard(call_id)
            return "never"


# --- a runtime on redis-server, the fake model and the in-memory fleet -----------------------------


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()  # the ledger (db 0) and the results (db 1) of earlier tests
    client.close()
    return redis_server.url


@dataclass
class Turn:
    """One ended turn: its outcome, and its events as `toolq run --json` writes them."""

    outcome: TurnOutcome
    events: list[dict[str, Any]]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def errors(self) -> list[str]:
        return [e["message"] for e in self.events if e["type"] == "error"]

    def completed_item(self, call_id: str) -> dict[str, Any]:
        """The call as its one `item.completed` event showed it."""
        (item,) = [e["item"] for e in self.events if e["type"] == "item.completed" and e["item"]["id"] == call_id]
        return item


@dataclass
class Driver:
    """One session on the in-memory fleet, and what its turns told their watchers."""

    session: Session
    runtime: Runtime
    transport: MemoryTransport
    events: list[dict[str, Any]] = field(default_factory=list)
    """The running (or last) turn's events, as `toolq run --json` would write them."""

    def start(self, prompt: str) -> asyncio.Task[Turn]:
        """Start a turn; its task ends with the turn (whatever ends it)."""
        events: list[dict[str, Any]] = []
        self.events = events

        async def run() -> Turn:
            outcome = await self.session.run_turn(prompt, lambda e: events.append(e.to_json()))
            return Turn(outcome, events)

        return asyncio.create_task(run())

    async def run(self, prompt: str) -> Turn:
        return await self.start(prompt)

    def saw(self, event_type: str, call_id: str | None = None) -> bool:
        return any(e["type"] == event_type and (call_id is None or e.get("item", {}).get("id") == call_id)
                   for e in self.events)

    async def stored_items(self, turn_id: str) -> list[dict[str, Any]]:
        """The turn's items as Redis holds them for `toolq resume`."""
        _, _, committed = await self.runtime.turns.load(turn_id)
        return [c.item for c in committed]

    async def ledger_turn(self, turn_id: str) -> dict[str, str]:
        return await self.runtime.fleet.ledger.turn(turn_id)

    async def ledger_call_state(self, task_id: str) -> str | None:
        """The state `toolq status` shows for a call (written in the background: flushed first)."""
        await flush_background()
        state = await self.runtime.fleet.ledger.r.hget(keys.call(task_id), "state")
        return state.decode() if state else None


@asynccontextmanager
async def driver(redis_url: str, fake: FakeModel, workspace: Path, tools: Tools, **settings: Any
                 ) -> AsyncIterator[Driver]:
    """A `Runtime(fleet, client)` whose fleet sends its calls to the in-memory transport."""
    settings = Settings(redis_url=redis_url, openai_base_url=fake.base_url, openai_api_key="test",
                        workspace=workspace, signing_key=secrets.token_hex(32), **settings)
    fleet = await Fleet.open(settings, catalog=tools.catalog)
    transport = fleet.transport = MemoryTransport(catalog_runner(tools.catalog))
    runtime = Runtime(fleet, ModelClient(ModelSettings.from_settings(settings)))
    session = Session(runtime)
    try:
        yield Driver(session, runtime, transport)
        # Every call was answered by toolq itself, not patched up by the pairing normaliser.
        assert not session.history.repairs, f"the history needed repairs: {dict(session.history.repairs)}"
    finally:
        await session.close()
        await transport.aclose()
        await runtime.aclose()


def run_async(test: Callable[[], Any]) -> Any:
    """Run an async test body on a fresh event loop (the suite has no asyncio plugin); a hang fails."""
    return asyncio.run(asyncio.wait_for(test(), HUNG))


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + PATIENCE
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# --- what every ended turn must satisfy ------------------------------------------------------------


def calls_and_outputs(items: list[dict[str, Any]]) -> tuple[Counter[str], Counter[str]]:
    calls = Counter(i["call_id"] for i in items if i.get("type") == "function_call")
    outputs = Counter(i["call_id"] for i in items if i.get("type") == "function_call_output")
    return calls, outputs


def assert_each_call_has_one_output(items: list[dict[str, Any]]) -> None:
    calls, outputs = calls_and_outputs(items)
    assert calls and set(calls.values()) == {1}, calls
    assert outputs == calls, f"calls {dict(calls)} but outputs {dict(outputs)}"
    assert pairing_problems(items) == []


def outputs_of(items: list[dict[str, Any]]) -> dict[str, str]:
    return {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}


def assert_one_terminal_event(turn: Turn, expected: str) -> None:
    assert [t for t in turn.types() if t in TERMINAL] == [expected], turn.types()
    assert turn.types()[-1] == expected


# --- retry -----------------------------------------------------------------------------------------


def test_a_stream_cut_mid_way_is_retried_with_the_committed_call_and_its_one_output(redis_url, tmp_path):
    """The first response's call is done, the second is cut half-streamed (the TCP connection drops):
    the done call runs once and rides the retry with its output; the half call never runs."""
    tools = Tools()
    # One delta per call's arguments: created, in_progress, then 4 frames per call (added, delta,
    # arguments.done, output_item.done). After 8 frames the second call has its first delta only.
    cut_in_second_call = b.response(b.function_call("echo", {"text": "whole"}, "call_whole"),
                                    b.function_call("echo", {"text": "half"}, "call_half"),
                                    b.cut_after(8, clean=False), chunk_size=1000)
    script = [cut_in_second_call,
              [b.function_call("echo", {"text": "again"}, "call_again")],
              [b.message("recovered")]]

    async def go() -> tuple[Turn, list[dict[str, Any]]]:
        async with driver(redis_url, fake, tmp_path, tools) as d:
            turn = await d.run("build it")
            return turn, await d.stored_items(turn.outcome.turn_id)

    with FakeModel(script) as fake:
        turn, stored = run_async(go)
        requests = fake.requests

    assert turn.outcome.status == "completed" and turn.outcome.final_message == "recovered"
    assert turn.outcome.requests == 3 and len(requests) == 3
    assert tools.ran == ["call_whole", "call_again"], "the half-streamed call ran, or a call ran twice"
    (reconnect,) = turn.errors()
    assert reconnect.startswith(f"Reconnecting... 1/5 ({STREAM_DISCONNECTED}transport error"), reconnect
    assert_one_terminal_event(turn, "turn.completed")
    retried = requests[1]["input"]
    assert outputs_of(retried) == {"call_whole": "whole"}
    assert_each_call_has_one_output(requests[2]["input"])
    assert_each_call_has_one_output(stored)


@pytest.mark.parametrize("status, said", [(500, HIGH_DEMAND), (502, "unexpected status 502 Bad Gateway")],
                         ids=["500", "502"])
def test_a_5xx_is_retried_by_the_turn_and_the_turn_completes(redis_url, tmp_path, status, said):
    """With the client's own retries off (TOOLQ_REQUEST_MAX_RETRIES=0) the 5xx reaches the turn loop,
    which says it reconnects and asks again with the same history."""
    tools = Tools()
    script = [[b.http_error(status)], [b.function_call("echo", {"text": "hi"}, "call_1")], [b.message("done")]]

    async def go() -> Turn:
        async with driver(redis_url, fake, tmp_path, tools, request_max_retries=0) as d:
            return await d.run("say hi")

    with FakeModel(script) as fake:
        turn = run_async(go)
        requests = fake.requests

    assert turn.outcome.status == "completed" and turn.outcome.final_message == "done"
    assert turn.outcome.requests == 3 and len(requests) == 3
    assert requests[1]["input"] == requests[0]["input"], "the retry did not resend the same history"
    (reconnect,) = turn.errors()
    assert reconnect.startswith(f"Reconnecting... 1/5 ({said}"), reconnect
    assert tools.ran == ["call_1"]
    assert_one_terminal_event(turn, "turn.completed")
    assert_each_call_has_one_output(requests[2]["input"])
    assert outputs_of(requests[2]["input"]) == {"call_1": "hi"}


def test_spent_retries_fail_the_turn_with_one_line_and_every_committed_call_keeps_one_output(
        redis_url, tmp_path):
    """TOOLQ_STREAM_MAX_RETRIES=1: two cut streams, each with a call done before its cut, end the turn.
    Both calls ran once and each has exactly one output, in this process and in Redis."""
    tools = Tools()
    script = [[b.function_call("echo", {"text": "first"}, "call_first"), b.cut_after(clean=False)],
              [b.function_call("echo", {"text": "second"}, "call_second"), b.cut_after(clean=False)],
              [b.message("never asked")]]

    async def go() -> tuple[Turn, list[dict[str, Any]], dict[str, str]]:
        async with driver(redis_url, fake, tmp_path, tools, stream_max_retries=1) as d:
            turn = await d.run("try hard")
            return turn, await d.stored_items(turn.outcome.turn_id), await d.ledger_turn(turn.outcome.turn_id)

    with FakeModel(script) as fake:
        turn, stored, record = run_async(go)
        requests = fake.requests

    outcome = turn.outcome
    assert outcome.status == "failed" and outcome.requests == 2 and len(requests) == 2
    assert outcome.error.startswith(STREAM_DISCONNECTED), outcome.error
    assert len(outcome.error.splitlines()) == 1, outcome.error
    reconnect, said = turn.errors()
    assert reconnect.startswith(f"Reconnecting... 1/1 ({STREAM_DISCONNECTED}") and said == outcome.error
    assert turn.completed_item("call_second")["output"] == "second"
    assert_one_terminal_event(turn, "turn.failed")
    assert tools.ran == ["call_first", "call_second"]
    assert outputs_of(stored) == {"call_first": "first", "call_second": "second"}
    assert_each_call_has_one_output(stored)
    assert record["state"] == "failed" and record["error"] == outcome.error


# --- deadline --------------------------------------------------------------------------------------

#: Long enough that the first response and its call's start come well before it, even on a loaded box.
TURN_TIMEOUT = 4.0


def test_the_turn_deadline_stops_a_running_call_says_why_and_ends_the_turn(redis_url, tmp_path):
    """TOOLQ_TURN_TIMEOUT passes while `hang` runs: toolq stops the call (revokes it), answers it with
    its own line saying why, and the turn fails without asking the model again. The session's next
    turn has a deadline of its own."""
    tools = Tools()
    script = [[b.function_call("hang", {}, "call_slow")], [b.message("next turn")]]

    async def go() -> tuple[Turn, Turn, list[dict[str, Any]], dict[str, str], list[str], list[str]]:
        async with driver(redis_url, fake, tmp_path, tools, turn_timeout=TURN_TIMEOUT) as d:
            late = await d.run("build")
            stored = await d.stored_items(late.outcome.turn_id)
            record = await d.ledger_turn(late.outcome.turn_id)
            sent, revoked = list(d.transport.sent), list(d.transport.revoked)
            record["call_state"] = await d.ledger_call_state(sent[0])
            return late, await d.run("and now?"), stored, record, sent, revoked

    with FakeModel(script) as fake:
        late, after, stored, record, sent, revoked = run_async(go)
        requests = fake.requests

    outcome = late.outcome
    assert outcome.status == "failed" and outcome.requests == 1
    assert outcome.error == f"turn stopped: it ran past its deadline (TOOLQ_TURN_TIMEOUT={TURN_TIMEOUT:g}s)"
    assert late.errors() == [outcome.error]
    assert_one_terminal_event(late, "turn.failed")
    assert tools.stopped == ["call_slow"] and not tools.hanging, "the call was not stopped"
    assert revoked == sent and len(sent) == 1
    written = late.completed_item("call_slow")
    assert written["state"] == "timed_out" and written["status"] == "failed"
    assert re.fullmatch(r"call timed out after [0-9]+\.[0-9]s \(the turn's deadline\) and toolq told its worker to "
                        r"stop it; it may have run on until the worker heard", outputs_of(stored)["call_slow"])
    assert_each_call_has_one_output(stored)
    assert (record["state"], record["error"], record["call_state"]) == ("failed", outcome.error, "timed_out")
    assert after.outcome.status == "completed" and after.outcome.final_message == "next turn"
    assert len(requests) == 2, "the model was asked again after the deadline"
    assert_each_call_has_one_output(requests[1]["input"])


def test_the_turn_deadline_bounds_a_stalled_model_stream(redis_url, tmp_path):
    """The model's stream stalls (for an hour) with no call in it: the turn's deadline stops the
    stream too, and the turn fails saying so (it used to wait for the stream and then complete)."""
    tools = Tools()
    script = [[b.message("thinking"), b.stall(3600)], [b.message("next turn")]]

    async def go() -> tuple[Turn, Turn]:
        async with driver(redis_url, fake, tmp_path, tools, turn_timeout=TURN_TIMEOUT) as d:
            return await d.run("build"), await d.run("and now?")

    with FakeModel(script) as fake:
        late, after = run_async(go)

    assert late.outcome.status == "failed" and late.outcome.requests == 1
    assert late.outcome.error == f"turn stopped: it ran past its deadline (TOOLQ_TURN_TIMEOUT={TURN_TIMEOUT:g}s)"
    assert_one_terminal_event(late, "turn.failed")
    assert after.outcome.status == "completed" and after.outcome.final_message == "next turn"


def test_a_servers_retry_after_never_keeps_a_turn_past_its_deadline(redis_url, tmp_path):
    """A 429 naming an hour's Retry-After: the turn waits at most until its deadline, then fails
    saying so, without a second request (it used to sleep the whole hour)."""
    tools = Tools()
    script = [[b.http_error(429, headers={"retry-after": "3600"})], [b.message("next turn")]]

    async def go() -> tuple[Turn, Turn]:
        async with driver(redis_url, fake, tmp_path, tools, turn_timeout=TURN_TIMEOUT, request_max_retries=0) as d:
            return await d.run("build"), await d.run("and now?")

    with FakeModel(script) as fake:
        late, after = run_async(go)
        requests = fake.requests

    assert late.outcome.status == "failed" and late.outcome.requests == 1
    assert late.outcome.error == f"turn stopped: it ran past its deadline (TOOLQ_TURN_TIMEOUT={TURN_TIMEOUT:g}s)"
    assert after.outcome.status == "completed" and len(requests) == 2


def test_a_servers_many_line_error_page_reaches_the_user_as_one_line(redis_url, tmp_path):
    """A proxy's HTML 502 page, retries spent: the turn's error, its events and the ledger say it on one line."""
    tools = Tools()
    page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<h1>Bad Gateway</h1>\r\n</body></html>"
    script = [[b.http_error(502, body=page)], [b.http_error(502, body=page)]]

    async def go() -> tuple[Turn, dict[str, str]]:
        async with driver(redis_url, fake, tmp_path, tools, request_max_retries=0, stream_max_retries=1) as d:
            failed = await d.run("build")
            return failed, await d.ledger_turn(failed.outcome.turn_id)

    with FakeModel(script) as fake:
        failed, record = run_async(go)

    error = failed.outcome.error or ""
    assert failed.outcome.status == "failed" and "Bad Gateway" in error
    for said in [error, *failed.errors(), record["error"]]:
        assert "\n" not in said and "\r" not in said, said


# --- cancel ----------------------------------------------------------------------------------------


async def cancel(d: Driver, how: str) -> None:
    """Ctrl-C in this process (`Session.cancel()`), or `toolq cancel TURN` from another (the ledger
    in Redis records it and publishes it; the turn's scope hears it)."""
    if how == "ctrl_c":
        d.session.cancel()
    else:
        assert d.session.turn_id is not None
        await d.runtime.fleet.ledger.cancel_turn(d.session.turn_id)


def assert_cancelled(turn: Turn) -> None:
    assert turn.outcome.status == "cancelled", turn.outcome
    assert re.fullmatch(r"turn cancelled after [0-9]+\.[0-9]s", turn.outcome.error or ""), turn.outcome.error
    assert_one_terminal_event(turn, "turn.aborted")
    assert turn.errors() == []


def assert_aborted_turn_recorded(items: list[dict[str, Any]]) -> None:
    """The cancelled turn's history ends with Codex's `<turn_aborted>` note, every call answered."""
    assert_each_call_has_one_output(items)
    assert items[-1]["role"] == "user" and items[-1]["content"][0]["text"] == TURN_ABORTED


@pytest.mark.parametrize("how", ["ctrl_c", "toolq_cancel"])
def test_a_cancel_while_a_call_runs_aborts_it_keeps_the_finished_one_and_the_next_turn_goes_on(
        redis_url, tmp_path, how):
    """One call has finished, the other runs: the cancel stops the running one (revoked, its handler
    cancelled) and answers it `aborted`, keeps the finished one's real output, asks the model
    nothing more; the next turn starts from that paired history and `<turn_aborted>`."""
    tools = Tools()
    script = [[b.function_call("echo", {"text": "done"}, "call_done"), b.function_call("hang", {}, "call_running")],
              [b.message("second turn answer")]]

    async def go() -> tuple[Turn, Turn, list[dict[str, Any]], list[str], list[str]]:
        async with driver(redis_url, fake, tmp_path, tools) as d:
            first = d.start("first")
            await wait_until(lambda: "call_running" in tools.hanging and d.saw("item.completed", "call_done"),
                             "one call to finish and the other to run")
            await cancel(d, how)
            cancelled = await first
            stored = await d.stored_items(cancelled.outcome.turn_id)
            running_task = d.transport.sent[1]
            assert await d.ledger_call_state(running_task) == "cancelled"
            return cancelled, await d.run("second"), stored, list(d.transport.revoked), [running_task]

    with FakeModel(script) as fake:
        cancelled, second, stored, revoked, running_task = run_async(go)
        requests = fake.requests

    assert_cancelled(cancelled)
    assert cancelled.outcome.requests == 1
    assert tools.stopped == ["call_running"] and not tools.hanging, "the running call was not stopped"
    assert revoked == running_task
    assert cancelled.completed_item("call_running")["state"] == "cancelled"
    outputs = outputs_of(stored)
    assert outputs["call_done"] == "done", "a finished call lost its output to the cancel"
    assert ABORTED_OUTPUT.fullmatch(outputs["call_running"]), outputs["call_running"]
    assert_aborted_turn_recorded(stored)

    assert second.outcome.status == "completed" and second.outcome.final_message == "second turn answer"
    assert_one_terminal_event(second, "turn.completed")
    assert len(requests) == 2, "the cancelled turn asked the model again"
    carried = requests[1]["input"]
    assert_each_call_has_one_output(carried)
    assert outputs_of(carried) == outputs
    assert TURN_ABORTED in [p.get("text") for i in carried if i.get("type") == "message" for p in i["content"]]


def test_a_cancel_while_the_model_streams_closes_the_stream_and_aborts_the_call_it_started(redis_url, tmp_path):
    """The response's call is done and running, then the stream stalls (for an hour, unless the fake
    model closes): the cancel does not wait for the stream, aborts the call, and the next turn goes on."""
    tools = Tools()
    script = [[b.message("looking into it"), b.function_call("hang", {}, "call_streamed"), b.stall(3600)],
              [b.message("second turn answer")]]

    async def go() -> tuple[Turn, Turn, list[dict[str, Any]]]:
        async with driver(redis_url, fake, tmp_path, tools) as d:
            first = d.start("first")
            await wait_until(lambda: "call_streamed" in tools.hanging, "the streamed call to run")
            d.session.cancel()
            cancelled = await first
            stored = await d.stored_items(cancelled.outcome.turn_id)
            return cancelled, await d.run("second"), stored

    with FakeModel(script) as fake:
        cancelled, second, stored = run_async(go)
        requests = fake.requests

    assert_cancelled(cancelled)
    assert cancelled.outcome.requests == 1 and cancelled.outcome.final_message == "looking into it"
    assert tools.stopped == ["call_streamed"] and not tools.hanging
    assert ABORTED_OUTPUT.fullmatch(outputs_of(stored)["call_streamed"]), outputs_of(stored)
    assert_aborted_turn_recorded(stored)
    assert second.outcome.status == "completed" and second.outcome.final_message == "second turn answer"
    assert len(requests) == 2
    assert_each_call_has_one_output(requests[1]["input"])


def test_a_cancel_during_the_wait_before_a_retry_ends_the_turn_at_once(redis_url, tmp_path):
    """A 429 naming an hour's Retry-After: the turn says it will reconnect and waits; a cancel ends
    the wait (else this test hangs) and no second request is made."""
    tools = Tools()
    script = [[b.http_error(429, headers={"retry-after": "3600"})], [b.message("second turn answer")]]

    async def go() -> tuple[Turn, Turn, list[dict[str, Any]]]:
        async with driver(redis_url, fake, tmp_path, tools, request_max_retries=0) as d:
            first = d.start("first")
            await wait_until(lambda: d.saw("error"), "the turn to wait before its retry")
            d.session.cancel()
            cancelled = await first
            return cancelled, await d.run("second"), await d.stored_items(cancelled.outcome.turn_id)

    with FakeModel(script) as fake:
        cancelled, second, stored = run_async(go)
        requests = fake.requests

    assert cancelled.outcome.status == "cancelled" and cancelled.outcome.requests == 1
    assert stored[-1]["content"][0]["text"] == TURN_ABORTED
    assert [t for t in cancelled.types() if t in TERMINAL] == ["turn.aborted"]
    assert cancelled.errors() == ["Reconnecting... 1/5 (exceeded retry limit, last status: 429 Too Many Requests)"]
    assert second.outcome.status == "completed" and len(requests) == 2


# --- metrics: what a turn counts, whatever ends it --------------------------------------------------


def scraped(port: int, name: str, **labels: str) -> float:
    """One sample of this process's orchestrator metrics, scraped over HTTP (0 when absent)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_a_turn_leaves_the_in_flight_gauge_even_when_its_callers_emit_raises_at_the_end(
        redis_url, tmp_path, served):
    tools = Tools()

    async def go() -> None:
        async with driver(redis_url, fake, tmp_path, tools) as d:
            def emit(event: Any) -> None:
                if event.to_json()["type"] == "turn.completed":
                    raise RuntimeError("the caller's own emit broke")

            with pytest.raises(RuntimeError, match="emit broke"):
                await d.session.run_turn("hello", emit)

    with FakeModel([[b.message("hi")]]) as fake:
        run_async(go)
    assert scraped(served, "toolq_turns_in_flight") == 0
    assert scraped(served, "toolq_turns_total", state="completed") == 1


def test_a_cancelled_turn_task_leaves_the_in_flight_gauge(redis_url, tmp_path, served):
    """The task that runs a turn cancelled from outside (asyncio's CancelledError, which the loop's
    `except Exception` does not see): the turn still counts as ended."""
    tools = Tools()

    async def go() -> None:
        async with driver(redis_url, fake, tmp_path, tools) as d:
            task = d.start("wait for it")
            await wait_until(lambda: "call_slow" in tools.hanging, "the call to run")
            assert scraped(served, "toolq_turns_in_flight") == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with FakeModel([[b.function_call("hang", {}, "call_slow")], [b.message("never")]]) as fake:
        run_async(go)
    assert scraped(served, "toolq_turns_in_flight") == 0


def test_model_requests_count_retried_only_what_the_turn_retries(redis_url, tmp_path, served):
    """TOOLQ_STREAM_MAX_RETRIES=1 and two cut streams: the first is retried, the second fails the turn."""
    tools = Tools()
    script = [[b.function_call("echo", {"text": "first"}, "call_first"), b.cut_after(clean=False)],
              [b.function_call("echo", {"text": "second"}, "call_second"), b.cut_after(clean=False)]]

    async def go() -> Turn:
        async with driver(redis_url, fake, tmp_path, tools, stream_max_retries=1) as d:
            return await d.run("try hard")

    with FakeModel(script) as fake:
        turn = run_async(go)
    assert turn.outcome.status == "failed"
    assert scraped(served, "toolq_model_requests_total", outcome="retried") == 1
    assert scraped(served, "toolq_model_requests_total", outcome="failed") == 1
