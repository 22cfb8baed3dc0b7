"""Where a running embedded stack tells the same user's other shells how to reach it.

With no `REDIS_URL`, `toolq run` starts a private, password-protected server. `toolq cancel`,
`status` and `turns` in another shell find it here: one file per running stack in a per-user
runtime directory (`$XDG_RUNTIME_DIR/toolq`, else `/tmp/toolq-<uid>`), naming the server's URL
with its password. The directory is 0700 and each file 0600, and both must be owned by the
reader: a directory or file another user made (to plant a URL or read ours) is refused, never
trusted. A file whose process is gone (a SIGKILLed run) is stale and removed when found.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from toolq.core import trusted_files
from toolq.core.errors import ConfigurationError

ENTRY_PREFIX = "stack-"


class StackEntry(BaseModel):
    """One running embedded stack, as its file records it."""

    pid: int
    """The `toolq run` (or demo, bench) process that owns the stack."""
    pid_started: str | None = None
    """That process's start time (/proc/PID/stat field 22), so a reused pid is not mistaken for it."""
    redis_url: str
    """Broker and ledger, password included (hence the 0600 file)."""
    started_at: float
    logdir: str
    warm: WarmFleet | None = None
    """Set for a stack `toolq up` left running for the next runs (toolq/local/warm.py)."""


class WarmFleet(BaseModel):
    """What a run needs to use a warm stack instead of starting its own."""

    signing_key: str
    """The fleet's key (its workers check every call against it), hence the 0600 file."""
    tools: list[str]
    """The tool modules its workers loaded: a run asking for others starts its own stack."""
    settings_digest: str
    """What its workers run with (the sandbox, limits, the tools path: `warm.settings_digest`): a
    run whose own settings differ starts its own stack rather than have them ignored."""


StackEntry.model_rebuild()


def runtime_root(env: dict[str, str] | os._Environ[str] | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "toolq"
    return Path("/tmp") / f"toolq-{os.geteuid()}"


def _check_private(st: os.stat_result, path: Path, kind: str) -> None:
    if st.st_uid != os.geteuid():
        raise ConfigurationError(f"{path} belongs to uid {st.st_uid}, not you: refusing to use it; remove it "
                                 "or set XDG_RUNTIME_DIR to a directory of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigurationError(f"{path} is mode {stat.S_IMODE(st.st_mode):o}, readable by others: "
                                 f"refusing to use it; `chmod 700` it (a {kind} of toolq's must be private)")


def private_root(create: bool = True) -> Path | None:
    """The runtime directory, created 0700 if absent; None if absent and not `create`.
    Refuses (ConfigurationError) one that is a symlink, not a directory, or not private to us."""
    root = runtime_root()
    if create:
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"{root} is not a directory (a symlink?): refusing to use it; remove it")
    _check_private(st, root, "directory")
    return root


def _process_start(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19]  # field 22 overall: starttime, in clock ticks since boot


def alive(entry: StackEntry) -> bool:
    """Whether the entry's process still runs (a zombie has stopped: it only waits to be reaped)."""
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: the pid was reused, our run is gone
    try:
        if Path(f"/proc/{entry.pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        return False
    return entry.pid_started is None or _process_start(entry.pid) in (None, entry.pid_started)





def register(redis_url: str, logdir: Path, warm: WarmFleet | None = None) -> Path | None:
    """Announce a stack of this process; returns its file (remove it with `unregister`).
    A runtime directory that cannot be trusted costs only discovery: warned, and the run goes on."""
    try:
        root = private_root()
        assert root is not None
    except (ConfigurationError, OSError) as e:
        print(f"toolq: `toolq cancel/status/turns` will not find this run without REDIS_URL: {e}", file=sys.stderr)
        return None
    pid = os.getpid()
    entry = StackEntry(pid=pid, pid_started=_process_start(pid), redis_url=redis_url, started_at=time.time(),
                       logdir=str(logdir), warm=warm)
    path = root / f"{ENTRY_PREFIX}{pid}-{secrets.token_hex(4)}.json"
    # Never written through a name someone else prepared: the file holds the server's password.
    trusted_files.replace(path, entry.model_dump_json().encode(), "the runtime entry")
    return path


def unregister(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def _read_entry(path: Path) -> StackEntry | None:
    """The entry if the file is ours, private and well-formed; None (left alone) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            _check_private(st, path, "file")
            entry = StackEntry.model_validate(json.loads(f.read()))
        except (ConfigurationError, ValueError, ValidationError):
            return None
        # A stack of ours serves on loopback: an entry naming another host was not written by toolq.
        return entry if _on_loopback(entry.redis_url) else None


def _on_loopback(url: str) -> bool:
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host in ("127.0.0.1", "localhost", "::1")


def running_stacks() -> list[StackEntry]:
    """This user's running embedded stacks, oldest first; stale files are removed on the way."""
    root = private_root(create=False)
    if root is None:
        return []
    found = []
    for path in sorted(root.glob(f"{ENTRY_PREFIX}*.json")):
        entry = _read_entry(path)
        if entry is None:
            continue
        if alive(entry):
            found.append(entry)
        else:
            path.unlink(missing_ok=True)
    return sorted(found, key=lambda e: e.started_at)


def ledger_urls(redis_url: str | None) -> list[str]:
    """The Redis URLs `toolq cancel/status/turns` read: REDIS_URL if set, else every running
    embedded stack of this user."""
    if redis_url:
        return [redis_url]
    urls = [e.redis_url for e in running_stacks()]
    if not urls:
        raise ConfigurationError(f"no REDIS_URL and no embedded `toolq run` of yours is running "
                                 f"(none announced in {runtime_root()}); set REDIS_URL to the Redis the "
                                 "orchestrator uses")
    return urls
