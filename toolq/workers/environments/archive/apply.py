"""A turn's changes applied back to the user's folder (`apply_delta`): each path applied or
refused with its reason (`ApplyReport`), through confined fd opens, never into a git directory."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path

from toolq.core.environments import Checkpoint
from toolq.workers.environments.archive.model import (
    DEFAULT_LIMITS,
    OUTSIDE,
    ApplyReport,
    ArchiveError,
    Entry,
    Limits,
    Manifest,
    _checked_name,
    _in_git_dir,
    _Links,
    _order,
    _parents,
)
from toolq.workers.environments.archive.tarfiles import _entry_of, _Member, _member_data, _members
from toolq.workers.environments.archive.walk import _CREATE_FLAGS, _DIR_FLAGS, _READ_CHUNK, _READ_FLAGS, _kind_of
from toolq.workers.workspace import PROTECTED_DIR, open_entry


def apply_delta(target: Path, base: Manifest, checkpoint: Checkpoint, delta_tar: bytes | None,
                limits: Limits = DEFAULT_LIMITS) -> ApplyReport:
    """Apply a checkpoint's changes to the user's folder `target` (the folder uploaded as `base`).

    A path is applied only where the folder still holds what was uploaded: one changed there
    meanwhile (content, mode or kind; for an added path, anything there) is refused and listed, as
    is anything under `.git`, any path through a symlink in the folder, and a symlink leading out.
    Files are written to a temporary name in their directory and renamed over (atomic), through
    directory fds opened O_NOFOLLOW; deletions remove only what still equals the base."""
    members = sorted(_members(delta_tar, limits, "the checkpoint", links_out=True),
                     key=lambda m: _order(m.name)) if delta_tar else []
    try:
        root = os.open(target, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError as e:
        raise ArchiveError(f"cannot open {target}: {e.strerror}") from None
    applier = _Applier(root, target, base, delta_tar or b"")
    try:
        for raw in sorted(checkpoint.deleted, key=_order):
            name = _checked_name(raw, "deleted path")
            if name is not None:
                applier.delete(name)
        applier.git_like = applier.git_shaped_dirs(members)
        links = {p: e.target or "" for p, e in base.items() if e.kind == "symlink" and p not in applier.removed}
        links.update({m.name: m.info.linkname for m in members if m.kind == "symlink"})
        resolver = _Links(links)
        for member in members:
            applier.write(member, resolver)
    finally:
        os.close(root)
    return applier.report


class _Refused(Exception):
    pass


def _is_git_dir(fd: int) -> bool:
    """What git takes for a repository's directory (HEAD, objects/, refs/), whatever its name: a
    bare repository or a `gitdir:` target inside the folder, whose hooks and config git would obey."""
    try:
        return (stat.S_ISREG(os.stat("HEAD", dir_fd=fd, follow_symlinks=False).st_mode)
                and all(stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                        for name in ("objects", "refs")))
    except OSError:
        return False


class _Applier:
    def __init__(self, root: int, target: Path, base: Manifest, tar: bytes) -> None:
        self.root, self.target, self.base, self.tar = root, target, base, tar
        self.report = ApplyReport()
        self.removed: set[str] = set()
        self.refused_dirs: set[str] = set()
        self.git_like: set[str] = set()

    def refuse(self, path: str, reason: str) -> None:
        self.report.refused.append((path, reason))

    def _parent(self, path: str, *, create: bool = False) -> int:
        """An fd of `path`'s directory, each component opened O_NOFOLLOW (a symlink on the way is
        refused); missing ones made if `create`."""
        fd = os.dup(self.root)
        try:
            for part in path.split("/")[:-1]:
                if _is_git_dir(fd):
                    raise _Refused("it is inside a git directory")
                try:
                    sub = open_entry(fd, part, directory=True)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    sub = open_entry(fd, part, directory=True)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _Refused("it lies under a symlink or a file in the folder") from None
                    raise
                os.close(fd)
                fd = sub
            if _is_git_dir(fd):
                raise _Refused("it is inside a git directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _current(self, parent: int, name: str) -> Entry | None:
        """What the folder holds at `name` now, as a manifest entry (None if nothing)."""
        try:
            status = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        kind = _kind_of(status.st_mode)
        mode = stat.S_IMODE(status.st_mode) & 0o777
        if kind == "dir":
            return Entry("dir", mode)
        if kind == "symlink":
            return Entry("symlink", 0o777, target=os.readlink(name, dir_fd=parent))
        if kind == "file":
            fd = os.open(name, _READ_FLAGS, dir_fd=parent)
            try:
                digest = hashlib.sha256()
                size = 0
                while chunk := os.read(fd, _READ_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                return Entry("file", stat.S_IMODE(os.fstat(fd).st_mode) & 0o777, size, digest.hexdigest())
            finally:
                os.close(fd)
        return Entry("file", -1)  # a FIFO or device: never equal to anything uploaded

    def git_shaped_dirs(self, members: list[_Member]) -> set[str]:
        """Folders ("" the top) the checkpoint's files would leave looking like a git directory to
        git (HEAD beside objects/ and refs/, or beside a `commondir` naming them elsewhere): written
        one by one, `sub/config` lands before `sub/refs` makes `sub` a bare repository, whose config
        (core.pager, aliases) the user's git in `sub` would obey. Nothing goes under one."""
        names: dict[str, set[str]] = {}
        for member in members:
            parent, _, name = member.name.rpartition("/")
            names.setdefault(parent, set()).add(name.lower())
        shaped = set()
        for folder, adding in names.items():
            final = adding | {n.lower() for n in self._names_in(folder)
                              if (f"{folder}/{n}" if folder else n) not in self.removed}
            if "head" in final and ("commondir" in final or {"objects", "refs"} <= final):
                shaped.add(folder)
        return shaped

    def _names_in(self, folder: str) -> list[str]:
        """What the user's folder holds now in `folder` (nothing if it is missing or not reached
        without a link)."""
        try:
            fd = self._parent(f"{folder}/x" if folder else "x")
        except (OSError, _Refused):
            return []
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def _guard(self, path: str) -> None:
        if _in_git_dir(path):
            raise _Refused(f"it is inside a `{PROTECTED_DIR}` directory")
        for folder in ("", *_parents(path)):
            if folder in self.git_like:
                raise _Refused(f"it would make {folder or 'the folder'} a git directory, whose config and hooks "
                               "git obeys")
        for parent in _parents(path):
            if parent in self.refused_dirs:
                raise _Refused(f"its folder {parent} was not applied")

    def delete(self, path: str) -> None:
        """Remove `path` (a directory with everything under it) where it still equals the base."""
        try:
            self._guard(path)
            if path not in self.base:
                return
            under = sorted((p for p in self.base if p == path or p.startswith(path + "/")), key=_order, reverse=True)
            for gone in under:
                self._delete_one(gone)
            if path in self.removed:
                self.report.applied.append(path)
        except _Refused as e:
            self.refuse(path, str(e))
        except OSError as e:
            self.refuse(path, e.strerror or str(e))

    def _delete_one(self, path: str) -> None:
        try:
            parent = self._parent(path)
        except FileNotFoundError:
            self.removed.add(path)
            return
        except _Refused as e:
            self.refuse(path, str(e))
            return
        name = path.rpartition("/")[2]
        try:
            now = self._current(parent, name)
            if now is None:
                self.removed.add(path)
                return
            if now != self.base[path]:
                self.refuse(path, f"it changed in {self.target} since the upload")
                return
            if now.kind == "dir":
                try:
                    os.rmdir(name, dir_fd=parent)
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    self.refuse(path, f"it holds files added in {self.target} since the upload")
                    return
            else:
                os.unlink(name, dir_fd=parent)
            self.removed.add(path)
        finally:
            os.close(parent)

    def write(self, member: _Member, links: _Links) -> None:
        path = member.name
        try:
            self._guard(path)
            if member.kind == "symlink" and (why := links.why_out(path)):
                raise _Refused(f"the symlink {why}" + (f" {self.target}" if why == OUTSIDE else ""))
            parent = self._parent(path, create=True)
            try:
                if self._write_at(parent, member):
                    self.report.applied.append(path)
            finally:
                os.close(parent)
        except _Refused as e:
            if member.kind == "dir":
                self.refused_dirs.add(path)
            self.refuse(path, str(e))
        except OSError as e:
            if member.kind == "dir":
                self.refused_dirs.add(path)
            self.refuse(path, e.strerror or str(e))

    def _write_at(self, parent: int, member: _Member) -> bool:
        """Write one member where the folder still holds the base's entry; whether anything changed."""
        path, name = member.name, member.name.rpartition("/")[2]
        data = _member_data(self.tar, member) if member.kind == "file" else b""
        wanted = _entry_of(member, data)
        now = self._current(parent, name)
        if now == wanted:
            return False
        was = None if path in self.removed else self.base.get(path)
        if now != was:
            if was is None:
                raise _Refused(f"it exists in {self.target} but was not in the upload")
            raise _Refused(f"it changed in {self.target} since the upload")
        if member.kind == "dir":
            if now is not None and now.kind != "dir":
                os.unlink(name, dir_fd=parent)
            if now is None or now.kind != "dir":
                os.mkdir(name, 0o700, dir_fd=parent)
            fd = open_entry(parent, name, directory=True)
            try:
                os.fchmod(fd, wanted.mode)
            finally:
                os.close(fd)
            return True
        if now is not None and now.kind == "dir":
            os.rmdir(name, dir_fd=parent)  # its base members were deleted first; ENOTEMPTY if more came
        temp = f".toolq-apply-{secrets.token_hex(6)}"
        if member.kind == "symlink":
            os.symlink(member.info.linkname, temp, dir_fd=parent)
        else:
            fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=parent)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, wanted.mode)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(temp, dir_fd=parent)
                raise
            os.close(fd)
        try:
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            os.unlink(temp, dir_fd=parent)
            raise
        return True
