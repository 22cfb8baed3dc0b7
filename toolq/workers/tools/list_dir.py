"""`list_dir`: a directory tree of the workspace, breadth-limited (Codex's `list_dir`).

Entries are sorted by their path relative to `dir_path`, indented two spaces per level, and marked
`/` (directory), `@` (symlink, never followed) or `?` (other). Unlike Codex, `dir_path` may also be
relative to the workspace. The tree is read through directory fds, each subdirectory opened with
`O_NOFOLLOW` from its parent's fd, so swapping a directory for a symlink cannot lead the listing
out of the workspace. Every entry is held to be sorted, so the entries are charged against the
sandbox's memory limit, and the call's deadline is checked in every directory (`CallBudget`).
"""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import dataclass

from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, tool
from toolq.core.errors import RespondToModel
from toolq.workers.call_budget import CallBudget
from toolq.workers.workspace import Workspace, describe, walk

MAX_ENTRY_BYTES = 500
INDENT = "  "
#: What Python holds for an entry beside its names (the object, its strs, a list slot).
ENTRY_OVERHEAD_BYTES = 256


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
    with Workspace(ctx.workspace) as ws:
        target = ws.locate(args.dir_path)
        lines = [f"Absolute path: {ws.display(target)}"]
        entries: list[_Entry] = []
        try:
            fd = ws.open_dir(target)
            try:
                _collect(fd, args.depth, entries, CallBudget(ctx, "list_dir"))
            finally:
                os.close(fd)
        except OSError as e:
            raise RespondToModel(f"failed to read directory: {describe(e)}") from None
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


def _collect(fd: int, depth: int, entries: list[_Entry], budget: CallBudget) -> None:
    """Add every entry of the tree open at `fd`, `depth` levels deep (the caller sorts them)."""
    with closing(walk(fd, depth)) as directories:
        for _, prefix, found in directories:
            budget.check()
            level = prefix.count("/") + 1 if prefix else 0
            for item in found:
                relative = f"{prefix}/{item.name}" if prefix else item.name
                entries.append(_Entry(_cut(relative), _cut(item.name), level, _marker(item)))
                budget.charge(len(relative) + len(item.name) + ENTRY_OVERHEAD_BYTES, f"listing {len(entries)} entries")


def _marker(item: os.DirEntry[str]) -> str:
    # DirEntry types come from lstat: a symlink is reported as a symlink and never followed.
    if item.is_symlink():
        return "@"
    if item.is_dir(follow_symlinks=False):
        return "/"
    return "" if item.is_file(follow_symlinks=False) else "?"


def _cut(text: str) -> str:
    """The name as valid text (undecodable bytes replaced), at most 500 bytes, whole characters."""
    text = text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
    data = text.encode()
    if len(data) <= MAX_ENTRY_BYTES:
        return text
    return data[:MAX_ENTRY_BYTES].decode("utf-8", errors="ignore")
