"""An uploaded folder -> a deterministic tar and its manifest (`pack_dir`); a git checkout packs
only what git lists (`_git_listing`)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

from toolq.workers.environments.archive.model import (
    DEFAULT_LIMITS,
    OUTSIDE,
    ArchiveError,
    Entry,
    Limits,
    Manifest,
    Packed,
    _in_git_dir,
    _is_utf8,
    _Links,
    _order,
    _parents,
    _shown,
)
from toolq.workers.environments.archive.tarfiles import _TarWriter
from toolq.workers.environments.archive.walk import _Budget, _kind_of, _Node, _read_file, _TooBig, _walk
from toolq.workers.workspace import open_entry


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
        listed = _git_listing(folder) if _is_checkout(folder) else None
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


def _is_checkout(folder: Path) -> bool:
    """A `.git` that git takes for a repository: a `.git` file (a worktree's), or a folder with
    something in it. The empty `.git` the sandbox leaves in a workspace that had none (so that no
    command can make one: isolation/bwrap.py) is no repository, to git or here."""
    git = folder / ".git"
    try:
        if not git.is_dir() or git.is_symlink():
            return os.path.lexists(git)
        with os.scandir(git) as entries:
            return next(entries, None) is not None
    except OSError:
        return True  # git will say what is wrong with it


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
