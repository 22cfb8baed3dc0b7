"""A checked tar -> files (`extract`). Writes go through directory fds opened with O_NOFOLLOW, one
component at a time, with O_CREAT|O_EXCL: nothing in the destination is followed, even if
something else changes it meanwhile."""

from __future__ import annotations

import os
from pathlib import Path

from toolq.workers.environments.archive.model import DEFAULT_LIMITS, ArchiveError, Entry, Limits, Manifest, _order
from toolq.workers.environments.archive.tarfiles import _entry_of, _Member, _member_data, _members
from toolq.workers.environments.archive.walk import _CREATE_FLAGS, _DIR_FLAGS
from toolq.workers.workspace import open_entry


class _Dirs:
    """Directory fds along the path being written, each opened O_NOFOLLOW from its parent's; a
    directory's final mode is set when the writer leaves it (so a read-only one is filled first)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.stack: list[tuple[str, int, int | None]] = []  # (path, fd, mode to set on leaving)

    def enter(self, path: str, mode: int | None = None) -> int:
        """The fd of directory `path` (its parents opened or made on the way)."""
        while self.stack and not (path == self.stack[-1][0] or path.startswith(self.stack[-1][0] + "/")):
            self._leave()
        if self.stack and self.stack[-1][0] == path:
            if mode is not None:
                self.stack[-1] = (path, self.stack[-1][1], mode)
            return self.stack[-1][1]
        here = self.stack[-1][0] if self.stack else ""
        rest = path[len(here):].lstrip("/").split("/")
        for i, part in enumerate(rest):
            parent = self.stack[-1][1] if self.stack else self.root
            made = False
            try:
                os.mkdir(part, 0o700, dir_fd=parent)
                made = True
            except FileExistsError:
                pass
            fd = open_entry(parent, part, directory=True)
            sub = f"{here}/{'/'.join(rest[:i + 1])}".lstrip("/")
            last = i == len(rest) - 1
            # a directory the tar holds no member for gets the usual mode
            self.stack.append((sub, fd, mode if last and mode is not None else 0o755 if made else None))
        return self.stack[-1][1]

    def parent_of(self, path: str) -> int:
        parent = path.rpartition("/")[0]
        return self.enter(parent) if parent else self._to_root()

    def _to_root(self) -> int:
        while self.stack:
            self._leave()
        return self.root

    def _leave(self) -> None:
        _, fd, mode = self.stack.pop()
        try:
            if mode is not None:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def close(self) -> None:
        while self.stack:
            self._leave()


def extract(tar: bytes, dest: Path, limits: Limits = DEFAULT_LIMITS) -> Manifest:
    """Unpack an untrusted tar into `dest`, an empty directory the caller made (and removes if this
    raises). Every member is checked first (`_members`); then each is written through directory fds
    opened O_NOFOLLOW, files created O_EXCL|O_NOFOLLOW, modes without suid/sgid/sticky, and the bytes
    written are counted against the caps again. Returns the tar's manifest (`manifest_of`)."""
    members = sorted(_members(tar, limits), key=lambda m: _order(m.name))
    try:
        root = os.open(dest, _DIR_FLAGS)
    except OSError as e:
        raise ArchiveError(f"cannot open {dest}: {e.strerror}") from None
    dirs = _Dirs(root)
    written = 0
    manifest: Manifest = {}
    try:
        if os.listdir(root):
            raise ArchiveError(f"{dest} is not empty")
        for member in members:
            try:
                manifest[member.name] = entry = _write_member(tar, member, dirs, limits.max_bytes - written)
            except OSError as e:
                raise ArchiveError(f"cannot unpack {member.name}: {e.strerror}") from None
            written += entry.size
        try:
            dirs.close()
        except OSError as e:
            raise ArchiveError(f"cannot unpack {dest}: {e.strerror}") from None
    finally:
        try:
            dirs.close()
        finally:
            os.close(root)
    return manifest


def _write_member(tar: bytes, member: _Member, dirs: _Dirs, room: int) -> Entry:
    """Write one checked member into a fresh tree; its manifest entry."""
    mode = member.info.mode & 0o777
    if member.kind == "dir":
        dirs.enter(member.name, mode)
        return _entry_of(member)
    parent = dirs.parent_of(member.name)
    name = member.name.rpartition("/")[2]
    if member.kind == "symlink":
        os.symlink(member.info.linkname, name, dir_fd=parent)
        return _entry_of(member)
    data = _member_data(tar, member)
    if len(data) != member.info.size or len(data) > room:
        raise ArchiveError(f"the archive's member {member.name} holds more bytes than the caps allow")
    fd = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=parent)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return _entry_of(member, data)
