"""The trace vocabulary both ends share (no I/O): the W3C trace context a call carries inside its
signed task message, and the names of toolq's spans and attributes, after the OpenTelemetry GenAI
semantic conventions (`gen_ai.*`) where they name a thing, `toolq.*` where they do not."""

from __future__ import annotations

import re

from pydantic import BaseModel, field_validator

#: `version-traceid-parentid-flags`, lower-case hex (W3C Trace Context, level 1).
TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class TraceContext(BaseModel):
    """Where a call's spans hang in its turn's trace: the orchestrator's `execute_tool` span. It
    travels inside the signed invocation, so a worker joins only the trace its orchestrator named."""

    traceparent: str
    tracestate: str = ""

    @field_validator("traceparent")
    @classmethod
    def _w3c(cls, v: str) -> str:
        if not TRACEPARENT.fullmatch(v):
            raise ValueError("traceparent is not a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>)")
        return v

    @field_validator("tracestate")
    @classmethod
    def _bounded(cls, v: str) -> str:
        if len(v) > 512:
            raise ValueError("tracestate is over 512 characters")
        return v

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]


# --- span names (a low-cardinality name, the detail in attributes) -------------------------------
INVOKE_AGENT = "invoke_agent toolq"  # a turn: the root span
CHAT = "chat"  # a model request: "chat {model}"
EXECUTE_TOOL = "execute_tool"  # a tool call: "execute_tool {tool}"
# on the worker, under a call's execute_tool span
QUEUE_WAIT = "toolq.queue_wait"
TOOL = "toolq.tool"  # "toolq.tool {tool}"
SANDBOX_START = "toolq.sandbox.start"
COMMAND = "toolq.command"
RESULT_STORE = "toolq.result.store"
MCP_CALL = "tools/call"  # "tools/call {server}.{tool}", the MCP convention's name

# --- GenAI semantic-convention attributes ---------------------------------------------------------
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
AGENT_NAME = "gen_ai.agent.name"
CONVERSATION_ID = "gen_ai.conversation.id"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"  # content: only with capture on
TOOL_RESULT = "gen_ai.tool.call.result"  # content: only with capture on
ERROR_TYPE = "error.type"
COMMAND_LINE = "process.command_line"  # content: only with capture on
EXIT_CODE = "process.exit.code"

# --- toolq's own ----------------------------------------------------------------------------------
TURN_ID = "toolq.turn.id"
TASK_ID = "toolq.task.id"
QUEUE = "toolq.queue"
CALL_STATE = "toolq.call.state"
OUTPUT_REASON = "toolq.output.reason"  # why toolq, not the tool, wrote the output
WORKER = "toolq.worker"
HOST = "toolq.host"
ENVIRONMENT_ID = "toolq.environment.id"
SANDBOX_BACKEND = "toolq.sandbox.backend"
SESSION_ID = "toolq.session.id"
SESSION_HOST = "toolq.session_host"

#: The standard switch for prompt, output and argument text in spans (off unless "true").
CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
