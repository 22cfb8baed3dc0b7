"""`toolq run` without paying for its imports again: the client of a warm fleet's launcher.

A one-call turn on a warm fleet spends most of its time importing (pydantic, httpx, redis-py and
toolq's run path: 0.4 s of 0.7 s), which a Python process pays at every launch. While `toolq up`
runs, this launcher keeps one process with the run path imported and idle (no thread, no
connection, no event loop), listening on a socket in the user's private runtime directory. A
`toolq run` connects (the client below imports only the standard library), passes its standard
streams, arguments, environment and directory, and the launcher forks a child that becomes that
run: it writes to the caller's terminal, reads its stdin, and its exit status is the caller's.
Signals the caller gets (Ctrl-C, SIGTERM, a resize) go to the child; a caller that dies (SIGKILL)
takes the child with it.

Trust: both ends check the other is this user (SO_PEERCRED), the socket lives in the 0700
runtime directory, and the client never uses a runtime directory inside the folder a run works
in (what a command writes must not be able to stand in for the launcher and read a run's
environment). A caller whose interpreter or import path differs from the launcher's is refused
(it could import other code), and runs the ordinary way, as does any run when anything here fails.
`TOOLQ_LAUNCHER=0` turns the client off.

Only the standard library is imported: the client runs before anything else. The launcher
itself is toolq/cli/launcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import sys
from pathlib import Path
from typing import Any

SOCKET_NAME = "launcher.sock"
#: A key the launcher makes at start (0600 beside the socket): a request without it is refused,
#: so a process that can connect to the socket but not read the runtime directory (a sandboxed
#: command, were it ever let create a Unix socket) cannot make it fork a run.
KEY_NAME = "launcher.key"
#: The largest request (arguments and environment); a bigger one runs the ordinary way.
MAX_REQUEST = 1 << 20
#: Commands the launcher runs: `toolq run`, whose start-up is mostly imports. Not `resume` (its
#: workspace is the saved turn's, which the client cannot check against the runtime directory),
#: `demo` (it starts its own stack) nor `batch` (a long job).
COMMANDS = frozenset({"run"})
#: What the client forwards to the child.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGWINCH, signal.SIGUSR1,
             signal.SIGUSR2)
#: What must match between a caller and the launcher, or the child could import other code.
SAME_PYTHON = ("PYTHONPATH", "TOOLQ_TOOLS_PATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")


def runtime_root(env: Any = None) -> Path:
    """The user's runtime directory for toolq (stdlib only: the client runs before any import)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "toolq"
    return Path("/tmp") / f"toolq-{os.geteuid()}"


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def python_identity(env: Any) -> dict[str, Any]:
    return {"executable": sys.executable, "prefix": sys.prefix, **{k: env.get(k, "") for k in SAME_PYTHON}}


# ---- the client: `toolq run` ------------------------------------------------------------------

def _inside(root: Path, folders: list[str]) -> bool:
    for folder in folders:
        try:
            where = Path(folder).resolve()
        except (OSError, RuntimeError):
            return True  # cannot tell: do not trust the directory
        if root == where or where in root.parents:
            return True
    return False


def _workspaces(argv: list[str]) -> list[str]:
    """The folders the run may work in, as its settings will pick them (`--workspace`, else
    TOOLQ_WORKSPACE, else the current directory; and an `--upload` folder): a runtime directory
    inside one is never trusted."""
    flagged = {"--workspace": "", "--upload": ""}
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in flagged:
            flagged[name] = value if value else (argv[i + 1] if i + 1 < len(argv) else "")
    workspace = flagged["--workspace"] or os.environ.get("TOOLQ_WORKSPACE", "") or os.getcwd()
    return [f for f in (workspace, flagged["--upload"]) if f]


#: Set in a launcher's child: it is the run, and must not ask the launcher again.
launched = False


def try_launch(argv: list[str]) -> int | None:
    """Run `toolq ARGV` in the warm fleet's launcher and return its exit status, or None: no
    launcher (or a refusal, or any failure before the child started), so run the ordinary way."""
    if launched or os.environ.get("TOOLQ_LAUNCHER", "1") == "0" or not argv or argv[0] not in COMMANDS:
        return None
    try:
        root = runtime_root().resolve()
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return None
        if _inside(root, _workspaces(argv)):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        key = read_key(root)
        sock.connect(str(root / SOCKET_NAME))
        if peer_uid(sock) != os.geteuid():
            return None
        request = {"key": key, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
                   "python": python_identity(os.environ)}
        payload = json.dumps(request).encode()
        if len(payload) > MAX_REQUEST:
            return None
        socket.send_fds(sock, [payload], [0, 1, 2])
        first = json.loads(sock.recv(4096) or b"{}")
    except (OSError, ValueError):
        sock.close()
        return None
    pid = first.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        sock.close()
        return None  # refused (another interpreter, a bad request): the ordinary way
    return _follow(sock, pid)


def read_key(root: Path) -> str:
    """The launcher's key: a file of ours, 0600, never through a link (OSError otherwise)."""
    fd = os.open(root / KEY_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(f"{root / KEY_NAME} is not a private file of ours")
        return os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow(sock: socket.socket, pid: int) -> int:
    """The child runs: forward signals to it and wait for its status."""
    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            raw = sock.recv(4096)
        except InterruptedError:
            continue
        except OSError:
            raw = b""
        if not raw:
            print("toolq: the run's process ended without a status (the warm fleet's launcher was killed)",
                  file=sys.stderr)
            return 1
        status = json.loads(raw)
        if "exit" in status:
            return int(status["exit"])
        if "signal" in status:  # end as the child ended, so a shell sees the same thing
            ended = int(status["signal"])
            signal.signal(ended, signal.SIG_DFL)
            os.kill(os.getpid(), ended)
            return 128 + ended
