"""MCP tools as toolq tools: one record per listed tool, and the `ToolSpec` both sides build from it.

A record is what a worker learns from `tools/list` and tells the fleet (the server's name and the
tool's name, description and `inputSchema`, plus the settings that are part of the declaration).
Worker and orchestrator both turn it into a `ToolSpec` with `tool_spec`, so the declaration
digest, computed from the listed schema, is the same on both sides for as long as the server
lists the same schema, and differs as soon as it lists another.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from toolq.core.catalog import Handler, ToolSpec, map_subschemas

#: A Responses API function name; an MCP tool named otherwise cannot be offered to the model.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: A server listing more tools than this is deferred behind tool_search unless its config says.
DEFER_ABOVE = 40


#: Every MCP server's tools are declared on a queue of this prefix, which is how the orchestrator
#: tells them among the fleet's declarations.
MCP_QUEUE_PREFIX = "mcp."


def mcp_queue(server: str) -> str:
    """The queue a server's tools are declared on (`--queues` selects by it): workers that host
    the server consume it; calls travel on each declaration's own queue (`advert.tool_queue`)."""
    return f"{MCP_QUEUE_PREFIX}{server}"


class McpToolRecord(BaseModel):
    """One MCP tool as listed by one server: what the fleet needs to offer and route it."""

    model_config = ConfigDict(frozen=True)

    server: str
    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout: float
    deferred: bool = False
    digest: str = ""
    """The declaration digest the hosting worker computed (`tool_spec(...).digest()`)."""


def tool_spec(record: McpToolRecord, handler: Handler | None = None) -> ToolSpec:
    """The namespaced function tool for one record; workers pass the handler that forwards to the host."""
    return ToolSpec(
        name=record.name,
        namespace=record.server,
        description=record.description,
        kind="function",
        parameters=record.input_schema,
        strict=strict_allowed(record.input_schema),
        queue=mcp_queue(record.server),
        timeout=record.timeout,
        deferred=record.deferred,
        handler=handler,
    )


def unusable(name: str, schema: Any) -> str | None:
    """Why a listed tool cannot be offered to the model, or None."""
    if not TOOL_NAME.fullmatch(name):
        return "its name is not a valid function name (letters, digits, _ and -, at most 64)"
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return "its inputSchema is not an object schema"
    # here: the orchestrator reads this module for MCP_QUEUE_PREFIX, and never checks a listing
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        return f"its inputSchema is not valid JSON Schema: {e.message}"
    return None


def strict_allowed(schema: Any) -> bool:
    """Whether the schema is already in the Responses strict subset (every object closed, every
    property required); toolq never rewrites a server's schema, so anything else goes non-strict."""
    if not isinstance(schema, dict):
        return False
    ok = True

    def visit(node: Any) -> Any:
        nonlocal ok
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                props = node.get("properties", {})
                if node.get("additionalProperties") is not False or set(node.get("required", [])) != set(props):
                    ok = False
            map_subschemas(node, visit)
        return node

    visit(schema)
    return ok
