"""Tests of the built-in tools. `make_ctx` and `call` run a tool the way a worker does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolq.core.calls import CustomPayload, FunctionPayload, ToolInvocation, ToolName, ToolSearchPayload
from toolq.core.catalog import Catalog, ToolContext, ToolSpec, call_handler, parse_arguments


def make_ctx(
    workspace: Path,
    spec: ToolSpec,
    payload: Any,
    *,
    deadline_in: float = 60.0,
    is_cancelled: Callable[[], bool] = lambda: False,
    catalog: Catalog | None = None,
) -> ToolContext:
    invocation = ToolInvocation(
        turn_id="turn-1",
        step=0,
        output_index=0,
        call_id="call_1",
        tool_name=ToolName(namespace=spec.namespace, name=spec.name),
        payload=payload,
        deadline=time.time() + deadline_in,
        workspace=str(workspace),
    )
    return ToolContext(invocation=invocation, workspace=workspace, is_cancelled=is_cancelled, catalog=catalog)


def call(fn: Any, workspace: Path, arguments: Any, **ctx_options: Any) -> Any:
    """Run a tool as the worker does: parse a function call's JSON, or hand over the raw payload."""
    spec: ToolSpec = fn.tool_spec
    if spec.kind == "function":
        payload: Any = FunctionPayload(arguments=arguments)
        args: Any = parse_arguments(spec, arguments)
    elif spec.kind == "custom":
        payload, args = CustomPayload(input=arguments), arguments
    else:
        payload = args = ToolSearchPayload(**arguments)
    ctx = make_ctx(workspace, spec, payload, **ctx_options)
    return asyncio.run(call_handler(spec, args, ctx))
