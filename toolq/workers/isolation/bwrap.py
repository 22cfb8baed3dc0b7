"""bubblewrap: the default sandbox where unprivileged user namespaces work.

Each command gets new user, pid, network, ipc, uts and cgroup namespaces and a root built from
nothing: the system directories read-only, a fresh `/dev`, its own `/proc` (only its own
processes), a private `/tmp`, and the call's workspace read-write with `.git/` read-only again
(as in Codex's workspace-write sandbox). The worker's home, its logs and other workspaces are
not mounted at all. `--die-with-parent` and pid 1 of the namespace take every process down when
the call ends, `setsid -f` and double forks included.

The command has no capabilities, even in its own user namespace: run by a root worker, bwrap
would otherwise keep them all, and the command could `umount` a mask or remount `/usr`
read-write (uid 0 in the sandbox is the host's root). Memory the command could fill outside its
processes' address space is bounded: `/tmp` and `/dev/shm` are tmpfs of the call's memory limit,
and the rest of `/dev` is read-only. `/proc/sys` is read-only too: uid 0 in the sandbox passes the
sysctls' permission check, capabilities or not (it rewrote `vm.swappiness` of the host). A
command that finds `.git` bound from anywhere but the workspace does not run.

Started through a `Gate` (what `Sandbox.launch` does), bwrap holds its sandbox before the command
runs (`--block-fd`) while the worker sets the call's rlimits on it and checks, from outside, that
`.git` in its final root is a mount of the workspace's own `.git` (`GitMount`): no `prlimit` or
shell runs before the command. Without a gate (or where the outside check cannot tell, see
`argv`), a shell checks `.git`'s mount from inside first (`GIT_CHECK`). A session-host slot thread
starts bwrap from a smaller mount table of its own (`spawner.py`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolq.workers.isolation import cell_init, spawner
from toolq.workers.isolation.policy import Policy
from toolq.workers.isolation.reaper import _libc, has_exited

log = logging.getLogger("toolq.sandbox")

#: Where the private /tmp is: HOME and TMPDIR point here inside the sandbox.
SANDBOX_TMP = "/tmp"


#: A cell's /dev: what bwrap's --dev makes but the devpts instance. With --dev, an unprivileged
#: bwrap maps the uid to 0 to mount devpts and then enters a second user namespace, in which its
#: covers of /proc are locked: a command's own /proc could not be mounted (`cell_init.py`).
CELL_DEV = ("--tmpfs", "/dev",
            *(arg for node in ("null", "zero", "full", "random", "urandom", "tty")
              for arg in ("--dev-bind", f"/dev/{node}", f"/dev/{node}")),
            *(arg for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                                       ("core", "/proc/kcore"), ("ptmx", "pts/ptmx"))
              for arg in ("--symlink", target, f"/dev/{link}")),
            "--dir", "/dev/pts")


def executable() -> str | None:
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def _private_proc() -> tuple[str, ...]:
    """The root-only files of /proc covered (`cell_init.private_proc_files`), found once: the
    kernel's /proc has the same files in every sandbox."""
    return tuple(a for path in cell_init.private_proc_files() for a in ("--ro-bind-try", "/dev/null", path))


def argv(bwrap: str, policy: Policy, workspace: str, cwd: str, command: list[str], gate: Gate | None = None,
         cell: bool = False) -> list[str]:
    """The command line; with a `gate`, bwrap waits at it before the command runs (`Gate.release`).
    `cell`: for a cell's own program (`cell.py`), which keeps the capabilities of its user namespace
    (an unprivileged bwrap would drop them all), drops them before each command it runs and mounts
    each one a `/dev/pts` of its own."""
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-add" if cell else "--cap-drop", "ALL"]
    if gate is not None:
        args += ["--info-fd", str(gate.info_w), "--block-fd", str(gate.block_r)]
        if not cell and gate.seccomp_fd >= 0:  # a cell installs it before each command itself
            args += ["--seccomp", str(gate.seccomp_fd)]
    if policy.network == "host":
        args.append("--share-net")
    size = str(policy.limits.memory_mb * 1024 * 1024)
    args += [*(CELL_DEV if cell else ("--dev", "/dev")), "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger",
             "/proc/sysrq-trigger", *_private_proc(), "--size", size, "--tmpfs", SANDBOX_TMP]
    spawner.follow_host_mounts(workspace)  # first: the workspace's path may resolve only on the host's mounts
    real = os.path.realpath(workspace)
    for d, link in _read_dirs(policy.read_dirs):
        if d == real or d.startswith(real.rstrip("/") + "/"):
            continue  # under the workspace: its bind below covers this one
        args += ["--symlink", link, d] if link is not None else ["--ro-bind-try", d, d]
    args += _etc(policy.etc, policy.read_dirs)
    args += _masks(policy.hidden)
    args += ["--bind", real, real]
    if real != workspace:  # reached through a symlink: the same path inside as outside
        args += ["--symlink", real, workspace]
    git = os.path.join(real, ".git")
    placeholder_git(real)
    try:
        found = os.lstat(git)
    except OSError:
        found = None
    if found is not None and stat.S_ISLNK(found.st_mode):
        found = None  # a symlinked .git is not bound: it resolves inside the sandbox only
    checkable = gate is not None and not (real + "/").startswith(_STAGING)
    if found is not None and checkable and _git_is_a_mount(real, git) is False:
        assert gate is not None
        where = (_identity(real), _identity("/", follow=True))
        # Every other git directory and `.git` file under the workspace too, each checked at the
        # gate as the top one is: a submodule's `.git` file rewritten to name a model-made gitdir,
        # or a nested repository's config, is what a human's git in that folder obeys.
        # A cell binds them itself, before each of its commands (`cell_init.GitGuard`).
        for path, identity in [] if cell else nested_gits(real):
            args += ["--ro-bind", path, path]
            gate.nested.append(GitMount(path, real, identity, *where))
        # bwrap closes the file op's fd when the op is done: the gate's sign that .git is bound.
        args += ["--ro-bind", git, git, "--file", str(gate.bound_w), "/dev/null"]
        gate.git = GitMount(git, real, _identity(git, found), *where)
    elif found is not None and (mount := _git_mount(git)) is not None:
        # Without a gate, or where the gate cannot tell (a workspace under bwrap's own staging
        # paths, a .git that is a mount point here, a kernel without statx's mount id): checked
        # from inside.
        args += ["--ro-bind", git, git]
        command = ["/bin/sh", "-c", GIT_CHECK, "toolq-sandbox", _escape(git), mount[0], *command]
    args += ["--remount-ro", "/", "--chdir", cwd, "--", *command]
    return args


#: Runs first in the sandbox when `.git` is bound: bwrap resolves the bind's source and target by
#: path (even with --ro-bind-fd), so a parallel call that swaps `.git` for a symlink (`..`) while
#: bwrap starts gets the symlink's target (the host's directory) bound instead. The mount table
#: is final here: the command runs only if `.git`'s mount is the workspace's own `.git`, and
#: read-only (bwrap remounts a bind read-only by the target's realpath, taken after the bind: a
#: symlink to another mount point swapped in between leaves the bind writable).
GIT_CHECK = """ok=
while read -r _ _ dev root mount opts _; do
  [ "$mount" = "$1" ] && [ "$dev $root" = "$2" ] && case "$opts" in ro|ro,*) ok=1;; esac
done < /proc/self/mountinfo
[ -n "$ok" ] || { echo "sandbox refused the command: .git changed while the sandbox was set up" >&2; exit 125; }
shift 2
exec "$@"
"""


@functools.lru_cache(maxsize=8)
def _read_dirs(dirs: tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """Each readable directory and, for a symlink (`/bin` -> `usr/bin`), its target: once per
    worker, as the system directories do not change under it."""
    return tuple((d, os.readlink(d) if os.path.islink(d) else None) for d in dirs)


def _git_is_a_mount(workspace: str, git: str) -> bool | None:
    """Whether `.git` is a mount point of its own here (the workspace's recursive bind would then
    carry a writable mount of the same inode at .git, whatever the .git bind did); None where
    statx does not tell."""
    try:
        ws, own = _mount_id(workspace), _mount_id(git)
    except OSError:
        return None
    return None if ws is None or own is None else ws != own


def placeholder_git(workspace: str) -> None:
    """Where the workspace has no `.git`, an empty one, which the sandbox binds read-only like any
    `.git`: a command cannot make a repository there (`git init`, then a `core.fsmonitor` that a
    human's later `git status` runs). Git takes an empty `.git` for no repository at all."""
    try:
        os.mkdir(os.path.join(workspace, ".git"), 0o755)
    except OSError:
        pass  # there already (a repository, or a link: judged by the caller), or a read-only workspace


@functools.lru_cache(maxsize=8)
def _etc(entries: tuple[str, ...], read_dirs: tuple[str, ...]) -> tuple[str, ...]:
    """/etc as commands see it: a directory holding only the allowlisted `entries`, each bound
    read-only. A symlink is made again where its target is in the sandbox (`localtime` into
    /usr/share/zoneinfo); one that leads elsewhere (`resolv.conf` -> ../run/systemd/...) gets its
    target bound (`Policy.from_settings` kept only those everyone may read)."""
    args = ["--dir", "/etc"]
    for path in entries:
        if not os.path.islink(path):
            args += ["--ro-bind-try", path, path]
            continue
        target = os.path.realpath(path)
        if any(target == d or target.startswith(d.rstrip("/") + "/") for d in (*read_dirs, *entries)):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind-try", target, path]
    return tuple(args)


def _masks(hidden: tuple[str, ...]) -> list[str]:
    """The masks of `hidden` (files and folders beneath the read directories that other users may
    not read): a directory under an empty tmpfs (no mount-table read in bwrap), a file under
    /dev/null when this worker's uid can read it (each bind costs bwrap a read of its whole mount
    table; a file the uid cannot read needs no mask, as the command runs as that uid without
    capabilities). A root worker's command masks them all (root owns them)."""
    args: list[str] = []
    for path in hidden:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            args += ["--tmpfs", path]
        elif stat.S_ISCHR(mode) and os.stat(path).st_rdev == os.stat("/dev/null").st_rdev:
            continue  # masked in this thread's namespace already (`spawner.prepare_spawning_thread`)
        elif os.access(path, os.R_OK):  # permission bits and ACLs, as the kernel checks them
            args += ["--ro-bind", "/dev/null", path]
    return args


Identity = tuple[int, int]


def _identity(path: str, found: os.stat_result | None = None, follow: bool = False) -> Identity:
    """(device, inode): what a bind mount shows at its mount point is its source's."""
    st = found or os.stat(path, follow_symlinks=follow)
    return st.st_dev, st.st_ino


_AT_FDCWD, _AT_SYMLINK_NOFOLLOW, _AT_EMPTY_PATH, _STATX_INO, _STATX_MNT_ID = -100, 0x100, 0x1000, 0x100, 0x1000


def _mount_id(path: str, fd: int | None = None) -> int | None:
    """The id of the mount `path` (not followed; or what `fd` is open on) is on, from statx(2);
    None where the kernel does not tell (before Linux 5.8). Mount ids are unique across namespaces."""
    buf = ctypes.create_string_buffer(256)  # struct statx
    at, name, flags = (_AT_FDCWD, os.fsencode(path), _AT_SYMLINK_NOFOLLOW) if fd is None else (fd, b"", _AT_EMPTY_PATH)
    if _libc.statx(at, name, flags, _STATX_INO | _STATX_MNT_ID, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    mask, = struct.unpack_from("I", buf, 0)
    return struct.unpack_from("Q", buf, 144)[0] if mask & _STATX_MNT_ID else None


def _escape(path: str) -> str:
    """A path as /proc/<pid>/mountinfo writes it."""
    for char, code in (("\\", "\\134"), (" ", "\\040"), ("\t", "\\011"), ("\n", "\\012")):
        path = path.replace(char, code)
    return path


class _MountTable:
    """This process's mount table, parsed once and again only when it changed (mountinfo polls
    POLLPRI on a change): `_git_mount` runs for every command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._poller = select.poll()
        self._mounts: list[tuple[str, str, str]] = []

    def mounts(self) -> list[tuple[str, str, str]]:
        """(major:minor, root, mount point) of each mount, the mount point unescaped."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
                self._poller.register(self._fd, select.POLLPRI)
            elif not self._poller.poll(0):
                return self._mounts
            mounts = []
            for line in _read_all("/proc/self/mountinfo").decode("utf-8", "surrogateescape").splitlines():
                _, _, dev, root, mount = line.split(" ", 5)[:5]
                mount = mount.encode().decode("unicode_escape") if "\\" in mount else mount
                mounts.append((dev, root, mount))
            self._mounts = mounts
            return mounts


_HOST_MOUNTS = _MountTable()


def _forget_host_mounts() -> None:
    global _HOST_MOUNTS
    _HOST_MOUNTS = _MountTable()  # a forked child (a pool process) must not inherit a held lock


os.register_at_fork(after_in_child=_forget_host_mounts)


def _git_mount(git: str) -> tuple[str, bool] | None:
    """`major:minor root` of a bind mount of `git`, as mountinfo shows it (the root is the path
    within its filesystem), and whether `git` is a mount point here; None when no mount of this
    process's table contains it."""
    best: tuple[str, str, str] | None = None
    try:
        mounts = _HOST_MOUNTS.mounts()
    except OSError:
        return None
    for dev, root, mount in mounts:
        inside = git == mount or git.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[2])):
            best = (dev, root, mount)
    if best is None:
        return None
    dev, root, mount = best
    rest = os.path.relpath(git, mount)
    return f"{dev} {os.path.normpath(root.rstrip('/') + '/' + _escape(rest))}", mount == git


#: Where bwrap builds the sandbox's root before pivoting into it (its mount table shows these
#: prefixes until then): a workspace under them is checked from inside.
_STAGING = ("/newroot/", "/oldroot/")
#: How long a start waits for bwrap at each step of the gate; only a sandbox that lost the .git
#: race waits for its last mount-table change that never comes.
GATE_TIMEOUT = 10.0


#: The searches for git directories below a workspace's top, each kept for the next sandbox of
#: that workspace (`cell_init.GitScan` lists again only the folders changed since).
_SCANS: dict[str, tuple[cell_init.GitScan, threading.Lock]] = {}
_SCANS_LOCK = threading.Lock()
_SCANS_KEPT = 64
_PATH_MAX = 4096

open_no_links = cell_init.open_no_links
_gitdir_named = cell_init.gitdir_named


def nested_gits(workspace: str) -> list[tuple[str, Identity]]:
    """Git directories and `.git` files beneath `workspace` other than its top `.git`
    (`cell_init.GitScan`). Raises GateRefused past `cell_init.GITS_MOST` of them."""
    with _SCANS_LOCK:
        kept = _SCANS.pop(workspace, None)
        scan, lock = kept if kept is not None else (cell_init.GitScan(workspace), threading.Lock())
        while len(_SCANS) >= _SCANS_KEPT:
            _SCANS.pop(next(iter(_SCANS)))
        _SCANS[workspace] = scan, lock  # the most recently used last
    with lock:
        try:
            found = scan.search()
        except cell_init.TooManyGits as e:
            raise GateRefused(str(e)) from None
        if scan.stopped:
            log.warning("searched %d entries of %s for nested git directories and stopped (SCAN_ENTRIES); "
                        "any beyond are not made read-only", scan.entries, workspace)
    if any(len(os.fsencode(path)) >= _PATH_MAX for path in found):  # bwrap binds by path: it could not
        raise GateRefused("a git directory lies deeper below the workspace than the kernel's path limit (PATH_MAX): "
                          "a sandbox started per command cannot make it read-only, so no command runs here; remove "
                          "it, or use cells (TOOLQ_SANDBOX_CELLS=1, the default), which bind it by descriptor")
    return sorted(found.items())


class GateRefused(Exception):
    """The sandbox's .git is not the workspace's own: the command was not run."""


@dataclass(frozen=True)
class GitMount:
    """What `.git` must be in the sandbox's final root: a mount of its own there, of the workspace's
    own .git (the same device and inode as on the host when the command line was made). A `.git`
    swapped for a symlink to `..` while bwrap resolves the bind's source gets the workspace's
    parent bound (another inode); while it resolves the target, the bind lands on the parent and
    .git is no mount."""

    path: str
    workspace: str
    expected: Identity
    workspace_id: Identity
    host_root: Identity

    def judge(self, root: str) -> bool | None:
        """`root`: the sandbox's root as this process reaches it (`/proc/<pid>/root`). True: `.git`
        is the workspace's own; False: the root is final and it is not; None: not final yet (the
        host's root before bwrap's first pivot, its staging root with only newroot/ and oldroot/
        after it)."""
        try:  # the workspace first: in the staging root its path ends at the first component
            if _identity(root + self.workspace) != self.workspace_id or _identity(root, follow=True) == self.host_root:
                return None
            workspace_mount = _mount_id(root + self.workspace)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:  # no link on the way either: a folder above a nested .git swapped for one leads elsewhere
            git = open_no_links(root, self.path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            if e.errno == errno.ELOOP:
                return False
            raise
        try:  # one object for the three looks: a parallel call may rename what is at the path
            # The bind landed at .git (not, through a symlink there, on the workspace's parent),
            # bound the workspace's own .git (not what a symlink at the source pointed to), and is
            # read-only: bwrap finds its new mount again by the target's realpath to remount it
            # read-only, so a symlink to another mount point swapped in between gets that one
            # remounted and leaves .git writable.
            found = os.fstat(git)
            return (_mount_id("", git) != workspace_mount and (found.st_dev, found.st_ino) == self.expected
                    and bool(os.fstatvfs(git).f_flag & os.ST_RDONLY))
        finally:
            os.close(git)


class Gate:
    """The start handshake: bwrap writes its sandbox's pid (`--info-fd`), signals when `.git` is
    bound (`--file` on a socket, see `argv`), and waits (`--block-fd`) until `release` lets the
    command run. Closing the gate without a release lets bwrap go on: kill it first."""

    def __init__(self) -> None:
        self.info_r, self.info_w = os.pipe()
        self.block_r, self.block_w = os.pipe()
        self._bound, bound_child = socket.socketpair()
        self.bound_w = bound_child.detach()
        self.seccomp_fd = _seccomp_fd()
        self.git: GitMount | None = None
        self.nested: list[GitMount] = []
        """Nested git directories and `.git` files, each bound read-only and checked as `git`."""
        self.child: int | None = None
        """The sandbox's first process (pid 1 of its namespace), once bwrap said so."""

    @property
    def child_fds(self) -> tuple[int, ...]:
        # bwrap keeps a write end of --block-fd too: if this process dies at the gate, bwrap
        # waits forever (and dies with its cgroup) instead of reading end-of-file and going on.
        return tuple(fd for fd in (self.info_w, self.block_r, self.bound_w, self.block_w, self.seccomp_fd) if fd >= 0)

    def opened(self) -> None:
        """After the spawn: the ends bwrap holds are its own now."""
        for fd in (self.info_w, self.block_r, self.bound_w, self.seccomp_fd):
            if fd >= 0:
                os.close(fd)
        self.info_w = self.block_r = self.bound_w = self.seccomp_fd = -1
        self._bound.shutdown(socket.SHUT_WR)  # the file op reads nothing

    def release(self, set_limits: Callable[[int], None], alive: Callable[[], bool]) -> None:
        """Set the limits on the held sandbox, check .git, let the command run. Raises GateRefused
        (or OSError); returns without a release when bwrap ended on its own (its message is in
        the output)."""
        self.child = _read_child_pid(self.info_r)
        if self.child is None:
            return  # bwrap failed before its sandbox existed
        set_limits(self.child)
        if self.git is not None:
            own = self._git_is_own(alive)
            if own is None:
                _kill(self.child)  # bwrap ended during the set-up; nothing of it may go on
                return
            if not own:
                raise GateRefused(".git changed while the sandbox was set up (another command swapped it): "
                                  "the command did not run")
        _read_to_end(self.info_r)  # the rest of bwrap's JSON: closing the pipe first would SIGPIPE bwrap
        os.write(self.block_w, b"1")

    def _git_is_own(self, alive: Callable[[], bool]) -> bool | None:
        """Whether the final mount table has the workspace's own .git; None if bwrap ended first."""
        assert self.git is not None and self.child is not None
        self._bound.settimeout(GATE_TIMEOUT)
        if self._bound.recv(1) != b"":
            return False
        try:
            # Opened before the first look, never read: it polls POLLPRI on every later change of
            # the sandbox's mount table (its remount of / and pivots), so no change is missed.
            changes = os.open(f"/proc/{self.child}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            if alive():
                raise
            return None
        try:
            poller = select.poll()
            poller.register(changes, select.POLLPRI)
            deadline = time.monotonic() + GATE_TIMEOUT
            while (verdict := self._judge(f"/proc/{self.child}/root")) is None:
                if not alive():
                    return None
                if time.monotonic() > deadline:
                    return False
                poller.poll(50)
            return verdict
        except OSError:
            if alive():
                raise
            return None
        finally:
            os.close(changes)

    def _judge(self, root: str) -> bool | None:
        assert self.git is not None
        verdict = self.git.judge(root)
        if verdict:  # the root is final: every nested one must be as it was, too
            return all(mount.judge(root) for mount in self.nested)
        return verdict

    def close(self) -> None:
        for fd in (self.info_r, self.info_w, self.block_r, self.block_w, self.bound_w, self.seccomp_fd):
            if fd >= 0:
                os.close(fd)
        self.info_r = self.info_w = self.block_r = self.block_w = self.bound_w = self.seccomp_fd = -1
        self._bound.close()


@functools.lru_cache(maxsize=1)
def _program() -> bytes | None:
    return cell_init.seccomp_program()


def _seccomp_fd() -> int:
    """A descriptor bwrap's --seccomp reads the commands' filter from (to its end: one per start);
    -1 on an architecture without one."""
    program = _program()
    if program is None:
        return -1
    fd = os.memfd_create("toolq-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def spawn(build: Callable[[Gate], list[str]], set_limits: Callable[[int], None], **popen: Any) -> subprocess.Popen:
    """Popen bwrap's command line (`build`, given the gate) and hold it at the gate until
    `set_limits(pid)` and the .git check are done. Raises GateRefused or OSError, with nothing
    left running."""
    gate = Gate()
    try:
        pass_fds = (*gate.child_fds, *popen.pop("pass_fds", ()))
        proc = subprocess.Popen(build(gate), pass_fds=pass_fds, **popen)
        gate.opened()
        try:
            gate.release(set_limits, alive=lambda: not has_exited(proc.pid))
        except BaseException:
            # Before the gate closes: a closed --block-fd lets the sandbox go on.
            for pid in (gate.child, proc.pid):
                _kill(pid)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            raise
        return proc
    finally:
        gate.close()


def _kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


#: The first member of bwrap's `--info-fd` JSON, once its number is complete. bwrap writes the
#: JSON a member at a time (nine writes in 0.8); waiting for its end would wake this thread for each.
_CHILD_PID = re.compile(rb'^\s*\{\s*"child-pid"\s*:\s*(\d+)\s*[,}]')


def _read_child_pid(fd: int) -> int | None:
    """The sandbox's pid from bwrap's `--info-fd` (written before the sandbox starts); None if
    bwrap ended first. The rest of the JSON is left for `_read_to_end`."""
    data = b""
    for chunk in _chunks(fd):
        data += chunk
        if found := _CHILD_PID.match(data):
            return int(found.group(1))
    if not data:
        return None
    raise OSError(f"bwrap's --info-fd said {data[:200]!r}")


def _read_to_end(fd: int) -> None:
    """Until bwrap closes its end (right after its JSON's last member)."""
    for _ in _chunks(fd):
        pass


def _chunks(fd: int) -> Iterator[bytes]:
    """What bwrap writes to `fd`, until it closes it; OSError past GATE_TIMEOUT."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise OSError(f"bwrap did not start its sandbox within {GATE_TIMEOUT:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        yield chunk


def probe(policy: Policy) -> str | None:
    """None when bubblewrap runs a command here with this policy, through its gate and with a
    `.git` to check; else why not (one line)."""
    bwrap = executable()
    if bwrap is None:
        return "bwrap is not installed"
    with tempfile.TemporaryDirectory(prefix="toolq-probe-") as ws:
        os.mkdir(os.path.join(ws, ".git"))
        try:
            proc = spawn(lambda gate: argv(bwrap, policy, ws, ws, ["/bin/sh", "-c", "echo ok > probe"], gate),
                         lambda pid: None, env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
        except (OSError, GateRefused) as e:
            return f"bwrap did not run: {e}"
        try:
            _, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "bwrap did not run: it did not finish within 20 s"
        if proc.returncode != 0 or not (Path(ws) / "probe").exists():
            err = stderr.decode(errors="replace").strip().splitlines()
            return f"bwrap failed here ({err[-1] if err else f'exit {proc.returncode}'})"
    return None


def version(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.split()
        return out[-1] if out else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"
