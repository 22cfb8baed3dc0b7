"""Files toolq writes for its user (a conversation's `--session` file, `toolq batch --out`):
never through a link, never inside a workspace.

A command can plant a symlink anywhere in its workspace (`conversation.json.tmp` ->
`~/.bashrc`, `results.jsonl` -> `/etc/ld.so.preload`); a trusted process that opens such a name
would write there with model-chosen content. So a file is refused inside a workspace, a
replacement goes through a temporary name created exclusively beside it, and every open refuses a
link in the last component (`O_NOFOLLOW`) and anything but a regular file of ours.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from toolq.core.errors import ConfigurationError

#: No link followed; a FIFO planted at the name does not block the open (it is then refused).
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def refuse_inside(path: Path, workspaces: Iterable[Path], what: str) -> None:
    """ConfigurationError when `path` lies in one of `workspaces`, where the model's commands write."""
    where = os.path.realpath(path.parent)
    for workspace in workspaces:
        root = os.path.realpath(workspace)
        if where == root or where.startswith(root.rstrip("/") + "/"):
            raise ConfigurationError(f"{what} {path} is inside the workspace {workspace}, where the model's commands "
                                     "could replace it with a link: keep it outside the workspace")


def _regular(fd: int, path: Path, what: str) -> int:
    """`fd` if it is a regular file of ours: another user's file (one they prepared, or a hard
    link to something of theirs) is neither read as our conversation nor appended to."""
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"belongs to uid {st.st_uid}, not you" if st.st_uid != os.geteuid() else None)
    if problem:
        os.close(fd)
        raise ConfigurationError(f"{what} {path} {problem}")
    return fd


def _open(path: Path, flags: int, what: str, mode: int = 0o600) -> int:
    try:
        return _regular(os.open(path, flags | _NOFOLLOW, mode), path, what)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise ConfigurationError(f"{what} {path} is a symbolic link; toolq does not write through one") from None
        raise


def read_bytes(path: Path, what: str) -> bytes | None:
    """The file's bytes, None when it does not exist; a link or a non-file is refused."""
    try:
        fd = _open(path, os.O_RDONLY, what)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def replace(path: Path, data: bytes, what: str) -> None:
    """`path` now holds `data`, whole or not at all: written to a new name beside it that nobody
    could have prepared (O_EXCL), then renamed over it (a link at `path` is replaced, not followed)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_append(path: Path, what: str, mode: int = 0o644) -> IO[bytes]:
    """`path` opened to append (created if missing), never through a link."""
    return os.fdopen(_open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, what, mode), "ab+")
