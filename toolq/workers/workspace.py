"""Where file tools may touch the machine: model-named paths confined to the workspace, by fd.

A hostile model can change the tree between a check and an open (with `exec_command`, or a
parallel call), so the file tools never check a path string and open it later. Every file is
opened relative to a directory fd of the workspace, and the kernel's answer is what counts:

- `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (Linux >= 5.6) resolves the whole path and
  refuses, atomically, any `..` or symlink that would leave the directory; symlinks that stay
  inside are followed.
- Where the kernel lacks it (or for an absolute symlink that points back inside, which
  RESOLVE_BENEATH refuses), a walk opens one component at a time with `O_NOFOLLOW` from the
  directory fd, reads each symlink itself and splices its target into the walk. Each fd it holds
  was a real directory inside the tree when it was opened; an attacker who can only write inside
  the workspace cannot move one out.

Then, on the fd: only regular files are read (opened `O_NONBLOCK`, so a FIFO never blocks), a file
with another hard link is never written (it would rewrite a file elsewhere), and nothing under a
`.git` directory is written (git runs commands named in `.git/config`; Codex's workspace-write
sandbox keeps `.git` read-only too). Reading through a hard link is allowed: it reads a file the
worker can already read, linked by someone who could already name it.

`resolve_in_workspace` is the old string check, kept for `exec_command`'s working directory: a
process's cwd is a path, and the process sandbox confines what the command can reach.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from toolq.core.errors import RespondToModel
from toolq.core.libc import libc as _libc

T = TypeVar("T")

#: `openat2`'s number; new syscalls share one number on every architecture but alpha.
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
#: As the kernel: a path may follow at most 40 symlinks.
MAX_SYMLINKS = 40
#: Directories that file tools never write into, at any depth.
PROTECTED_DIR = ".git"
_EAGAIN_RETRIES = 8
_DIRECTORY_ON_THE_WAY = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]




def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """The `openat2(2)` system call; raises OSError as `os.open` does."""
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, resolve)
    encoded = os.fsencode(path)
    fd = _libc.syscall(
        ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(encoded), ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def _kernel_has_openat2() -> bool:
    root = os.open("/", os.O_PATH | os.O_CLOEXEC)
    try:
        os.close(openat2(root, ".", os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_BENEATH))
    except OSError:  # ENOSYS on old kernels, EPERM under some seccomp profiles
        return False
    finally:
        os.close(root)
    return True


#: Whether this machine resolves with `openat2`; tests set it to False to exercise the walk.
USE_OPENAT2 = _kernel_has_openat2()


class NotARegularFile(OSError):
    """The path names a FIFO, socket or device: file tools read and write regular files only."""

    def __init__(self, mode: int) -> None:
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a regular file")
        super().__init__(f"not a regular file ({kind})")


def describe(error: OSError) -> str:
    """An OS error as Codex prints one: `No such file or directory (os error 2)`."""
    return f"{error.strerror} (os error {error.errno})" if error.errno else str(error)


class _Escape(Exception):
    """The path leads out of the workspace (turned into the model's message by the caller)."""


@dataclass(frozen=True)
class Target:
    """A model-named path, checked lexically: `rel` is relative to the workspace root."""

    given: str
    rel: PurePosixPath


class Workspace:
    """A call's workspace as an open directory; every file tool reaches files through it.

    Use as a context manager (the directory fd is closed on exit). `root` is the resolved
    workspace path, used in the texts the model sees.
    """

    def __init__(self, workspace: Path | str) -> None:
        self.root = Path(workspace).resolve()
        self._bases = _bases_of(workspace)
        self.fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    # --- naming ----------------------------------------------------------------------------

    def locate(self, path: str) -> Target:
        """`path` checked as text: no NUL, no `..`, absolute only inside the workspace."""
        return Target(path, _lexical(path, self.root, self._bases))

    def display(self, target: Target | PurePosixPath) -> Path:
        """The absolute path the model is shown for a target (as named, symlinks not resolved)."""
        return self.root / (target.rel if isinstance(target, Target) else target)

    def _inside(self, absolute: PurePosixPath) -> PurePosixPath | None:
        return _relative_to_any(absolute, self._bases)

    # --- opening ---------------------------------------------------------------------------

    def open(self, target: Target, flags: int = os.O_PATH) -> int:
        """An fd for `target`, symlinks inside the workspace followed, any way out refused."""
        try:
            return self._resolve(target.rel, flags)
        except _Escape:
            raise RespondToModel(
                f"path `{target.given}` leads outside the workspace `{self.root}` through a symlink"
            ) from None

    def open_file(self, target: Target) -> tuple[int, os.stat_result]:
        """A regular file opened for reading, and its status (IsADirectoryError, NotARegularFile)."""
        fd = self.open(target, os.O_RDONLY | os.O_NONBLOCK)
        return fd, _checked(fd, regular_status)

    def open_dir(self, target: Target) -> int:
        """A directory opened for listing."""
        return self.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)

    def _resolve(self, rel: PurePosixPath, flags: int, mode: int = 0) -> int:
        flags |= os.O_CLOEXEC
        if USE_OPENAT2:
            for _ in range(_EAGAIN_RETRIES):
                try:
                    return openat2(self.fd, str(rel), flags, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
                except OSError as e:
                    if e.errno == errno.EXDEV:
                        break  # a way out, or an absolute symlink back in: the walk tells them apart
                    if e.errno != errno.EAGAIN:  # EAGAIN: a rename raced the lookup; try again
                        raise
        return self._walk(rel.parts, flags, mode)

    def _walk(self, parts: tuple[str, ...], flags: int, mode: int) -> int:  # noqa: C901 - path resolution, as the kernel's
        """Open `parts` one component at a time with O_NOFOLLOW, resolving symlinks here."""
        todo = list(parts)
        held: list[int] = []  # the directories below the root on the current path
        links = 0
        try:
            while todo:
                name = todo.pop(0)
                if name in ("", "."):
                    continue
                if name == "..":
                    if not held:
                        raise _Escape
                    os.close(held.pop())
                    continue
                here = held[-1] if held else self.fd
                if not todo:  # the last component
                    try:
                        fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
                    except OSError as e:
                        target = _link_or_raise(here, name, e)
                    else:
                        if not flags & os.O_PATH or not stat.S_ISLNK(os.fstat(fd).st_mode):
                            return fd
                        os.close(fd)  # O_PATH | O_NOFOLLOW opened the symlink itself: follow it
                        target = _link_or_raise(here, name, OSError(errno.ELOOP, os.strerror(errno.ELOOP)))
                else:
                    try:
                        held.append(os.open(name, _DIRECTORY_ON_THE_WAY, dir_fd=here))
                        continue
                    except OSError as e:
                        target = _link_or_raise(here, name, e)
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                if target is None:
                    todo.insert(0, name)
                elif target.startswith("/"):
                    inside = self._inside(PurePosixPath(target))
                    if inside is None:
                        raise _Escape
                    while held:
                        os.close(held.pop())
                    todo[:0] = inside.parts
                else:
                    todo[:0] = target.split("/")
            return os.open(".", flags, mode, dir_fd=held[-1] if held else self.fd)
        finally:
            for fd in held:
                os.close(fd)

    # --- writing (apply_patch) ---------------------------------------------------------------

    def check_writable(self, target: Target) -> None:
        """Raise unless `target` may be written: not under `.git`, and if it exists, a regular
        file with no other hard link. Writes nothing (apply_patch verifies before it writes)."""
        self._refuse_protected_name(target)
        try:
            fd = self.open(target, os.O_PATH)
        except FileNotFoundError:
            self._nearest_directory(target, target.rel.parent)
            self._refuse_dangling_link(target)
            return
        try:
            self._check_file_for_writing(fd, target)
        finally:
            os.close(fd)

    def _refuse_dangling_link(self, target: Target) -> None:
        """A missing file may still be a name: a symlink to nothing, which `open_for_writing` would
        refuse (O_NOFOLLOW) after earlier files were written. Refuse it now instead."""
        try:
            parent = self.open(Target(target.given, target.rel.parent), os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return  # the directory is missing too: the name is free
        try:
            if stat.S_ISLNK(os.stat(target.rel.name, dir_fd=parent, follow_symlinks=False).st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        except FileNotFoundError:
            pass
        finally:
            os.close(parent)

    def check_removable(self, target: Target) -> None:
        """Raise unless the name `target` may be removed: its directory is not under `.git`."""
        self._refuse_protected_name(target)
        os.close(self._directory(target, target.rel.parent, create=False))

    def open_for_writing(self, target: Target) -> int:
        """`target` opened for writing (not truncated), created with its missing parent
        directories if absent; refused as `check_writable` refuses."""
        self._refuse_protected_name(target)
        try:
            fd = self.open(target, os.O_WRONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            parent = self._directory(target, target.rel.parent, create=True)
            try:
                fd = os.open(target.rel.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             0o666, dir_fd=parent)
            finally:
                os.close(parent)
        _checked(fd, lambda fd: self._check_file_for_writing(fd, target))
        return fd

    def unlink(self, target: Target) -> None:
        """Remove the name `target` (a symlink itself, not what it points to); absent is fine."""
        self._refuse_protected_name(target)
        try:
            parent = self._directory(target, target.rel.parent, create=False)
        except FileNotFoundError:
            return
        try:
            os.unlink(target.rel.name, dir_fd=parent)
        except FileNotFoundError:
            pass
        finally:
            os.close(parent)

    def write_file(self, target: Target, data: bytes) -> None:
        """`target`'s content replaced by `data` (created, with its missing parents, if absent);
        refused as `check_writable` refuses, checked again on the fd it writes."""
        with open(self.open_for_writing(target), "wb") as f:
            f.truncate(0)
            f.write(data)

    def make_directory(self, target: Target, *, parents: bool) -> None:
        """Directory `target` made (FileExistsError if the name is taken; with `parents`, an existing
        directory is fine and missing parents are made); never under `.git`."""
        self._refuse_protected_name(target)
        if parents:
            os.close(self._directory(target, target.rel, create=True))
            return
        parent = self.directory_of(target)
        try:
            os.mkdir(target.rel.name, 0o777, dir_fd=parent)
        finally:
            os.close(parent)

    def directory_of(self, target: Target) -> int:
        """An O_PATH fd of the directory holding the name `target` (symlinks inside followed), checked
        not to be a `.git`; the name itself is not looked at (a symlink stays a symlink)."""
        if not target.rel.parts:
            raise RespondToModel("the workspace's root has no directory holding it here")
        return self._directory(target, target.rel.parent, create=False)

    def _directory(self, target: Target, rel: PurePosixPath, *, create: bool) -> int:
        """An O_PATH fd of directory `rel`, checked not protected; missing ones made if `create`."""
        try:
            fd = self.open(Target(target.given, rel), os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create or rel == rel.parent:
                raise
            up = self._directory(target, rel.parent, create=True)
            try:
                try:
                    os.mkdir(rel.name, 0o777, dir_fd=up)
                except FileExistsError:
                    pass
                fd = os.open(rel.name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=up)
            finally:
                os.close(up)
        _checked(fd, lambda fd: self._refuse_protected_location(fd, target))
        return fd

    def _nearest_directory(self, target: Target, rel: PurePosixPath) -> None:
        """Check the deepest existing ancestor of a file still to be created."""
        while True:
            try:
                os.close(self._directory(target, rel, create=False))
                return
            except FileNotFoundError:
                if rel == rel.parent:
                    raise
                rel = rel.parent

    def _check_file_for_writing(self, fd: int, target: Target) -> None:
        status = regular_status(fd)
        if status.st_nlink > 1:
            raise RespondToModel(
                f"path `{target.given}` has {status.st_nlink} hard links: writing it would change a file "
                "elsewhere too, so it is not written"
            )
        self._refuse_protected_location(fd, target)

    def _refuse_protected_name(self, target: Target) -> None:
        if _names_a_git_dir(target.rel.parts):
            raise _protected(target)

    def _refuse_protected_location(self, fd: int, target: Target) -> None:
        """Where the fd really is (symlinks resolved, by the kernel's record of it): not under a
        `.git`, however it is spelt, nor under a git directory of another name (the one a `.git`
        file names, `gitdir: ../modules/x`), which git reads as it reads `.git`."""
        real = PurePosixPath(os.readlink(f"/proc/self/fd/{fd}"))
        where = self._inside(real)
        if where is None:
            raise RespondToModel(f"path `{target.given}` leads outside the workspace `{self.root}` through a symlink")
        if _names_a_git_dir(where.parts):
            raise _protected(target)
        if any(_is_git_dir(str(d)) for d in (real, *real.parents[:len(where.parts)])):
            raise _protected(target)


def _checked(fd: int, check: Callable[[int], T]) -> T:
    """`check(fd)`'s result; the fd is closed if the check raises."""
    try:
        return check(fd)
    except BaseException:
        os.close(fd)
        raise


def _link_or_raise(here: int, name: str, error: OSError) -> str | None:
    """The target of symlink `name`, which O_NOFOLLOW refused; None if `name` has just become a
    directory (look it up again); `error` if it is no symlink."""
    if error.errno not in (errno.ELOOP, errno.ENOTDIR):
        raise error
    try:
        return os.readlink(name, dir_fd=here)
    except OSError:
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=here, follow_symlinks=False).st_mode):
                return None  # swapped back between the open and the readlink
        except OSError:
            pass
        raise error from None  # not a symlink: a file where a directory was named


def _names_a_git_dir(parts: tuple[str, ...]) -> bool:
    """A `.git` among `parts`, in any case (`.GIT` is `.git` on a case-insensitive file system)."""
    return any(part.lower() == PROTECTED_DIR for part in parts)


def _is_git_dir(path: str) -> bool:
    """What git itself takes for a repository's directory: HEAD, objects/ and refs/."""
    return (os.path.isfile(os.path.join(path, "HEAD")) and os.path.isdir(os.path.join(path, "objects"))
            and os.path.isdir(os.path.join(path, "refs")))


def _protected(target: Target) -> RespondToModel:
    return RespondToModel(f"path `{target.given}` is inside a `{PROTECTED_DIR}` directory, "
                          "which file tools do not change")


def open_entry(dir_fd: int, name: str, *, directory: bool = False) -> int:
    """Entry `name` of an open directory, for a tree walk: never through a symlink (ELOOP), and a
    FIFO swapped in since the listing opens without blocking (O_NONBLOCK); check its type on the fd."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    return os.open(name, flags, dir_fd=dir_fd)


def walk(top: int, depth: int | None = None, enter: Callable[[os.DirEntry[str]], bool] = lambda entry: True,
         ) -> Generator[tuple[int, str, list[os.DirEntry[str]]], None, None]:
    """Each directory of the tree open at `top`, top-down and depth-first in name order: its fd,
    its path relative to `top` ("" for `top`), and its entries sorted by name (types from lstat).

    Subdirectories are opened with `open_entry` from their parent's fd, so the walk never follows a
    symlink nor blocks on a FIFO swapped in, and goes `depth` levels deep at most (1: `top` only);
    those `enter` refuses are skipped. A subdirectory that cannot be opened or listed is skipped; an
    error listing `top` is raised. Iterative: a deep tree costs an fd per level, not a stack frame.
    Close the generator (`contextlib.closing`) to close the fds of an unfinished walk at once.
    """

    def listing(fd: int) -> list[os.DirEntry[str]]:
        with os.scandir(fd) as it:
            return sorted(it, key=lambda entry: entry.name)

    def subdirectories(entries: list[os.DirEntry[str]], level: int) -> Iterator[os.DirEntry[str]]:
        if depth is not None and level >= depth:
            return iter(())
        return iter([e for e in entries if e.is_dir(follow_symlinks=False) and enter(e)])

    entries = listing(top)
    yield top, "", entries
    stack = [(top, "", 1, subdirectories(entries, 1))]
    try:
        while stack:
            fd, relative, level, pending = stack[-1]
            entry = next(pending, None)
            if entry is None:
                stack.pop()
                if fd != top:
                    os.close(fd)
                continue
            try:
                sub = open_entry(fd, entry.name, directory=True)
            except OSError:
                continue  # swapped for a symlink since the listing, or unreadable
            try:
                entries = listing(sub)
            except OSError:
                os.close(sub)
                continue
            sub_relative = f"{relative}/{entry.name}" if relative else entry.name
            stack.append((sub, sub_relative, level + 1, subdirectories(entries, level + 1)))
            yield sub, sub_relative, entries
    finally:
        for fd, *_ in stack:
            if fd != top:
                os.close(fd)


def regular_status(fd: int) -> os.stat_result:
    """The fd's status, if it is a regular file; IsADirectoryError or NotARegularFile otherwise."""
    status = os.fstat(fd)
    if stat.S_ISDIR(status.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    if not stat.S_ISREG(status.st_mode):
        raise NotARegularFile(status.st_mode)
    return status


def _bases_of(workspace: Path | str) -> tuple[PurePosixPath, PurePosixPath]:
    """The workspace as resolved and as configured (it may itself sit under a symlink)."""
    return PurePosixPath(Path(workspace).resolve()), PurePosixPath(os.path.abspath(workspace))


def _relative_to_any(absolute: PurePosixPath, bases: tuple[PurePosixPath, ...]) -> PurePosixPath | None:
    for base in bases:
        if absolute == base or absolute.is_relative_to(base):
            return absolute.relative_to(base)
    return None


def _lexical(path: str, root: Path, bases: tuple[PurePosixPath, ...]) -> PurePosixPath:
    """`path` relative to the workspace, checked as text only."""
    if "\0" in path:
        raise RespondToModel(f"path `{path}` contains a NUL byte")
    given = PurePosixPath(path)
    if ".." in given.parts:
        raise RespondToModel(f"path `{path}` is not allowed: `..` components may not be used")
    if not given.is_absolute():
        return PurePosixPath(*given.parts)
    rel = _relative_to_any(PurePosixPath(os.path.normpath(given)), bases)
    if rel is None:
        raise RespondToModel(f"path `{path}` is outside the workspace `{root}`")
    return rel


def resolve_in_workspace(workspace: Path, path: str) -> Path:
    """The fully resolved path that `path` names, which must lie inside `workspace`.

    Relative paths resolve against the workspace; absolute paths must already point inside it.
    `..` components are refused outright, and so is a path whose symlinks lead out. A string
    check: for a process's working directory only (file tools use `Workspace`).
    """
    root = Path(workspace).resolve()
    resolved = (root / _lexical(path, root, _bases_of(workspace))).resolve()
    if not (resolved == root or resolved.is_relative_to(root)):
        raise RespondToModel(f"path `{path}` leads outside the workspace `{root}` through a symlink")
    return resolved
