"""Builders for fake-model scripts, in the style of Codex's `ev_function_call` test helpers.

Item builders return the item as it appears in `response.output_item.done` (ids are optional:
the renderer fills in deterministic ones). Directive builders return `{"directive": ...}` dicts
that change how a response is served. A response is a list of items and directives, or the dict
`response(...)` returns; a script is a list of responses, one per request. The JSON script format
is the same dicts (see `toolq.dev.fake_model.server`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Step = dict[str, Any]


# --- items ---------------------------------------------------------------------------------


def message(text: str, *, id: str | None = None, phase: str | None = None) -> Step:
    item: Step = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
    }
    return _with(item, id=id, phase=phase)


def reasoning(summary: str | Sequence[str] = (), *, encrypted_content: str | None = None,
              id: str | None = None) -> Step:
    parts = [summary] if isinstance(summary, str) else list(summary)
    item: Step = {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in parts]}
    return _with(item, id=id, encrypted_content=encrypted_content)


def function_call(
    name: str,
    arguments: dict[str, Any] | str = "{}",
    call_id: str | None = None,
    namespace: str | None = None,
    *,
    id: str | None = None,
) -> Step:
    """`arguments` may be a dict (serialized here) or raw text, which may be invalid JSON on purpose."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    item: Step = {"type": "function_call", "status": "completed", "name": name, "arguments": args}
    return _with(item, call_id=call_id, namespace=namespace, id=id)


def custom_tool_call(name: str, input: str, call_id: str | None = None, *, id: str | None = None) -> Step:
    item: Step = {"type": "custom_tool_call", "status": "completed", "name": name, "input": input}
    return _with(item, call_id=call_id, id=id)


def tool_search_call(
    arguments: dict[str, Any], call_id: str | None = None, *, execution: str = "client", id: str | None = None
) -> Step:
    """`arguments` is a JSON object on the wire here, unlike a function call's string."""
    item: Step = {"type": "tool_search_call", "status": "completed", "execution": execution, "arguments": arguments}
    return _with(item, call_id=call_id, id=id)


def web_search_call(query: str = "toolq", *, id: str | None = None) -> Step:
    """A hosted (server-run) tool: never dispatched by toolq, only recorded and replayed."""
    item: Step = {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": query}}
    return _with(item, id=id)


# --- responses and directives --------------------------------------------------------------


def response(
    *steps: Step,
    usage: dict[str, Any] | None = None,
    gate: bool = False,
    id: str | None = None,
    chunk_size: int | None = None,
) -> Step:
    """One scripted response. `gate=True` holds it just before `response.completed` until
    `FakeModel.release()`; `chunk_size` sets how many characters each delta carries."""
    spec: Step = {"output": list(steps)}
    return _with(spec, usage=usage, gate=gate or None, id=id, chunk_size=chunk_size)


def http_error(status: int, body: dict[str, Any] | str | None = None, headers: dict[str, str] | None = None) -> Step:
    """Answer with this HTTP status instead of a stream. `body` defaults to an OpenAI error JSON."""
    return _with({"directive": "http_error", "status": status}, body=body, headers=headers)


def cut_after(n_events: int | None = None, *, clean: bool = True) -> Step:
    """End the stream after `n_events` events (default: just before the terminal event).

    `clean=True` ends the HTTP body properly (the stream simply stops); `clean=False` drops the
    TCP connection mid-body, which clients see as a transport error.
    """
    return {"directive": "cut", "after": n_events, "clean": clean}


def stall(seconds: float) -> Step:
    """Send nothing for `seconds` at this point of the response (idle-timeout tests)."""
    return {"directive": "stall", "seconds": seconds}


def gate() -> Step:
    """Hold the stream at this point until `FakeModel.release()`."""
    return {"directive": "gate"}


def failed(code: str = "server_error", message: str = "scripted response.failed") -> Step:
    """End with `response.failed` carrying this error instead of `response.completed`."""
    return {"directive": "failed", "code": code, "message": message}


def incomplete(reason: str = "max_output_tokens") -> Step:
    """End with `response.incomplete` instead of `response.completed`."""
    return {"directive": "incomplete", "reason": reason}


def error_event(code: str, message: str, type: str | None = None) -> Step:
    """End with a top-level `error` event (real nested shape) followed by `response.failed`."""
    return _with({"directive": "error_event", "code": code, "message": message}, type=type)


def malformed_frame(data: str = '{"type": "response.output_text.delta", "delta": ') -> Step:
    """An SSE frame at this point whose `data` is not valid JSON."""
    return {"directive": "raw", "text": f"event: response.output_text.delta\ndata: {data}\n\n"}


def raw_frame(text: str) -> Step:
    """Bytes written verbatim at this point (e.g. `data: [DONE]\\n\\n`, a frame without `event:`)."""
    return {"directive": "raw", "text": text}


def replay(path: str | Path) -> Step:
    """Serve a recorded SSE body (or a Codex JSON-array fixture) event by event."""
    return {"directive": "replay", "path": str(path)}


def _with(d: Step, **optional: Any) -> Step:
    d.update({k: v for k, v in optional.items() if v is not None})
    return d
