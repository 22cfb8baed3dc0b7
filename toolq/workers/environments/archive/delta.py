"""An environment's changes against its base (`tree_delta`, `Delta`): a walk of the environment
(or of an overlay's upper directory) compared with the base's manifest, the added and changed
members packed into one tar."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from toolq.core.environments import Checkpoint
from toolq.workers.environments.archive.model import (
    DEFAULT_LIMITS,
    ArchiveError,
    Entry,
    Kind,
    Limits,
    Manifest,
    _is_utf8,
    _Links,
    _order,
    _parents,
    _shown,
)
from toolq.workers.environments.archive.tarfiles import _tar_of, manifest_of
from toolq.workers.environments.archive.walk import (
    _DIR_FLAGS,
    _READ_CHUNK,
    _READ_FLAGS,
    _Budget,
    _kind_of,
    _Node,
    _read_file,
    _TooBig,
    _walk,
)
from toolq.workers.workspace import PROTECTED_DIR

#: What overlayfs marks in an upper dir, by the namespace of its attributes: `trusted` as root,
#: `user` where it is mounted with `userxattr` (unprivileged, in the host's namespace). Only the
#: mount's own are read: the other names are a command's to set (`user.*` through a root's overlay)
#: and mean nothing to overlayfs.
_OPAQUE, _WHITEOUT = "overlay.opaque", "overlay.whiteout"
#: A metacopy file holds no data and a redirected directory holds another's: the upper dir alone
#: would not tell the changes, so an overlay with them is refused (the host mounts without both).
_METACOPY, _REDIRECT = "overlay.metacopy", "overlay.redirect"


@dataclass
class Delta:
    """An environment's changes against its base. `added` lists new files and links (and a new
    directory only when nothing new is under it), `changed` what differs in content, mode or kind,
    `deleted` what is gone (a directory once, nothing under it). `tar` holds every added and
    changed member, new directories included (None when there are none); `entries` is its manifest."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    tar: bytes | None = None
    entries: Manifest = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """What the commands left that a checkpoint cannot carry, one line each: sockets, FIFOs and
    devices, symlinks leading out of the environment, names that are not UTF-8."""

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, tar: bytes | None) -> Delta:
        return cls(added=list(checkpoint.added), changed=list(checkpoint.changed), deleted=list(checkpoint.deleted),
                   tar=tar, entries=manifest_of(tar) if tar else {})


def tree_delta(base: Manifest, env_dir: Path, *, upper: Path | None = None, xattrs: str = "trusted",
               limits: Limits = DEFAULT_LIMITS) -> Delta:
    """The environment's changes against its base manifest. Copy mode (`upper` None): `env_dir` is
    walked whole and compared with the base (size first, then sha256). Overlay mode: only the
    overlay's upper dir is walked: a 0/0 character device (or a file marked so) is a whiteout, an
    opaque directory hides the base under it, a file copied up unchanged is no change; `xattrs`
    names the namespace of the mount's own attributes ("trusted", or "user" with `userxattr`).
    Nothing is followed; the caps count what the delta carries."""
    top = upper if upper is not None else env_dir
    try:
        root = os.open(top, _DIR_FLAGS)
    except OSError as e:
        raise ArchiveError(f"cannot open {top}: {e.strerror}") from None
    scan = _Scan(base, _Budget(limits, "the environment's changes"), f"{xattrs}.")
    most = len(base) + limits.max_files  # what a base and a delta within the caps can hold
    try:
        # The workspace's own `.git` is never a change: no upload carries it, and the sandbox keeps
        # it read-only (making an empty one to cover where there was none: not the model's doing).
        for seen, node in enumerate(_walk(root, descend=lambda path: path != PROTECTED_DIR, most=most), 1):
            if node.path == PROTECTED_DIR:
                continue
            if seen > most:
                raise ArchiveError(f"the environment holds more than {most} files and folders; "
                                   "TOOLQ_UPLOAD_MAX_FILES raises the cap")
            if upper is not None:
                scan.upper_node(node)
            else:
                scan.node(node)
    except OSError as e:
        raise ArchiveError(f"cannot read the environment: {e.strerror}: {e.filename or ''}".rstrip(": ")) from None
    finally:
        os.close(root)
    return scan.delta(overlay=upper is not None)


class _Scan:
    def __init__(self, base: Manifest, budget: _Budget, xattrs: str = "trusted.") -> None:
        self.base, self.budget = base, budget
        self.opaque_name, self.whiteout_name = xattrs + _OPAQUE, xattrs + _WHITEOUT
        self.redirect_name, self.metacopy_name = xattrs + _REDIRECT, xattrs + _METACOPY
        self.present: set[str] = set()
        self.whiteouts: set[str] = set()
        self.opaque: list[str] = []
        self.members: dict[str, tuple[Entry, bytes]] = {}
        self.skipped: list[str] = []

    def node(self, node: _Node) -> None:
        kind = _kind_of(node.status.st_mode)
        if kind is None:
            self.skipped.append(_shown(node.path))
            return
        self.present.add(node.path)
        if not _is_utf8(node.path):
            self.skipped.append(f"{_shown(node.path)} (a name that is not UTF-8: not carried)")
            return
        self._compare(node, kind)

    def upper_node(self, node: _Node) -> None:
        mode = node.status.st_mode
        if stat.S_ISCHR(mode) and node.status.st_rdev == 0:
            self.whiteouts.add(node.path)
            return
        if node.fd is not None:
            _refuse_xattrs(node.fd, node.path, (self.redirect_name,))
            if _xattr(node.fd, self.opaque_name) == b"y":
                self.opaque.append(node.path)
        elif stat.S_ISREG(mode):
            fd = os.open(node.name, _READ_FLAGS, dir_fd=node.parent)
            try:
                if node.status.st_size == 0 and _xattr(fd, self.whiteout_name) is not None:
                    self.whiteouts.add(node.path)
                    return
                _refuse_xattrs(fd, node.path, (self.metacopy_name, self.redirect_name))
            finally:
                os.close(fd)
        self.node(node)

    def _compare(self, node: _Node, kind: Kind) -> None:
        was = self.base.get(node.path)
        mode = stat.S_IMODE(node.status.st_mode) & 0o777
        if kind == "dir":
            entry = Entry("dir", mode)
            if was != entry:
                self._carry(node.path, entry, b"")
            return
        if kind == "symlink":
            entry = Entry("symlink", 0o777, target=os.readlink(node.name, dir_fd=node.parent))
            if was != entry:
                self._carry(node.path, entry, b"")
            return
        if was is not None and was.kind == "file" and was.size == node.status.st_size \
                and _same_file(node, was):
            return  # size first, then the hash: only a changed file is read into the tar
        try:
            data, status = _read_file(node.parent, node.name, node.path, self.budget.left())
        except _TooBig:
            raise self.budget.too_big(node.path) from None
        entry = Entry("file", stat.S_IMODE(status.st_mode) & 0o777, len(data), hashlib.sha256(data).hexdigest())
        if entry != self.base.get(node.path):
            self._carry(node.path, entry, data)

    def _carry(self, path: str, entry: Entry, data: bytes) -> None:
        self.budget.count(path, len(data))
        self.members[path] = (entry, data)

    def _drop_links_out(self, gone: set[str]) -> None:
        """A symlink leading out (a venv's `python -> /usr/bin/python3`) is not carried: no host
        would unpack the checkpoint. It is listed in `skipped`."""
        links = {p: e.target or "" for p, e in self.base.items() if e.kind == "symlink" and p not in gone}
        links.update({p: e.target or "" for p, (e, _) in self.members.items() if e.kind == "symlink"})
        resolver = _Links(links)
        for path, (entry, _) in list(self.members.items()):
            if entry.kind == "symlink" and (why := resolver.why_out(path)):
                del self.members[path]
                self.skipped.append(f"{path} (a symlink that {why}: not carried)")

    def delta(self, *, overlay: bool) -> Delta:
        if overlay:
            gone = {p for p in self.whiteouts if p in self.base}
            for top in self.opaque:
                gone.update(p for p in self.base if p.startswith(top + "/") and p not in self.present)
            # a base entry under an upper non-directory is gone too (a file replaced a directory)
            replaced = [p for p, (e, _) in self.members.items() if e.kind != "dir"
                        and (was := self.base.get(p)) is not None and was.kind == "dir"]
            for top in replaced:
                gone.update(p for p in self.base if p.startswith(top + "/"))
        else:
            gone = {p for p in self.base if p not in self.present}
        self._drop_links_out(gone)
        deleted = sorted((p for p in gone if not any(q in gone for q in _parents(p))), key=_order)
        self.skipped += [f"{_shown(p)} (deleted; a name that is not UTF-8: not recorded)" for p in deleted
                         if not _is_utf8(p)]
        deleted = [p for p in deleted if _is_utf8(p)]
        carried = sorted(self.members, key=_order)
        added_dirs = {p for p in carried if p not in self.base and self.members[p][0].kind == "dir"}
        under_new = {q for p in carried for q in _parents(p)}
        added = [p for p in carried if p not in self.base and not (p in added_dirs and p in under_new)]
        changed = [p for p in carried if p in self.base]
        entries = {p: e for p, (e, _) in self.members.items()}
        tar = _tar_of((p, e, d) for p, (e, d) in self.members.items()) if self.members else None
        return Delta(added, changed, deleted, tar, entries, sorted(self.skipped, key=_order))


def _same_file(node: _Node, was: Entry) -> bool:
    fd = os.open(node.name, _READ_FLAGS, dir_fd=node.parent)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or stat.S_IMODE(status.st_mode) & 0o777 != was.mode:
            return False
        digest = hashlib.sha256()
        while chunk := os.read(fd, _READ_CHUNK):
            digest.update(chunk)
        return digest.hexdigest() == was.sha256
    finally:
        os.close(fd)


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EPERM, errno.EACCES):
            return None
        raise


def _refuse_xattrs(fd: int, path: str, names: Iterable[str]) -> None:
    for name in names:
        if _xattr(fd, name) is not None:
            raise ArchiveError(f"the overlay marks {path} with {name}; toolq reads overlays mounted with "
                               "metacopy=off,redirect_dir=off")
