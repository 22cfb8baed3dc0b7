"""The unified diff a turn's outcome carries (`unified_diff`): a delta against its base, as a tar
or as the tree the host unpacked (`BaseTree`), capped in bytes read and compared."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from toolq.core.environments import MAX_PATCH_BYTES, TurnDiff
from toolq.workers.environments.archive.delta import Delta
from toolq.workers.environments.archive.model import (
    ArchiveError,
    Entry,
    Manifest,
    _in_git_dir,
    _is_utf8,
    _order,
    _parents,
)
from toolq.workers.environments.archive.tarfiles import _entry_of, _member_data, _members, manifest_of
from toolq.workers.environments.archive.walk import _DIR_FLAGS, _read_file, _TooBig
from toolq.workers.workspace import open_entry

#: A file larger than this is listed as binary in a diff, not diffed.
MAX_DIFF_FILE = 1 << 20


#: A diff compares this many bytes of files at most (difflib's time grows with them); then it is cut.
MAX_DIFFED_BYTES = 32 << 20


@dataclass(frozen=True)
class BaseTree:
    """A base as a host holds it: unpacked (its read-only cache) with its manifest. `unified_diff`
    reads from it only the files a delta changed or deleted, where a base tar is parsed whole."""

    tree: Path
    manifest: Manifest


def git_shaped(paths: Iterable[str]) -> set[str]:
    """The folders ("" the top) that `paths` (a whole tree's) make look like a git directory to
    git: HEAD beside objects/ and refs/, or beside a `commondir` naming them elsewhere."""
    names: dict[str, set[str]] = {}
    for path in paths:
        for parent, name in ((q.rpartition("/")[0], q.rpartition("/")[2]) for q in (*_parents(path), path)):
            names.setdefault(parent, set()).add(name.lower())
    return {d for d, n in names.items() if "head" in n and ("commondir" in n or {"objects", "refs"} <= n)}


def unified_diff(base: bytes | BaseTree | None, delta: Delta, checkpoint: str = "") -> TurnDiff:
    """The delta as git shows it: a unified diff of its text files (`a/` and `b/`, `/dev/null` for
    an added or deleted file, git's file modes and path quoting), the other files listed as binary
    (and those under `.git`, which no patch should carry), the deleted paths listed; cut at
    MAX_PATCH_BYTES, or once MAX_DIFFED_BYTES of files were compared (truncated set). Symlinks diff
    as their targets, as in git. `base`: the base's tar, or its unpacked tree; None for no base."""
    diff = TurnDiff(checkpoint=checkpoint, deleted=list(delta.deleted))
    out: list[str] = []
    size = diffed = 0
    # A folder the changes leave shaped as a git directory (sub/HEAD, sub/config, sub/objects/,
    # sub/refs/): `git apply` of the patch would make it a repository whose config the user's git
    # obeys. Its files are listed as binary, as those under `.git` are.
    base_paths = base.manifest.keys() if isinstance(base, BaseTree) else manifest_of(base).keys() if base else ()
    gone = set(delta.deleted)
    shaped = git_shaped([*(p for p in base_paths if not any(q in gone for q in (p, *_parents(p)))),
                         *delta.entries, *delta.added, *delta.changed])
    for path, before, after in _file_sides(base, delta):
        old = _text(*before) if before else []
        new = _text(*after) if after else []
        if old is None or new is None or _in_git_dir(path) or any(q in shaped for q in ("", *_parents(path))):
            if after is not None:
                diff.binary.append(path)
            continue
        diffed += (before[0].size if before else 0) + (after[0].size if after else 0)
        if diff.truncated or diffed > MAX_DIFFED_BYTES:
            diff.truncated = True  # difflib's time grows with the files: the checkpoint has them whole
            continue
        encoded = _file_patch(path, before, after, old, new).encode("utf-8", "surrogateescape")
        if len(encoded) > MAX_PATCH_BYTES - size:
            diff.truncated = True
            cut = encoded[:MAX_PATCH_BYTES - size].decode("utf-8", "ignore")
            out.append(cut[:cut.rfind("\n") + 1])  # whole lines only
            continue
        out.append(encoded.decode("utf-8", "surrogateescape"))
        size += len(encoded)
    diff.patch = "".join(out)
    return diff


Side = tuple[Entry, bytes]


def _file_sides(base: bytes | BaseTree | None, delta: Delta) -> Iterator[tuple[str, Side | None, Side | None]]:
    """(path, the base's side, the environment's side) for each file and link the delta changes:
    those in its tar, then those under its deleted paths."""
    base_paths, base_side = _base_lookup(base)
    after_tar = delta.tar or b""
    new_members = _members(after_tar, None, "the delta", links_out=True) if delta.tar else []
    for member in sorted(new_members, key=lambda m: _order(m.name)):
        if member.kind != "dir":
            data = _member_data(after_tar, member) if member.kind == "file" else b""
            yield member.name, base_side(member.name), (_entry_of(member, data), data)
    for path in delta.deleted:
        for gone in sorted((p for p in base_paths if p == path or p.startswith(path + "/")), key=_order):
            before = base_side(gone)
            if before is not None:
                yield gone, before, None


def _base_lookup(base: bytes | BaseTree | None) -> tuple[Iterable[str], Callable[[str], Side | None]]:
    """The base's paths, and its side of a path (None for nothing or a directory)."""
    if isinstance(base, BaseTree):
        tree = base

        def from_tree(path: str) -> Side | None:
            entry = tree.manifest.get(path)
            if entry is None or entry.kind == "dir":
                return None
            if entry.kind == "symlink" or entry.size > MAX_DIFF_FILE:
                return entry, b""  # a big file is binary to the diff: not read
            return entry, _read_in_tree(tree.tree, path, MAX_DIFF_FILE)

        return tree.manifest.keys(), from_tree
    tar = base or b""
    members = {m.name: m for m in _members(tar, None, "the base")} if base else {}

    def from_tar(path: str) -> Side | None:
        member = members.get(path)
        if member is None or member.kind == "dir":
            return None
        data = _member_data(tar, member) if member.kind == "file" else b""
        return _entry_of(member, data), data

    return members.keys(), from_tar


def _read_in_tree(tree: Path, path: str, most: int) -> bytes:
    """A file of an unpacked tree, each component opened O_NOFOLLOW from the tree's fd."""
    parts = path.split("/")
    try:
        fd = os.open(tree, _DIR_FLAGS)
        try:
            for part in parts[:-1]:
                sub = open_entry(fd, part, directory=True)
                os.close(fd)
                fd = sub
            return _read_file(fd, parts[-1], path, most)[0]
        finally:
            os.close(fd)
    except (OSError, _TooBig) as e:
        raise ArchiveError(f"cannot read {path} in the base {tree}: {getattr(e, 'strerror', None) or e}") from None


def _git_mode(entry: Entry) -> str:
    if entry.kind == "symlink":
        return "120000"
    return "100755" if entry.mode & 0o111 else "100644"


def _text(entry: Entry, data: bytes) -> list[str] | None:
    """The lines of a file git would diff as text (a symlink: its target); None for binary."""
    if entry.kind == "symlink":
        data = os.fsencode(entry.target or "")
    if entry.size > MAX_DIFF_FILE or len(data) > MAX_DIFF_FILE or b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


def _file_patch(path: str, before: Side | None, after: Side | None, old: list[str], new: list[str]) -> str:
    a, b = _quoted(f"a/{path}"), _quoted(f"b/{path}")
    head = [f"diff --git {a} {b}\n"]
    if before is None and after is not None:
        head.append(f"new file mode {_git_mode(after[0])}\n")
    elif after is None and before is not None:
        head.append(f"deleted file mode {_git_mode(before[0])}\n")
    elif before is not None and after is not None and _git_mode(before[0]) != _git_mode(after[0]):
        head += [f"old mode {_git_mode(before[0])}\n", f"new mode {_git_mode(after[0])}\n"]
    if old == new:
        return "".join(head) if len(head) > 1 else ""
    hunks = list(difflib.unified_diff(old, new, a if before else "/dev/null", b if after else "/dev/null",
                                      n=3, lineterm="\n"))
    return "".join(head + hunks)


_C_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r", 34: '\\"', 92: "\\\\"}


def _quoted(name: str) -> str:
    """A path as git writes it in a patch: in C quotes when it holds a control character, a quote, a
    backslash (so a newline in a name cannot start a line of the patch) or bytes that are not UTF-8."""
    raw = os.fsencode(name)
    if _is_utf8(name) and not any(byte < 0x20 or byte in (0x22, 0x5C, 0x7F) for byte in raw):
        return name
    out = "".join(_C_ESCAPES.get(byte, f"\\{byte:03o}" if byte < 0x20 or byte == 0x7F else chr(byte))
                  if byte < 0x80 else f"\\{byte:03o}" for byte in raw)
    return f'"{out}"'
