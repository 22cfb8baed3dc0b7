"""For users' own tests (like `temporalio.testing`): the fake model, and one call run in-process.

    from toolq.testing import run_call

    def test_search_finds_the_word(tmp_path):
        (tmp_path / "a.txt").write_text("needle")
        result = run_call(search, {"query": "needle"}, workspace=tmp_path)
        assert result.status == "completed" and "a.txt" in result.output

`run_call` goes through what a real call goes through, minus the queue: the orchestrator's routing
and validation (`RespondToModel` texts included), then the worker's checks and the handler.
`FakeModel` is the scripted Responses server `toolq fake-model` runs; `builders` write its scripts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from toolq.core.calls import ToolResult
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.items import CustomToolCallItem, FunctionCallItem, ToolSearchCallItem
from toolq.dev.fake_model import builders
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.binding import bind_item
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.transport.memory import HOSTNAME
from toolq.workers.execute import run_in_process

__all__ = ["FakeModel", "arun_call", "builders", "run_call"]


def _spec_of(tool: Any) -> ToolSpec:
    spec = tool if isinstance(tool, ToolSpec) else getattr(tool, "tool_spec", None)
    if not isinstance(spec, ToolSpec):
        raise TypeError(f"{tool!r} is not a @tool function or a ToolSpec")
    return spec


async def arun_call(tool: Any, arguments: dict[str, Any] | str | None = None, *, workspace: str | Path | None = None,
                    call_id: str = "call_test") -> ToolResult:
    """Run one call of `tool` (a `@tool` function) in this process and return its `ToolResult`.

    `arguments`: a dict or the raw JSON text of a function tool, the freeform text of a custom
    tool, or a tool_search's `{"query": ..., "limit": ...}`."""
    spec = _spec_of(tool)
    catalog = Catalog([spec])
    if spec.kind == "custom":
        item: Any = CustomToolCallItem(call_id=call_id, name=spec.name, namespace=spec.namespace,
                                       input=str(arguments or ""))
    elif spec.kind == "tool_search":
        item = ToolSearchCallItem(call_id=call_id, execution="client", arguments=arguments or {})
    else:
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        item = FunctionCallItem(call_id=call_id, name=spec.name, namespace=spec.namespace, arguments=raw)
    ctx = StepContext("turn-test", 0, time.time() + spec.timeout, str(workspace or Path.cwd()))
    bound = bind_item(item, Registry(catalog), ctx, 0)
    assert bound is not None
    if bound.answer is not None:
        return bound.answer
    assert bound.invocation is not None
    return await run_in_process(bound.invocation, spec, catalog, HOSTNAME)


def run_call(tool: Any, arguments: dict[str, Any] | str | None = None, *, workspace: str | Path | None = None,
             call_id: str = "call_test") -> ToolResult:
    """`arun_call` for synchronous tests (starts its own event loop)."""
    return asyncio.run(arun_call(tool, arguments, workspace=workspace, call_id=call_id))
