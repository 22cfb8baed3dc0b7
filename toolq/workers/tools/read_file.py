"""`read_file`: numbered lines from a file in the workspace (Codex's `read_file`, slice mode).

Codex removed this tool upstream (docs/reference/codex-behaviour.md#tools); toolq keeps its slice
mode: lines come back as `L<n>: <text>`, each cut to 500 bytes (Codex's `MAX_LINE_LENGTH`). The
indentation-aware mode is not offered. Only a regular file is read (a FIFO or device gets an
error, never a blocked call), and in chunks: a line is never held longer than needed to print it,
the deadline is checked as the file is read, and the lines kept are charged against the sandbox's
memory limit (`limit` is the model's: a billion empty lines would otherwise be held as a billion
strings).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, tool
from toolq.core.errors import RespondToModel
from toolq.workers.call_budget import CallBudget
from toolq.workers.reading import bounded_lines
from toolq.workers.workspace import Workspace, describe

MAX_LINE_BYTES = 500
#: Bytes of a line kept to print its first MAX_LINE_BYTES: a UTF-8 character is at most 4 bytes,
#: and every byte read prints as at least one byte.
_KEEP_BYTES = MAX_LINE_BYTES + 4
#: What Python holds for a line kept beside its text (a str and its slot in the list).
LINE_OVERHEAD_BYTES = 64


class ReadFileArgs(BaseModel):
    file_path: str = Field(description="Path of the file to read, relative to the workspace or absolute inside it.")
    offset: int = Field(default=1, description="The line number to start reading from (1-indexed).")
    limit: int = Field(default=2000, description="The maximum number of lines to return.")


@tool
def read_file(args: ReadFileArgs, ctx: ToolContext) -> str:
    """Reads a file in the workspace and returns its lines prefixed with their numbers (`L<n>: `)."""
    if args.offset < 1:
        raise RespondToModel("offset must be a 1-indexed line number")
    if args.limit < 1:
        raise RespondToModel("limit must be greater than zero")
    collected: list[str] = []
    seen = 0
    budget = CallBudget(ctx, "read_file")
    try:
        with Workspace(ctx.workspace) as ws:
            fd, _ = ws.open_file(ws.locate(args.file_path))
        try:
            for raw in bounded_lines(fd, _KEEP_BYTES, budget.check):
                seen += 1
                if seen < args.offset:
                    continue
                collected.append(f"L{seen}: {_format_line(raw)}")
                budget.charge(len(collected[-1]) + LINE_OVERHEAD_BYTES, f"reading {len(collected)} lines")
                if len(collected) == args.limit:
                    break
        finally:
            os.close(fd)
    except OSError as e:
        raise RespondToModel(f"failed to read file: {describe(e)}") from None
    if seen < args.offset:
        raise RespondToModel("offset exceeds file length")
    return "\n".join(collected)


def _format_line(raw: bytes) -> str:
    line = raw.removesuffix(b"\r")
    text = line.decode("utf-8", errors="replace")
    data = text.encode()
    if len(data) <= MAX_LINE_BYTES:
        return text
    return data[:MAX_LINE_BYTES].decode("utf-8", errors="ignore")  # never split a character
