"""The host's socket protocol: one JSON object per line, one request at a time per connection.

Pool children send `call`; the worker's main process sends `list`. A child that goes away
mid-call (cancelled, timed out, killed) closes its connection, and the host cancels the call,
which tells the server (`notifications/cancelled`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from toolq.core.items import ContentPart
from toolq.core.mcp_specs import McpToolRecord
from toolq.core.tracing import TraceContext


class McpOutput(BaseModel):
    """A call's model-visible output (`results.map_result`) and whether the tool said it failed."""

    output: str | list[ContentPart]
    is_error: bool = False


class ListRequest(BaseModel):
    op: Literal["list"] = "list"


class CallRequest(BaseModel):
    op: Literal["call"] = "call"
    server: str
    tool: str
    arguments: dict[str, Any]
    digest: str
    """The declaration the child checked; the host refuses if its server listed another since."""
    timeout: float
    trace: TraceContext | None = None
    """The pool child's `tools/call` span (from the call's signed invocation, never from a server):
    the host sends it as the request's `_meta.traceparent` and `_meta.tracestate`."""


Request = Annotated[ListRequest | CallRequest, Field(discriminator="op")]
REQUEST = TypeAdapter(Request)


class ServerState(BaseModel):
    name: str
    transport: str
    state: Literal["starting", "ready", "down"]
    error: str | None = None
    """Why the server is down, or why its last start failed."""
    restarts: int = 0
    tools: list[McpToolRecord] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    """Listed tools that cannot be offered, each with the reason."""


class Listing(BaseModel):
    generation: int
    """Bumped on every change of any server's tools or state."""
    servers: list[ServerState]

    def records(self) -> list[McpToolRecord]:
        """Tools of the servers that are up: a down server's tools are not offered."""
        return [t for s in self.servers if s.state == "ready" for t in s.tools]


class CallReply(BaseModel):
    result: McpOutput | None = None
    refusal: str | None = None
    """Why the call did not run or did not finish (server down, list changed, timeout)."""
    lost: str | None = None
    """The server had the call and died: what was lost (the call may have partly run)."""
    stale: bool = False
    """The server lists the tool differently from the declaration the call carries."""
    timed_out: float | None = None
    """The call ran out of its time (this many seconds) and the server was asked to cancel it."""
