"""`grep_files`: which files in the workspace contain a regex (Codex's `grep_files`).

Codex shells out to `rg --files-with-matches --sortr=modified`; toolq searches in Python with the
same visible behaviour: matching paths (absolute), most recently modified first, or
`No matches found.`. Like rg's defaults it skips hidden files and directories, binary files (a
NUL byte), non-regular files and symlinks, which are never followed. Unlike rg it does not read
`.gitignore`.

A hostile model chooses the pattern, the glob and the files, so every cost is bounded:
- the pattern is RE2 syntax, matched in linear time (as rg's regex crate): backreferences and
  lookaround, which need backtracking, are refused;
- the tree is walked through directory fds, each entry opened `O_NOFOLLOW | O_NONBLOCK` from its
  directory's fd, so a FIFO never blocks and a swapped symlink never leads out;
- files are read in chunks, a line longer than `MAX_LINE_BYTES` is searched in its first
  `MAX_LINE_BYTES`, and the deadline is checked on every chunk;
- brace alternatives in `include` expand to at most `MAX_GLOBS` globs;
- the matching paths held are charged against the sandbox's memory limit (`CallBudget`).
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from contextlib import closing
from dataclasses import dataclass

import re2
from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, ToolReturn, tool
from toolq.core.errors import RespondToModel
from toolq.workers.call_budget import CallBudget
from toolq.workers.reading import line_blocks
from toolq.workers.workspace import Workspace, describe, open_entry, walk

MAX_LIMIT = 2000
#: Codex gives rg 30 s.
SEARCH_TIMEOUT = 30.0
#: A longer line is searched in its first 8 MiB (rg would hold the whole line in memory).
MAX_LINE_BYTES = 8 * 1024 * 1024
#: `*.{a,b}{c,d}` is 4 globs; 20 such pairs would be a million.
MAX_GLOBS = 1024
MAX_BRACE_DEPTH = 32
#: What Python holds for a matching path beside its text (a tuple, a float, a str, a list slot).
MATCH_OVERHEAD_BYTES = 160

#: RE2's errors for what only a backtracking engine can do (lookaround, possessive repeats).
_BACKTRACKING_ONLY = ("invalid perl operator", "bad repetition operator")
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the model's error, answered to it; not a log line
_BLOCK_OPTIONS = re2.Options()
_BLOCK_OPTIONS.log_errors = False
_BLOCK_OPTIONS.never_nl = True


class GrepFilesArgs(BaseModel):
    pattern: str = Field(description="Regular expression to search for (RE2 syntax, as rg).")
    include: str | None = Field(
        default=None, description='Optional glob of the files to search (e.g. "*.py", "*.{ts,tsx}").'
    )
    path: str | None = Field(default=None, description="Directory or file to search; defaults to the workspace.")
    limit: int = Field(default=100, description="Maximum number of file paths to return (at most 2000).")


class _Binary(Exception):
    """The file holds a NUL byte: rg stops searching it."""


@dataclass
class _Search:
    regex: re2._Regexp
    include: _Include | None
    budget: CallBudget
    prefilter: re2._Regexp | None = None
    """The pattern over a block of lines at once (one call per megabyte, not per line): with
    `never_nl` no match can span lines, so no block match means no line matches."""

    def may_match(self, block: bytes) -> bool:
        return self.prefilter is None or self.prefilter.search(block) is not None

    def check(self, chunk: bytes) -> None:
        """Run on every chunk read: the call's cancel and deadline, and rg's binary test."""
        self.budget.check()
        if b"\0" in chunk:
            raise _Binary


@tool
def grep_files(args: GrepFilesArgs, ctx: ToolContext) -> ToolReturn:
    """Finds the files whose contents match a regular expression, most recently modified first."""
    pattern = args.pattern.strip()
    if not pattern:
        raise RespondToModel("pattern must not be empty")
    if args.limit < 1:
        raise RespondToModel("limit must be greater than zero")
    include = _Include(args.include.strip()) if args.include and args.include.strip() else None
    search = _Search(compile_pattern(pattern), include, CallBudget(ctx, "grep_files", seconds=SEARCH_TIMEOUT),
                     _block_prefilter(pattern))
    matches: list[tuple[float, str]] = []
    with Workspace(ctx.workspace) as ws:
        target = ws.locate(args.path or ".")
        root = ws.display(target)
        try:
            fd = ws.open(target, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise RespondToModel(f"unable to access `{root}`: {describe(e)}") from None
        try:
            status = os.fstat(fd)
            if stat.S_ISDIR(status.st_mode):
                try:
                    _search_tree(fd, str(root), search, matches)
                except OSError:
                    pass  # the directory cannot be listed: nothing found, like rg --no-messages
            elif include is None or include.matches(target.rel.name, target.rel.name):
                _search_file(fd, str(root), search, matches)
        finally:
            os.close(fd)
    if not matches:
        return ToolReturn(output="No matches found.", success=False)
    matches.sort(key=lambda m: (-m[0], m[1]))
    return ToolReturn(output="\n".join(p for _, p in matches[: min(args.limit, MAX_LIMIT)]))


def compile_pattern(pattern: str) -> re2._Regexp:
    """The pattern as RE2, or the model's error naming what RE2 does not allow."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if isinstance(e.args[0], bytes) else str(e.args[0])
        if reason.startswith(_BACKTRACKING_ONLY) or re.match(r"invalid escape sequence: \\[1-9]", reason):
            reason += " (grep_files matches in linear time, as rg does: no backreferences or lookaround)"
        raise RespondToModel(f"invalid regex `{pattern}`: {reason}") from None


def _block_prefilter(pattern: str) -> re2._Regexp | None:
    """None where a block search could miss a line's match: `\\A`/`\\z` (a line's start and end
    are not the block's), flag groups (`(?-m)`), and `$` (a line is matched without its `\\r`)."""
    if any(s in pattern for s in ("\\A", "\\z", "(?", "$")):
        return None
    return re2.compile("(?m)" + pattern, _BLOCK_OPTIONS)


def _search_tree(fd: int, root: str, search: _Search, matches: list[tuple[float, str]]) -> None:
    """Search each directory's files, then its subdirectories (in name order), hidden ones skipped.
    (`os.fwalk` opens a subdirectory without O_NOFOLLOW or O_NONBLOCK: one swapped for a symlink
    to a FIFO would block it; `walk` never does.)"""
    with closing(walk(fd, enter=lambda entry: not entry.name.startswith("."))) as directories:
        for dir_fd, relative_dir, entries in directories:
            for entry in entries:
                name = entry.name
                relative = f"{relative_dir}/{name}" if relative_dir else name
                if (not name.startswith(".") and entry.is_file(follow_symlinks=False)
                        and (search.include is None or search.include.matches(name, relative))):
                    _search_entry(dir_fd, name, f"{root}/{relative}", search, matches)


def _search_entry(dir_fd: int, name: str, path: str, search: _Search, matches: list[tuple[float, str]]) -> None:
    try:
        fd = open_entry(dir_fd, name)
    except OSError:
        return  # a symlink (ELOOP), or unreadable: skipped, like rg --no-messages
    try:
        _search_file(fd, path, search, matches)
    finally:
        os.close(fd)


def _search_file(fd: int, path: str, search: _Search, matches: list[tuple[float, str]]) -> None:
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        return  # a FIFO, socket or device: never read
    search.check(b"")
    try:
        for block in line_blocks(fd, MAX_LINE_BYTES, search.check):
            if search.may_match(block) and any(search.regex.search(line.removesuffix(b"\r"))
                                               for line in block.split(b"\n")):
                search.budget.charge(len(path) + MATCH_OVERHEAD_BYTES, f"{len(matches) + 1} matching paths")
                matches.append((status.st_mtime, path))
                return
    except _Binary:
        return
    except OSError:
        return  # unreadable files are skipped, like rg --no-messages


class _Include:
    """The `include` glob, brace alternatives expanded (rg globs allow them; fnmatch does not)."""

    def __init__(self, glob: str) -> None:
        globs = expand_braces(glob)
        # As in rg, a glob without a slash matches the file name at any depth.
        self._by_name = _any_of([g for g in globs if "/" not in g])
        self._by_path = _any_of([g for g in globs if "/" in g])

    def matches(self, name: str, relative: str) -> bool:
        return bool(
            (self._by_name is not None and self._by_name.match(name))
            or (self._by_path is not None and self._by_path.match(relative))
        )


def _any_of(globs: list[str]) -> re.Pattern[str] | None:
    # fnmatch's translations match in linear time (no nested quantifiers); one regex for them all.
    return re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None


def expand_braces(glob: str) -> list[str]:
    """`*.{ts,tsx}` -> `*.ts`, `*.tsx` (nested groups too; an unmatched brace is literal).

    The number of globs is computed before any is built, so `{a,b}` x 40 is refused at once.
    """
    pairs = _matching_braces(glob)
    sequence = _parse(glob, 0, len(glob), pairs)
    count = _count(sequence)
    if count > MAX_GLOBS:
        raise RespondToModel(f"include glob `{glob}` expands to more than {MAX_GLOBS} globs")
    return _generate(sequence)


#: A glob is a sequence of literal text and brace groups; a group is a list of alternative sequences.
_Sequence = list["str | list[_Sequence]"]


def _matching_braces(glob: str) -> dict[int, int]:
    """Each `{` that has a matching `}`, by position; refused if nested beyond MAX_BRACE_DEPTH."""
    pairs: dict[int, int] = {}
    open_at: list[int] = []
    for i, c in enumerate(glob):
        if c == "{":
            open_at.append(i)
        elif c == "}" and open_at:
            pairs[open_at.pop()] = i
    depth = 0
    closes = set(pairs.values())
    for i in range(len(glob)):
        if i in pairs:
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                raise RespondToModel(f"include glob `{glob}` nests braces more than {MAX_BRACE_DEPTH} deep")
        elif i in closes:
            depth -= 1
    return pairs


def _parse(glob: str, start: int, end: int, pairs: dict[int, int]) -> _Sequence:
    sequence: _Sequence = []
    i = start
    while i < end:
        if i not in pairs:
            literal_end = i + 1
            while literal_end < end and literal_end not in pairs:
                literal_end += 1
            sequence.append(glob[i:literal_end])
            i = literal_end
            continue
        close = pairs[i]
        alternatives, alt_start, j = [], i + 1, i + 1
        while j < close:
            if j in pairs:
                j = pairs[j] + 1  # a nested group's commas are its own
            elif glob[j] == ",":
                alternatives.append(_parse(glob, alt_start, j, pairs))
                alt_start = j = j + 1
            else:
                j += 1
        alternatives.append(_parse(glob, alt_start, close, pairs))
        sequence.append(alternatives)
        i = close + 1
    return sequence


def _count(sequence: _Sequence) -> int:
    total = 1
    for part in sequence:
        if isinstance(part, list):
            total *= sum(_count(alt) for alt in part)
            total = min(total, MAX_GLOBS + 1)  # enough to refuse; keeps the numbers small
    return total


def _generate(sequence: _Sequence) -> list[str]:
    globs = [""]
    for part in sequence:
        if isinstance(part, str):
            globs = [g + part for g in globs]
        else:
            options = [g for alt in part for g in _generate(alt)]
            globs = [g + o for g in globs for o in options]
    return globs
