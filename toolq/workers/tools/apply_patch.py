"""`apply_patch`: Codex's freeform patch tool (docs/reference/codex-behaviour.md#apply_patch).

The model sends the patch envelope as a custom tool call's raw `input`. The whole patch is parsed
and checked against the files first (every path confined to the workspace); nothing is written
unless every hunk applies. Error texts follow Codex's `apply_patch verification failed: ...`.

Files are read and written through the workspace's directory fd (`toolq.workers.workspace`): only
regular files, never one with another hard link, never anything under `.git` (git runs commands
named in `.git/config`). Verification checks each of these before anything is written, and each
write checks them again on the file it opened.

A file is patched in memory (its text and a list of its lines), in the pool process, outside the
sandbox: what that needs is charged against the sandbox's memory limit before the file is split
(`CallBudget`), and matching checks the call's deadline, so a huge file or a pattern that almost
matches everywhere ends in the model's error instead of gigabytes and minutes of a worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from toolq.core.catalog import ToolContext, tool
from toolq.core.errors import RespondToModel
from toolq.workers.call_budget import CallBudget
from toolq.workers.reading import read_at_most
from toolq.workers.workspace import Target, Workspace, describe

BEGIN_PATCH = "*** Begin Patch"
END_PATCH = "*** End Patch"
ADD_FILE = "*** Add File: "
DELETE_FILE = "*** Delete File: "
UPDATE_FILE = "*** Update File: "
MOVE_TO = "*** Move to: "
END_OF_FILE = "*** End of File"
CONTEXT = "@@ "
EMPTY_CONTEXT = "@@"
#: A file to update is read whole; a larger one is refused rather than exhausting the worker.
MAX_FILE_BYTES = 64 * 1024 * 1024
#: Memory a file being patched holds per byte (its bytes, its text, the new text, encoded, with
#: room for a text that Python stores at 4 bytes a character) and per line (a str and its slot in
#: the list); measured at up to 24 bytes per byte for a file of 2-character lines.
BYTES_PER_BYTE = 6
BYTES_PER_LINE = 80
#: How many places a pattern is tried at between two checks of the deadline.
CHECK_EVERY = 4096

#: The envelope as a Lark grammar, for the model's constrained sampling.
GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.+)/? LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.+)/? LF
eof_line: "*** End of File" LF

%import common.LF
"""

# Codex's words (the model was trained on them): a long first line, kept whole.
DESCRIPTION = """Use the `apply_patch` tool to edit files. This is a FREEFORM tool: send the patch text itself, not JSON.

A patch is an envelope of file operations:

*** Begin Patch
*** Add File: <path>        (then every line of the new file, each prefixed with +)
*** Delete File: <path>
*** Update File: <path>     (optionally followed by *** Move to: <new path>)
@@ <optional line to locate the change, e.g. a function header>
 context line (prefixed with a space)
-removed line
+added line
*** End of File             (optional: the change touches the end of the file)
*** End Patch

Paths are relative to the workspace. Give about three lines of context around each change; repeat @@ to
make several changes in one file."""


@dataclass
class Chunk:
    context: str | None
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)
    end_of_file: bool = False


@dataclass
class AddFile:
    path: str
    contents: str


@dataclass
class DeleteFile:
    path: str


@dataclass
class UpdateFile:
    path: str
    move_to: str | None
    chunks: list[Chunk]


Hunk = AddFile | DeleteFile | UpdateFile


class PatchError(Exception):
    """A reason the patch cannot be applied, in Codex's words."""


@tool(grammar={"type": "grammar", "syntax": "lark", "definition": GRAMMAR}, description=DESCRIPTION, parallel=False,
      view="file_change")
def apply_patch(patch: str, ctx: ToolContext) -> str:
    budget = CallBudget(ctx, "apply_patch")
    with Workspace(ctx.workspace) as ws:
        try:
            hunks = parse_patch(patch)
            writes, summary = verify(hunks, ws, budget)
        except PatchError as e:
            raise RespondToModel(f"apply_patch verification failed: {e}") from None
        try:
            commit(ws, writes)
        except OSError as e:
            raise RespondToModel(f"apply_patch failed: {describe(e)}") from None
    return "Exit code: 0\nWall time: 0 seconds\nOutput:\n" + summary


# --- parsing (Codex's lenient parser) ----------------------------------------------------------


def parse_patch(text: str) -> list[Hunk]:
    lines = [line.removesuffix("\r") for line in text.strip().split("\n")]
    lines = _strip_heredoc(lines)
    body = lines[1:-1]
    hunks: list[Hunk] = []
    line_number = 2
    while body:
        hunk, used = _parse_hunk(body, line_number)
        hunks.append(hunk)
        line_number += used
        body = body[used:]
    return hunks


def _strip_heredoc(lines: list[str]) -> list[str]:
    """Accept a patch still wrapped in `<<'EOF' ... EOF`, as Codex's lenient mode does."""
    error = _boundary_error(lines)
    if error is None:
        return lines
    if len(lines) >= 4 and lines[0] in ("<<EOF", "<<'EOF'", '<<"EOF"') and lines[-1].endswith("EOF"):
        inner = lines[1:-1]
        if (inner_error := _boundary_error(inner)) is None:
            return inner
        raise PatchError(inner_error)
    raise PatchError(error)


def _boundary_error(lines: list[str]) -> str | None:
    first, last = lines[0].strip(), lines[-1].strip()
    if first != BEGIN_PATCH:
        return "invalid patch: The first line of the patch must be '*** Begin Patch'"
    if len(lines) < 2 or last != END_PATCH:
        return "invalid patch: The last line of the patch must be '*** End Patch'"
    return None


def _hunk_error(line_number: int, message: str) -> PatchError:
    return PatchError(f"invalid hunk at line {line_number}, {message}")


def _parse_hunk(lines: list[str], line_number: int) -> tuple[Hunk, int]:
    first = lines[0].strip()
    if first.startswith(ADD_FILE):
        contents = []
        for line in lines[1:]:
            if not line.startswith("+"):
                break
            contents.append(line[1:] + "\n")
        return AddFile(first[len(ADD_FILE) :], "".join(contents)), 1 + len(contents)
    if first.startswith(DELETE_FILE):
        return DeleteFile(first[len(DELETE_FILE) :]), 1
    if first.startswith(UPDATE_FILE):
        path = first[len(UPDATE_FILE) :]
        used = 1
        move_to = None
        if len(lines) > 1 and lines[1].startswith(MOVE_TO):
            move_to = lines[1][len(MOVE_TO) :]
            used += 1
        chunks: list[Chunk] = []
        while used < len(lines):
            line = lines[used]
            if not line.strip():  # blank lines may separate chunks
                used += 1
                continue
            if line.startswith("*"):
                break
            chunk, n = _parse_chunk(lines[used:], line_number + used, allow_missing_context=not chunks)
            chunks.append(chunk)
            used += n
        if not chunks:
            raise _hunk_error(line_number, f"Update file hunk for path '{path}' is empty")
        return UpdateFile(path, move_to, chunks), used
    raise _hunk_error(
        line_number,
        f"'{first}' is not a valid hunk header. Valid hunk headers: "
        "'*** Add File: {path}', '*** Delete File: {path}', '*** Update File: {path}'",
    )


def _parse_chunk(lines: list[str], line_number: int, allow_missing_context: bool) -> tuple[Chunk, int]:
    if lines[0] == EMPTY_CONTEXT:
        chunk, start = Chunk(None), 1
    elif lines[0].startswith(CONTEXT):
        chunk, start = Chunk(lines[0][len(CONTEXT) :]), 1
    elif allow_missing_context:
        chunk, start = Chunk(None), 0
    else:
        raise _hunk_error(line_number, f"Expected update hunk to start with a @@ context marker, got: '{lines[0]}'")
    if start >= len(lines):
        raise _hunk_error(line_number + 1, "Update hunk does not contain any lines")
    parsed = 0
    for line in lines[start:]:
        if line == END_OF_FILE:
            if parsed == 0:
                raise _hunk_error(line_number + 1, "Update hunk does not contain any lines")
            chunk.end_of_file = True
            parsed += 1
            break
        marker, rest = line[:1], line[1:]
        if marker == "":  # an empty line is an empty context line
            chunk.old_lines.append("")
            chunk.new_lines.append("")
        elif marker == " ":
            chunk.old_lines.append(rest)
            chunk.new_lines.append(rest)
        elif marker == "+":
            chunk.new_lines.append(rest)
        elif marker == "-":
            chunk.old_lines.append(rest)
        elif parsed == 0:
            raise _hunk_error(
                line_number + 1,
                f"Unexpected line found in update hunk: '{line}'. Every line should start with "
                "' ' (context line), '+' (added line), or '-' (removed line)",
            )
        else:
            break  # the start of the next chunk
        parsed += 1
    return chunk, start + parsed


# --- verification: every change computed in memory before anything is written -----------------


#: What a patch does to each file, by its path in the workspace: new text, or None to delete it.
Writes = dict[PurePosixPath, tuple[Target, str | None]]


def verify(hunks: list[Hunk], ws: Workspace, budget: CallBudget | None = None) -> tuple[Writes, str]:
    """The files to write (None = delete), in order, and Codex's summary of them; `budget` bounds
    the memory and time they take."""
    if not hunks:
        raise PatchError("No files were modified.")
    state: Writes = {}  # the files as they will be after the hunks so far
    added: list[str] = []
    modified: list[str] = []
    deleted: list[str] = []
    try:
        for hunk in hunks:
            target = ws.locate(hunk.path)
            if isinstance(hunk, AddFile):
                _check_writable(ws, target)
                state[target.rel] = (target, hunk.contents)
                added.append(hunk.path)
            elif isinstance(hunk, DeleteFile):
                _read(ws, state, target, "Failed to read", budget)
                ws.check_removable(target)
                state[target.rel] = (target, None)
                deleted.append(hunk.path)
            else:
                original = _read(ws, state, target, "Failed to read file to update", budget)
                new = apply_chunks(original, hunk.chunks, ws.display(target), budget.check if budget else None)
                if hunk.move_to is not None:
                    dest = ws.locate(hunk.move_to)
                    _check_writable(ws, dest)
                    ws.check_removable(target)
                    state[target.rel] = (target, None)
                    state[dest.rel] = (dest, new)
                    modified.append(hunk.move_to)
                else:
                    _check_writable(ws, target)
                    state[target.rel] = (target, new)
                    modified.append(hunk.path)
    except RespondToModel as e:  # a path out of the workspace, into .git, or with other hard links
        raise PatchError(e.message) from None
    summary = "Success. Updated the following files:\n" + "".join(
        f"{kind} {p}\n" for kind, paths in (("A", added), ("M", modified), ("D", deleted)) for p in paths
    )
    return state, summary


def _check_writable(ws: Workspace, target: Target) -> None:
    try:
        ws.check_writable(target)
    except OSError as e:
        raise PatchError(f"Failed to write file {ws.display(target)}: {describe(e)}") from None


def _read(ws: Workspace, state: Writes, target: Target, context: str, budget: CallBudget | None) -> str:
    path = ws.display(target)
    if target.rel in state:
        content = state[target.rel][1]
        if content is None:
            raise PatchError(f"{context} {path}: No such file or directory (os error 2)")
        return content
    try:
        fd, _ = ws.open_file(target)
        try:
            cap = MAX_FILE_BYTES if budget is None else min(MAX_FILE_BYTES, budget.memory // BYTES_PER_BYTE)
            data = read_at_most(fd, cap + 1)
        finally:
            os.close(fd)
        if len(data) > cap:
            raise PatchError(f"{context} {path}: larger than {_mib(cap)} MiB"
                             + ("" if cap == MAX_FILE_BYTES or budget is None
                                else f": the sandbox limits a call to {_mib(budget.memory)} MiB"))
        if budget is not None:  # before the text is split: the lines are where the memory goes
            try:
                budget.charge(len(data) * BYTES_PER_BYTE + data.count(b"\n") * BYTES_PER_LINE,
                              f"patching {len(data)} bytes")
            except RespondToModel as e:
                raise PatchError(f"{context} {path}: {e.message}") from None
        return data.decode("utf-8")  # bytes: keep CRLF line endings as they are
    except OSError as e:
        raise PatchError(f"{context} {path}: {describe(e)}") from None
    except UnicodeDecodeError:
        raise PatchError(f"{context} {path}: stream did not contain valid UTF-8") from None


def _mib(n: int) -> int:
    return n // (1024 * 1024)


def apply_chunks(original: str, chunks: list[Chunk], path: Path, check: Callable[[], None] | None = None) -> str:
    """The file's new text after the chunks (Codex's `compute_replacements` + `apply_replacements`);
    `check` runs as matching goes (the call's deadline)."""
    lines = original.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline is not a line of its own
    replacements: list[tuple[int, int, list[str]]] = []
    index = 0
    for chunk in chunks:
        if chunk.context is not None:
            found = seek_sequence(lines, [chunk.context], index, eof=False, check=check)
            if found is None:
                raise PatchError(f"Failed to find context '{chunk.context}' in {path}")
            index = found + 1
        if not chunk.old_lines:  # a pure addition goes at the end of the file
            at = len(lines) - 1 if lines and lines[-1] == "" else len(lines)
            replacements.append((at, 0, chunk.new_lines))
            continue
        pattern, new = chunk.old_lines, chunk.new_lines
        found = seek_sequence(lines, pattern, index, chunk.end_of_file, check)
        if found is None and pattern[-1] == "":
            # A trailing empty line stands for the file's final newline: retry without it.
            pattern = pattern[:-1]
            if new and new[-1] == "":
                new = new[:-1]
            found = seek_sequence(lines, pattern, index, chunk.end_of_file, check)
        if found is None:
            raise PatchError(f"Failed to find expected lines in {path}:\n" + "\n".join(chunk.old_lines))
        replacements.append((found, len(pattern), new))
        index = found + len(pattern)
    for start, length, new in sorted(replacements, key=lambda r: r[0], reverse=True):
        lines[start : start + length] = new
    if not lines or lines[-1] != "":
        lines.append("")
    return "\n".join(lines)


_PUNCTUATION = str.maketrans(
    {
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
        **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f", '"'),
        **dict.fromkeys("\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000", " "),
    }
)


def seek_sequence(lines: list[str], pattern: list[str], start: int, eof: bool,
                  check: Callable[[], None] | None = None) -> int | None:
    """Where `pattern` occurs in `lines` at or after `start`, matched ever more forgivingly:
    exactly, then ignoring trailing whitespace, then surrounding whitespace, then also typographic
    punctuation. With `eof`, a match at the very end of the file is tried first. `check` runs
    every CHECK_EVERY places (a pattern that almost matches everywhere takes len(lines) x
    len(pattern) comparisons)."""
    if not pattern:
        return start
    if len(pattern) > len(lines):
        return None
    last = len(lines) - len(pattern)
    starts = [last, start] if eof else [start]
    for normalise in (
        lambda s: s,
        str.rstrip,
        str.strip,
        lambda s: s.strip().translate(_PUNCTUATION),
    ):
        want = [normalise(p) for p in pattern]
        for first in starts:
            for i in range(first, last + 1):
                if check is not None and i % CHECK_EVERY == 0:
                    check()
                if all(normalise(lines[i + k]) == want[k] for k in range(len(pattern))):
                    return i
    return None


def commit(ws: Workspace, writes: Writes) -> None:
    for target, content in writes.values():
        if content is None:
            ws.unlink(target)
            continue
        ws.write_file(target, content.encode("utf-8"))
