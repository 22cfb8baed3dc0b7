"""Reading a tree by fd: a walk (`_walk`) that opens each directory with O_NOFOLLOW, one component
at a time, reads files with caps (`_read_file`), and counts a tree's files and bytes (`_Budget`).
Nothing in the tree is followed, even if something else changes it meanwhile."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from toolq.workers.environments.archive.model import MAX_DEPTH, ArchiveError, Kind, Limits, MiB, _short
from toolq.workers.workspace import open_entry

_READ_CHUNK = 1 << 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Node:
    path: str
    parent: int
    """An fd of the directory holding it (valid until the walk moves on)."""
    name: str
    status: os.stat_result
    fd: int | None = None
    """A directory's own fd (O_NOFOLLOW), for its xattrs."""


def _listed(fd: int, path: str, most: int | None) -> list[str]:
    """A directory's names, sorted; past `most` of them, ArchiveError before the rest are read (a
    command's folder of ten million files, listed whole, held gigabytes in the worker)."""
    if most is None:
        return sorted(os.listdir(fd))
    names = []
    with os.scandir(fd) as entries:
        for entry in entries:
            names.append(entry.name)
            if len(names) > most:
                raise ArchiveError(f"{_short(path) or 'the top folder'} holds more than {most} files and folders; "
                                   "TOOLQ_UPLOAD_MAX_FILES raises the cap")
    return sorted(names)


def _walk(root: int, *, descend: Callable[[str], bool] = lambda path: True, most: int | None = None,
          ) -> Iterator[_Node]:
    """Every entry under the directory open at `root`, in `_order`, a directory before its
    members; symlinks are never followed (entries are lstat'ed, directories opened O_NOFOLLOW).
    An unreadable directory raises (a skipped one would read as deleted)."""
    stack: list[tuple[int, str, Iterator[str]]] = [(root, "", iter(_listed(root, "", most)))]
    try:
        while stack:
            fd, rel, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                if fd != root:
                    os.close(fd)
                continue
            path = f"{rel}/{name}" if rel else name
            try:
                status = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(status.st_mode) or not descend(path):
                    yield _Node(path, fd, name, status)
                    continue
                if len(stack) >= MAX_DEPTH:
                    raise ArchiveError(f"{_short(path)} lies deeper than {MAX_DEPTH} folders")  # an fd per level
                sub = open_entry(fd, name, directory=True)
                try:
                    names_below = _listed(sub, path, most)
                except BaseException:
                    os.close(sub)
                    raise
                stack.append((sub, path, iter(names_below)))
            except OSError as e:
                raise OSError(e.errno, e.strerror, path) from None  # named from the top, for the user
            yield _Node(path, fd, name, os.fstat(sub), sub)
    finally:
        for fd, _, _ in stack:
            if fd != root:
                os.close(fd)


def _read_file(parent: int, name: str, path: str, most: int) -> tuple[bytes, os.stat_result]:
    """A regular file's bytes, opened by name under `parent` without following a link; at most
    `most` bytes, or ArchiveError."""
    fd = os.open(name, _READ_FLAGS, dir_fd=parent)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ArchiveError(f"{path} is no longer a regular file")
        data = _read_fd(fd, path, most)
    finally:
        os.close(fd)
    return data, status


def _read_fd(fd: int, path: str, most: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > most:
            raise _TooBig(path)
        chunks.append(chunk)


class _TooBig(ArchiveError):
    """Raised inside a read; the caller says which cap."""


def _kind_of(mode: int) -> Kind | None:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return None


class _Budget:
    """The caps on one tree or tar, counted as it is read."""

    def __init__(self, limits: Limits, what: str) -> None:
        self.limits, self.what = limits, what
        self.files = self.bytes = 0

    def count(self, path: str, size: int = 0) -> None:
        self.files += 1
        self.bytes += size
        if self.files > self.limits.max_files:
            raise ArchiveError(f"{self.what} has more than {self.limits.max_files} files and folders "
                               f"(at {path}); TOOLQ_UPLOAD_MAX_FILES raises the cap")
        if self.bytes > self.limits.max_bytes:
            raise self.too_big(path)

    def left(self) -> int:
        return self.limits.max_bytes - self.bytes

    def too_big(self, path: str) -> ArchiveError:
        return ArchiveError(f"{self.what} holds more than {self.limits.max_bytes // MiB} MB of files "
                            f"(at {path}); TOOLQ_UPLOAD_MAX_MB raises the cap")
