"""Example user tools: `toolq worker --tools examples.search_tools --queues search`.

Two tools share the name `search`: `workspace.search` looks inside the workspace's files and the
plain `search` matches their paths. The model sees two different tools, and both go to the
`search` queue, so only workers started with `--queues search` run them. `regex_search` is a
freeform (custom) tool: the model sends a bare regular expression, with no JSON to escape.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Callable, Iterator

from pydantic import BaseModel, Field

from toolq import RespondToModel, ToolContext, tool

QUEUE = "search"
#: Larger files are skipped: a search tool should answer in well under its timeout.
MAX_FILE_BYTES = 1_000_000


class SearchArgs(BaseModel):
    query: str = Field(description="The text to look for (case-insensitive).")
    limit: int = Field(default=20, description="The maximum number of results.")


@tool(name="search", namespace="workspace", queue=QUEUE, timeout=30, idempotent=True)
def search_workspace(args: SearchArgs, ctx: ToolContext) -> str:
    """Searches the contents of the workspace's text files. Returns `path:line: text` per match."""
    needle = _needle(args)
    return _grep(ctx.workspace, lambda line: needle in line.lower(), args.limit)


@tool(queue=QUEUE, timeout=30, idempotent=True)
async def search(args: SearchArgs, ctx: ToolContext) -> str:
    """Finds files in the workspace whose path contains the query. Returns one path per line."""
    needle = _needle(args)
    # Async tools share one event loop per worker process: keep blocking work off it.
    paths = await asyncio.to_thread(lambda: list(_files(ctx.workspace)))
    found = [p for p in paths if needle in p.lower()][: args.limit]
    return "\n".join(found) or "no files match"


@tool(grammar={"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}, queue=QUEUE, timeout=30,
      idempotent=True)
def regex_search(pattern: str, ctx: ToolContext) -> str:
    """Searches the workspace's text files for a Python regular expression. This is a FREEFORM tool:
    send the bare pattern, not JSON. Returns `path:line: text` per match."""
    try:
        rx = re.compile(pattern.rstrip("\n"))
    except re.error as e:
        raise RespondToModel(f"invalid regular expression: {e}") from None
    return _grep(ctx.workspace, lambda line: rx.search(line) is not None, limit=50)


def _needle(args: SearchArgs) -> str:
    # Short, lowercase messages naming the bad input: the model reads them and tries again.
    if not args.query.strip():
        raise RespondToModel("query must not be empty")
    if args.limit < 1:
        raise RespondToModel("limit must be greater than zero")
    return args.query.lower()


def _files(root: Path) -> Iterator[str]:
    """Workspace-relative paths of regular files, sorted, skipping hidden entries (`.git`, `.venv`)."""
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith("."):
                yield os.path.relpath(os.path.join(directory, name), root)


def _grep(root: Path, matches: Callable[[str], bool], limit: int) -> str:
    hits: list[str] = []
    for rel in _files(root):
        path = root / rel
        if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if matches(line):
                hits.append(f"{rel}:{number}: {line}")
                if len(hits) == limit:
                    return "\n".join(hits)
    return "\n".join(hits) or "no matches"
