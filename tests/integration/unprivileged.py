"""A worker run as an unprivileged user, so that every attack tried on a root worker is tried on
one that runs as `nobody` too (issue 24: "as root and as an unprivileged worker user").

Here the interpreter lives under /root (mode 0700), which `nobody` cannot traverse. The worker
therefore starts in a private mount namespace where each such directory is an empty tmpfs
(mode 0755) holding only what the worker needs from it (the interpreter's prefix), bound back in;
the host's mounts are not changed. Then `setpriv` drops to the user, with no supplementary groups
and no capabilities, and execs the worker: the worker's pid is the one `Popen` started, so
`WorkerProcess.stop`/`kill` work as for a root worker.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import toolq
from toolq.local.embedded import WorkerProcess

USER = "nobody"
#: A second unprivileged uid, for "another local user runs what the worker's command left".
OTHER_UID = 4243
#: A worker user of its own, with no entry in /etc/passwd (as in many containers): unlike nobody,
#: whose uid is the kernel's overflow uid, it mounts its environments' overlays in its host's
#: namespace (toolq/workers/environments/namespace.py).
OWN_IDS = (4244, 4244)


def unavailable() -> str | None:
    """Why a worker cannot be started as another user here, or None."""
    if os.geteuid() != 0:
        return "starting a worker as another user needs root"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"there is no user {USER!r} here"
    return None


def ids() -> tuple[int, int]:
    entry = pwd.getpwnam(USER)
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        gid = entry.pw_gid
    return entry.pw_uid, gid


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory above `path` that others cannot traverse, if any."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        d = os.path.join(*parts[:i])
        if os.path.isdir(d) and not os.stat(d).st_mode & stat.S_IXOTH:
            return d
    return None


def _needed() -> list[str]:
    """What the worker reads: the interpreter's prefixes, the virtualenv, the toolq checkout."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(toolq.__file__)))}
    return sorted(paths)


def wrap(argv: list[str], keep: str, as_ids: tuple[int, int] | None = None) -> list[str]:
    """`argv` run as the user (`as_ids`: another uid and gid), in a mount namespace of its own
    where it can reach `_needed()`. `keep`: an empty directory of the caller's, where the needed
    paths wait while a tmpfs covers their closed ancestor."""
    uid, gid = as_ids or ids()
    steps = ["set -e"]
    covers: dict[str, list[str]] = {}
    for path in _needed():
        top = _closed_ancestor(path)
        if top is not None:
            covers.setdefault(top, []).append(path)
    n = 0
    for top, paths in covers.items():
        aside = []
        for path in paths:
            spot = os.path.join(keep, str(n))
            n += 1
            steps += [f"mkdir -p {shlex.quote(spot)}", f"mount --bind {shlex.quote(path)} {shlex.quote(spot)}"]
            aside.append((spot, path))
        steps.append(f"mount -t tmpfs -o mode=0755,size=1m toolq-test {shlex.quote(top)}")
        for spot, path in aside:
            steps += [f"mkdir -p {shlex.quote(path)}", f"mount --move {shlex.quote(spot)} {shlex.quote(path)}"]
    steps.append(f'exec setpriv --reuid={uid} --regid={gid} --clear-groups --inh-caps=-all -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(steps), "toolq-as-user",
            *argv]


def owned_dir(prefix: str, as_ids: tuple[int, int] | None = None) -> Path:
    """A new directory the user (or `as_ids`) owns (mode 0700), where it can reach it (under /tmp)."""
    uid, gid = as_ids or ids()
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(d, uid, gid)
    return d


def worker_folder(user: bool, tmp_path_factory: Any, name: str, as_ids: tuple[int, int] | None = None) -> Path:
    """A folder for a worker's files: one the user (or `as_ids`) owns for an unprivileged worker
    (skipped where there can be none), else a pytest folder of root's."""
    if user and (why := unavailable()):
        pytest.skip(f"no unprivileged worker here: {why}")
    return owned_dir(f"toolq-{name}-", as_ids) if user else tmp_path_factory.mktemp(name)


class UserWorkerProcess(WorkerProcess):
    """A `WorkerProcess` run as `USER`, or as `as_ids` (see the module's docstring)."""

    def __init__(self, *args: Any, as_ids: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user_ids = as_ids or ids()
        os.chown(self.logdir, *self.user_ids)
        self._keep = tempfile.mkdtemp(prefix="toolq-as-user-")

    def argv(self) -> list[str]:
        return wrap(super().argv(), self._keep, self.user_ids)

    def start(self, wait: bool = True) -> WorkerProcess:
        name = USER if self.user_ids == ids() else f"u{self.user_ids[0]}"
        self.env = {**self.env, "HOME": "/nonexistent", "USER": name, "LOGNAME": name}
        self.log.write_text("")
        os.chown(self.log, *self.user_ids)
        return super().start(wait)

    def stop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().stop(*args, **kwargs)
        finally:
            shutil.rmtree(self._keep, ignore_errors=True)
