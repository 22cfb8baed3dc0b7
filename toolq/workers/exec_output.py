"""Codex's unified-exec response text: what `exec_command` and `write_stdin` answer, whether the
command ran in the pool child (`tools/exec_command.py`) or in the session host (`sessions/calls.py`)."""

from __future__ import annotations

import secrets

from toolq.core.truncate import TruncationPolicy, approx_token_count, formatted_truncate_text


def format_exec_output(content: str, exit_code: int | None, wall_time: float, max_tokens: int, *,
                       session_id: int | None = None) -> str:
    """Codex's unified-exec response text (docs/reference/codex-behaviour.md#exec_command); with a
    `session_id`, the process is still running."""
    status = (f"Process running with session ID {session_id}" if session_id is not None
              else f"Process exited with code {exit_code}")
    tokens = approx_token_count(content)
    if tokens > max_tokens:
        content = f"Warning: truncated output (original token count: {tokens})\n" + formatted_truncate_text(
            content, TruncationPolicy.tokens(max_tokens)
        )
    return (
        f"Chunk ID: {secrets.token_hex(3)}\n"
        f"Wall time: {wall_time:.4f} seconds\n"
        f"{status}\n"
        f"Original token count: {tokens}\n"
        f"Output:\n{content}"
    )
