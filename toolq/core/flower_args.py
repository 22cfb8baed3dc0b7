"""What Flower's args column shows of a call, in short: its declaration's `flower_args`, else each
top-level argument its schema names; an argument whose name looks secret by its length only; all
values in one budget of FLOWER_ARGS_CHARS.

Both ends render it: the orchestrator into the task message's `argsrepr` (which the turn's store
budget counts), and the worker into its task-received event, from its own declaration of the tool
(Flower learns a call's arguments only from the worker's events). Pure: never raises.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from toolq.core import untrusted
from toolq.core.catalog import Shown, ToolSpec
from toolq.core.tracing import TRACEPARENT

#: What all shown values may take in all: the task message carries it twice, and the turn's store
#: budget counts it so (durable.ARGSREPR_BYTES).
FLOWER_ARGS_CHARS = 300
#: A trace link's characters at most (the user's TOOLQ_TRACE_URL with the trace id in it).
TRACE_CHARS = 200
#: An undeclared argument's name is the model's text when the schema names none: cut to this.
_NAME_CHARS = 40

#: Words of an argument's name that say its value may be a secret: only its length is shown.
SECRET_WORDS = frozenset({
    "password", "passwd", "passphrase", "pass", "pwd", "secret", "secrets", "token", "key", "apikey", "auth",
    "authorization", "credential", "credentials", "cookie", "bearer", "private", "signature", "otp", "pin",
    "sessionkey", "jwt", "certificate", "hmac",
})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def secret_name(name: str) -> bool:
    """Whether an argument's name looks like it holds a secret (`password`, `api_key`,
    `accessToken`, `X-Auth`, `client_secret`...): split in words at `_`, `-`, case and digits."""
    words = [w.lower() for w in _WORDS.findall(name)]
    return any(w in SECRET_WORDS for w in words) or any(
        a + b in SECRET_WORDS for a, b in zip(words, words[1:], strict=False))


def shown_arguments(spec: ToolSpec) -> tuple[tuple[str, Shown], ...]:
    """What Flower shows of a tool's arguments: its declared `flower_args`, else each top-level
    argument its schema names, in order; any argument whose name looks secret by its length only."""
    declared = spec.flower_args
    if not declared:
        properties = (spec.parameters or {}).get("properties") if spec.kind == "function" else None
        names = list(properties) if isinstance(properties, dict) else []
        if spec.kind == "custom":
            names = ["input"]
        elif spec.kind == "tool_search":
            names = ["query", "limit"]
        declared = tuple((name, "value") for name in names)
    return tuple((name, "length" if secret_name(name) else how) for name, how in declared)


def flower_args(invocation: Any, spec: ToolSpec | None, trace_url: str | None = None) -> str:
    """A call's args as Flower shows them: the call id, the turn, and the arguments its
    declaration names (`shown_arguments`), every value sharing one budget of FLOWER_ARGS_CHARS
    (a string is cut, then quoted; anything else has its repr cut). A tool with no declared
    `flower_args` and no names in its schema (an MCP server's `{"type": "object"}`) shows the
    top-level arguments the model sent, names and values in the same budget. Never raises."""
    if not isinstance(invocation, dict):
        return "()"
    base = f"call_id={_text(invocation.get('call_id'))!r}, turn={_text(invocation.get('turn_id'))!r}"
    shown_trace = _trace(invocation.get("trace"), trace_url)
    args = _arguments(invocation.get("payload")) if spec is not None else None
    if spec is None or not args:
        return f"({base}{shown_trace})"
    named = shown_arguments(spec)
    free = not named and spec.kind == "function"
    wanted = [(name, "length" if secret_name(name) else "value") for name in args] if free else named
    shown, room = [base], FLOWER_ARGS_CHARS
    for name, how in wanted:
        if room <= 0 and (free or how != "length"):  # a declared length is always shown: the declaration bounds them
            continue
        value = args.get(name)
        if value is None and not free:  # not sent, or null (a strict schema's "use the default")
            continue
        label = _cut(str(name), _NAME_CHARS) if free else name
        room -= len(label) if free else 0
        if how == "length":  # a secret, or what is typed into a session: its size only
            text = str(len(value) if isinstance(value, str) else len(json.dumps(value, default=str)))
        elif isinstance(value, str):  # cut, then quoted: a command line reads as one
            text = repr(_cut(value, max(room, 1)))
        else:  # the model's JSON, whatever it holds: its repr is cut instead
            text = _cut(repr(value), max(room, 1))
        shown.append(f"{label}={text}")
        room -= len(text)
    return f"({', '.join(shown)}{shown_trace})"


def _trace(trace: Any, trace_url: str | None) -> str:
    """`, trace=<link or trace id>` for a call that carries its trace context (tracing on): the
    address in TOOLQ_TRACE_URL (`{trace_id}` replaced) when it is set, else the trace id."""
    if not isinstance(trace, dict):
        return ""
    traceparent = trace.get("traceparent")
    if not isinstance(traceparent, str) or not TRACEPARENT.fullmatch(traceparent):
        return ""
    trace_id = traceparent[3:35]
    url = trace_url if trace_url is not None else os.environ.get("TOOLQ_TRACE_URL")
    if url and "{trace_id}" in url:
        return f", trace={_cut(url.replace('{trace_id}', trace_id), TRACE_CHARS)!r}"
    return f", trace={trace_id!r}"


def _arguments(payload: Any) -> dict[str, Any] | None:
    """A payload's arguments as a dict: a function call's JSON object, a custom tool's `input`,
    a tool_search's query; None when there are none to show."""
    if not isinstance(payload, dict):
        return None
    if payload.get("kind") == "function":
        try:
            args = untrusted.loads(payload.get("arguments") or "")
        except (ValueError, RecursionError, TypeError):
            return None
        return args if isinstance(args, dict) else None
    return {k: v for k, v in payload.items() if k != "kind"}


def _text(value: Any) -> str:
    return _cut(value if isinstance(value, str) else str(value), 200)


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[:max(room - 1, 0)] + "…"
