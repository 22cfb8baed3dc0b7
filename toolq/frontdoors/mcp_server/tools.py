"""The fleet's tools as MCP tools, and an MCP `tools/call` as the toolq call item it stands for.

Function tools keep their JSON Schema; a namespaced tool (an MCP server a worker hosts, a
`@tool(namespace=...)`) is offered as `NAMESPACE__NAME`: MCP allows a dot, but the clients hand
the names to model APIs whose function names may not hold one (OpenAI's: `[A-Za-z0-9_-]`). A custom
(freeform) tool such as apply_patch takes text, which MCP cannot carry bare: it is offered with the
input schema `{"input": string}` and its grammar in the description. `tool_search` is not offered:
an MCP client's tool list holds every tool already, deferred ones included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from mcp import types

#: Between a namespace and its tool's name in an MCP tool name.
NAMESPACE_SEPARATOR = "__"
#: What a custom tool takes over MCP: its freeform text under one key.
CUSTOM_INPUT = "input"
#: Every tool may run as an MCP task (a handle polled later): each call is a turn in the ledger.
TASK_SUPPORT = types.ToolExecution(taskSupport="optional")


@dataclass(frozen=True)
class Offered:
    """One tool as an MCP client sees it, and what a call of it becomes."""

    tool: types.Tool
    name: str
    """The toolq tool's own name (without its namespace)."""
    namespace: str | None
    kind: Literal["function", "custom"]

    def call_item(self, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
        """The Responses item a model would have sent for this call. ValueError: a custom tool's
        `input` is not text."""
        ns = {"namespace": self.namespace} if self.namespace else {}
        if self.kind == "custom":
            text = arguments.get(CUSTOM_INPUT)
            if not isinstance(text, str):
                raise ValueError(f"{self.tool.name} takes its input as text: {{\"{CUSTOM_INPUT}\": \"...\"}}")
            return {"type": "custom_tool_call", "call_id": call_id, "name": self.name, "input": text, **ns}
        return {"type": "function_call", "call_id": call_id, "name": self.name,
                "arguments": json.dumps(arguments), **ns}


def offered_tools(specs: list[dict[str, Any]]) -> dict[str, Offered]:
    """The MCP tools for the `tools` of a Responses request (`Registry.model_visible_specs`), by name."""
    offered: dict[str, Offered] = {}
    for spec in specs:
        if spec.get("type") == "namespace":
            for sub in spec.get("tools", []):
                if (o := _offered(sub, spec["name"])) is not None:
                    offered.setdefault(o.tool.name, o)
        elif (o := _offered(spec, None)) is not None:
            offered.setdefault(o.tool.name, o)  # a plain tool named like a namespaced one: the first stays
    return offered


def _offered(spec: dict[str, Any], namespace: str | None) -> Offered | None:
    kind = spec.get("type")
    name = spec.get("name")
    if kind not in ("function", "custom") or not isinstance(name, str):
        return None
    shown = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
    description = spec.get("description") or ""
    if kind == "custom":
        schema = {"type": "object", "additionalProperties": False, "required": [CUSTOM_INPUT],
                  "properties": {CUSTOM_INPUT: {"type": "string", "description": "the tool's freeform input"}}}
        grammar = spec.get("format")
        if isinstance(grammar, dict) and grammar.get("definition"):
            description += (f"\n\nThe input follows this {grammar.get('syntax', '')} grammar:\n"
                            f"{grammar['definition']}")
        return Offered(types.Tool(name=shown, description=description, inputSchema=schema, execution=TASK_SUPPORT),
                       name, namespace, "custom")
    schema = spec.get("parameters") or {"type": "object", "properties": {}}
    return Offered(types.Tool(name=shown, description=description, inputSchema=schema, execution=TASK_SUPPORT),
                   name, namespace, "function")
