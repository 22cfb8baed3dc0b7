"""Trees <-> tars, safely (issue 28 items 1, 4 and 8).

An environment's files travel as tars: an uploaded folder (`pack_dir`), a git commit's
`git archive`, a checkpoint's changes against its base (`tree_delta`). Every tar that reaches a
host or comes back from one is hostile input: the commands that wrote a checkpoint's files are the
model's. So a tar is only ever *parsed* with `tarfile` (never `extractall`), every member is
checked before anything is written (`_members`), and writes go through directory fds opened with
O_NOFOLLOW, one component at a time, with O_CREAT|O_EXCL: nothing in the destination is followed,
even if something else changes it meanwhile.

The tars this module writes are deterministic (sorted, mtime 0, owner 0 with no names, permission
bits only), so one folder always packs to one blob id and the store keeps it once. They carry
regular files, directories and symlinks that stay inside the tree, with UTF-8 names only (the
records naming them are JSON); what else a tree holds is refused (an upload) or left out and said
(a checkpoint's `Delta.skipped`).
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import io
import os
import secrets
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from toolq.core.environments import MAX_PATCH_BYTES, Checkpoint, TurnDiff
from toolq.workers.workspace import MAX_SYMLINKS, PROTECTED_DIR, open_entry

if TYPE_CHECKING:
    from toolq.core.settings import Settings

MiB = 1 << 20
#: A file larger than this is listed as binary in a diff, not diffed.
MAX_DIFF_FILE = 1 << 20
#: A diff compares this many bytes of files at most (difflib's time grows with them); then it is cut.
MAX_DIFFED_BYTES = 32 << 20
_READ_CHUNK = 1 << 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: The names overlayfs marks an upper directory opaque with (as root; unprivileged, `userxattr`).
_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")
#: Marks a file as a whiteout (newer kernels, beside the 0/0 character device).
_XWHITEOUT = ("trusted.overlay.whiteout", "user.overlay.whiteout")
#: A metacopy file holds no data and a redirected directory holds another's: the upper dir alone
#: would not tell the changes, so an overlay with them is refused (the host mounts without both).
_UNSUPPORTED_XATTRS = ("trusted.overlay.metacopy", "user.overlay.metacopy",
                       "trusted.overlay.redirect", "user.overlay.redirect")

Kind = Literal["file", "dir", "symlink"]


class ArchiveError(Exception):
    """A tree or tar refused: one line for the user, naming the member."""


@dataclass(frozen=True)
class Limits:
    """Caps on one tar or tree: its files' bytes and its members (files, directories and links)."""

    max_bytes: int
    max_files: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(max_bytes=settings.upload_max_mb * MiB, max_files=settings.upload_max_files)


DEFAULT_LIMITS = Limits(max_bytes=256 * MiB, max_files=100_000)


@dataclass(frozen=True)
class Entry:
    """One member of a tree: a regular file (its size and sha256), a directory, or a symlink (its
    target). `mode` holds the permission bits only (no suid, sgid or sticky bit)."""

    kind: Kind
    mode: int
    size: int = 0
    sha256: str | None = None
    target: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("kind", self.kind), ("mode", self.mode), ("size", self.size),
                                  ("sha256", self.sha256), ("target", self.target)) if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(kind=data["kind"], mode=int(data["mode"]), size=int(data.get("size", 0)),
                   sha256=data.get("sha256"), target=data.get("target"))


Manifest = dict[str, Entry]


def manifest_to_json(manifest: Manifest) -> dict[str, dict[str, Any]]:
    return {path: entry.to_json() for path, entry in sorted(manifest.items())}


def manifest_from_json(data: dict[str, dict[str, Any]]) -> Manifest:
    return {path: Entry.from_json(entry) for path, entry in data.items()}


@dataclass(frozen=True)
class Packed:
    """A folder packed for upload: the tar (its sha256 is its blob id) and what it holds."""

    tar: bytes
    manifest: Manifest
    skipped: list[str] = field(default_factory=list)
    """Sockets, FIFOs and devices in the folder: a tar carries none."""

    @property
    def blob(self) -> str:
        return hashlib.sha256(self.tar).hexdigest()


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


@dataclass
class ApplyReport:
    """What `apply_delta` did to the user's folder: the paths applied and those refused, each with
    its reason (one line each)."""

    applied: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"not applied: {path} ({reason})" for path, reason in self.refused]


# ---- names ---------------------------------------------------------------------------------------

def _order(path: str) -> list[str]:
    """Sort key: a directory's members right after it, before its next sibling (`a`, `a/x`, `a-b`)."""
    return path.split("/")


def _in_git_dir(path: str) -> bool:
    return any(part.lower() == PROTECTED_DIR for part in path.split("/"))


def _parents(path: str) -> Iterator[str]:
    """`a/b/c` -> `a`, `a/b`."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def _checked_name(raw: str, what: str = "the archive's member") -> str | None:
    """A member's name made relative (`./` and a trailing `/` dropped); None for the root itself.
    Raises for a name that could land anywhere but below the destination."""
    if "\0" in raw:
        raise ArchiveError(f"{what} {raw!r} has a NUL byte in its name")
    if raw.startswith("/"):
        raise ArchiveError(f"{what} {raw!r} has an absolute path")
    name = raw.rstrip("/")
    while name.startswith("./"):
        name = name[2:].lstrip("/")
    if name in ("", "."):
        return None
    parts = name.split("/")
    if ".." in parts:
        raise ArchiveError(f"{what} {raw!r} has a `..` component")
    if "" in parts or "." in parts:
        raise ArchiveError(f"{what} {raw!r} is not a plain relative path")
    if len(parts) > MAX_DEPTH or len(os.fsencode(name)) > MAX_PATH or any(len(os.fsencode(p)) > 255 for p in parts):
        # each level holds an fd while it is written: a name thousands deep would run a worker out of them
        raise ArchiveError(f"{what} {_short(raw)!r} is longer or deeper than a path may be here "
                           f"({MAX_PATH} bytes, {MAX_DEPTH} levels, 255 bytes a name)")
    return name


def _short(text: str, most: int = 120) -> str:
    return text if len(text) <= most else text[:most] + "..."


#: The longest path and the deepest one a tree may hold (the kernel's PATH_MAX; levels of directories).
MAX_PATH = 4095
MAX_DEPTH = 256
OUTSIDE = "leads outside"
_LOOPS = "loops"
#: The kernel's limit on a symlink's target (PATH_MAX less its NUL).
MAX_LINK_TARGET = 4095


class _Links:
    """A tree's symlinks resolved from the tree's own links, as the kernel would resolve them,
    without a file system: `s -> .` then `q -> s/..` leaves the tree, though `q`'s target alone does
    not look like it. A missing component counts as a directory. Each link is resolved once."""

    def __init__(self, links: dict[str, str]) -> None:
        self.links = links
        self._resolved: dict[str, list[str] | str] = {}  # a link -> where it leads (parts) or why not
        self._active: list[str] = []

    def why_out(self, path: str) -> str | None:
        """None if link `path` stays inside; else why not (`leads outside`, ...). A link that loops,
        or only resolves through more than 40 links, leads nowhere (the kernel gives ELOOP): it
        stays, as a broken link does."""
        found = self._resolve(path)
        return found if isinstance(found, str) and found != _LOOPS else None

    def _resolve(self, path: str) -> list[str] | str:
        if path in self._resolved:
            return self._resolved[path]
        if path in self._active or len(self._active) >= MAX_SYMLINKS:
            return _LOOPS  # not kept: from a shallower start the same link may resolve
        target = self.links[path]
        if not target or "\0" in target:
            found: list[str] | str = "has no usable target"
        elif len(os.fsencode(target)) > MAX_LINK_TARGET:
            found = f"has a target longer than {MAX_LINK_TARGET} bytes"
        elif target.startswith("/"):
            found = OUTSIDE
        else:
            self._active.append(path)
            try:
                found = self._walk(path.split("/")[:-1], target)
            finally:
                self._active.pop()
            if found == _LOOPS:
                return found
        self._resolved[path] = found
        return found

    def _walk(self, here: list[str], target: str) -> list[str] | str:
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not here:
                    return OUTSIDE
                here.pop()
                continue
            step = "/".join([*here, part])
            if step not in self.links:
                here.append(part)
                continue
            found = self._resolve(step)
            if isinstance(found, str):
                return found
            here = list(found)
        return here


# ---- writing tars --------------------------------------------------------------------------------

class _TarWriter:
    """A deterministic tar: members in `_order`, mtime 0, owner 0, no owner names, permission bits."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.PAX_FORMAT)
        self._last: list[str] | None = None

    def add(self, name: str, entry: Entry, data: bytes = b"") -> None:
        if self._last is not None and _order(name) <= self._last:
            raise ArchiveError(f"cannot pack {name}: it comes out of order")  # never, but the blob id would change
        self._last = _order(name)
        info = tarfile.TarInfo(name)
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = entry.mode & 0o777
        if entry.kind == "dir":
            info.type = tarfile.DIRTYPE
        elif entry.kind == "symlink":
            info.type = tarfile.SYMTYPE
            info.linkname = entry.target or ""
        else:
            info.size = len(data)
        self._tar.addfile(info, io.BytesIO(data) if entry.kind == "file" else None)

    def finish(self) -> bytes:
        self._tar.close()
        return self._buffer.getvalue()


def _tar_of(members: Iterable[tuple[str, Entry, bytes]]) -> bytes:
    writer = _TarWriter()
    for name, entry, data in sorted(members, key=lambda m: _order(m[0])):
        writer.add(name, entry, data)
    return writer.finish()


# ---- reading trees by fd -------------------------------------------------------------------------

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


# ---- packing an upload ---------------------------------------------------------------------------

def pack_dir(path: Path, limits: Limits = DEFAULT_LIMITS) -> Packed:
    """The folder as a deterministic tar and its manifest. A git checkout packs its tracked and
    untracked-not-ignored files (as `git ls-files` lists them); any other folder, every file.
    `.git` is never packed; a symlink is kept only if it stays inside the folder (one leading out
    is refused: dropping it would change the project silently). Sockets, FIFOs and devices are
    skipped and listed."""
    folder = Path(path)
    try:
        root = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ArchiveError(f"cannot open the folder {folder}: {e.strerror}") from None
    try:
        listed = _git_listing(folder) if os.path.lexists(folder / ".git") else None
        budget = _Budget(limits, f"the folder {folder}")
        manifest: Manifest = {}
        skipped: list[str] = []
        writer = _TarWriter()  # written as read (the nodes come in `_order`): the files are held once
        try:
            for node in _packed_nodes(root, listed):
                if not _is_utf8(node.path):
                    raise ArchiveError(f"{_shown(node.path)} in {folder} has a name that is not UTF-8, which an "
                                       "environment cannot carry; rename it")
                packed = _pack_node(node, budget)
                if packed is None:
                    skipped.append(node.path)
                    continue
                manifest[node.path] = packed[0]
                writer.add(node.path, *packed)
        except OSError as e:
            raise ArchiveError(f"cannot read {folder}: {e.strerror}: {e.filename or ''}".rstrip(": ")) from None
        links = {p: e.target or "" for p, e in manifest.items() if e.kind == "symlink"}
        resolver = _Links(links)
        for link, target in sorted(links.items()):
            if why := resolver.why_out(link):
                raise ArchiveError(f"the symlink {link} -> {target} {why} the folder {folder}; "
                                   "replace it with a file or a link inside it" if why == OUTSIDE else
                                   f"the symlink {link} -> {target} in {folder} {why}")
        return Packed(writer.finish(), manifest, skipped)
    finally:
        os.close(root)


def _pack_node(node: _Node, budget: _Budget) -> tuple[Entry, bytes] | None:
    """A node's entry and bytes; None for a socket, FIFO or device (not packed)."""
    kind = _kind_of(node.status.st_mode)
    if kind is None:
        return None
    if kind == "dir":
        budget.count(node.path)
        return Entry("dir", stat.S_IMODE(node.status.st_mode) & 0o777), b""
    if kind == "symlink":
        budget.count(node.path)
        return Entry("symlink", 0o777, target=os.readlink(node.name, dir_fd=node.parent)), b""
    try:
        data, status = _read_file(node.parent, node.name, node.path, budget.left())
    except _TooBig:
        raise budget.too_big(node.path) from None
    budget.count(node.path, len(data))
    return Entry("file", stat.S_IMODE(status.st_mode) & 0o777, len(data), hashlib.sha256(data).hexdigest()), data


def _packed_nodes(root: int, listed: list[str] | None) -> Iterator[_Node]:
    """The nodes to pack: every one under `root` but `.git`, or those git listed with the
    directories on their way (a listed directory, a submodule, whole)."""
    if listed is None:
        yield from (n for n in _walk(root, descend=lambda p: not _in_git_dir(p)) if not _in_git_dir(n.path))
        return
    wanted = sorted({p for p in listed if not _in_git_dir(p)}, key=_order)
    seen: set[str] = set()
    for path in wanted:
        for parent in [*_parents(path), path]:
            if parent in seen:
                continue
            seen.add(parent)
            node = _node_at(root, parent)
            if node is None:
                break  # tracked but deleted from the work tree, or under a symlink: not there to pack
            try:
                yield node
                if node.fd is not None and parent == path:
                    for sub in _walk(node.fd, descend=lambda p: not _in_git_dir(p)):
                        if not _in_git_dir(sub.path):
                            sub.path = f"{path}/{sub.path}"
                            seen.add(sub.path)
                            yield sub
            finally:
                if node.fd is not None:
                    os.close(node.fd)
                os.close(node.parent)
            if node.fd is None and parent != path:
                break


def _node_at(root: int, path: str) -> _Node | None:
    """The node at `path` under `root`, reached without following a link (None if absent there)."""
    parts = path.split("/")
    fd = os.dup(root)
    try:
        for part in parts[:-1]:
            sub = open_entry(fd, part, directory=True)
            os.close(fd)
            fd = sub
        status = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        own = open_entry(fd, parts[-1], directory=True) if stat.S_ISDIR(status.st_mode) else None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    return _Node(path, fd, parts[-1], status, own)


def _git_listing(folder: Path) -> list[str]:
    """`git ls-files` of a checkout: tracked and untracked-not-ignored files. The user's own folder,
    but git is kept from running anything it names (fsmonitor, hooks) and from the user's GIT_*
    variables and the system config; no pager."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_PAGER="cat", PAGER="cat", GIT_TERMINAL_PROMPT="0",
               GIT_OPTIONAL_LOCKS="0", GIT_CEILING_DIRECTORIES=str(folder.resolve().parent))
    # safe.directory: git refuses a checkout another user owns, for fear of its config running
    # programs; the two that could here are turned off, and the user named this folder.
    argv = ["git", "--no-pager", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
            "-c", f"safe.directory={folder.resolve()}", "ls-files", "-z", "-co", "--exclude-standard"]
    try:
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ArchiveError(f"cannot list the git checkout {folder}: {e}") from None
    if done.returncode != 0:
        reason = os.fsdecode(done.stderr).strip().splitlines()
        raise ArchiveError(f"git cannot list the checkout {folder}: {reason[0] if reason else done.returncode}")
    # an untracked repository inside is listed as `inner/`: packed whole, as a submodule is
    return sorted({os.fsdecode(name).rstrip("/") for name in done.stdout.split(b"\0") if name.rstrip(b"/")})


# ---- reading tars --------------------------------------------------------------------------------

@dataclass
class _Member:
    name: str
    info: tarfile.TarInfo
    kind: Kind


def _members(tar: bytes, limits: Limits | None, what: str = "the archive", *, links_out: bool = False,
             ) -> list[_Member]:
    """Every member of an untrusted tar, checked before anything is written: plain relative names,
    no duplicates, files, directories and symlinks only, no member under a symlink or a file, no
    link leading out, no name a pax or GNU header changes behind a short one, nothing after the
    last member, and the caps on declared sizes and count. `links_out`: a symlink leading out is
    left for the caller to refuse by itself (applying a checkpoint refuses that one path)."""
    budget = _Budget(limits, what) if limits else None
    found: list[_Member] = []
    try:
        archive = tarfile.open(fileobj=io.BytesIO(tar), mode="r:")
    except tarfile.TarError as e:
        raise ArchiveError(f"{what} is not a tar: {e}") from None
    try:
        while True:
            try:
                info = archive.next()
            except tarfile.TarError as e:
                raise ArchiveError(f"{what} is damaged after {found[-1].name if found else 'its start'}: {e}") from None
            if info is None:
                break
            if "path" in archive.pax_headers or "linkpath" in archive.pax_headers:
                raise ArchiveError(f"{what} has a global pax header that renames its members")
            _check_spelling(tar, info, what)
            name = _checked_name(info.name, f"{what}'s member")
            kind = _member_kind(info, what)
            if name is None:
                if kind != "dir":
                    raise ArchiveError(f"{what}'s member {info.name!r} names the destination itself")
                continue
            if info.size < 0 or (info.size and kind != "file"):
                raise ArchiveError(f"{what}'s member {name} declares a size of {info.size} bytes")
            if budget:
                budget.count(name, info.size if kind == "file" else 0)
            if kind == "file" and info.offset_data + info.size > len(tar):
                raise ArchiveError(f"{what}'s member {name} declares {info.size} bytes but the archive ends first")
            found.append(_Member(name, info, kind))
        end = archive.offset
    finally:
        archive.close()
    if tar[end:].count(0) != len(tar) - end:
        raise ArchiveError(f"{what} has bytes after {found[-1].name if found else 'its start'} that are no tar member "
                           "(a member holding more than it declares?)")
    _check_tree(found, what, links_out)
    return found


def _check_spelling(tar: bytes, info: tarfile.TarInfo, what: str) -> None:
    """A pax or GNU long-name header may give a name the ustar header cannot hold (longer than its
    100 bytes, or not ASCII), never rename a member the ustar header names plainly: a reader that
    skips those headers would see another archive."""
    header = tar[info.offset_data - 512:info.offset_data]
    if len(header) < 512:
        raise ArchiveError(f"{what}'s member {info.name!r} has a truncated header")
    for field_name, value, raw in (("path", info.name, _ustar_name(header)), ("link", info.linkname, header[157:257])):
        spelt = raw.split(b"\0", 1)[0]
        encoded = os.fsencode(value)
        if not value or encoded == spelt or (field_name == "path" and encoded.rstrip(b"/") == spelt.rstrip(b"/")):
            continue
        if len(encoded) <= 100 and value.isascii():
            was = spelt.decode(errors="replace")
            if field_name == "path":
                raise ArchiveError(f"{what}'s member {was!r} is renamed to {value!r} by an extended header")
            raise ArchiveError(f"{what}'s member {info.name!r} has its link target {was!r} changed to {value!r} "
                               "by an extended header")


def _ustar_name(header: bytes) -> bytes:
    """The name a header spells, read as tarfile reads it (its prefix field, whatever the magic)."""
    name = header[0:100].split(b"\0", 1)[0]
    prefix = header[345:500].split(b"\0", 1)[0]
    return prefix + b"/" + name if prefix else name


def _member_kind(info: tarfile.TarInfo, what: str) -> Kind:
    if info.issparse():
        raise ArchiveError(f"{what}'s member {info.name!r} is a sparse file, which toolq does not unpack")
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    kind = ("a hard link" if info.islnk() else "a character device" if info.ischr() else "a block device"
            if info.isblk() else "a FIFO" if info.isfifo() else f"of type {info.type!r}")
    raise ArchiveError(f"{what}'s member {info.name!r} is {kind}, which toolq does not unpack")


def _check_tree(found: list[_Member], what: str, links_out: bool) -> None:
    kinds: dict[str, Kind] = {}
    for member in found:
        if member.name in kinds:
            raise ArchiveError(f"{what} holds {member.name} twice")
        kinds[member.name] = member.kind
    for member in found:
        for parent in _parents(member.name):
            if kinds.get(parent, "dir") != "dir":
                raise ArchiveError(f"{what}'s member {member.name} lies under {parent}, which is a {kinds[parent]}")
    if links_out:
        return
    links = {m.name: m.info.linkname for m in found if m.kind == "symlink"}
    resolver = _Links(links)
    for name, target in links.items():
        if why := resolver.why_out(name):
            raise ArchiveError(f"{what}'s symlink {name} -> {target!r} {why}" + (" it" if why == OUTSIDE else ""))


def _member_data(tar: bytes, member: _Member) -> bytes:
    start = member.info.offset_data
    return tar[start:start + member.info.size]


def _entry_of(member: _Member, data: bytes = b"") -> Entry:
    mode = member.info.mode & 0o777
    if member.kind == "file":
        return Entry("file", mode, len(data), hashlib.sha256(data).hexdigest())
    if member.kind == "symlink":
        return Entry("symlink", 0o777, target=member.info.linkname)
    return Entry("dir", mode)


def manifest_of(tar: bytes) -> Manifest:
    """What a tar holds: path -> Entry (its members checked as `extract` checks them, caps aside)."""
    return {m.name: _entry_of(m, _member_data(tar, m) if m.kind == "file" else b"") for m in _members(tar, None)}


# ---- extracting ----------------------------------------------------------------------------------

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


# ---- an environment's changes --------------------------------------------------------------------

def tree_delta(base: Manifest, env_dir: Path, *, upper: Path | None = None,
               limits: Limits = DEFAULT_LIMITS) -> Delta:
    """The environment's changes against its base manifest. Copy mode (`upper` None): `env_dir` is
    walked whole and compared with the base (size first, then sha256). Overlay mode: only the
    overlay's upper dir is walked: a 0/0 character device (or a file marked so) is a whiteout, an
    opaque directory hides the base under it, a file copied up unchanged is no change. Nothing is
    followed; the caps count what the delta carries."""
    top = upper if upper is not None else env_dir
    try:
        root = os.open(top, _DIR_FLAGS)
    except OSError as e:
        raise ArchiveError(f"cannot open {top}: {e.strerror}") from None
    scan = _Scan(base, _Budget(limits, "the environment's changes"))
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
    def __init__(self, base: Manifest, budget: _Budget) -> None:
        self.base, self.budget = base, budget
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
            _refuse_xattrs(node.fd, node.path, _UNSUPPORTED_XATTRS[2:])
            if any(_xattr(node.fd, name) == b"y" for name in _OPAQUE):
                self.opaque.append(node.path)
        elif stat.S_ISREG(mode):
            fd = os.open(node.name, _READ_FLAGS, dir_fd=node.parent)
            try:
                if node.status.st_size == 0 and any(_xattr(fd, name) is not None for name in _XWHITEOUT):
                    self.whiteouts.add(node.path)
                    return
                _refuse_xattrs(fd, node.path, _UNSUPPORTED_XATTRS)
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


def _is_utf8(path: str) -> bool:
    """Whether a name (decoded with surrogateescape, as os gives it) is UTF-8: only those travel,
    as the records naming them are JSON."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: str) -> str:
    """A name as text that any JSON can carry (bytes that are not UTF-8 as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


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


# ---- the diff a turn's outcome carries -----------------------------------------------------------

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


# ---- applying a turn's changes back --------------------------------------------------------------

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
