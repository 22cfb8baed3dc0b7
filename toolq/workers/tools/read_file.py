"""`read_file`: numbered lines from a file in the workspace (Codex's `read_file`, slice mode).

Codex removed this tool upstream (contracts §9); toolq keeps its slice mode: lines come back as
`L<n>: <text>`, each cut to 500 bytes. The indentation-aware mode is not offered.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from toolq.orchestrator.errors import RespondToModel
from toolq.workers.catalog import ToolContext, tool
from toolq.workers.workspace import resolve_in_workspace

MAX_LINE_BYTES = 500


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
    path = resolve_in_workspace(ctx.workspace, args.file_path)
    collected: list[str] = []
    seen = 0
    try:
        with open(path, "rb") as f:
            for raw in f:
                seen += 1
                if seen < args.offset:
                    continue
                collected.append(f"L{seen}: {_format_line(raw)}")
                if len(collected) == args.limit:
                    break
    except OSError as e:
        raise RespondToModel(f"failed to read file: {e.strerror} (os error {e.errno})") from None
    if seen < args.offset:
        raise RespondToModel("offset exceeds file length")
    return "\n".join(collected)


def _format_line(raw: bytes) -> str:
    line = raw.removesuffix(b"\n").removesuffix(b"\r")
    text = line.decode("utf-8", errors="replace")
    data = text.encode()
    if len(data) <= MAX_LINE_BYTES:
        return text
    return data[:MAX_LINE_BYTES].decode("utf-8", errors="ignore")  # never split a character
