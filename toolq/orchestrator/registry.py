"""The registry: which calls may run, and the tools the model sees (Codex `registry.rs`).

`bind` is the last gate before the queue: nothing invalid is ever dispatched. An unknown tool,
bad JSON or a schema violation raises `RespondToModel` (the model reads it and the turn goes on);
a payload kind the tool does not take raises `Fatal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolq.core.calls import FUNCTIONS_NAMESPACE, FunctionPayload, ToolCall, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolSpec, is_nullable, load_arguments, map_subschemas
from toolq.core.environments import EnvRef
from toolq.core.errors import Fatal, RespondToModel

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError as SchemaError


@dataclass(frozen=True)
class StepContext:
    """What a call of one model response is bound to."""

    turn_id: str
    step: int
    deadline: float
    workspace: str | None = None
    conversation: str | None = None
    """The conversation (a `Session`) the call belongs to: its exec_command sessions live as long as it."""
    environment: EnvRef | None = None
    """The environment the calls run in (on its host), or None: the shared `workspace`."""


class Registry:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._validators: dict[ToolName, Draft202012Validator] = {}
        """Compiled at a tool's first call, not here: a turn whose model calls no such tool never
        loads jsonschema (a quarter of `toolq run`'s start-up imports)."""

    def _index(self, spec: ToolSpec) -> None:
        self._validators.pop(spec.tool_name, None)  # a new declaration: compiled again when called

    def add(self, specs: list[ToolSpec]) -> None:
        """Tools learned rather than loaded here (the fleet's MCP namespaces use `replace_namespace`)."""
        for spec in specs:
            self.catalog.add(spec)
            self._index(spec)

    def replace_namespace(self, namespace: str, specs: list[ToolSpec]) -> None:
        """A namespace learned from the fleet becomes exactly `specs` (none: no live worker serves it)."""
        for name in [n for n in self._validators if n.namespace == namespace]:
            del self._validators[name]
        self.catalog.replace_namespace(namespace, specs)

    def lookup(self, name: ToolName) -> ToolSpec | None:
        spec = self.catalog.get(name)
        if spec is None and name.namespace == FUNCTIONS_NAMESPACE:
            spec = self.catalog.get(ToolName.plain(name.name))
        return spec

    def bind(self, call: ToolCall, step: StepContext, output_index: int) -> ToolInvocation:
        spec = self.lookup(call.tool_name)
        if spec is None:
            what = "unsupported custom tool call" if call.payload.kind == "custom" else "unsupported call"
            raise RespondToModel(f"{what}: {call.tool_name.display()}")
        if call.payload.kind != spec.kind:
            raise Fatal(f"tool {call.tool_name.display()} invoked with incompatible payload")
        if isinstance(call.payload, FunctionPayload):
            self._validate_arguments(spec, call.payload.arguments)
        return ToolInvocation(
            turn_id=step.turn_id,
            step=step.step,
            output_index=output_index,
            call_id=call.call_id,
            tool_name=spec.tool_name,
            payload=call.payload,
            deadline=step.deadline,
            workspace=step.workspace,
            spec_digest=spec.digest(),
            conversation=step.conversation,
            environment=step.environment,
        )

    def _validate_arguments(self, spec: ToolSpec, raw: str) -> None:
        args = load_arguments(raw)
        validator = self._validator(spec)
        if validator is None:
            return
        try:
            error = next(iter(sorted(validator.iter_errors(args), key=lambda e: list(e.path))), None)
        except RecursionError:  # a recursive schema ($ref) walked down deeply nested arguments
            raise RespondToModel("failed to parse function arguments: nesting too deep for the schema") from None
        if error is not None:
            raise RespondToModel(f"failed to parse function arguments: {describe_schema_error(error)}")

    def _validator(self, spec: ToolSpec) -> Draft202012Validator | None:
        if spec.kind != "function" or spec.parameters is None:
            return None
        validator = self._validators.get(spec.tool_name)
        if validator is None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError as InvalidSchema

            try:  # declarations are checked where they are made; one learned from the fleet is checked here
                Draft202012Validator.check_schema(spec.parameters)
            except InvalidSchema as e:
                raise RespondToModel(f"tool {spec.tool_name.display()} declares an invalid parameters schema: "
                                     f"{e.message}") from None
            validator = self._validators[spec.tool_name] = Draft202012Validator(_nullable_is_optional(spec.parameters))
        return validator

    def model_visible_specs(self, loaded: set[ToolName] | frozenset[ToolName] = frozenset()) -> list[dict[str, Any]]:
        """Tools for the request's `tools`: deferred ones only once a search has loaded them, and
        never one declared `offered=False` (front doors' tools). Namespaced tools are grouped under
        one `namespace` spec each."""
        specs: list[dict[str, Any]] = []
        namespaces: dict[str, dict[str, Any]] = {}
        for spec in self.catalog:
            if not spec.offered or (spec.deferred and spec.tool_name not in loaded):
                continue
            if spec.namespace is None:
                specs.append(spec.model_spec())
                continue
            group = namespaces.get(spec.namespace)
            if group is None:
                group = {"type": "namespace", "name": spec.namespace, "description": "", "tools": []}
                namespaces[spec.namespace] = group
                specs.append(group)
            group["tools"].append(spec.model_spec())
        return specs

    def deferred_names(self, tools: list[dict[str, Any]]) -> set[ToolName]:
        """The tool names a tool_search output made visible."""
        names: set[ToolName] = set()
        for t in tools:
            if t.get("type") == "namespace":
                names |= {ToolName(namespace=t["name"], name=sub["name"]) for sub in t.get("tools", [])}
            elif "name" in t:
                names.add(ToolName.plain(t["name"]))
        return names


def _nullable_is_optional(schema: Any) -> Any:
    """Strict schemas list every key as required and mark optional ones nullable; models that
    are not in strict mode (compatible servers) simply omit them, which is just as valid."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, _nullable_is_optional)
    props = out.get("properties")
    if isinstance(props, dict) and "required" in out:
        out["required"] = [k for k in out["required"] if not is_nullable(props.get(k, {}))]
    return out


def describe_schema_error(error: SchemaError) -> str:
    """Name the offending field, serde-style: "missing field `cmd`", "invalid type at `limit`: ..."."""
    path = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "required":
        required = error.validator_value if isinstance(error.validator_value, list) else []
        given = error.instance if isinstance(error.instance, dict) else {}
        missing = next((r for r in required if r not in given), None)
        field = f"{path}.{missing}" if path else missing
        return f"missing field `{field}`"
    if error.validator == "additionalProperties":
        return f"unknown field at `{path or '<root>'}`: {error.message}"
    return f"invalid value at `{path or '<root>'}`: {error.message}"
