"""A scripted Responses API server on 127.0.0.1: real SSE over TCP, or one JSON response.

Request k to `POST /v1/responses` gets scripted response k: streamed as SSE when the request says
`"stream": true`, else (as the Responses API answers) as one JSON `response` object, the one its
stream's terminal event would carry (a cut drops the connection; an `error_event`, HTTP 500).
When the script runs out, every further request gets HTTP 400 with error code
`script_exhausted` (a client ends the turn and shows it; it is never mistaken for the model
speaking). With `loop=True` the script starts again instead, both when it runs out and when a new
run begins (see `_starts_run`; and the same request after a response that completed cleanly, from
a run cancelled midway), so one server can answer `toolq run` after `toolq run`. Every request
body is recorded (`requests`, with `request_times` and `request_headers`) so tests can assert
what was sent.

Script format (a JSON file, or the same structure built in Python with `builders`): a list of
responses, or `{"responses": [...]}`. A response is one of
- a list of steps: output items and directives, served in order;
- `{"output": [steps...], "usage": {...}, "id": "resp_x", "gate": true, "chunk_size": 16}`;
- a string: shorthand for one assistant message.

An item is its `response.output_item.done` JSON (`{"type": "function_call", "name": "exec_command",
"arguments": "{\\"cmd\\":\\"ls\\"}", "call_id": "call_1"}`); `id`, `call_id` and `status` are
filled in when absent. Shorthands: a message may give `"text"` instead of `content`, a reasoning
item may give `summary` as strings, a function call may give `arguments` as an object.

`{{SESSION_ID}}` anywhere in a response stands for the session id the request's last tool output
that said "session ID N" gave (Codex's are random): a script's `write_stdin` reaches the session its
`exec_command` left running.

A directive is `{"directive": name, ...}`:
- `http_error` `{status, body?, headers?}`: answer with that status instead of a stream;
- `failed` `{code, message}`, `incomplete` `{reason}`, `error_event` `{code, message, type?}`:
  end with that terminal event instead of `response.completed` (wherever the step sits);
- `cut` `{after?: n_events, clean?: true}`: stop after n events (default: before the terminal
  event); `clean: false` drops the connection mid-body;
- `stall` `{seconds}`, `gate` (hold until `FakeModel.release()`), `raw` `{text}` (verbatim bytes,
  e.g. a malformed frame): positional, they happen where they sit among the items;
- `replay` `{path}`: serve a recorded SSE body (path relative to the script file).

Many turns at once (`toolq batch`, concurrent `Session`s): `{"by_prompt": {PROMPT: [responses],
"*": [responses]}}` gives each conversation its own script, chosen by its last user message
(`*` for any other), and a request gets the response whose index is how many times tool outputs
were answered since that message, so interleaved turns never take each other's responses.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import IO, Any

from toolq.dev.fake_model.render import Cut, Gate, HttpError, Op, Stall, render, whole_response

SCRIPT_EXHAUSTED = "script_exhausted"
#: How long a gate holds a response when nobody releases it: long for a test, short for CI.
GATE_TIMEOUT = 60.0


def load_script(script: Any) -> tuple[list[Any] | dict[str, list[Any]], Path | None]:
    """The list of responses (or, `by_prompt`, one list per prompt) and the folder relative
    replay paths start from."""
    if script is None:
        text = (resources.files("toolq.dev.fake_model") / "scripts" / "demo.json").read_text()
        return _responses(json.loads(text)), None
    if isinstance(script, (str, Path)):
        path = Path(script)
        return _responses(json.loads(path.read_text())), path.resolve().parent
    return (_responses(script) if isinstance(script, dict) else list(script)), None


def _responses(doc: Any) -> list[Any] | dict[str, list[Any]]:
    if isinstance(doc, dict) and "by_prompt" in doc:
        scripts = doc["by_prompt"]
        if not isinstance(scripts, dict) or not all(isinstance(v, list) for v in scripts.values()):
            raise ValueError('"by_prompt" maps each prompt (or "*") to a list of responses')
        return dict(scripts)
    responses = doc.get("responses") if isinstance(doc, dict) else doc
    if not isinstance(responses, list):
        raise ValueError('a script is a JSON list of responses or {"responses": [...]}')
    return responses


class FakeModel:
    """A running fake server; a context manager that stops it on exit."""

    def __init__(self, script: Any = None, *, port: int = 0, log: IO[str] | None = None, loop: bool = False) -> None:
        script, self._base_dir = load_script(script)
        self.by_prompt: dict[str, list[Any]] | None = script if isinstance(script, dict) else None
        """Per conversation, by its last user message (see the module docstring); else `script`."""
        self.script: list[Any] = [] if isinstance(script, dict) else script
        self.loop = loop
        self._next = 0
        """Index of the script entry the next request gets."""
        self._last_input: list[Any] | None = None
        self._last_ended_cleanly = False
        """The last response served ended in `response.completed` (see `_ends_cleanly`)."""
        self.requests: list[dict[str, Any]] = []
        self.request_times: list[float] = []
        self.request_headers: list[dict[str, str]] = []
        self._log = log
        self._lock = threading.Lock()
        self._gate = threading.Semaphore(0)
        self._closing = threading.Event()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.model = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-model", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def release(self, n: int = 1) -> None:
        """Let `n` held responses (gates) go on; a release before the gate is reached is kept."""
        self._gate.release(n)

    def close(self) -> None:
        self._closing.set()
        self._gate.release(1000)  # wake held handlers so they can see we are closing
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, body: dict[str, Any], headers: dict[str, str]) -> HttpError | list[Op]:
        inputs: list[Any] = body["input"] if isinstance(body.get("input"), list) else [body.get("input")]
        with self._lock:
            number = len(self.requests) + 1
            self.requests.append(body)
            self.request_times.append(time.monotonic())
            self.request_headers.append(headers)
            if self.by_prompt is not None:
                script, index = _conversation_script(self.by_prompt, inputs)
            else:
                again = inputs == self._last_input and self._last_ended_cleanly
                if self.loop and (self._next >= len(self.script) or _starts_run(self._last_input, inputs) or again):
                    self._next = 0
                self._last_input = inputs
                script, index = self.script, self._next
                self._last_ended_cleanly = index < len(script) and _ends_cleanly(script[index])
                self._next += 1
        exhausted = index >= len(script)
        if self._log is not None:
            note = " (script exhausted)" if exhausted else f" (response {index + 1}/{len(script)})"
            print(f"request {number}: {len(inputs)} input items{note} at {time.monotonic():.6f}",
                  file=self._log, flush=True)
        if exhausted:
            return self._exhausted(script)
        return render(script[index], body, number, self._base_dir)

    def _exhausted(self, script: list[Any]) -> HttpError:
        fix = "the script is empty" if not script else "restart `toolq fake-model`, or start it with --loop"
        message = f"fake model: script exhausted: all {len(script)} scripted responses were served; {fix}"
        return HttpError(400, _error_json(message, SCRIPT_EXHAUSTED))


#: Directives after which a client may send the same request again (a retry, not a new run).
_RETRIED_AFTER = frozenset({"http_error", "failed", "incomplete", "error_event", "cut", "stall", "gate", "raw",
                            "replay"})


def _ends_cleanly(response: Any) -> bool:
    """Whether the response ends in `response.completed` with nothing a client would retry: then
    the same request again is a new run (a run cancelled after it never asked again), not a retry."""
    steps = response.get("output", []) if isinstance(response, dict) else response
    if isinstance(response, dict) and response.get("gate"):
        return False
    return not isinstance(steps, list) or not any(
        isinstance(s, dict) and s.get("directive") in _RETRIED_AFTER for s in steps)


def _starts_run(previous: list[Any] | None, inputs: list[Any]) -> bool:
    """A new run (a new turn) is under way: a new user message, or a history that is not the last one grown.

    Within a turn toolq's input only grows, by model items and tool outputs; a retry resends it.
    A new turn adds a user message (`--session`) or starts from a shorter history.
    """
    if previous is None:
        return True
    return len(inputs) < len(previous) or _user_messages(inputs) != _user_messages(previous)


def _conversation_script(by_prompt: dict[str, list[Any]], inputs: list[Any]) -> tuple[list[Any], int]:
    """A `by_prompt` request's script (by its last user message) and its index in it: one per
    run of tool outputs since that message (each answered response with calls added one)."""
    last = max((k for k, i in enumerate(inputs) if _is_user_message(i)), default=-1)
    prompt = _text(inputs[last]) if last >= 0 else ""
    runs, in_outputs = 0, False
    for item in inputs[last + 1:]:
        is_output = isinstance(item, dict) and str(item.get("type", "")).endswith("_output")
        runs += is_output and not in_outputs
        in_outputs = is_output
    return by_prompt.get(prompt, by_prompt.get("*", [])), runs


def _is_user_message(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message"


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(c.get("text", "") for c in content or [] if isinstance(c, dict))


def _user_messages(inputs: list[Any]) -> int:
    return sum(1 for i in inputs if _is_user_message(i))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    model: FakeModel


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # One small write per event: without this, Nagle + delayed ACK can hold frames ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed its keep-alive connection: normal, not worth a traceback

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests and the CLI report requests their own way

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.split("?")[0].rstrip("/") not in ("/v1/responses", "/responses"):
            self._error(HttpError(404, _error_json(f"no route for POST {self.path}", "not_found")))
            return
        try:
            body = json.loads(raw)
        except ValueError as e:
            self._error(HttpError(400, _error_json(f"request body is not JSON: {e}", "invalid_json")))
            return
        try:
            plan = self.server.model._plan(body if isinstance(body, dict) else {"input": body}, dict(self.headers))
        except (KeyError, TypeError, ValueError) as e:
            self._error(HttpError(500, _error_json(f"fake model script error: {e!r}", "script_error")))
            return
        try:
            if isinstance(plan, HttpError):
                self._error(plan)
            elif isinstance(body, dict) and body.get("stream") is True:
                self._stream(plan)
            else:
                self._whole(plan)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (e.g. its idle timeout fired)

    def _error(self, err: HttpError) -> None:
        self.send_response(err.status)
        headers = {"Content-Type": "application/json", **err.headers}
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(err.body)))
        self.end_headers()
        self.wfile.write(err.body)

    def _whole(self, ops: list[Op]) -> None:
        """A request without `"stream": true`: the same response as one JSON object, once its
        pauses have passed (a cut drops the connection: the response never came)."""
        model = self.server.model
        frames: list[bytes] = []
        for op in ops:
            if isinstance(op, bytes):
                frames.append(op)
            elif isinstance(op, Stall):
                if model._closing.wait(op.seconds):
                    return
            elif isinstance(op, Gate):
                model._gate.acquire(timeout=GATE_TIMEOUT)
                if model._closing.is_set():
                    return
            elif isinstance(op, Cut):
                break
        answer = whole_response(frames)
        if isinstance(answer, HttpError):
            self._error(answer)
            return
        if answer is None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def _stream(self, ops: list[Op]) -> None:
        model = self.server.model
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        write = self.wfile.write
        for op in ops:
            if isinstance(op, bytes):
                write(b"%X\r\n%s\r\n" % (len(op), op))
            elif isinstance(op, Stall):
                if model._closing.wait(op.seconds):
                    break
            elif isinstance(op, Gate):
                model._gate.acquire(timeout=GATE_TIMEOUT)
                if model._closing.is_set():
                    break
            elif isinstance(op, Cut):
                if not op.clean:
                    # Drop the connection without the closing chunk: a transport error for the client.
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                break
        write(b"0\r\n\r\n")


def _error_json(message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def serve_forever(port: int = 0, script: str | None = None, *, loop: bool = False) -> int:
    """`toolq fake-model`: print the base URL, serve until interrupted."""
    try:
        fake = FakeModel(script, port=port, log=sys.stderr, loop=loop)
    except (OSError, ValueError) as e:
        print(f"toolq fake-model: {e}", file=sys.stderr)
        return 1
    print(fake.base_url, flush=True)
    what = script or "the built-in demo conversation"
    again = "again for each run" if loop else "once (--loop: for every run)"
    served = (f"{len(fake.by_prompt)} prompts' scripts" if fake.by_prompt is not None
              else f"{len(fake.script)} scripted responses")
    print(f"serving {served} from {what}, {again}; Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        while fake._thread.is_alive():
            fake._thread.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        fake.close()
    return 0
