"""`grep_files`: which files in the workspace contain a regex (Codex's `grep_files`).

Codex shells out to `rg --files-with-matches --sortr=modified`; toolq searches in Python with the
same visible behaviour: matching paths (absolute), most recently modified first, or
`No matches found.`. Like rg's defaults it skips hidden files and directories, binary files (a
NUL byte) and symlinks, which are never followed. Unlike rg it does not read `.gitignore`, and
the pattern is a Python regular expression.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from pathlib import Path

from pydantic import BaseModel, Field

from toolq.orchestrator.errors import RespondToModel
from toolq.workers.catalog import ToolContext, ToolReturn, tool
from toolq.workers.sandbox import CallCancelled
from toolq.workers.workspace import resolve_in_workspace

MAX_LIMIT = 2000
#: Codex gives rg 30 s.
SEARCH_TIMEOUT = 30.0


class GrepFilesArgs(BaseModel):
    pattern: str = Field(description="Regular expression to search for.")
    include: str | None = Field(
        default=None, description='Optional glob of the files to search (e.g. "*.py", "*.{ts,tsx}").'
    )
    path: str | None = Field(default=None, description="Directory or file to search; defaults to the workspace.")
    limit: int = Field(default=100, description="Maximum number of file paths to return (at most 2000).")


@tool
def grep_files(args: GrepFilesArgs, ctx: ToolContext) -> ToolReturn:
    """Finds the files whose contents match a regular expression, most recently modified first."""
    pattern = args.pattern.strip()
    if not pattern:
        raise RespondToModel("pattern must not be empty")
    if args.limit < 1:
        raise RespondToModel("limit must be greater than zero")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise RespondToModel(f"invalid regex `{pattern}`: {e}") from None
    root = resolve_in_workspace(ctx.workspace, args.path or ".")
    if not os.path.lexists(root):
        raise RespondToModel(f"unable to access `{root}`: No such file or directory (os error 2)")
    include = _expand_braces(args.include.strip()) if args.include and args.include.strip() else None
    deadline = time.monotonic() + min(SEARCH_TIMEOUT, ctx.remaining())
    matches: list[tuple[float, str]] = []
    for path in _candidates(root, include):
        if ctx.cancelled():
            raise CallCancelled("grep_files cancelled")
        if time.monotonic() > deadline:
            raise RespondToModel(f"grep_files timed out after {SEARCH_TIMEOUT:.0f} seconds")
        if _contains(path, regex):
            try:
                matches.append((os.stat(path).st_mtime, path))
            except OSError:
                continue
    if not matches:
        return ToolReturn(output="No matches found.", success=False)
    matches.sort(key=lambda m: (-m[0], m[1]))
    return ToolReturn(output="\n".join(p for _, p in matches[: min(args.limit, MAX_LIMIT)]))


def _candidates(root: Path, include: list[str] | None):
    if root.is_file():
        if _included(root.name, root.name, include):
            yield str(root)
        return
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = os.path.join(directory, name)
            if name.startswith(".") or os.path.islink(path):
                continue
            if _included(name, os.path.relpath(path, root), include):
                yield path


def _included(name: str, relative: str, include: list[str] | None) -> bool:
    if include is None:
        return True
    # As in rg, a glob without a slash matches the file name at any depth.
    return any(fnmatch.fnmatchcase(relative if "/" in g else name, g) for g in include)


def _contains(path: str, regex: re.Pattern[str]) -> bool:
    try:
        with open(path, "rb") as f:
            for raw in f:
                if b"\0" in raw:
                    return False  # binary: rg stops searching it
                if regex.search(raw.decode("utf-8", errors="replace").rstrip("\r\n")):
                    return True
    except OSError:
        pass  # unreadable files are skipped, like rg --no-messages
    return False


def _expand_braces(glob: str) -> list[str]:
    """`*.{ts,tsx}` -> `*.ts`, `*.tsx` (rg globs allow alternatives; fnmatch does not)."""
    match = re.search(r"\{([^{}]*)\}", glob)
    if match is None:
        return [glob]
    head, tail = glob[: match.start()], glob[match.end() :]
    return [g for alt in match.group(1).split(",") for g in _expand_braces(head + alt + tail)]
