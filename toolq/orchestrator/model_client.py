"""The model client: one Responses API sampling request over SSE, with Codex's failure handling.

`ModelClient.stream(body)` POSTs `{base_url}/responses`, retries 5xx and transport errors before
any SSE byte (the inner layer, `request_max_retries`), then yields typed `StreamEvent`s until
`response.completed`. Every other outcome raises `ModelError`, classified as Codex does
(docs/reference/codex-behaviour.md#model-errors-and-retries): `retryable` errors are for the caller's outer
"stream retry" loop (`stream_max_retries`, `backoff`, or `delay` when the server named one), the
rest end the turn. Items yielded before a failure stay committed: the caller already has them.
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx

from toolq.core.settings import DEFAULT_MAX_EVENT_BYTES, Settings
from toolq.orchestrator.protocol.events import (
    Completed,
    ErrorEvent,
    EventDecoder,
    Failed,
    Incomplete,
    StreamCut,
    StreamEvent,
)
from toolq.orchestrator.protocol.sse import aiter_frames

log = logging.getLogger("toolq.client")

DEFAULT_BASE_URL = "https://api.openai.com/v1"

# Codex's exact texts (docs/reference/codex-behaviour.md#model-errors-and-retries),
# so toolq ends a turn the way Codex does.
STREAM_DISCONNECTED = "stream disconnected before completion: "
CLOSED_EARLY = "stream closed before response.completed"
IDLE_TIMEOUT = "idle timeout waiting for SSE"
QUOTA_EXCEEDED = "Quota exceeded. Check your plan and billing details."
CONTEXT_WINDOW = (
    "Codex ran out of room in the model's context window. Start a new thread or clear earlier history before retrying."
)
HIGH_DEMAND = "We’re currently experiencing high demand, which may cause temporary errors."
AT_CAPACITY = "Selected model is at capacity. Please try a different model."
CYBER_POLICY = "This request has been flagged for possible cybersecurity risk."

# Authentication fails at once, not after Codex's outer retries: a wrong key stays wrong. The
# wording follows the official SDK's ("... by setting the OPENAI_API_KEY environment variable").
MISSING_KEY = (
    "no API key for {url}: set the OPENAI_API_KEY environment variable "
    "(only a server on localhost or 127.0.0.1 may be used without one)"
)
AUTH_FIX = {
    401: "set OPENAI_API_KEY to a valid key for this server",
    403: "the key in OPENAI_API_KEY may not use this model or endpoint: check its project and --model",
}

_TRY_AGAIN = re.compile(r"(?i)try again in\s*(\d+(?:\.\d+)?)\s*(s|ms|seconds?)")


class ModelError(Exception):
    """A sampling request that did not complete.

    `message` is what the user sees (Codex's wording); `detail` is what the server said, verbatim.
    `retryable` tells the outer loop to try again, after `delay` seconds if the server named a
    delay (Retry-After, "try again in Xs"), else after `backoff(n)`.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        delay: float | None = None,
        status: int | None = None,
        code: str | None = None,
        detail: str | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.unreachable = unreachable
        """No connection to the endpoint at all (refused, timed out): nothing answered."""
        self.retryable = retryable
        self.delay = delay
        self.status = status
        self.code = code
        self.detail = detail

    def __repr__(self) -> str:
        return f"ModelError({self.message!r}, retryable={self.retryable}, delay={self.delay}, status={self.status})"


def backoff(attempt: int) -> float:
    """Codex's delay before retry `attempt` (1-based): 0.2 s * 2^(attempt-1), +-10 % jitter."""
    return 0.2 * 2 ** (attempt - 1) * random.uniform(0.9, 1.1)


@dataclass
class ModelSettings:
    """Where and how to sample. The environment (OPENAI_BASE_URL, OPENAI_API_KEY, like the official
    SDK) is read once, by `Settings`; `from_settings` is the one way from there to here."""

    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = None
    model: str = "gpt-5.5"
    extra_headers: dict[str, str] = field(default_factory=dict)
    request_max_retries: int = 4
    """HTTP retries (5xx, transport) before any SSE byte, inside one `stream()` call."""
    stream_max_retries: int = 5
    """Whole-request retries, done by the caller's turn loop."""
    stream_idle_timeout: float = 300.0
    """Seconds without a byte from the server before the stream counts as dead."""
    connect_timeout: float = 10.0
    max_sse_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    """Bigger SSE events are dropped unread (counted in `skipped["oversize"]`)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelSettings:
        """The model endpoint as toolq's settings give it (OPENAI_BASE_URL, OPENAI_API_KEY, TOOLQ_MODEL...)."""
        return cls(base_url=settings.openai_base_url, api_key=settings.openai_api_key, model=settings.model,
                   request_max_retries=settings.request_max_retries, stream_max_retries=settings.stream_max_retries,
                   stream_idle_timeout=settings.stream_idle_timeout, max_sse_event_bytes=settings.max_sse_event_bytes)

    @property
    def responses_url(self) -> str:
        return self.base_url.rstrip("/") + "/responses"


def missing_api_key(base_url: str, api_key: str | None) -> str | None:
    """The one-line error for a remote endpoint without a key; None when none is needed."""
    if api_key or is_local(base_url):
        return None
    return MISSING_KEY.format(url=base_url)


def is_local(url: str) -> bool:
    """A loopback host: local servers (the fake model, Ollama, vLLM on this box) need no key."""
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_request(
    model: str,
    input: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    *,
    instructions: str | None = None,
    reasoning: dict[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    tool_choice: str | dict[str, Any] = "auto",
) -> dict[str, Any]:
    """A stateless streaming request: the whole history every time, nothing stored server-side."""
    body: dict[str, Any] = {
        "model": model,
        "input": input,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel_tool_calls,
        "store": False,
        "stream": True,
    }
    if instructions:
        body["instructions"] = instructions
    if reasoning is not None:
        body["reasoning"] = reasoning
        # Stateless requests must carry reasoning back, which only the encrypted form allows.
        body["include"] = ["reasoning.encrypted_content"]
    return body


Sleep = Callable[[float], Awaitable[Any]]


class ModelClient:
    """Async client for one Responses endpoint. `sleep` is injectable so tests need no clock."""

    def __init__(
        self, settings: ModelSettings, transport: httpx.AsyncBaseTransport | None = None, *,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self._sleep = sleep
        headers = {"Content-Type": "application/json", **settings.extra_headers}
        if settings.api_key:
            headers["Authorization"] = f"Bearer {settings.api_key}"
        # The read timeout is the idle timeout: httpx re-arms it on every chunk received.
        timeout = httpx.Timeout(settings.stream_idle_timeout, connect=settings.connect_timeout)
        # Plain http (a local vLLM, Ollama, the fake model) never negotiates TLS: the CA bundle
        # is not loaded (30 ms of each `toolq run`'s start). https verifies as always.
        tls = settings.base_url.lower().startswith("https:")
        self._http = httpx.AsyncClient(transport=transport, headers=headers, timeout=timeout, verify=tls)
        self.skipped: Counter[str] = Counter()
        """Frames skipped by reason, over every stream of this client."""

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> ModelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        """One sampling request. Ends after `Completed`; raises `ModelError` otherwise.

        `Failed` and `Incomplete` events are yielded before the error is raised; an `error`
        event is yielded, and decides the error if no `response.failed` follows it.
        """
        response = await self._open(body)
        decoder = EventDecoder()
        frames = aiter_frames(response, self.settings.max_sse_event_bytes)
        pending: ModelError | None = None
        try:
            async for frame in frames:
                event = decoder.decode(frame)
                if event is None:
                    continue
                if isinstance(event, StreamCut):  # an event over the bound that may have held a commit
                    raise ModelError(STREAM_DISCONNECTED + event_too_large(event), retryable=True)
                if isinstance(event, Completed):
                    # Stop here even if the server keeps the socket open (Codex does the same).
                    yield event
                    return
                if isinstance(event, Failed):
                    # A bare `response.failed` after an `error` event: the error event said why.
                    if pending is not None and event.code is None:
                        failure = pending
                    else:
                        failure = stream_failure(event.code, event.message)
                    yield event
                    raise failure
                if isinstance(event, Incomplete):
                    yield event
                    raise ModelError(
                        f"Incomplete response returned, reason: {event.reason or 'unknown'}", retryable=False
                    )
                if isinstance(event, ErrorEvent):
                    pending = stream_failure(event.code, event.message)
                yield event
        except httpx.ReadTimeout:
            raise ModelError(STREAM_DISCONNECTED + IDLE_TIMEOUT, retryable=True) from None
        except httpx.TransportError as e:
            raise transport_failure(e, self.settings.responses_url) from e
        finally:
            self.skipped.update(decoder.skipped)
            if decoder.skipped["oversize"]:
                log.warning("dropped %d SSE event(s) over TOOLQ_MAX_SSE_EVENT_BYTES (%d bytes)",
                            decoder.skipped["oversize"], self.settings.max_sse_event_bytes)
            await frames.aclose()
            await response.aclose()
        if pending is not None:
            raise pending
        raise ModelError(STREAM_DISCONNECTED + CLOSED_EARLY, retryable=True)

    async def _open(self, body: dict[str, Any]) -> httpx.Response:
        """POST until a 2xx SSE response, retrying 5xx and transport errors (the inner layer)."""
        url = self.settings.responses_url
        problem = missing_api_key(self.settings.base_url, self.settings.api_key)
        if problem:
            raise ModelError(problem, retryable=False)
        attempt = 0
        while True:
            attempt += 1
            try:
                request = self._http.build_request(
                    "POST", url, json=body, headers={"Accept": "text/event-stream", "Cache-Control": "no-store"}
                )
                response = await self._http.send(request, stream=True)
            except httpx.TransportError as e:
                error = transport_failure(e, url)
            else:
                if response.is_success:
                    await _require_sse(response)
                    return response
                text = (await response.aread()).decode("utf-8", "replace")
                await response.aclose()
                error = http_failure(response.status_code, response.headers, text, url)
                if response.status_code < 500:
                    raise error
            if attempt > self.settings.request_max_retries:
                raise error
            await self._sleep(backoff(attempt))


async def _require_sse(response: httpx.Response) -> None:
    content_type = response.headers.get("content-type", "")
    if "text/event-stream" in content_type.partition(";")[0]:
        return
    start = (await response.aread())[:200].decode("utf-8", "replace")
    await response.aclose()
    raise ModelError(
        f"expected an SSE stream but got status {response.status_code} with content-type "
        f"{content_type or 'none'!r}: {start}",
        retryable=False,
        status=response.status_code,
        detail=start,
    )


def transport_failure(e: httpx.TransportError, url: str) -> ModelError:
    """A network error, retryable as in Codex; the message names the URL, so a wrong one shows."""
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ModelError(f"cannot reach {url} ({_describe(e)}): is the server running? check OPENAI_BASE_URL",
                          retryable=True, unreachable=True)
    return ModelError(STREAM_DISCONNECTED + f"transport error: {_describe(e)}, url: {url}", retryable=True)


def one_line(text: str, limit: int = 2000) -> str:
    """What a server said, as one line a user reads (a proxy's HTML error page spans many)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def http_failure(status: int, headers: Mapping[str, str], body: str, url: str) -> ModelError:
    """An HTTP error status, classified as Codex does (docs/reference/codex-behaviour.md#model-errors-and-retries),
    but 401/403 end at once."""
    error = _error_object(body)
    code = error.get("code") if isinstance(error.get("code"), str) else None
    server_message = error.get("message") if isinstance(error.get("message"), str) else None
    reason = _reason(status)
    if status in AUTH_FIX:
        said = one_line(server_message or body, 300) or "no details"
        return ModelError(f"{status} {reason} from {url}: {said}; {AUTH_FIX[status]}", retryable=False,
                          status=status, code=code, detail=body)
    if status == 400:
        # Codex shows the raw body: it names the bad field (`param`) better than any summary (on one line).
        return ModelError(one_line(body), retryable=False, status=status, code=code, detail=body)
    if status == 429:
        if code == "insufficient_quota":
            return ModelError(QUOTA_EXCEEDED, retryable=False, status=status, code=code, detail=body)
        delay = retry_after(headers)
        if delay is None and code == "rate_limit_exceeded":
            delay = try_again_in(server_message or "")
        # Without a server-named delay a 429 is final: retrying blind only burns more quota.
        return ModelError(
            f"exceeded retry limit, last status: {status} {reason}",
            retryable=delay is not None,
            delay=delay,
            status=status,
            code=code,
            detail=body,
        )
    if status == 500:
        return ModelError(HIGH_DEMAND, retryable=True, status=status, code=code, detail=body)
    if status == 503 and code in ("server_is_overloaded", "slow_down"):
        return ModelError(AT_CAPACITY, retryable=False, status=status, code=code, detail=body)
    return ModelError(
        f"unexpected status {status} {reason}: {one_line(body)}, url: {url}",
        retryable=True, status=status, code=code, detail=body,
    )


def event_too_large(cut: StreamCut) -> str:
    return (f"a {cut.event_type or 'unreadable'} event of {cut.size} bytes was over the "
            f"TOOLQ_MAX_SSE_EVENT_BYTES bound and was dropped")


def stream_failure(code: str | None, message: str | None) -> ModelError:
    """A `response.failed` or `error` event, classified by `error.code` as Codex does
    (docs/reference/codex-behaviour.md#model-errors-and-retries)."""
    text = message or ""
    if code == "context_length_exceeded":
        return ModelError(CONTEXT_WINDOW, retryable=False, code=code, detail=text)
    if code == "insufficient_quota":
        return ModelError(QUOTA_EXCEEDED, retryable=False, code=code, detail=text)
    if code == "usage_not_included":
        return ModelError(f"usage not included in your plan: {text}", retryable=False, code=code, detail=text)
    if code == "cyber_policy":
        return ModelError(text.strip() or CYBER_POLICY, retryable=False, code=code, detail=text)
    if code == "invalid_prompt":
        return ModelError(text.strip() or "Invalid request.", retryable=False, code=code, detail=text)
    if code in ("server_is_overloaded", "slow_down"):
        return ModelError(AT_CAPACITY, retryable=False, code=code, detail=text)
    if code == "rate_limit_exceeded":
        return ModelError(
            f"rate limit exceeded: {text}", retryable=True, delay=try_again_in(text), code=code, detail=text
        )
    if code == "server_error":  # the server said it failed: nothing was disconnected
        return ModelError(f"the model server failed this response: {text or code}", retryable=True, code=code,
                          detail=text)
    return ModelError(
        STREAM_DISCONNECTED + (text or "response.failed event received"), retryable=True, code=code, detail=text
    )


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from `retry-after-ms`, or `retry-after` as seconds or an HTTP date."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(float(ms) / 1000, 0.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def try_again_in(message: str) -> float | None:
    """The delay in "Please try again in 11.054s" / "28ms" / "35 seconds", in seconds."""
    m = _TRY_AGAIN.search(message)
    if m is None:
        return None
    value = float(m.group(1))
    return value / 1000 if m.group(2).lower() == "ms" else value


def _error_object(body: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # an error body nested too deep is no error object either
        return {}
    error = doc.get("error", doc) if isinstance(doc, dict) else None
    return error if isinstance(error, dict) else {}


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
