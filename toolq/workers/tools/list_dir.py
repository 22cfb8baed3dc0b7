"""`list_dir`: a directory tree of the workspace, breadth-limited (Codex's `list_dir`).

Entries are sorted by their path relative to `dir_path`, indented two spaces per level, and marked
`/` (directory), `@` (symlink, never followed) or `?` (other). Unlike Codex, `dir_path` may also be
relative to the workspace.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, Field

from toolq.orchestrator.errors import RespondToModel
from toolq.workers.catalog import ToolContext, tool
from toolq.workers.workspace import resolve_in_workspace

MAX_ENTRY_BYTES = 500
INDENT = "  "


class ListDirArgs(BaseModel):
    dir_path: str = Field(description="Directory to list, relative to the workspace or absolute inside it.")
    offset: int = Field(default=1, description="The entry number to start listing from (1-indexed).")
    limit: int = Field(default=25, description="The maximum number of entries to return.")
    depth: int = Field(default=2, description="The maximum directory depth to traverse.")


@dataclass
class _Entry:
    sort_key: str
    name: str
    depth: int
    suffix: str


@tool
def list_dir(args: ListDirArgs, ctx: ToolContext) -> str:
    """Lists the entries of a directory in the workspace, with type markers and nested entries indented."""
    if args.offset < 1:
        raise RespondToModel("offset must be a 1-indexed entry number")
    if args.limit < 1:
        raise RespondToModel("limit must be greater than zero")
    if args.depth < 1:
        raise RespondToModel("depth must be greater than zero")
    root = resolve_in_workspace(ctx.workspace, args.dir_path)
    lines = [f"Absolute path: {root}"]
    entries = _collect(root, args.depth)
    if not entries:
        return lines[0]
    entries.sort(key=lambda e: e.sort_key)
    start = args.offset - 1
    if start >= len(entries):
        raise RespondToModel("offset exceeds directory entry count")
    selected = entries[start : start + args.limit]
    lines.extend(f"{INDENT * e.depth}{e.name}{e.suffix}" for e in selected)
    if start + len(selected) < len(entries):
        lines.append(f"More than {len(selected)} entries found")
    return "\n".join(lines)


def _collect(root: os.PathLike[str] | str, depth: int) -> list[_Entry]:
    entries: list[_Entry] = []
    queue: deque[tuple[str, str, int]] = deque([(os.fspath(root), "", depth)])
    while queue:
        directory, prefix, remaining = queue.popleft()
        try:
            with os.scandir(directory) as it:
                found = list(it)
        except OSError as e:
            raise RespondToModel(f"failed to read directory: {e.strerror} (os error {e.errno})") from None
        for item in found:
            relative = f"{prefix}/{item.name}" if prefix else item.name
            # DirEntry types come from lstat: a symlink is reported as a symlink and never followed.
            if item.is_symlink():
                suffix = "@"
            elif item.is_dir(follow_symlinks=False):
                suffix = "/"
                if remaining > 1:
                    queue.append((item.path, relative, remaining - 1))
            elif item.is_file(follow_symlinks=False):
                suffix = ""
            else:
                suffix = "?"
            entries.append(_Entry(_cut(relative), _cut(item.name), prefix.count("/") + 1 if prefix else 0, suffix))
    return entries


def _cut(text: str) -> str:
    """The name as valid text (undecodable bytes replaced), at most 500 bytes, whole characters."""
    text = text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
    data = text.encode()
    if len(data) <= MAX_ENTRY_BYTES:
        return text
    return data[:MAX_ENTRY_BYTES].decode("utf-8", errors="ignore")
