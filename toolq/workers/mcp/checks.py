"""The check of a tool's structured content against its `outputSchema`, compiled once per listing.

The SDK's `ClientSession.call_tool` makes the same check on every call with `jsonschema.validate`,
which checks the schema against its metaschema and builds a validator each time (~0.7 ms for a
one-field schema, more than the rest of the host's work on a call). The host sends `tools/call`
itself and checks with a validator compiled when the tool was listed, with the SDK's rules: an
explicit empty registry (a `$ref` resolves within the schema or to a bundled metaschema, never
by a fetch), and a result the server marked `isError` is not checked.
"""

from __future__ import annotations

from typing import Any

from jsonschema import SchemaError
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from mcp import types
from referencing import Registry
from referencing.exceptions import Unresolvable


class OutputCheck:
    def __init__(self, tool: str, schema: dict[str, Any]) -> None:
        """Raises `SchemaError` for a schema that is not valid JSON Schema."""
        cls = validator_for(schema)
        cls.check_schema(schema)
        self.tool = tool
        self._validator: Validator = cls(schema, registry=Registry())

    def problem(self, result: types.CallToolResult) -> str | None:
        """Why the result breaks the tool's output schema, or None."""
        if result.isError:
            return None
        if result.structuredContent is None:
            return f"tool {self.tool} has an output schema but did not return structured content"
        try:
            error = best_match(self._validator.iter_errors(result.structuredContent))
        except Unresolvable as e:
            return f"tool {self.tool}'s output schema has a $ref that does not resolve: {e}"
        return None if error is None else f"invalid structured content returned by tool {self.tool}: {error.message}"


def output_check(tool: types.Tool) -> OutputCheck | None:
    """The tool's check, None if it declares no output schema. Raises `SchemaError` if its schema is invalid."""
    return None if tool.outputSchema is None else OutputCheck(tool.name, tool.outputSchema)


__all__ = ["OutputCheck", "SchemaError", "output_check"]
