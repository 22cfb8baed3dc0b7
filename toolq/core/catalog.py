"""The tool catalog: each tool declared once, read by both sides.

The orchestrator reads it for model-visible specs and validation (`toolq.orchestrator.registry`);
workers read it to execute (`toolq.workers.app`). A tool is a function with a `@tool` declaration:

    class SearchArgs(BaseModel):
        query: str

    @tool(namespace="workspace", queue="search")
    def search(args: SearchArgs, ctx: ToolContext) -> str:
        "Search the workspace."
        ...

Function tools take a pydantic args model (rendered to a strict JSON Schema unless an explicit
`parameters` schema is given) or, with `parameters=` alone, a dict; custom tools take `grammar=`
(or a `str` input) and receive the freeform text.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import re
import sys
import time
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic.fields import FieldInfo

from toolq.core import untrusted
from toolq.core.calls import PayloadKind, ToolInvocation, ToolName
from toolq.core.errors import ConfigurationError, RespondToModel, problems
from toolq.core.items import ContentPart, ToolOutputBody
from toolq.core.tool_limits import UNLIMITED, ToolLimit, declared_limit


class LiveOutput(Protocol):
    """Where a running tool writes its output while it runs (the worker's `OutputStream`)."""

    def write(self, data: bytes) -> None: ...

    def tick(self) -> None:
        """Publish what is due though nothing new came (a batch waits at most a tenth of a second)."""


DEFAULT_QUEUE = "toolq"

#: How a call reaches a worker: by its declaration's queue, or to the one worker that holds the
#: session its `session_id` argument names (write_stdin).
Route = Literal["queue", "session"]
#: What watchers (`toolq run --json`, the live view) see of a call: toolq's `tool_call`, or Codex's
#: item for a shell command (from its `cmd` and `shell` arguments; a session-routed call shows its
#: session's command), a patch (its freeform input) or a plan (its `plan` argument).
View = Literal["tool_call", "command", "file_change", "todo_list"]
#: How Flower's args column shows an argument: its value (a long text cut short), or its length only.
Shown = Literal["value", "length"]
ROUTES: tuple[Route, ...] = ("queue", "session")
VIEWS: tuple[View, ...] = ("tool_call", "command", "file_change", "todo_list")
SHOWN: tuple[Shown, ...] = ("value", "length")


@dataclass
class ToolReturn:
    """What a tool hands back when it has more to say than its output text."""

    output: ToolOutputBody | list[ContentPart]
    success: bool = True
    exit_code: int | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class ToolContext:
    """What a running tool may know about its call. Built by the worker."""

    invocation: ToolInvocation
    workspace: Path
    is_cancelled: Callable[[], bool] = lambda: False
    catalog: Catalog | None = None
    output: LiveOutput | None = None
    """Where a running command's output goes while it runs, when the turn is watched (shown only)."""

    @property
    def call_id(self) -> str:
        return self.invocation.call_id

    @property
    def deadline(self) -> float:
        return self.invocation.deadline

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.time())

    def cancelled(self) -> bool:
        """Long tools poll this: True once the turn (or this call) was cancelled."""
        return self.is_cancelled()


Handler = Callable[..., Any]

#: What a handler's parameter may receive besides one argument (named by its args-model field):
#: the whole arguments (an args model, a dict, a freeform text, a payload), or the `ToolContext`.
WHOLE_ARGUMENTS = "*arguments"
CONTEXT = "*ctx"


@dataclass(frozen=True)
class Binding:
    """How a worker calls a handler: what each of its parameters receives, positionally then by
    keyword. Each source is `WHOLE_ARGUMENTS`, `CONTEXT` or the name of an args-model field."""

    positional: tuple[str, ...] = (WHOLE_ARGUMENTS, CONTEXT)
    keyword: tuple[tuple[str, str], ...] = ()


#: `handler(args, ctx)`: what every handler was called with before issue 26, and a spec built
#: directly (an MCP tool's `Forward`) still is.
LEGACY = Binding()


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """One tool's declaration. Shaped like pydantic-ai's `ToolDefinition`."""

    name: str
    namespace: str | None = None
    description: str = ""
    kind: PayloadKind = "function"
    """The payload kind the tool accepts; any other kind is a Fatal mismatch."""
    parameters: dict[str, Any] | None = None
    """JSON Schema (Draft 2020-12) of a function tool's arguments."""
    strict: bool = False
    grammar: dict[str, Any] | None = None
    """A custom tool's `format` (e.g. `{"type": "grammar", "syntax": "lark", "definition": ...}`)."""
    parallel: bool = True
    """Safe to run beside other calls of its step; serial tools run alone, in call order."""
    queue: str = DEFAULT_QUEUE
    timeout: float = 60.0
    idempotent: bool = False
    """Only idempotent tools are redelivered after a worker dies mid-call."""
    deferred: bool = False
    """Hidden from the model until a tool_search finds it."""
    offered: bool = True
    """Listed to a model or an MCP client; False: front doors call it, a model is never offered it
    (one that names it anyway gets it as any call). Not in the digest."""
    whole_output: bool = False
    """Its output travels whole, never cut to what a model's history keeps: a front door reads it
    (fs's readFile), and the tool bounds it itself. Not in the digest."""
    session_gone: str | None = None
    """`route="session"`: the output the orchestrator gives a call whose session its conversation
    does not hold (or whose worker is gone); None: write_stdin's words, Codex's. Not in the digest."""
    shell_like: bool = False
    """Aborted shell calls read `Wall time: X seconds\\naborted by user`, like Codex's."""
    # What the pipeline does differently for a tool is read from here, never from its name. None of
    # it is in the digest: an orchestrator and a worker that differ here still agree on the call.
    streams_output: bool = False
    """Its handler writes what runs to `ctx.output` while it runs; a watched turn shows it live."""
    route: Route = "queue"
    sessions: bool = False
    """It runs in the worker's session host (exec_command's sessions): a worker that loads one starts it."""
    view: View = "tool_call"
    flower_args: tuple[tuple[str, Shown], ...] = ()
    """The arguments Flower's args column shows, in order, and how; no other argument is shown."""
    limit: ToolLimit = field(default=UNLIMITED, compare=False)
    """max_concurrency / rate_limit across the fleet (TOOLQ_TOOL_LIMITS overrides it); policy, not
    part of the declaration's digest: changing a limit never reroutes a call."""
    args_model: type[BaseModel] | None = field(default=None, compare=False)
    handler: Handler | None = field(default=None, compare=False, repr=False)
    binding: Binding = field(default=LEGACY, compare=False, repr=False)
    """What each of the handler's parameters receives; not part of the digest (a worker calls its
    own handler). A spec built directly (MCP's) is called `handler(args, ctx)`."""

    @property
    def tool_name(self) -> ToolName:
        return ToolName(namespace=self.namespace, name=self.name)

    def model_spec(self) -> dict[str, Any]:
        """The tool as the model sees it (a namespace groups its tools one level up)."""
        if self.kind == "custom":
            spec: dict[str, Any] = {"type": "custom", "name": self.name, "description": self.description}
            if self.grammar:
                spec["format"] = self.grammar
            return spec
        if self.kind == "tool_search":
            return {
                "type": "tool_search",
                "execution": "client",
                "description": self.description,
                "parameters": self.parameters,
            }
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "strict": self.strict,
            "parameters": self.parameters or {"type": "object", "properties": {}, "additionalProperties": False},
        }

    def declaration(self) -> dict[str, Any]:
        """Everything both sides must agree on; its digest travels with each invocation."""
        return {
            "namespace": self.namespace,
            "spec": self.model_spec(),
            "kind": self.kind,
            "parallel": self.parallel,
            "queue": self.queue,
            "timeout": self.timeout,
            "idempotent": self.idempotent,
            "deferred": self.deferred,
        }

    @functools.cached_property
    def _digest(self) -> str:
        blob = json.dumps(self.declaration(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def digest(self) -> str:
        """Checked on both sides of every call, so computed once per spec."""
        return self._digest


class Catalog:
    """Tools keyed by (namespace, name). Registering a name twice is a configuration error."""

    def __init__(self, specs: list[ToolSpec] | None = None) -> None:
        self._specs: dict[ToolName, ToolSpec] = {}
        for spec in specs or []:
            self.add(spec)

    def add(self, spec: ToolSpec) -> ToolSpec:
        if spec.tool_name in self._specs:
            raise ConfigurationError(f"duplicate tool: {spec.tool_name} is already registered")
        self._specs[spec.tool_name] = spec
        return spec

    def replace_namespace(self, namespace: str, specs: list[ToolSpec]) -> None:
        """A namespace's tools become exactly `specs` (an MCP server listed its tools anew)."""
        for name in [n for n in self._specs if n.namespace == namespace]:
            del self._specs[name]
        for spec in specs:
            self.add(spec)

    def get(self, name: ToolName) -> ToolSpec | None:
        return self._specs.get(name)

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def queues(self) -> list[str]:
        return sorted({s.queue for s in self})


#: The process-wide catalog that `@tool` fills; `toolq.workers.loader.load_catalog` adds the built-ins.
CATALOG = Catalog()


def tool(
    fn: Handler | None = None,
    *,
    name: str | None = None,
    namespace: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    grammar: dict[str, Any] | None = None,
    kind: PayloadKind | None = None,
    strict: bool | None = None,
    parallel: bool = True,
    queue: str = DEFAULT_QUEUE,
    timeout: float = 60.0,
    idempotent: bool = False,
    deferred: bool = False,
    offered: bool = True,
    whole_output: bool = False,
    session_gone: str | None = None,
    shell_like: bool = False,
    streams_output: bool = False,
    route: Route = "queue",
    sessions: bool = False,
    view: View = "tool_call",
    flower_args: Mapping[str, Shown] | None = None,
    max_concurrency: int | None = None,
    rate_limit: str | None = None,
    catalog: Catalog | None = None,
) -> Any:
    """Declare a function (sync or async) as a tool and register it.

    The handler's first parameter says what the tool takes:
    - a pydantic `BaseModel` annotation: a function tool; its arguments arrive as that model and
      its schema is the model's, in strict form (or `parameters=` when given, sent as given);
    - `parameters=` (a JSON Schema dict) with no args model: a function tool whose arguments
      arrive as the parsed JSON `dict`, checked against that schema (jsonschema) before dispatch;
    - `str` (or `grammar=`): a custom (freeform) tool that receives the model's text.
    The kind is never changed silently: `parameters=` together with `grammar=`, `kind="custom"`
    or a `str` input is refused with a `ConfigurationError`, as is a schema that is not valid
    JSON Schema. The docstring is the description.

    `max_concurrency=N`: at most N calls of this tool run at once across the fleet; `rate_limit=
    "10/s"` (or `"100/m"`): at most that many start per second (minute) across the fleet. A call
    held back waits as `throttled`, never fails for it (toolq/orchestrator/limits.py).

    What toolq does differently for the tool (none of it changes the declaration's digest):
    `streams_output=True`: what it writes to `ctx.output` while it runs is shown live to a watched
    turn; `flower_args={"url": "value", "token": "length"}`: Flower's args column shows these
    arguments (a long value cut short, or only a length), and no others; `view=`: what watchers see
    (`"command"` for a tool taking `cmd`, as exec_command); `route="session"`: the call goes to the
    worker holding the session its `session_id` argument names. `sessions=True` is exec_command's.
    `offered=False`: front doors call it (toolq exec-server's process and file tools); no listing
    offered to a model or an MCP client shows it. `whole_output=True`: its output is never cut to
    what a model's history keeps (a front door needs it whole); the tool must bound it itself.
    `session_gone=`: with `route="session"`, the output of a call whose session is unknown or lost.
    """

    caller = sys._getframe(1).f_locals  # resolves annotations naming classes local to the declaring function

    def register(f: Handler) -> Handler:
        label = name or f.__name__
        try:
            limit = declared_limit(max_concurrency, rate_limit)
        except ValueError as e:
            raise ConfigurationError(f"tool {label}: {_first_error(e)}") from None
        _check_capabilities(label, route, view, flower_args or {})
        explicit = parameters is not None or grammar is not None or kind in ("custom", "tool_search")
        shape = _handler_shape(label, f, caller, explicit=explicit, function=kind == "function")
        args_model = shape.args_model
        k = _payload_kind(label, shape, kind, parameters, grammar)
        schema = parameters
        if k == "function" and schema is None:
            if args_model is None:
                raise ConfigurationError(f"tool {label}: a function tool needs an args model")
            schema = strict_json_schema(args_model)
        spec = ToolSpec(
            name=label,
            namespace=namespace,
            description=description or shape.description,
            kind=k,
            parameters=schema,
            strict=(parameters is None) if strict is None else strict,
            grammar=grammar,
            parallel=parallel,
            queue=queue,
            timeout=timeout,
            idempotent=idempotent,
            deferred=deferred,
            offered=offered,
            whole_output=whole_output,
            session_gone=session_gone,
            shell_like=shell_like,
            streams_output=streams_output,
            route=route,
            sessions=sessions,
            view=view,
            flower_args=tuple((flower_args or {}).items()),
            limit=limit,
            args_model=args_model,
            handler=f,
            binding=shape.binding,
        )
        (catalog if catalog is not None else CATALOG).add(spec)
        f.tool_spec = spec  # type: ignore[attr-defined]
        return f

    return register(fn) if fn is not None else register


def _check_capabilities(label: str, route: str, view: str, flower_args: Mapping[str, str]) -> None:
    """One clear error for a capability toolq does not know (a typo would silently do nothing)."""
    for what, value, known in (("route", route, ROUTES), ("view", view, VIEWS)):
        if value not in known:
            raise ConfigurationError(f"tool {label}: {what}={value!r} is not one of {', '.join(known)}")
    for arg, how in flower_args.items():
        if how not in SHOWN:
            raise ConfigurationError(f"tool {label}: flower_args[{arg!r}]={how!r} is not one of {', '.join(SHOWN)}")


def _first_error(e: ValueError) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}".lstrip(": ")
    return str(e)


def _payload_kind(label: str, shape: _Shape, kind: PayloadKind | None, parameters: dict[str, Any] | None,
                  grammar: dict[str, Any] | None) -> PayloadKind:
    """The kind a declaration asks for, or one clear error when its parts disagree."""
    if parameters is not None:
        if grammar is not None or kind == "custom":
            raise ConfigurationError(f"tool {label}: parameters= declares a function tool's JSON arguments; a custom "
                                     "tool takes freeform text (grammar=), so give one or the other")
        if shape.args_model is None and shape.text_input:
            raise ConfigurationError(f"tool {label}: parameters= makes a function tool, whose handler gets the "
                                     "arguments as a dict (or an args model), but its input is annotated str")
        if not shape.module.startswith(tuple(CHECKED_PACKAGES)):
            _check_schema(label, parameters)
    if kind is not None:
        return kind
    if grammar is not None:
        return "custom"
    return "function" if shape.args_model is not None or parameters is not None else "custom"


#: Packages whose `parameters=` schemas toolq's own suite checks (test_strict_schema) instead of
#: every start-up: the built-in tools' package adds itself, so declaring them needs no jsonschema
#: (~25 ms of every `toolq run`). A user's declaration is always checked.
CHECKED_PACKAGES: set[str] = set()


def _check_schema(label: str, parameters: dict[str, Any]) -> None:
    from jsonschema import Draft202012Validator  # here: only a user's parameters= declaration needs it
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        raise ConfigurationError(f"tool {label}: parameters= is not a valid JSON Schema: {e.message}") from None


# --- what a handler takes (issue 26) ----------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """What a handler's signature says: its args model (given or inferred), how to call it, its description."""

    binding: Binding
    description: str
    module: str
    args_model: type[BaseModel] | None = None
    text_input: bool = False
    """Its whole input is annotated `str`: a freeform (custom) tool's text."""


class _Unresolved:
    """An annotation written as a string that names nothing here (a name imported for type checking only)."""

    def __init__(self, text: str, error: Exception) -> None:
        self.text, self.error = text, error


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _handler_shape(label: str, f: Handler, caller: Mapping[str, Any], *, explicit: bool, function: bool) -> _Shape:
    """Read the handler's signature once, at declaration.

    The forms toolq had before issue 26 keep their declarations (and digests): the first parameter
    takes the whole arguments (an args model, the `parameters=` dict, a `str` or unannotated
    freeform text, a payload) and the context goes to a parameter that declares it: annotated
    `ToolContext`, named `ctx`, or (as before) an unannotated second parameter. Any other handler
    has its arguments inferred from its typed parameters, as pydantic-ai and the OpenAI Agents SDK
    do: a pydantic model built from the signature, the docstring's first paragraph the description."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError) as e:
        raise ConfigurationError(f"tool {label}: its handler {f!r} has no signature to read ({e})") from None
    module = getattr(f, "__module__", None) or ""
    doc = inspect.cleandoc(getattr(f, "__doc__", None) or "")
    namespace = {**getattr(inspect.unwrap(f), "__globals__", {}), **caller}
    hints = {p.name: _resolve(p.annotation, namespace) for p in params}
    first = params[0] if params else None
    rest = params[1:]
    first_hint = hints[first.name] if first is not None else None
    is_model = isinstance(first_hint, type) and issubclass(first_hint, BaseModel)
    text = first_hint is str or first_hint == "str"
    unannotated = first is not None and first.annotation is inspect.Parameter.empty
    first_takes_all = first is not None and not _is_context(first, hints) and first.kind in _POSITIONAL
    if explicit or (first_takes_all and (is_model or (not function and (text or unannotated)))
                    and all(_beside_whole(p, k == 0, hints) for k, p in enumerate(rest))):
        return _Shape(binding=_whole_binding(label, f, params, hints), description=doc, module=module,
                      args_model=first_hint if is_model else None, text_input=text)
    model, binding = _inferred(label, f, params, hints, doc)
    return _Shape(binding=binding, description=_first_paragraph(doc), module=module, args_model=model)


def _resolve(annotation: Any, namespace: dict[str, Any]) -> Any:
    """A parameter's annotation as an object (`from __future__ import annotations` leaves a string),
    looked up as `typing.get_type_hints` does, plus the declaring function's own names."""
    if not isinstance(annotation, str):
        return annotation
    try:
        value = eval(annotation, namespace)  # the author's own annotation, as get_type_hints evaluates it
        return eval(value, namespace) if isinstance(value, str) else value  # `x: "Model"` under the future import
    except Exception as e:
        return _Unresolved(annotation, e)


def _is_context(p: inspect.Parameter, hints: Mapping[str, Any]) -> bool:
    """A parameter that declares it takes the `ToolContext`: so annotated, or named `ctx`."""
    hint = hints[p.name]
    if p.name == "ctx" or (isinstance(hint, type) and issubclass(hint, ToolContext)):
        return True
    text = hint.text if isinstance(hint, _Unresolved) else hint if isinstance(hint, str) else ""
    return text.rsplit(".", 1)[-1].strip("'\" ") == "ToolContext"


def _beside_whole(p: inspect.Parameter, second: bool, hints: Mapping[str, Any]) -> bool:
    """Whether `p` fits beside a first parameter that takes the whole arguments: the context
    (declared, or an unannotated second parameter as before issue 26), or one never given."""
    return (_is_context(p, hints) or p.default is not inspect.Parameter.empty
            or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            or (second and p.annotation is inspect.Parameter.empty))


def _whole_binding(label: str, f: Handler, params: list[inspect.Parameter], hints: Mapping[str, Any]) -> Binding:
    """The first parameter gets the whole arguments; the context goes to the parameter that takes it."""
    if not params:
        return Binding(positional=())
    positional = [WHOLE_ARGUMENTS] if params[0].kind in _POSITIONAL else []
    keyword = [] if positional else [(params[0].name, WHOLE_ARGUMENTS)]
    given = False
    for k, p in enumerate(params[1:]):
        takes = _is_context(p, hints) or (k == 0 and p.annotation is inspect.Parameter.empty
                                          and p.kind != inspect.Parameter.VAR_KEYWORD)
        if takes and not given:
            given = True
            if k == 0 and p.kind in (*_POSITIONAL, inspect.Parameter.VAR_POSITIONAL):
                positional.append(CONTEXT)
            elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                keyword.append((p.name, CONTEXT))
            else:
                raise ConfigurationError(f"tool {label}: parameter {p.name} of {_fn(f)} takes the context but "
                                         "cannot be passed it; make it the second parameter")
        elif p.default is inspect.Parameter.empty and p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY):
            raise ConfigurationError(f"tool {label}: parameter {p.name} of {_fn(f)} is never given a value: its "
                                     "first parameter takes the whole arguments, and only ctx may follow it")
    return Binding(positional=tuple(positional), keyword=tuple(keyword))


def _fn(f: Handler) -> str:
    return f"{getattr(f, '__name__', None) or type(f).__name__}()"


def _inferred(label: str, f: Handler, params: list[inspect.Parameter], hints: Mapping[str, Any],
              doc: str) -> tuple[type[BaseModel], Binding]:
    """An args model built from the handler's typed parameters, and how to call it with one."""
    described = _documented_parameters(doc)
    fields: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[tuple[str, str]] = []
    for p in params:
        where = f"tool {label}: parameter {p.name} of {_fn(f)}"
        if _is_context(p, hints):
            source = CONTEXT
        else:
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                star = "*" if p.kind == inspect.Parameter.VAR_POSITIONAL else "**"
                raise ConfigurationError(f"tool {label}: parameter {star}{p.name} of {_fn(f)}: a tool's arguments "
                                         "are named, one parameter each (or one pydantic args model)")
            hint = hints[p.name]
            if p.annotation is inspect.Parameter.empty:
                raise ConfigurationError(f"{where} has no type annotation, so its argument cannot be declared: "
                                         f"annotate it (e.g. `{p.name}: str`), or take a pydantic args model")
            if isinstance(hint, _Unresolved):
                raise ConfigurationError(f"{where}: its annotation {hint.text!r} does not resolve here "
                                         f"({type(hint.error).__name__}: {hint.error})")
            _check_argument_type(where, hint)
            source = f"a{len(fields)}_{p.name}"  # never one of BaseModel's own attributes
            default = ... if p.default is inspect.Parameter.empty else p.default
            said = described.get(p.name) if not _has_description(hint, default) else None
            info = Field(alias=p.name, description=said) if said else Field(alias=p.name)
            fields[source] = (typing.Annotated[hint, info], default)
        if p.kind == inspect.Parameter.POSITIONAL_ONLY:
            positional.append(source)
        else:
            keyword.append((p.name, source))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a default JSON cannot show is left out of the schema, as pydantic says
            model = create_model(f"{label}_arguments", __config__=ConfigDict(protected_namespaces=()), **fields)
            model.model_json_schema()
    except Exception as e:  # a default that does not fit its type, say
        raise ConfigurationError(f"tool {label}: the arguments of {_fn(f)} make no args model: "
                                 f"{_first_sentence(e)}") from None
    return model, Binding(positional=tuple(positional), keyword=tuple(keyword))


def _has_description(hint: Any, default: Any) -> bool:
    infos = [a for a in typing.get_args(hint)[1:] if isinstance(a, FieldInfo)] if typing.get_origin(hint) is \
        typing.Annotated else []
    return any(i.description for i in [*infos, *([default] if isinstance(default, FieldInfo) else [])])


def _check_argument_type(where: str, hint: Any) -> None:
    """One line when pydantic cannot give the type a JSON Schema, or only one that strict mode
    cannot keep (an object with open keys, or no type at all: strict mode would change what it accepts)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            schema = TypeAdapter(hint).json_schema()
    except Exception as e:
        raise ConfigurationError(f"{where}: {_type_name(hint)} has no JSON Schema "
                                 f"({_first_sentence(e)}); use a JSON type or a pydantic model") from None
    if problem := _not_strict(schema, schema.get("$defs", {})):
        raise ConfigurationError(f"{where}: {_type_name(hint)} {problem}, which a strict schema cannot keep; use a "
                                 "pydantic model for it, or declare parameters= (a JSON Schema) instead")


def _first_sentence(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line.split(". ", 1)[0].rstrip(".")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")  # type: ignore[return-value]


def _not_strict(node: Any, defs: Mapping[str, Any], seen: frozenset[str] = frozenset(), at: str = "") -> str | None:
    """What makes a schema one that strict mode would change, or None (each `$defs` entry read once per path)."""
    if not isinstance(node, dict):
        return None
    where = f" (at {at.lstrip('.')})" if at else ""
    if not set(node) - {"title", "description", "default", "examples", "$defs"}:
        return f"accepts any JSON value{where}"
    extra = node.get("additionalProperties")
    if node.get("type") == "object" and (extra is True or isinstance(extra, dict)
                                         or (extra is None and "properties" not in node)):
        return f"is an object with open keys{where}"
    problems = [_not_strict(sub, defs, seen, f"{at}.{key}") for key, sub in (node.get("properties") or {}).items()]
    map_subschemas({k: v for k, v in node.items() if k not in ("$defs", "properties")},
                   lambda sub: problems.append(_not_strict(sub, defs, seen, at)))
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and (name := ref.rsplit("/", 1)[-1]) not in seen:
        problems.append(_not_strict(defs.get(name), defs, seen | {name}, at))
    return next((p for p in problems if p), None)


def _first_paragraph(doc: str) -> str:
    return doc.split("\n\n", 1)[0].strip()


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX = re.compile(r"^:param\s+(?:[^:\s]+\s+)?(\w+)\s*:\s*(.*)$")


def _documented_parameters(doc: str) -> dict[str, str]:
    """Each parameter's description from a Google-style `Args:` section or Sphinx `:param x:` lines."""
    found: dict[str, str] = {}
    lines = doc.splitlines()
    for k, line in enumerate(lines):
        if m := _SPHINX.match(line.strip()):
            found[m.group(1)] = m.group(2).strip()
        if not _SECTION.match(line.strip()):
            continue
        indent, name = None, None
        for entry in lines[k + 1:]:
            if not entry.strip():
                continue
            width = len(entry) - len(entry.lstrip())
            if width == 0:
                break
            if indent is None:
                indent = width
            if width == indent and (m := _ENTRY.match(entry.strip())):
                name = m.group(1).lstrip("*")
                found[name] = m.group(2).strip()
            elif width > indent and name is not None:
                found[name] = f"{found[name]} {entry.strip()}".strip()
    return found


def strict_json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON Schema in the Responses strict-mode subset (docs/reference/responses-stream.md#strict-mode):
    every object closed and every key required; optional keys become nullable."""
    return _strictify(model.model_json_schema())


# JSON Schema keywords whose values are subschemas. Everything else (`default`, `enum`, `const`,
# `examples`, `required`, ...) is data, and the keys of `properties` are argument names: a walk
# that treated every dict key as a keyword would strip an argument named `title`.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def map_subschemas(node: dict[str, Any], fn: Callable[[Any], Any], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of one schema node with `fn` applied to each of its direct subschemas (and the
    keywords in `drop` left out); every other value is copied as it is."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in drop:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: fn(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [fn(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            value = [fn(sub) for sub in value] if isinstance(value, list) else fn(value)
        out[key] = value
    return out


def _strictify(node: Any) -> Any:
    """One schema node in strict form; pydantic's annotation `title`s go."""
    if not isinstance(node, dict):
        return node  # `true`/`false` schemas
    out = map_subschemas(node, _strictify, drop=("title",))
    if out.get("type") == "object" or "properties" in out:
        props = out.get("properties", {})
        required = set(out.get("required", []))
        for key, sub in props.items():
            if key not in required and isinstance(sub, dict) and not is_nullable(sub):
                sub = {k: v for k, v in sub.items() if k != "default"}
                props[key] = {"anyOf": [sub, {"type": "null"}]}
        out["required"] = list(props)
        out["additionalProperties"] = False
    if "default" in out and out["default"] is None:
        del out["default"]
    return out


def is_nullable(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    if t == "null" or (isinstance(t, list) and "null" in t):
        return True
    return any(is_nullable(s) for s in schema.get("anyOf", []) if isinstance(s, dict))


def parse_arguments(spec: ToolSpec, raw: str) -> BaseModel | Any:
    """Parse a function call's raw JSON with the tool's own args model (Codex's `parse_arguments`);
    a tool declared with `parameters=` alone gets the parsed JSON (the registry has checked it
    against that schema before dispatch)."""
    obj = load_arguments(raw)
    if spec.args_model is None:
        return obj
    if isinstance(obj, dict):
        # Strict schemas make optional keys nullable: a null means "use the default".
        obj = {k: v for k, v in obj.items() if v is not None}
    try:
        return spec.args_model.model_validate(obj)
    except ValidationError as e:
        raise RespondToModel(f"failed to parse function arguments: {describe_validation_error(e)}") from None


_JSON_TYPES: dict[Any, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}


def plain_parameters(model: type[BaseModel]) -> dict[str, Any]:
    """The `parameters` schema of a tool whose arguments model says it all, written as Codex writes
    its built-ins' (a plain type and a description per field, no titles): each field's JSON type
    (an optional one's inner type, or `json_schema_extra={"type": ...}` where Codex says `number`
    of an integer), the fields without a default required, nothing else accepted."""
    properties: dict[str, Any] = {}
    for name, field_info in model.model_fields.items():
        extra = field_info.json_schema_extra if isinstance(field_info.json_schema_extra, dict) else {}
        inner = [a for a in typing.get_args(field_info.annotation) if a is not type(None)] or [field_info.annotation]
        prop: dict[str, Any] = {"type": extra.get("type") or _JSON_TYPES[inner[0]]}
        if field_info.description:
            prop["description"] = field_info.description
        properties[name] = prop
    return {"type": "object", "properties": properties,
            "required": [name for name, f in model.model_fields.items() if f.is_required()],
            "additionalProperties": False}


def load_arguments(raw: str) -> Any:
    """A function call's `arguments` as JSON, or `RespondToModel` naming what is wrong with them.

    Refused like serde_json (which Codex parses with) refuses them: past its nesting limit, or
    with a lone surrogate, which would raise `UnicodeEncodeError` wherever the value went next
    (a file path, a Celery message, the next request)."""
    try:
        obj = untrusted.loads(raw)
    except ValueError as e:
        raise RespondToModel(f"failed to parse function arguments: {e}") from None
    if untrusted.may_hold_surrogate(raw):
        bad = untrusted.first_surrogate(obj)
        if bad is not None:
            raise RespondToModel(f"failed to parse function arguments: {untrusted.describe_surrogate(bad)}")
    return obj


def describe_validation_error(e: ValidationError) -> str:
    where, message, kind = problems(e)[0]
    if kind == "missing":
        return f"missing field `{where}`"
    return f"invalid value for `{where}`: {message}" if where else message


async def call_handler(spec: ToolSpec, args: Any, ctx: ToolContext) -> Any:
    """Run a handler, sync or async, giving each parameter what its binding says: the whole
    arguments, the context (only to a handler that declares it) or one argument. Sync handlers run
    inline: a pool child runs one call at a time."""
    assert spec.handler is not None

    def value(source: str) -> Any:
        if source == WHOLE_ARGUMENTS:
            return args
        if source == CONTEXT:
            return ctx
        return getattr(args, source)

    b = spec.binding
    result = spec.handler(*[value(s) for s in b.positional], **{name: value(s) for name, s in b.keyword})
    if asyncio.iscoroutine(result):
        result = await result
    return result
