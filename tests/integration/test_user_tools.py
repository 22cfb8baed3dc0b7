"""User tools on real workers (issue 5, "User tools"): `examples.search_tools` on its own queue,
async handlers, declarations that differ between the two sides, and a queue nobody serves."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys

import pytest
import redis

import examples.search_tools  # noqa: F401  (the orchestrator side loads the same declarations)
import tests.integration.mismatch_tools as mismatch_tools
import toolq.core.catalog as catalog_module
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV, run_session, settings_for
from toolq.core import keys
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

SEARCH_TOOLS = "examples.search_tools"
SEARCH_WORKER = "search1@test"
FLEET = {"fleet0@test", "fleet1@test"}


def final(text="done"):
    return [b.message(text)]


@pytest.fixture(scope="module")
def search_worker(redis_server, tmp_path_factory):
    """What the README runs: `toolq worker --tools examples.search_tools --queues search`."""
    w = WorkerProcess(redis_server.url, name=SEARCH_WORKER, queues=["search"], concurrency=2,
                      tools=[SEARCH_TOOLS, TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path_factory.mktemp("search"))
    w.start()
    yield w
    w.stop(grace=3)


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "notes").mkdir(parents=True)
    (ws / "notes" / "todo.txt").write_text("buy milk\nfind the needle here\n")
    (ws / "readme.md").write_text("nothing to see\n")
    return ws


def completed_items(run) -> dict[str, dict]:
    return {e["item"]["id"]: e["item"] for e in run.events if e["type"] == "item.completed"}


def test_namespaced_and_plain_search_are_different_tools_on_the_search_worker(fleet, search_worker, drive,
                                                                             workspace):
    run = drive([
        [b.function_call("search", {"query": "needle", "limit": None}, "call_ws", namespace="workspace"),
         b.function_call("search", {"query": "TODO", "limit": None}, "call_plain"),
         b.function_call("exec_command", {"cmd": "echo builtin"}, "call_builtin")],
        final(),
    ], workspace=workspace, tools=[TEST_TOOLS, SEARCH_TOOLS])
    assert run.outcome.status == "completed"

    # request 1 offers both: the namespaced one grouped under its namespace
    tools = run.requests[0]["tools"]
    plain = [t for t in tools if t.get("type") == "function" and t["name"] == "search"]
    group = [t for t in tools if t.get("type") == "namespace" and t["name"] == "workspace"]
    assert len(plain) == 1 and plain[0]["description"].startswith("Finds files")
    assert [t["name"] for t in group[0]["tools"]] == ["search"]
    assert group[0]["tools"][0]["description"].startswith("Searches the contents")

    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_ws"] == "notes/todo.txt:2: find the needle here"
    assert outputs["call_plain"] == "notes/todo.txt"
    assert outputs["call_builtin"].endswith("Output:\nbuiltin\n")

    items = completed_items(run)
    assert items["call_ws"]["worker"] == SEARCH_WORKER
    assert items["call_plain"]["worker"] == SEARCH_WORKER
    assert items["call_builtin"]["worker"] in FLEET, "a built-in ran outside the default fleet"


def test_an_async_user_tool_runs_and_its_errors_reach_the_model(fleet, search_worker, drive, workspace):
    # `search` is `async def`; several calls in a row reuse the worker process's one event loop
    run = drive([
        [b.function_call("search", {"query": ".md", "limit": None}, "call_md"),
         b.function_call("search", {"query": "txt", "limit": 0}, "call_zero"),
         b.function_call("search", {"query": "nowhere", "limit": 5}, "call_none")],
        [b.function_call("search", {"query": "notes", "limit": 1}, "call_again")],
        final(),
    ], workspace=workspace, tools=[TEST_TOOLS, SEARCH_TOOLS])
    assert run.outcome.status == "completed"
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs == {"call_md": "readme.md", "call_zero": "limit must be greater than zero",
                       "call_none": "no files match"}
    again = run.outputs_of(2)[-1]
    assert (again["call_id"], again["output"]) == ("call_again", "notes/todo.txt")
    assert completed_items(run)["call_zero"]["success"] is False


def test_a_freeform_user_tool_takes_raw_text_and_answers_with_a_custom_output(fleet, search_worker, drive,
                                                                            workspace):
    run = drive([
        [b.custom_tool_call("regex_search", r"\bne+dle\b", "call_rx"),
         b.custom_tool_call("regex_search", "(unclosed", "call_bad")],
        final(),
    ], workspace=workspace, tools=[TEST_TOOLS, SEARCH_TOOLS])
    outputs = {o["call_id"]: o for o in run.outputs_of(1)}
    assert outputs["call_rx"]["type"] == "custom_tool_call_output"
    assert outputs["call_rx"]["output"] == "notes/todo.txt:2: find the needle here"
    assert outputs["call_bad"]["output"] == "invalid regular expression: missing ), unterminated subpattern at position 0"
    assert completed_items(run)["call_rx"]["worker"] == SEARCH_WORKER


def test_a_tool_declared_differently_on_its_only_worker_is_not_sent_to_it(redis_server, drive, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    # Only the worker sees the variable: its `touch_marker` has another timeout than ours, so
    # another declaration digest and another queue; the call is answered without reaching it.
    w = WorkerProcess(redis_server.url, name="mismatch1@test", queues=[mismatch_tools.QUEUE], concurrency=1,
                      tools=[TEST_TOOLS, "tests.integration.mismatch_tools"],
                      env={**WORKER_ENV, mismatch_tools.MISMATCH_ENV: "1"}, logdir=tmp_path)
    with w:
        run = drive([[b.function_call("touch_marker", {"name": "marker.txt"}, "call_mm")], final()],
                    workspace=workspace, tools=[TEST_TOOLS, "tests.integration.mismatch_tools"])
    output = run.outputs_of(1)[0]["output"]
    assert output == (
        "touch_marker was not run: no live worker serves tool `touch_marker` (declared in module "
        "`tests.integration.mismatch_tools`); 1 live worker(s) serve another declaration of it "
        "(another version of its module), and a call only goes to a worker whose declaration is the caller's: start one with "
        f"`toolq worker --tools tests.integration.mismatch_tools` (its queue is `{mismatch_tools.QUEUE}`, which a "
        "worker started with --queues must list)")
    assert not (workspace / "marker.txt").exists(), "the call ran on a worker with another declaration"
    item = completed_items(run)["call_mm"]
    assert (item["status"], item["state"], item["success"]) == ("failed", "rejected", False) and "worker" not in item
    assert run.outcome.status == "completed"  # the model reads why; the turn goes on


def test_a_worker_restricted_by_queues_does_not_serve_the_tools_of_other_queues(drive, tmp_path):
    # A private broker whose only worker has the search tools loaded but serves `toolq`, not `search`.
    with RedisServer() as server, WorkerProcess(server.url, name="toolq-only@test", queues=["toolq"], concurrency=2,
                                                tools=[SEARCH_TOOLS, TEST_TOOLS], env=WORKER_ENV,
                                                logdir=tmp_path):
        run = drive([
            [b.function_call("search", {"query": "x", "limit": None}, "call_stranded"),
             b.function_call("sleep_echo", {"text": "alive"}, "call_alive")],
            final(),
        ], redis_url=server.url, tools=[TEST_TOOLS, SEARCH_TOOLS])
        r = redis.Redis.from_url(server.url)
        task_ids = r.hget(keys.call_ids(run.outcome.turn_id), "call_stranded").decode().split()
        assert len(task_ids) == 1
        assert not r.exists(keys.started(task_ids[0])), "the call was started by some worker"
        assert r.hget(keys.call(task_ids[0]), "state") == b"rejected"
        r.close()
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_stranded"] == (
        f"search was not run: no live worker serves tool `search` (declared in module `{SEARCH_TOOLS}`): "
        f"start one with `toolq worker --tools {SEARCH_TOOLS}` (its queue is `search`, which a worker started with "
        "--queues must list)")
    assert json.loads(outputs["call_alive"])["text"] == "alive"
    items = completed_items(run)
    assert items["call_stranded"]["state"] == "rejected" and "worker" not in items["call_stranded"]
    assert items["call_stranded"]["status"] == "failed"  # as `codex exec --json` marks it
    assert items["call_alive"]["worker"] == "toolq-only@test"


# --- issue 26: a tool declared by its typed parameters, and one without ctx, on a real worker ------------------

TYPED_TOOLS = "typed_tools_issue26"
TYPED_SOURCE = '''
from typing import Annotated

from pydantic import BaseModel, Field

from toolq import ToolContext, tool


@tool(queue="typed")
def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return str(a + b)


@tool(queue="typed")
async def write_note(name: Annotated[str, Field(description="A file name in the workspace.")], text: str,
                     ctx: ToolContext, times: int = 1) -> str:
    """Writes a note into the workspace."""
    (ctx.workspace / name).write_text(text * times)
    return f"wrote {name} for {ctx.call_id}"


class Shout(BaseModel):
    text: str


@tool(queue="typed")
def shout(args: Shout) -> str:
    """An args model and no ctx."""
    return args.text.upper()
'''


def test_tools_declared_by_typed_parameters_and_without_ctx_run_on_a_real_worker(redis_server, tmp_path):
    # `def add(a: int, b: int)` was a freeform tool whose call failed with a TypeError, and
    # `def shout(args: Shout)` failed with "takes 1 positional argument but 2 were given".
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / f"{TYPED_TOOLS}.py").write_text(TYPED_SOURCE)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    # This side declares the same tools, into a catalog of its own: the process's stays as the other tests know it.
    private = catalog_module.Catalog()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        patch.setattr(catalog_module, "CATALOG", private)
        importlib.import_module(TYPED_TOOLS)
        sys.modules.pop(TYPED_TOOLS)
    catalog = catalog_module.Catalog([*load_catalog([TEST_TOOLS]), *private])
    assert [s.kind for s in private] == ["function"] * 3
    w = WorkerProcess(redis_server.url, name="typed1@test", queues=["typed"], concurrency=1, tools=[TYPED_TOOLS],
                      env={**WORKER_ENV, "TOOLQ_TOOLS_PATH": str(folder)}, logdir=tmp_path)
    with w, FakeModel([[b.function_call("add", {"a": 2, "b": 40}, "call_add"),
                        b.function_call("write_note", {"name": "n.txt", "text": "ab", "times": None}, "call_note"),
                        b.function_call("shout", {"text": "quiet"}, "call_shout"),
                        b.function_call("add", {"a": "two", "b": 1}, "call_bad")], final()]) as fake:
        settings = settings_for(redis_server.url, fake, workspace)
        events: list = []
        (outcome,), _ = asyncio.run(asyncio.wait_for(run_session(settings, ["go"], events, catalog=catalog), 90))
    assert outcome.status == "completed"
    offered = {t["name"]: t for t in fake.requests[0]["tools"] if t.get("type") == "function"}
    assert offered["add"]["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first term."},
                                                         "b": {"type": "integer", "description": "The second term."}}
    assert offered["add"]["description"] == "Adds two integers." and offered["add"]["strict"] is True
    outputs = {o["call_id"]: o["output"] for o in fake.requests[1]["input"] if o.get("type") == "function_call_output"}
    assert outputs["call_add"] == "42"
    assert outputs["call_note"] == "wrote n.txt for call_note" and (workspace / "n.txt").read_text() == "ab"
    assert outputs["call_shout"] == "QUIET"
    assert outputs["call_bad"].startswith("failed to parse function arguments: invalid value at `a`")
    items = {e["item"]["id"]: e["item"] for e in events if e["type"] == "item.completed"}
    assert {items[c]["worker"] for c in ("call_add", "call_note", "call_shout")} == {"typed1@test"}
