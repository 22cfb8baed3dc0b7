"""`write_stdin`: type into, or poll, an exec_command session (Codex's unified exec).

The call reaches the worker that holds the session through that worker's own queue
(`toolq.orchestrator.transport.session_route`); the session host there writes the characters and returns
the output since the previous call (toolq/workers/sessions).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from toolq.core.catalog import ToolContext, ToolReturn, plain_parameters, tool
from toolq.core.errors import RespondToModel
from toolq.workers.sessions import calls
from toolq.workers.tools.exec_command import DEFAULT_MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS_CAP

#: Codex's clamps: a write waits 250 ms by default; an empty poll waits at least 5 s (and at most
#: 300 s, `max_background_terminal_timeout`), unless the process exits first.
DEFAULT_YIELD_MS = 250.0
WRITE_YIELD = (250.0, 30_000.0)
POLL_YIELD = (5_000.0, 300_000.0)

class WriteStdinArgs(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: int = Field(description="Identifier of the running unified exec session.",
                            json_schema_extra={"type": "number"})
    chars: str = Field(default="", description="Bytes to write to stdin (may be empty to poll).")
    yield_time_ms: float | None = Field(default=None,
                                        description="How long to wait (in milliseconds) for output before yielding.")
    max_output_tokens: float | None = Field(
        default=None, ge=0, description="Maximum number of tokens to return. Excess output will be truncated.")

    def yield_ms(self) -> float:
        low, high = POLL_YIELD if not self.chars else WRITE_YIELD
        wanted = DEFAULT_YIELD_MS if self.yield_time_ms is None else self.yield_time_ms
        return min(max(wanted, low), high)


PARAMETERS = plain_parameters(WriteStdinArgs)


@tool(parameters=PARAMETERS, strict=False, shell_like=True, timeout=POLL_YIELD[1] / 1000 + 10, streams_output=True,
      sessions=True, route="session", view="command", flower_args={"session_id": "value", "chars": "length"})
def write_stdin(args: WriteStdinArgs, ctx: ToolContext) -> ToolReturn:
    """Writes characters to an existing unified exec session and returns recent output."""
    if not calls.available(ctx):
        raise RespondToModel(f"write_stdin failed: Unknown process id {args.session_id}")
    reply = calls.write_in_host(args.session_id, args.chars, args.yield_ms(), ctx)
    budget = DEFAULT_MAX_OUTPUT_TOKENS if args.max_output_tokens is None else int(args.max_output_tokens)
    return calls.to_return(reply, min(budget, MAX_OUTPUT_TOKENS_CAP))
