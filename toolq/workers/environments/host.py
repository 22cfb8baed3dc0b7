"""A host's environments on disk (issue 28): the base cache, each environment's workspace, its
checkpoints, its end, and the reaper.

Layout under the host's root (`TOOLQ_ENV_ROOT`), shared by every worker process of the machine:

    bases/<base id>/tree           a base unpacked once (`archive.extract`); manifest.json beside it
    envs/<env id>/upper,work,merged   overlay mode: the environment's writes over the base (`merged` is its workspace)
    envs/<env id>/tree             copy mode: a copy of the base (no hard link reaches a base file)
    envs/<env id>/env.json         mode, base and fleet, written last: an environment without it is half-made
    locks/                         flock files: a base is unpacked once, an environment made or ended once
    git/<hash of url>/             bare clones of git sources (made outside any sandbox, hooks off)

A base is read-only to every command: overlayfs never writes to its lower layer, a copy is a
copy, and no sandbox binds the host's root (a command sees its environment's workspace only). A
read-only bind of each base was tried and dropped: it outlived the workers as a mount per base.

What a command wrote is hostile data (the security rule): the host never follows a link in an
environment (checkpoints read by fd, removal by `shutil.rmtree`'s fd walk, a checkpoint laid over
a new environment through dir fds with O_NOFOLLOW) and never runs anything from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from toolq.core.environments import (
    BLOB_ID,
    EMPTY_BASE,
    Checkpoint,
    EnvironmentRecord,
    EnvMode,
    GitSource,
    HostAdvert,
    TurnDiff,
    env_key,
    host_envs_key,
    said_skipped,
)
from toolq.core.libc import libc
from toolq.core.signing import canonical
from toolq.workers.environments import archive, locks, namespace
from toolq.workers.store import BlobStore

log = logging.getLogger("toolq.worker.environments")

ENV_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")  # fullmatch: `$` would take "id\n"
MB = 1024 * 1024
_MNT_DETACH = 2
#: How long a computed size of an environment is reused before it is walked again (the advert and
#: the cap read it every few seconds; a create and a checkpoint walk their own environment afresh).
SIZE_FRESH = 30.0
#: git may take this long to clone or fetch a source (the request's deadline bounds it too).
GIT_TIMEOUT = 600.0
#: Parsed base manifests a process keeps (a base id names the same files forever): a checkpoint of
#: a 10,000-file base spent ~80 ms of its ~90 ms parsing the manifest's JSON again.
MANIFESTS_KEPT = 8


class EnvError(Exception):
    """An operation on an environment that did not happen; `str(e)` is one line for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class EnvBusy(EnvError):
    """Another request holds the environment's lock (asked not to wait)."""


def _env_id(env_id: str) -> str:
    if not isinstance(env_id, str) or not ENV_ID.fullmatch(env_id):
        raise EnvError(f"invalid environment id {env_id!r}")
    return env_id


def _base_id(base: str) -> str:
    if base != EMPTY_BASE and not (isinstance(base, str) and BLOB_ID.match(base)):
        raise EnvError(f"invalid base id {base!r}")
    return base


# ---- mounts ---------------------------------------------------------------------------------------

def _overlay_xattrs() -> str:
    """The namespace of the attributes overlayfs keeps in the upper dirs this process mounts: the
    trusted.* ones are the initial namespace's root's alone, so in the host's namespace `user`."""
    return "user" if namespace.inside() else "trusted"


def _mount_overlay(lower: Path, upper: Path, work: Path, target: Path, xattrs: str | None = None) -> None:
    """mount(2) itself, not the mount command: in the host's namespace (`namespace.py`) only this
    process holds the capability, and an exec'd command as a user other than root loses it.
    `xattrs`: the attribute names overlay keeps its marks in (default: this process's)."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if (xattrs or _overlay_xattrs()) == "user":
        options += ",userxattr"
    if libc.mount(b"overlay", str(target).encode(), b"overlay", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}")


def _is_mount(path: Path) -> bool:
    """Something is mounted on `path` (its device is not its folder's): two stats, where reading
    mountinfo on every call cost 0.3 ms and grew with each environment mounted (bench envs)."""
    try:
        return os.stat(path, follow_symlinks=False).st_dev != os.stat(path.parent, follow_symlinks=False).st_dev
    except OSError:
        return False


def _mount_points() -> set[str]:
    """This namespace's mount points (mountinfo's 5th field, its octal escapes undone)."""
    points = set()
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ")
            if len(fields) > 4:
                points.add(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4]).decode(
                    errors="surrogateescape"))
    return points


def _unmount(path: Path) -> None:
    """Unmount `path`, lazily if something still holds it (a process we could not kill yet)."""
    if libc.umount2(str(path).encode(), 0) != 0 and ctypes.get_errno() == errno.EBUSY:
        libc.umount2(str(path).encode(), _MNT_DETACH)


def can_mount_overlay(scratch: Path) -> bool:
    """Whether this process may mount an overlay here (root, or CAP_SYS_ADMIN): tried once."""
    if not namespace.plain_path(scratch):
        return False
    try:
        top = Path(tempfile.mkdtemp(dir=scratch, prefix=".probe-"))
    except OSError:
        return False
    try:
        for d in ("lower", "upper", "work", "merged"):
            (top / d).mkdir()
        (top / "lower" / "f").write_bytes(b"")
        _mount_overlay(top / "lower", top / "upper", top / "work", top / "merged")
    except OSError:
        return False
    else:
        ok = (top / "merged" / "f").exists()
        _unmount(top / "merged")
        return ok
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ---- sizes and processes --------------------------------------------------------------------------

def disk_bytes(top: Path) -> int:
    """Bytes a tree uses on disk, walked without following a link."""
    total = 0
    stack = [str(top)]
    while stack:
        # Streamed, never listed whole: a command's folder of ten million files held gigabytes
        # of entries in the worker's main process at every walk.
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def kill_processes_in(top: Path, device: int | None = None) -> int:
    """SIGKILL every process whose cwd or root lies under `top` (or on `device`, an overlay's own):
    a session's command, a sandbox cell of the environment. Returns how many."""
    killed, me = 0, os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        for link in ("cwd", "root"):
            where = f"/proc/{name}/{link}"
            try:
                hit = _under(os.readlink(where), str(top))
                if not hit and device is not None:
                    hit = os.stat(where).st_dev == device
            except OSError:
                continue
            if hit:
                with contextlib.suppress(OSError):
                    os.kill(int(name), signal.SIGKILL)
                    killed += 1
                break
    return killed


_DIR_PATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_READ = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(top: Path) -> None:
    """Remove a tree a command wrote, whatever its depth and modes. `shutil.rmtree` recurses once
    per level: a command's `mkdir d; cd d` 3000 times made it raise RecursionError, the
    environment stayed, and the reaper, stopped at it, reaped none after it. And on a worker
    that is not root the commands are its own uid: a folder they made mode 000 or 500 could not
    be emptied. Here one directory fd is held at a time (down by name, O_NOFOLLOW; back up by
    `..`: the tree's processes are dead, nothing moves it), and a directory's owner bits are
    set before it is read. Never follows a link."""
    try:
        fd = _open_dir_owned(os.open(top, _DIR_PATH))
    except FileNotFoundError:
        return
    path: list[str] = []  # the names down to `fd`
    pending: list[list[str]] = [[]]  # each level's directories still to remove, found by its last read
    try:
        while True:
            if not pending[-1]:
                # Read as a stream (a folder of millions is never listed whole): files go at once,
                # directories are taken 1024 at a time.
                seen = False
                with os.scandir(fd) as entries:
                    for entry in entries:
                        seen = True
                        if entry.is_dir(follow_symlinks=False):
                            pending[-1].append(entry.name)
                            if len(pending[-1]) >= 1024:
                                break
                        else:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.name, dir_fd=fd)
                if not seen:  # empty: up, and remove it
                    if not path:
                        break
                    up = os.open("..", _DIR_READ, dir_fd=fd)
                    os.close(fd)
                    fd = up
                    os.rmdir(path.pop(), dir_fd=fd)
                    pending.pop()
                continue  # files were removed, or directories found: read again, or go down
            name = pending[-1].pop()
            try:
                sub = _open_dir_owned(os.open(name, _DIR_PATH, dir_fd=fd))
            except FileNotFoundError:
                continue
            os.close(fd)
            fd = sub
            path.append(name)
            pending.append([])
    finally:
        os.close(fd)
    os.rmdir(top)


def _open_dir_owned(path_fd: int) -> int:
    """A readable fd of the directory an O_PATH fd holds (closed), its owner bits set first."""
    try:
        mode = stat.S_IMODE(os.fstat(path_fd).st_mode)
        if mode & 0o700 != 0o700:
            with contextlib.suppress(OSError):  # not ours (root passes over modes anyway)
                os.chmod(f"/proc/self/fd/{path_fd}", mode | 0o700)  # the directory itself, not a link
        return os.open(f"/proc/self/fd/{path_fd}", _DIR_READ & ~os.O_NOFOLLOW)  # the magic link: that inode
    finally:
        os.close(path_fd)


# ---- laying files into a workspace (by dir fd, never following a link) ----------------------------

def _open_dir(parent: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _remove_entry(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)  # fd-based: never follows a link out
    else:
        os.unlink(name, dir_fd=parent)


def _walk_to(top: int, parts: list[str], *, create: bool) -> int | None:
    """A dir fd for `parts` below `top`; a missing or non-directory component is made a directory
    when `create`, else None. The caller closes the fd."""
    fd = os.dup(top)
    for part in parts:
        try:
            nxt = _open_dir(fd, part)
        except OSError as e:
            if not create or e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                os.close(fd)
                if create:
                    raise
                return None
            _remove_entry(fd, part)  # a file or a link where the checkpoint has a directory
            os.mkdir(part, 0o755, dir_fd=fd)
            nxt = _open_dir(fd, part)
        os.close(fd)
        fd = nxt
    return fd


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        raise EnvError(f"a checkpoint names an invalid path {rel!r}")
    return parts


def delete_paths(workspace: Path, paths: list[str]) -> None:
    top = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in paths:
            parts = _split(rel)
            parent = _walk_to(top, parts[:-1], create=False)
            if parent is None:
                continue  # under a link or already gone: nothing of the base to delete there
            try:
                _remove_entry(parent, parts[-1])
            finally:
                os.close(parent)
    finally:
        os.close(top)


def copy_in(source: Path, workspace: Path) -> None:
    """Lay the tree `source` (extracted by `archive.extract`, so trusted) over `workspace`."""
    top = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for here, dirs, files in os.walk(source):
            rel_dir = os.path.relpath(here, source)
            parts = [] if rel_dir == "." else rel_dir.split(os.sep)
            parent = _walk_to(top, parts, create=True)
            assert parent is not None
            try:
                for name in dirs + files:
                    _copy_entry(os.path.join(here, name), parent, name)
            finally:
                os.close(parent)
    finally:
        os.close(top)


def _copy_entry(src: str, parent: int, name: str) -> None:
    st = os.lstat(src)
    mode = stat.S_IMODE(st.st_mode) & 0o777  # never a set-id bit
    if stat.S_ISDIR(st.st_mode):
        try:
            existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(existing.st_mode):
                os.unlink(name, dir_fd=parent)
                raise FileNotFoundError
        except FileNotFoundError:
            os.mkdir(name, mode, dir_fd=parent)
        fd = _open_dir(parent, name)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    elif stat.S_ISLNK(st.st_mode):
        _remove_entry(parent, name)
        os.symlink(os.readlink(src), name, dir_fd=parent)
    elif stat.S_ISREG(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                _remove_entry(parent, name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        try:
            with open(src, "rb") as f:
                while chunk := f.read(1 << 20):
                    os.write(fd, chunk)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


# ---- the host -------------------------------------------------------------------------------------

class EnvHost:
    """One machine's environments. Every worker process of the host makes one on the same root;
    they share the files and serialise on flock files (one per base, one per environment)."""

    def __init__(self, root: Path, host: str, store: BlobStore | None, cap_bytes: int, limits: archive.Limits, *,
                 r: redis.Redis | None = None, mode: EnvMode | None = None, fleet: str = "") -> None:
        """`mode`: forced (tests); None: overlay if this process may mount one, copy otherwise.
        `fleet`: names the Redis this host's records live in; the reaper ends an environment found
        on disk with no record only if it was made for the same fleet (two fleets' workers on one
        machine may share a root: neither reaps the other's)."""
        self.root, self.host, self.store, self.cap_bytes, self.limits, self.r = root, host, store, cap_bytes, limits, r
        self.fleet = fleet
        for d in ("bases", "envs", "locks", "git", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        self.mode: EnvMode = mode or ("overlay" if can_mount_overlay(root / "tmp") else "copy")
        if self.mode == "overlay" and not namespace.plain_path(root):
            self.mode = "copy"
        self._sizes: dict[str, tuple[float, int]] = {}
        self._unmountable: set[str] = set()
        self._manifests: dict[str, archive.Manifest] = {}

    # --- paths and locks ---

    def env_dir(self, env_id: str) -> Path:
        return self.root / "envs" / _env_id(env_id)

    def path(self, env_id: str) -> Path:
        """The workspace the environment's calls run in."""
        d = self.env_dir(env_id)
        meta = self._meta(d)
        mode = meta.get("mode") if meta else self.mode
        return d / ("merged" if mode == "overlay" else "tree")

    def present(self, env_id: str) -> bool:
        """Made on this host and whole (overlay: still mounted)."""
        try:
            d = self.env_dir(env_id)
        except EnvError:
            return False
        meta = self._meta(d)
        if meta is None:
            return False
        if meta.get("mode") == "overlay":
            return _is_mount(d / "merged")
        return (d / "tree").is_dir()

    def _locked(self, name: str, how: int = fcntl.LOCK_EX) -> contextlib.AbstractContextManager[bool]:
        """flock on `locks/<name>.lock`; with LOCK_NB in `how`, yields False if it is held."""
        return locks.locked(self.root / "locks" / f"{name}.lock", how)

    @contextlib.contextmanager
    def _base_in_use(self, base: str) -> Iterator[Path]:
        """The base's cache, kept from eviction (a shared lock) while an environment is made on it."""
        for _ in range(3):
            d = self.base_dir(base)  # unpacks under the exclusive lock, released before the shared one
            with self._locked(f"base-{base}", fcntl.LOCK_SH):
                if (d / "manifest.json").exists():
                    os.utime(d / "size")  # its last use: eviction takes the least recently used first
                    yield d
                    return
        raise EnvError(f"host {self.host}: base {base} was evicted three times while an environment was made on it")

    def evict_bases(self, need: int) -> int:
        """Remove unpacked bases no environment here is made on, least recently used first, until
        `need` bytes are freed; bytes freed. A base being unpacked or used by a create is skipped."""
        in_use = {(self._meta(self.root / "envs" / i) or {}).get("base") for i in self.env_ids()}
        freed = 0
        candidates = [b for b in self.bases() if b not in in_use]
        candidates.sort(key=lambda b: _mtime(self.root / "bases" / b / "size"))
        for base in candidates:
            if freed >= need:
                break
            with self._locked(f"base-{base}", fcntl.LOCK_EX | fcntl.LOCK_NB) as mine:
                in_use = {(self._meta(self.root / "envs" / i) or {}).get("base") for i in self.env_ids()}
                if not mine or base in in_use:
                    continue
                d = self.root / "bases" / base
                try:
                    size = int((d / "size").read_text())
                except (OSError, ValueError):
                    size = 0
                gone = self.root / "bases" / f".old-{base}-{os.getpid()}"
                os.rename(d, gone)
                shutil.rmtree(gone, ignore_errors=True)
                freed += size
                log.info("base %s evicted from the cache (%d MB freed)", base, -(-size // MB))
        return freed

    @staticmethod
    def _meta(d: Path) -> dict[str, Any] | None:
        try:
            return json.loads((d / "env.json").read_text())
        except (OSError, ValueError):
            return None

    # --- bases ---

    def base_dir(self, base: str) -> Path:
        """The base's cache, unpacked on first use (once per host, whichever process asks first)."""
        d = self.root / "bases" / _base_id(base)
        if (d / "manifest.json").exists():
            return d
        with self._locked(f"base-{base}"):
            if (d / "manifest.json").exists():
                return d
            tar: bytes | None = None
            manifest: archive.Manifest = {}
            if base != EMPTY_BASE:
                if self.store is None:
                    raise EnvError("this host has no workspace store to fetch the base from")
                tar = self.store.get(base)
                manifest = archive.manifest_of(tar)
            tmp = Path(tempfile.mkdtemp(dir=self.root / "bases", prefix=".new-"))
            try:
                (tmp / "tree").mkdir(mode=0o755)
                if tar is not None:
                    archive.extract(tar, tmp / "tree", self.limits)
                (tmp / "size").write_text(str(disk_bytes(tmp / "tree")))
                (tmp / "manifest.json").write_text(json.dumps(archive.manifest_to_json(manifest)))
                os.rename(tmp, d)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return d

    def manifest(self, base: str) -> archive.Manifest:
        """The base's manifest (read-only to callers), parsed once per process while it is among the
        last MANIFESTS_KEPT used: a base is content-addressed, so an evicted and unpacked-again
        base has the same manifest."""
        d = self.base_dir(base)
        manifest = self._manifests.pop(base, None)
        if manifest is None:
            manifest = archive.manifest_from_json(json.loads((d / "manifest.json").read_text()))
        self._manifests[base] = manifest  # the most recently used last
        while len(self._manifests) > MANIFESTS_KEPT:
            self._manifests.pop(next(iter(self._manifests)), None)
        return manifest

    def bases(self) -> list[str]:
        return sorted(p.name for p in (self.root / "bases").iterdir()
                      if not p.name.startswith(".") and (p / "manifest.json").exists())

    # --- sizes and the cap ---

    def env_bytes(self, env_id: str, *, fresh: bool = False, walk: bool = True) -> int:
        """`walk` False: the last size computed, however old (0 for none yet), never a walk of the
        environment (a command's million files take seconds to walk)."""
        seen = self._sizes.get(env_id)
        if seen is not None and not fresh and (not walk or time.monotonic() - seen[0] < SIZE_FRESH):
            return seen[1]
        if not walk:
            return 0
        d = self.env_dir(env_id)
        size = disk_bytes(d / "upper") + disk_bytes(d / "tree")
        self._sizes[env_id] = (time.monotonic(), size)
        return size

    def used_bytes(self, *, walk: bool = True) -> int:
        total = 0
        for d in (self.root / "envs").iterdir():
            if ENV_ID.fullmatch(d.name):
                total += self.env_bytes(d.name, walk=walk)
        for b in self.bases():
            with contextlib.suppress(OSError, ValueError):
                total += int((self.root / "bases" / b / "size").read_text())
        return total

    def _check_cap(self, adding: int) -> None:
        used = self.used_bytes()
        if used >= self.cap_bytes or used + adding > self.cap_bytes:
            self.evict_bases(used + adding - self.cap_bytes + 1)
            used = self.used_bytes()
        if used >= self.cap_bytes or used + adding > self.cap_bytes:
            raise EnvError(f"host {self.host}: environments use {-(-used // MB)} MB of "
                           f"TOOLQ_ENV_DISK_MB={self.cap_bytes // MB}; not created")

    # --- create ---

    def create(self, record: EnvironmentRecord) -> EnvMode:
        """Make the environment (idempotent: one already whole here is kept). A git source's base
        is resolved here and written into `record.base`."""
        d = self.env_dir(record.id)
        if record.source.kind == "git" and record.source.git is not None and record.base in ("", None):
            record.base = self.git_base(record.source.git)
        base = _base_id(record.base)
        with self._locked(record.id):
            meta = self._meta(d)
            if self.present(record.id):
                return (meta or {}).get("mode", self.mode)
            if meta is not None and meta.get("mode") == "overlay":
                # Whole on disk (env.json is written last), only not mounted where this worker
                # runs: mount it again, never remove a live environment's files as half-made.
                if self._remount_locked(record.id, d):
                    return "overlay"
                raise EnvError(f"host {self.host}: environment {record.id} is on this host's disk but this worker "
                               "cannot mount it; not made again")
            if d.exists():
                self._remove(record.id)  # half-made by a process that died
            with self._base_in_use(base) as base_dir:
                self._make(record, d, base, base_dir)
        self.env_bytes(record.id, fresh=True)
        return self.mode

    def _make(self, record: EnvironmentRecord, d: Path, base: str, base_dir: Path) -> None:
        adding = int((base_dir / "size").read_text()) if self.mode == "copy" else 0
        self._check_cap(adding)
        d.mkdir(mode=0o700)
        try:
            if self.mode == "overlay":
                for sub in ("upper", "work", "merged"):
                    (d / sub).mkdir(mode=0o755)
                _mount_overlay(base_dir / "tree", d / "upper", d / "work", d / "merged")
            else:
                # A copy, never a hard link: a command must not reach a base file.
                shutil.copytree(base_dir / "tree", d / "tree", symlinks=True)
            workspace = d / ("merged" if self.mode == "overlay" else "tree")
            if record.start:
                self._lay_checkpoint(record.start, base, workspace)
            (d / "env.json").write_text(json.dumps({"mode": self.mode, "base": base, "created_at": time.time(),
                                                    "fleet": self.fleet, "xattrs": _overlay_xattrs()}))
        except BaseException as e:
            self._remove(record.id)
            if isinstance(e, OSError):
                raise EnvError(f"host {self.host}: environment {record.id} not created: "
                               f"{e.strerror or e}") from None
            raise

    def _lay_checkpoint(self, checkpoint_id: str, base: str, workspace: Path) -> None:
        if self.store is None:
            raise EnvError("this host has no workspace store to fetch the checkpoint from")
        cp = self.read_checkpoint(checkpoint_id)
        if cp.base != base:
            raise EnvError(f"checkpoint {checkpoint_id} is of base {cp.base}, not {base}")
        delete_paths(workspace, cp.deleted)
        if cp.delta:
            tar = self.store.get(cp.delta)
            tmp = Path(tempfile.mkdtemp(dir=self.root / "tmp", prefix="delta-"))
            try:
                (tmp / "x").mkdir()
                archive.extract(tar, tmp / "x", self.limits)
                copy_in(tmp / "x", workspace)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def read_checkpoint(self, checkpoint_id: str) -> Checkpoint:
        assert self.store is not None
        try:
            return Checkpoint.model_validate_json(self.store.get(checkpoint_id))
        except ValueError:
            raise EnvError(f"checkpoint {checkpoint_id} is not a checkpoint record") from None

    # --- checkpoint ---

    def checkpoint(self, record: EnvironmentRecord) -> tuple[str, TurnDiff]:
        """The environment's changes against its base, put in the store: (checkpoint id, diff)."""
        if self.store is None:
            raise EnvError("this host has no workspace store to put the checkpoint in")
        d = self.env_dir(record.id)
        with self._locked(record.id):
            meta = self._meta(d)
            if meta is None or not self.present(record.id):
                raise EnvError(f"environment {record.id} is not on host {self.host}")
            base = meta["base"]
            overlay = meta.get("mode") == "overlay"
            workspace = d / ("merged" if overlay else "tree")
            manifest = self.manifest(base)
            delta = archive.tree_delta(manifest, workspace, upper=d / "upper" if overlay else None,
                                       xattrs=meta.get("xattrs", "trusted"), limits=self.limits)
        delta_id = self.store.put(delta.tar) if delta.tar else None
        cp = Checkpoint(base=base, delta=delta_id, added=sorted(delta.added), changed=sorted(delta.changed),
                        deleted=sorted(delta.deleted))
        checkpoint_id = self.store.put(canonical(cp.model_dump(mode="json")))
        # The base's side of changed and deleted files: read from the host's cache, file by file.
        base_side = None if base == EMPTY_BASE else archive.BaseTree(self.base_dir(base) / "tree", manifest)
        diff = archive.unified_diff(base_side, delta, checkpoint_id)
        diff.skipped = said_skipped(delta.skipped)
        self.env_bytes(record.id, fresh=True)
        return checkpoint_id, diff

    # --- destroy ---

    def destroy(self, env_id: str, *, wait: bool = True) -> bool:
        """Kill what runs in it, unmount, remove. True if there was something to destroy. `wait`
        False: EnvBusy while another request holds it (the reaper, on the agent's request loop,
        comes back at its next pass rather than hold up every request)."""
        d = self.env_dir(env_id)
        with self._locked(env_id, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)) as mine:
            if not mine:
                raise EnvBusy(f"environment {env_id} is busy")
            if not d.exists():
                return False
            self._remove(env_id)
        self._sizes.pop(env_id, None)
        return True

    def _remove(self, env_id: str) -> None:
        d = self.env_dir(env_id)
        merged = d / "merged"
        device = None
        if str(merged) in _mount_points():
            with contextlib.suppress(OSError):
                device = os.stat(merged).st_dev
        kill_processes_in(d, device)
        if str(merged) in _mount_points():
            _unmount(merged)
        if str(merged) in _mount_points():  # never remove through a live overlay
            libc.umount2(str(merged).encode(), _MNT_DETACH)
        with contextlib.suppress(OSError):
            remove_tree(d)  # what the commands wrote: any depth, any modes, never a link followed
        if d.exists():
            raise EnvError(f"host {self.host}: environment {env_id} could not be removed")

    def env_ids(self) -> list[str]:
        return sorted(p.name for p in (self.root / "envs").iterdir() if ENV_ID.fullmatch(p.name))

    def state_counts(self) -> dict[str, int]:
        """This host's environments on disk by their record's state (one MGET; "unknown": no record
        or one that does not read), for the `toolq_environments` gauge at scrape time."""
        ids = self.env_ids()
        if self.r is None or not ids:
            return {}
        counts: dict[str, int] = {}
        for raw in self.r.mget([env_key(i) for i in ids]):
            rec = _record(_bytes(raw))
            state = rec.state if rec is not None else "unknown"
            counts[state] = counts.get(state, 0) + 1
        return counts

    # --- the reaper ---

    def reap(self, now: float | None = None) -> list[str]:
        """Destroy every environment of this host whose record is gone (or ended, or now placed on
        another host), whose owner key no longer exists, or whose idle limit or lifetime passed;
        its record is marked `destroyed`. Works from the disk too, so an environment survives
        neither a worker restart nor a Redis that lost its keys. Nothing is destroyed while Redis
        does not answer. Returns the ids destroyed."""
        if self.r is None:
            return []
        now = time.time() if now is None else now
        mine = [i for i in self.env_ids() if (self._meta(self.env_dir(i)) or {}).get("fleet", "") == self.fleet]
        ids = set(mine) | {i.decode() if isinstance(i, bytes) else str(i)
                           for i in self.r.smembers(host_envs_key(self.host))}
        ids = {i for i in ids if ENV_ID.fullmatch(i)}
        order = sorted(ids)
        raws = [_bytes(raw) for raw in self.r.mget([env_key(i) for i in order])] if order else []
        records = dict(zip(order, (_record(raw) for raw in raws), strict=True))
        owners = sorted({rec.owner for rec in records.values() if rec is not None})
        alive = dict(zip(owners, self._exist(owners), strict=True))
        done = []
        for env_id, raw in zip(order, raws, strict=True):
            why = self._reason_to_end(raw, records[env_id], alive, now)
            if why is None:
                self.remount(env_id)
                continue
            try:
                if self.destroy(env_id, wait=False):
                    log.info("environment %s destroyed: %s", env_id, why)
            except EnvBusy:
                continue  # a request holds it now: the next pass
            except Exception as e:  # one environment that resists must not keep the others alive
                log.warning("environment %s could not be destroyed (%s): %s", env_id, why, e)
                continue
            if raw is not None and why != "it is placed on another host":
                self.update_record(env_id, state="destroyed", size=0)
            self.r.srem(host_envs_key(self.host), env_id)
            done.append(env_id)
        return done

    def remount(self, env_id: str) -> bool:
        """An overlay environment whose mount is gone (the machine restarted, or the worker runs in a
        new mount namespace) while its files are whole on disk is mounted again. True if it was."""
        d = self.env_dir(env_id)
        if not self._unmounted_overlay(d, self._meta(d)):
            return False
        with self._locked(env_id, fcntl.LOCK_EX | fcntl.LOCK_NB) as mine:  # busy: the reaper's next pass
            return mine and self._remount_locked(env_id, d)

    def _unmounted_overlay(self, d: Path, meta: dict[str, Any] | None) -> bool:
        """An overlay environment whole on this host's disk, not mounted where this process runs.
        Asked of every environment at each reap: two stats, not a read of mountinfo (which grows
        with every environment mounted)."""
        return (self.mode == "overlay" and meta is not None and meta.get("mode") == "overlay"
                and not _is_mount(d / "merged"))

    def _remount_locked(self, env_id: str, d: Path) -> bool:
        """`remount` under the environment's lock. It mounts as the environment was made: overlay's
        marks in its upper dir are in the attribute names it was made with (`trusted.` as root,
        `user.` in an unprivileged host's namespace); read with the other names, a command's own
        `user.overlay.*` would be taken for overlay's, or overlay's missed."""
        meta = self._meta(d)
        if meta is None or not self._unmounted_overlay(d, meta):
            return False
        xattrs = meta.get("xattrs", "trusted")
        if xattrs == "user" and not namespace.inside() and namespace.members_left(self.root, self.fleet):
            return False  # a root worker beside the namespace's workers: they hold it mounted there
        if xattrs not in ("trusted", "user") or (xattrs == "trusted" and namespace.inside()):
            if env_id not in self._unmountable:  # said once: the reaper asks every few seconds
                self._unmountable.add(env_id)
                log.warning("environment %s was made by a root worker (trusted.overlay.* marks): this worker, in "
                            "its host's namespace, cannot mount it again", env_id)
            return False
        with self._base_in_use(meta["base"]) as base_dir:
            try:
                _mount_overlay(base_dir / "tree", d / "upper", d / "work", d / "merged", xattrs)
            except OSError as e:
                log.warning("environment %s could not be mounted again: %s", env_id, e)
                return False
        log.info("environment %s mounted again", env_id)
        return True

    def _exist(self, names: list[str]) -> list[bool]:
        assert self.r is not None
        with self.r.pipeline(transaction=False) as p:
            for name in names:
                p.exists(name)
            return [bool(n) for n in p.execute()]

    def _reason_to_end(self, raw: bytes | None, rec: EnvironmentRecord | None, alive: dict[str, bool],
                       now: float) -> str | None:
        if raw is None:
            return "its record is gone"
        if rec is None:
            return "its record is unreadable"
        if rec.host != self.host:
            return "it is placed on another host"
        if rec.state in ("destroyed", "destroying", "lost", "failed"):
            return f"it is {rec.state}"
        if not alive.get(rec.owner):
            return f"its owner {rec.owner} is gone"
        if rec.state == "creating":
            return None  # its create request is on its way, or running now
        if now - rec.used_at > rec.idle_limit:
            return f"idle for {now - rec.used_at:.0f} s (limit {rec.idle_limit:.0f} s)"
        if now - rec.created_at > rec.lifetime:
            return f"its lifetime of {rec.lifetime:.0f} s passed"
        return None

    def update_record(self, env_id: str, **fields: Any) -> bool:
        """Set fields of the record in `env_key(env_id)` atomically (never recreating a deleted one)."""
        assert self.r is not None
        return bool(update_record(self.r, env_id, **fields))

    # --- the advert ---

    def advert(self) -> HostAdvert:
        """What placement reads, from the sizes last computed (`used_bytes` walks them afresh): an
        advert that waited on walking the environments lapsed while a command's million files
        were walked, and the host was taken for dead with every environment on it."""
        return HostAdvert(host=self.host, mode=self.mode, bases=self.bases(), environments=len(self.env_ids()),
                          used_bytes=self.used_bytes(walk=False), cap_bytes=self.cap_bytes)

    # --- git sources ---

    def git_base(self, source: GitSource) -> str:
        """Clone (or fetch) the repository on the host, outside any sandbox, and put `git archive`
        of the ref's commit in the store: the base id (cached by commit on the host)."""
        if self.store is None:
            raise EnvError("this host has no workspace store to put the repository's tree in")
        url, ref = source.url, source.ref or "HEAD"
        if url.startswith("-") or ref.startswith("-") or "\n" in url or "\n" in ref:
            raise EnvError(f"git source {url}@{ref} refused: neither may start with '-'")
        repo = self.root / "git" / hashlib.sha256(url.encode()).hexdigest()[:32]
        with self._locked(f"git-{repo.name}"):
            if not (repo / "HEAD").exists():
                shutil.rmtree(repo, ignore_errors=True)
                _git(["clone", "--bare", "--quiet", "--", url, str(repo)], url)
            else:
                _git(["--git-dir", str(repo), "fetch", "--quiet", "--force", "--", url,
                      "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"], url)
            commit = _git(["--git-dir", str(repo), "rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}"],
                          url).strip()
            # The cache is the host's own file, not a Redis key: whoever can write the store's
            # Redis (no signing key) would name a tree of their own for the user's URL and commit.
            cache = self.root / "git" / f"{repo.name}.bases" / commit
            with contextlib.suppress(OSError):
                cached = cache.read_text().strip()
                if BLOB_ID.match(cached) and self.store.has(cached):
                    return cached
            tar = _git_archive(repo, commit, url, self._most_tar_bytes())
            base = self.store.put(tar)
            cache.parent.mkdir(mode=0o700, exist_ok=True)
            cache.write_text(base)
        return base

    def _most_tar_bytes(self) -> int:
        """The longest tar of a tree within the caps: its files' bytes, and a header, a pax header
        and padding (2 KiB) per member."""
        most = self.limits.max_bytes + 2048 * (self.limits.max_files + 1) + 10240
        store_most = getattr(self.store, "max_bytes", None)
        return min(most, store_most) if isinstance(store_most, int) else most


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "SSH_AUTH_SOCK")}
    return {**env, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false",
            "GIT_ALLOW_PROTOCOL": "http:https:git:ssh:file"}


_GIT_SAFE = ["-c", "core.hooksPath=/dev/null", "-c", "protocol.ext.allow=never", "-c", "core.fsmonitor=false"]


def _git_bytes(args: list[str], url: str) -> bytes:
    try:
        done = subprocess.run(["git", *_GIT_SAFE, *args], capture_output=True, env=_git_env(), timeout=GIT_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvError(f"git {args[0]} of {url} failed: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise EnvError(f"git source {url}: {last}")
    return done.stdout


def _git_archive(repo: Path, commit: str, url: str, most: int) -> bytes:
    """`git archive` of the commit, read until `most` bytes: a hostile repository packs gigabytes of
    zeros into a few KiB, which the tar (read into the worker's memory) would hold whole."""
    argv = ["git", *_GIT_SAFE, "--git-dir", str(repo), "-c", "tar.umask=0022", "archive", "--format=tar", commit]
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    env=_git_env())
        except OSError as e:
            raise EnvError(f"git archive of {url} failed: {e}") from None
        assert proc.stdout is not None
        timer = threading.Timer(GIT_TIMEOUT, proc.kill)
        timer.start()
        chunks, total = [], 0
        try:
            while chunk := proc.stdout.read(1 << 20):
                total += len(chunk)
                if total > most:
                    proc.kill()
                    raise EnvError(f"git source {url}: the tree of {commit[:12]} is larger than "
                                   f"{most // MB} MB as a tar; TOOLQ_UPLOAD_MAX_MB and TOOLQ_STORE_MAX_BLOB_MB "
                                   "raise the cap")
                chunks.append(chunk)
        finally:
            timer.cancel()
            proc.stdout.close()
            code = proc.wait()
        if code != 0:
            err.seek(0)
            last = (err.read().decode(errors="replace").strip().splitlines() or [f"exit {code}"])[-1]
            raise EnvError(f"git source {url}: {last}")
    return b"".join(chunks)


def _git(args: list[str], url: str) -> str:
    return _git_bytes(args, url).decode(errors="replace")


# One round trip, atomic: a JSON record's fields set in place, only if it still exists.
_UPDATE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local rec = cjson.decode(raw)
for k, v in pairs(cjson.decode(ARGV[1])) do rec[k] = v end
redis.call('SET', KEYS[1], cjson.encode(rec), 'KEEPTTL')
return 1
"""


def update_record(r: redis.Redis, env_id: str, **fields: Any) -> int:
    return int(r.eval(_UPDATE, 1, env_key(env_id), json.dumps(fields)))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _record(raw: bytes | None) -> EnvironmentRecord | None:
    try:
        return EnvironmentRecord.model_validate_json(raw) if raw is not None else None
    except ValueError:
        return None


def _bytes(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value
