"""exec_command and write_stdin as a pool child runs them: through this worker's session host."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from toolq.core.catalog import ToolContext, ToolReturn
from toolq.core.errors import RespondToModel
from toolq.core.honest import InfrastructureLost
from toolq.workers.exec_output import format_exec_output
from toolq.workers.processes import CallCancelled
from toolq.workers.sessions import host_client
from toolq.workers.sessions.protocol import ExecRequest, Reply, WriteRequest

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


def _call(request: ExecRequest | WriteRequest, ctx: ToolContext, yield_ms: float, tool: str) -> Reply:
    try:
        reply = host_client.call(request, ctx.cancelled, timeout=yield_ms / 1000 + REPLY_SLACK, output=ctx.output)
    except host_client.Cancelled:
        raise CallCancelled(f"{tool} cancelled") from None
    except host_client.HostLost as e:  # the host (or its cell) died with the command in its hands
        raise InfrastructureLost(f"{e}, on worker {socket.gethostname()}") from None
    except host_client.HostUnavailable as e:
        raise InfrastructureLost(str(e), started=False) from None
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
