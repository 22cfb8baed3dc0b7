"""Turn one scripted response into what the server writes: SSE frames and pauses, or an HTTP error.

Pure (no sockets, no clock). Event order follows the real recordings (docs/reference/responses-stream.md#event-order):
`created → in_progress → per item: added → (content_part.added → delta* →
output_text.done → content_part.done | arguments.delta* → arguments.done | input.delta* →
input.done | summary part/text events) → done → completed`, with contiguous `sequence_number`s
from 0 and `response.completed` carrying the done items and usage.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolq.dev.fake_model import builders

DEFAULT_CHUNK = 16
#: A fixed `created_at` keeps every rendered byte deterministic.
CREATED_AT = 1767225600


@dataclass
class HttpError:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Stall:
    seconds: float


@dataclass
class Gate:
    pass


@dataclass
class Cut:
    clean: bool


Op = bytes | Stall | Gate | Cut


def normalize(entry: Any) -> dict[str, Any]:
    """Any accepted script entry as `{"output": [steps...], ...options}`."""
    if isinstance(entry, str):
        return {"output": [builders.message(entry)]}
    if isinstance(entry, list):
        return {"output": entry}
    if isinstance(entry, dict):
        return entry if "output" in entry else {"output": [entry]}
    raise ValueError(f"script entry must be a list, a dict or a string, not {type(entry).__name__}")


def render(entry: Any, request: dict[str, Any], number: int, base_dir: Path | None = None) -> HttpError | list[Op]:
    """The plan for response `number` (1-based) to `request`."""
    spec = normalize(_with_session_id(entry, request))
    steps = spec["output"]
    directives = [s for s in steps if "directive" in s]
    for d in directives:
        if d["directive"] == "http_error":
            return _http_error(d)
    cut = next((d for d in directives if d["directive"] == "cut"), None)

    replayed = next((d for d in directives if d["directive"] == "replay"), None)
    if replayed is not None:
        ops: list[Op] = list(replay_frames(_resolve(replayed["path"], base_dir)))
        n_terminal = 1
    else:
        ops, n_terminal = _Renderer(spec, request, number).run()
    if spec.get("gate"):
        ops.insert(len(ops) - n_terminal, Gate())
    if cut is not None:
        ops = _apply_cut(ops, cut.get("after"), n_terminal, bool(cut.get("clean", True)))
    return ops


#: In a script, the session id of the last "Process running with session ID N" the request's tool
#: outputs showed (Codex's ids are random): `write_stdin` to the session a script's command left running.
#: It becomes the number, quoted or not (`{"session_id": "{{SESSION_ID}}"}` gives `{"session_id": 42}`).
SESSION_ID = "{{SESSION_ID}}"
_SESSION_ID_SAID = re.compile(r"session ID (\d+)")


def _with_session_id(entry: Any, request: dict[str, Any]) -> Any:
    text = json.dumps(entry)
    if SESSION_ID not in text:
        return entry
    inputs = request.get("input")
    if not isinstance(inputs, list):
        inputs = []
    said = [m for item in inputs if isinstance(item, dict) and str(item.get("type", "")).endswith("_output")
            for m in _SESSION_ID_SAID.findall(json.dumps(item.get("output")))]
    number = said[-1] if said else "0"
    for quoted in (f'\\"{SESSION_ID}\\"', f'"{SESSION_ID}"', SESSION_ID):  # a number, quoted or not
        text = text.replace(quoted, number)
    return json.loads(text)


class _Renderer:
    def __init__(self, spec: dict[str, Any], request: dict[str, Any], number: int) -> None:
        self.spec = spec
        self.request = request
        self.number = number
        self.chunk = int(spec.get("chunk_size") or DEFAULT_CHUNK)
        self.resp_id = spec.get("id") or f"resp_fake{number:04d}"
        self.seq = 0
        self.ops: list[Op] = []
        self.done_items: list[dict[str, Any]] = []

    def run(self) -> tuple[list[Op], int]:
        self.emit("response.created", response=self.response_obj("in_progress"))
        self.emit("response.in_progress", response=self.response_obj("in_progress"))
        end: dict[str, Any] = {"directive": "completed"}
        for step in self.spec["output"]:
            kind = step.get("directive")
            if kind is None:
                self.item(step)
            elif kind == "stall":
                self.ops.append(Stall(float(step["seconds"])))
            elif kind == "gate":
                self.ops.append(Gate())
            elif kind == "raw":
                self.ops.append(step["text"].encode())
            elif kind in ("failed", "incomplete", "error_event"):
                end = step
            elif kind != "cut":
                raise ValueError(f"unknown directive {kind!r}")
        before = len(self.ops)
        self.terminal(end)
        return self.ops, len(self.ops) - before

    # --- frames ---

    def emit(self, type_: str, **fields: Any) -> None:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(event, separators=(",", ":"))
        self.ops.append(f"event: {type_}\ndata: {data}\n\n".encode())

    def chunks(self, text: str) -> list[str]:
        return [text[i : i + self.chunk] for i in range(0, len(text), self.chunk)]

    # --- items ---

    def item(self, step: dict[str, Any]) -> None:
        index = len(self.done_items)
        item = self.finish_item(step, index)
        where = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        self.emit("response.output_item.added", output_index=index, item=self.opened(item))
        if kind == "message":
            for ci, part in enumerate(item.get("content") or []):
                text = part.get("text", "")
                empty = {**part, "text": ""} if "text" in part else part
                self.emit("response.content_part.added", **where, content_index=ci, part=empty)
                if part.get("type") == "output_text":
                    for piece in self.chunks(text):
                        self.emit("response.output_text.delta", **where, content_index=ci, delta=piece, logprobs=[])
                    self.emit("response.output_text.done", **where, content_index=ci, text=text, logprobs=[])
                self.emit("response.content_part.done", **where, content_index=ci, part=part)
        elif kind == "reasoning":
            for si, part in enumerate(item.get("summary") or []):
                text = part.get("text", "")
                self.emit("response.reasoning_summary_part.added", **where, summary_index=si, part={**part, "text": ""})
                for piece in self.chunks(text):
                    self.emit("response.reasoning_summary_text.delta", **where, summary_index=si, delta=piece)
                self.emit("response.reasoning_summary_text.done", **where, summary_index=si, text=text)
                self.emit("response.reasoning_summary_part.done", **where, summary_index=si, part=part)
        elif kind == "function_call":
            for piece in self.chunks(item["arguments"]):
                self.emit("response.function_call_arguments.delta", **where, delta=piece)
            self.emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        elif kind == "custom_tool_call":
            for piece in self.chunks(item["input"]):
                self.emit("response.custom_tool_call_input.delta", **where, delta=piece)
            self.emit("response.custom_tool_call_input.done", **where, input=item["input"])
        elif kind == "web_search_call":
            for phase in ("in_progress", "searching", "completed"):
                self.emit(f"response.web_search_call.{phase}", **where)
        self.emit("response.output_item.done", output_index=index, item=item)
        self.done_items.append(item)

    def finish_item(self, step: dict[str, Any], index: int) -> dict[str, Any]:
        """The item as `output_item.done` carries it, with JSON-script shorthands expanded."""
        item = dict(step)
        kind = item.get("type")
        if kind == "message" and "text" in item and "content" not in item:
            item = {**builders.message(item.pop("text")), **item}
        if kind == "reasoning":
            summary = item.get("summary")
            if isinstance(summary, str):
                summary = [summary]
            item["summary"] = [{"type": "summary_text", "text": s} if isinstance(s, str) else s for s in summary or []]
        if kind == "function_call" and not isinstance(item.get("arguments", ""), str):
            item["arguments"] = json.dumps(item["arguments"])
        item.setdefault("id", f"{_ID_PREFIX.get(kind or '', 'item')}_fake{self.number:04d}_{index}")
        if kind in ("function_call", "custom_tool_call", "tool_search_call"):
            item.setdefault("call_id", f"call_fake{self.number:04d}_{index}")
        if kind != "reasoning":
            item.setdefault("status", "completed")
        return item

    @staticmethod
    def opened(item: dict[str, Any]) -> dict[str, Any]:
        """The item as `output_item.added` carries it: in progress, body still empty."""
        kind = item["type"]
        opened = dict(item)
        if "status" in opened:
            opened["status"] = "in_progress"
        if kind == "message":
            opened["content"] = []
        elif kind == "reasoning":
            opened["summary"] = []
        elif kind == "function_call":
            opened["arguments"] = ""
        elif kind == "custom_tool_call":
            opened["input"] = ""
        elif kind == "tool_search_call":
            opened["arguments"] = {}
        return opened

    # --- terminal ---

    def terminal(self, end: dict[str, Any]) -> None:
        kind = end["directive"]
        if kind == "completed":
            self.emit("response.completed", response=self.response_obj("completed", usage=self.usage()))
        elif kind == "incomplete":
            details = {"reason": end.get("reason")}
            obj = self.response_obj("incomplete", usage=self.usage(), incomplete_details=details)
            self.emit("response.incomplete", response=obj)
        else:
            error = {"code": end.get("code"), "message": end.get("message", "")}
            if kind == "error_event":
                nested = {"type": end.get("type") or end.get("code"), **error, "param": None}
                self.emit("error", error=nested)
            self.emit("response.failed", response=self.response_obj("failed", error=error))

    def response_obj(self, status: str, **extra: Any) -> dict[str, Any]:
        req = self.request
        return {
            "id": self.resp_id,
            "object": "response",
            "created_at": CREATED_AT + self.number,
            "status": status,
            "background": False,
            "error": extra.get("error"),
            "incomplete_details": extra.get("incomplete_details"),
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "model": req.get("model") or "fake-model",
            "output": list(self.done_items) if status != "in_progress" else [],
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": req.get("previous_response_id"),
            "reasoning": req.get("reasoning") or {"effort": None, "summary": None},
            "store": req.get("store", True),
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"),
            "tools": req.get("tools") or [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": extra.get("usage"),
            "metadata": {},
        }

    def usage(self) -> dict[str, Any]:
        # About 4 characters a token: deterministic, and large inputs cost visibly more.
        n_in = math.ceil(len(json.dumps(self.request.get("input", ""))) / 4)
        n_out = math.ceil(sum(len(json.dumps(i)) for i in self.done_items) / 4)
        usage = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        }
        usage.update(self.spec.get("usage") or {})
        return usage


_ID_PREFIX = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "custom_tool_call": "ctc",
    "tool_search_call": "tsc",
    "web_search_call": "ws",
}


#: The events that end a response, each carrying the whole `response` object.
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def whole_response(frames: list[bytes]) -> HttpError | bytes | None:
    """What a request without `"stream": true` gets instead of these SSE frames, as the Responses
    API answers it: the one `response` object its terminal event carries (the same items and
    usage), as JSON; an `error` event, as that error with HTTP 500; None when the frames never
    end the response (a cut): the server then drops the connection."""
    events = []
    for frame in frames:
        for line in frame.decode(errors="replace").splitlines():
            if line.startswith("data:"):
                try:
                    events.append(json.loads(line[5:].strip()))
                except ValueError:
                    pass  # a malformed frame a script wrote on purpose: a stream's business
    error = next((e for e in events if isinstance(e, dict) and e.get("type") == "error"), None)
    if error is not None:
        nested = error.get("error") if isinstance(error.get("error"), dict) else error
        return HttpError(500, json.dumps({"error": nested}).encode(), {"Content-Type": "application/json"})
    ends = [e for e in events if isinstance(e, dict) and e.get("type") in TERMINAL_EVENTS]
    if not ends:
        return None
    return json.dumps(ends[-1]["response"], separators=(",", ":")).encode()


def _http_error(d: dict[str, Any]) -> HttpError:
    status = int(d["status"])
    body = d.get("body")
    headers = dict(d.get("headers") or {})
    if body is None:
        body = {"error": {"message": f"scripted HTTP {status}", "type": "server_error", "param": None, "code": None}}
    if isinstance(body, str):
        headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        return HttpError(status, body.encode(), headers)
    headers.setdefault("Content-Type", "application/json")
    return HttpError(status, json.dumps(body).encode(), headers)


def _apply_cut(ops: list[Op], after: int | None, n_terminal: int, clean: bool) -> list[Op]:
    if after is None:
        return [*ops[: len(ops) - n_terminal], Cut(clean)]
    kept: list[Op] = []
    frames = 0
    for op in ops:
        if isinstance(op, bytes):
            if frames == after:
                break
            frames += 1
        kept.append(op)
    return [*kept, Cut(clean)]


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p


def replay_frames(path: Path) -> list[bytes]:
    """A recorded body split into frames, each ending in a blank line.

    A `.json` file is a Codex fixture (a JSON array of events), converted as Codex's
    `load_sse_fixture` does: `event: {type}` plus `data: {json}` unless the event has only `type`.
    """
    if path.suffix == ".json":
        frames = []
        for event in json.loads(path.read_text()):
            type_ = event.get("type", "")
            data = "" if set(event) == {"type"} else f"data: {json.dumps(event, separators=(',', ':'))}\n"
            frames.append(f"event: {type_}\n{data}\n".encode())
        return frames
    blocks = re.split(rb"(?:\r?\n){2,}", path.read_bytes())
    return [b.strip(b"\r\n") + b"\n\n" for b in blocks if b.strip()]
