"""`exec_command`: run a shell command in the workspace (Codex's unified exec).

Output text and truncation follow Codex's (docs/reference/codex-behaviour.md#exec_command). On a worker with a
session host and a call from a conversation, the command runs there and may outlive the call as
a session (toolq/workers/sessions); otherwise it runs to completion or to its time limit.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolq.core.catalog import ToolContext, ToolReturn, plain_parameters, tool
from toolq.core.errors import RespondToModel
from toolq.workers import isolation
from toolq.workers.exec_output import format_exec_output
from toolq.workers.processes import CallCancelled, run_command
from toolq.workers.sessions import calls as sessions
from toolq.workers.workspace import resolve_in_workspace

DEFAULT_MAX_OUTPUT_TOKENS = 10_000
#: Codex clamps `max_output_tokens` to the model's truncation policy (10k tokens for gpt-5.x).
MAX_OUTPUT_TOKENS_CAP = 10_000
TIMEOUT_EXIT_CODE = 124
EXEC_TIMEOUT = 300.0
#: Codex's default `yield_time_ms` for exec_command.
DEFAULT_YIELD_MS = 10_000.0

class ExecCommandArgs(BaseModel):
    # Unknown keys are ignored, as serde does for Codex (e.g. `sandbox_permissions`).
    model_config = ConfigDict(extra="ignore")

    cmd: str = Field(description="Shell command to execute.")
    workdir: str | None = Field(
        default=None,
        description="Working directory for the command, inside the workspace; defaults to the workspace root.")
    yield_time_ms: float | None = Field(
        default=None,
        description="How long to wait (in milliseconds, 250-30000, default 10000) for output before "
        "yielding; a command still running then keeps running as a session for write_stdin.")
    max_output_tokens: float | None = Field(
        default=None, ge=0,
        description="Maximum number of tokens of output to return (default 10000); the middle of longer output is cut.")
    tty: bool | None = Field(
        default=None, description="Whether to allocate a TTY for the command (stdin stays open for write_stdin).")
    shell: str | None = Field(default=None, description="Shell binary to run the command with; defaults to bash.")
    login: bool | None = Field(default=None, description="Ignored: the shell never runs as a login shell.")
    justification: str | None = Field(default=None, description="Ignored: no approval step exists.")

    @field_validator("yield_time_ms")
    @classmethod
    def _clamp_yield(cls, v: float | None) -> float | None:
        return None if v is None else min(max(v, 250.0), 30_000.0)


PARAMETERS = plain_parameters(ExecCommandArgs)


@tool(parameters=PARAMETERS, strict=False, shell_like=True, timeout=EXEC_TIMEOUT, streams_output=True,
      sessions=True, view="command", flower_args={"cmd": "value"})
def exec_command(args: ExecCommandArgs, ctx: ToolContext) -> ToolReturn:
    """Runs a shell command in the workspace and returns its output (stdout and stderr merged) once it exits.

    The command runs in a sandbox: it may write only inside the workspace (not `.git/`) and its own
    temporary directory, has no network, and has limits on memory, processes, CPU time and file size.
    A command still running after yield_time_ms keeps running as a session: the output says
    "Process running with session ID N", and write_stdin polls it or types into it (with tty).
    Processes left running in the background are killed when the command exits.
    """
    cwd = resolve_in_workspace(ctx.workspace, args.workdir) if args.workdir else Path(ctx.workspace)
    budget = DEFAULT_MAX_OUTPUT_TOKENS if args.max_output_tokens is None else int(args.max_output_tokens)
    if sessions.available(ctx):  # unified exec sessions hook (toolq/workers/sessions)
        reply = sessions.exec_in_host(args.cmd, shell=args.shell or "bash", cwd=cwd, tty=bool(args.tty),
                                      yield_ms=args.yield_time_ms or DEFAULT_YIELD_MS, ctx=ctx)
        if reply.spawn_errno is not None:
            raise RespondToModel(spawn_failure_text(OSError(reply.spawn_errno, reply.spawn_strerror)))
        return sessions.to_return(reply, min(budget, MAX_OUTPUT_TOKENS_CAP))
    limit = min(exec_command.tool_spec.timeout, ctx.remaining())
    try:
        result = run_command(
            args.cmd,
            cwd=cwd,
            timeout=limit,
            is_cancelled=ctx.cancelled,
            env=dict(os.environ),
            shell=args.shell or "bash",
            sandbox=isolation.current(),
            workspace=ctx.workspace,
            output=ctx.output,
        )
    except isolation.SandboxUnavailable as e:
        raise RespondToModel(f"exec_command refused: {e}") from None
    if result.spawn_error is not None:
        raise RespondToModel(spawn_failure_text(result.spawn_error))
    if result.cancelled:
        raise CallCancelled(f"exec_command cancelled after {result.wall_time:.1f}s")
    content = result.output.decode("utf-8", errors="replace")
    exit_code = result.exit_code
    if result.timed_out:
        content = f"command timed out after {round(limit * 1000)} milliseconds\n" + content
        exit_code = TIMEOUT_EXIT_CODE
    elif result.limit_note:
        content += f"\n[{result.limit_note}]\n"
    text = format_exec_output(content, exit_code, result.wall_time, min(budget, MAX_OUTPUT_TOKENS_CAP))
    return ToolReturn(output=text, success=exit_code == 0, exit_code=exit_code)


def spawn_failure_text(error: OSError) -> str:
    """Codex's text for a process that could not be created, with this OS error."""
    reason = f"{error.strerror or error} (os error {error.errno})"
    return (
        'exec_command failed: CreateProcess { message: "Rejected(\\"Failed to create unified exec process: '
        f'{reason}\\")" }}'
    )
