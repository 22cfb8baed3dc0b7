"""exec_command and write_stdin, and the front doors' process tools, as a pool child runs them:
through this worker's session host."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from toolq.core import tracing as names
from toolq.core.catalog import ToolContext, ToolReturn
from toolq.core.errors import RespondToModel
from toolq.core.honest import InfrastructureLost
from toolq.workers import spans
from toolq.workers.exec_output import format_exec_output
from toolq.workers.processes import CallCancelled
from toolq.workers.sessions import host_client
from toolq.workers.sessions.protocol import (
    ExecRequest,
    InputRequest,
    KillRequest,
    OutputFrame,
    Reply,
    Request,
    WriteRequest,
)

#: Slack for the host's reply over the yield time (it drains output after an exit).
REPLY_SLACK = 5.0


def available(ctx: ToolContext) -> bool:
    """Sessions need a conversation to belong to, and a worker that runs a session host."""
    return bool(ctx.invocation.conversation) and host_client.socket_path() is not None


def exec_in_host(cmd: str, *, shell: str, cwd: Path, tty: bool, yield_ms: float, ctx: ToolContext) -> Reply:
    conversation = ctx.invocation.conversation or ""
    request = ExecRequest(conversation=conversation, cmd=cmd, shell=shell, cwd=str(cwd),
                          workspace=str(ctx.workspace), env=dict(os.environ), tty=tty, yield_ms=yield_ms,
                          stream=ctx.output is not None)
    return _call(request, ctx, yield_ms, "exec_command")


def write_in_host(session_id: int, chars: str, yield_ms: float, ctx: ToolContext) -> Reply:
    request = WriteRequest(conversation=ctx.invocation.conversation or "", session_id=session_id, chars=chars,
                           yield_ms=yield_ms, stream=ctx.output is not None)
    return _call(request, ctx, yield_ms, "write_stdin")


def start_in_host(cmd: str, *, shell: str, cwd: Path, tty: bool, pipe_stdin: bool, env: dict[str, str],
                  ctx: ToolContext, frames: Callable[[OutputFrame], None]) -> Reply:
    """A front door's process (`process_start`): a session at once, every output frame to `frames`
    (the first names the session), the reply once it has exited; it runs until the call's deadline."""
    yield_ms = max(0.0, ctx.remaining() - REPLY_SLACK) * 1000
    request = ExecRequest(conversation=ctx.invocation.conversation or "", cmd=cmd, shell=shell, cwd=str(cwd),
                          workspace=str(ctx.workspace), env=dict(os.environ), tty=tty, yield_ms=yield_ms,
                          front_door=True, pipe_stdin=pipe_stdin, extra_env=env)
    return _call(request, ctx, yield_ms, "process_start", frames)


def input_in_host(session_id: int, data: str, ctx: ToolContext) -> Reply:
    """`data` (base64) to a session's stdin at once: its reply's `status`."""
    request = InputRequest(conversation=ctx.invocation.conversation or "", session_id=session_id, data=data,
                           yield_ms=0)
    return _call(request, ctx, 0, "process_write")


def kill_in_host(session_id: int, ctx: ToolContext) -> Reply:
    """SIGKILL a session's process group: its reply's `running`."""
    request = KillRequest(conversation=ctx.invocation.conversation or "", session_id=session_id, yield_ms=0)
    return _call(request, ctx, 0, "process_terminate")


def _call(request: Request, ctx: ToolContext, yield_ms: float, tool: str,
          frames: Callable[[OutputFrame], None] | None = None) -> Reply:
    # Traces: a command started in the session host is this call's `toolq.command` (to its exit, or
    # to the yield that leaves it running as a session).
    span = spans.start_command(request.cmd, session_host=True) if isinstance(request, ExecRequest) else None
    if span is not None:
        request = request.model_copy(update={"traced": True})
    try:
        reply = host_client.call(request, ctx.cancelled, timeout=yield_ms / 1000 + REPLY_SLACK, output=ctx.output,
                                 frames=frames)
    except host_client.Cancelled:
        spans.end(span, error="cancelled")
        raise CallCancelled(f"{tool} cancelled") from None
    except host_client.HostLost as e:  # the host (or its cell) died with the command in its hands
        spans.end(span, error="lost")
        raise InfrastructureLost(f"{e}, on worker {socket.gethostname()}") from None
    except host_client.HostUnavailable as e:
        spans.end(span, error="not_run")
        raise InfrastructureLost(str(e), started=False) from None
    except BaseException as e:
        spans.end(span, error=type(e).__name__)
        raise
    if span is not None and reply.spawn_started is not None and reply.sandbox not in (None, "none"):
        spans.sandbox_started(reply.sandbox or "", reply.spawn_started, reply.spawn_ended)
    spans.end(span, error="spawn_failed" if reply.spawn_errno is not None else None,
              **{names.EXIT_CODE: reply.exit_code, names.SESSION_ID: reply.session_id})
    if reply.error is not None:
        raise RespondToModel(reply.error)
    return reply


def to_return(reply: Reply, max_tokens: int) -> ToolReturn:
    content = host_client.output_text(reply)
    if reply.limit_note:
        content += f"\n[{reply.limit_note}]\n"
    text = format_exec_output(content, reply.exit_code, reply.wall_time, max_tokens,
                              session_id=reply.session_id)
    return ToolReturn(output=text, success=reply.exit_code in (0, None), exit_code=reply.exit_code)
