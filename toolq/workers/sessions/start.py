"""Starting, watching and stopping a worker's session host, from the worker's main process.

A host that dies (killed, out of memory) takes its sessions with it; a watcher thread kills what
its commands left in their cgroups (`limits.remove_stale_pool_cgroups`: the slots are named after
the dead host's pid) and starts a new one, so the worker goes on serving exec_command.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import tempfile
import threading

from toolq.core import import_path
from toolq.core.libc import die_with_parent
from toolq.workers.environments import namespace
from toolq.workers.isolation import limits
from toolq.workers.sessions import host_client
from toolq.workers.sessions.host_client import SOCKET_ENV

log = logging.getLogger("toolq.sessions")

_host: subprocess.Popen | None = None
_dir: str | None = None
_stopping = threading.Event()
_key = b""
"""What every request to the host starts with (`host_client._key`)."""
_booting: tuple[subprocess.Popen, str] | None = None
"""A launched host and its socket path, until `wait_ready` has seen it listen."""
#: How long a host that exited 0 waits for the worker's own shutdown notice before it is restarted.
STOP_NOTICE = 2.0


def _die_with_parent() -> None:
    # SIGTERM, not SIGKILL: the host kills its sessions' process groups before it goes.
    die_with_parent(signal.SIGTERM)


def _launch(path: str, env: dict[str, str]) -> subprocess.Popen:
    """The host reads its key from its stdin (not its environment: `/proc/<pid>/environ`)."""
    if os.path.exists(path):
        os.unlink(path)
    host = subprocess.Popen(import_path.python_argv("-m", "toolq.workers.sessions.host"), env=env,
                            cwd=import_path.NEUTRAL_CWD, stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                            preexec_fn=_die_with_parent, pass_fds=namespace.member_fds())
    assert host.stdin is not None
    try:
        host.stdin.write(_key + b"\n")
        host.stdin.close()
    except OSError:
        pass  # it died at once: _wait_ready says so
    return host


def _wait_ready(host: subprocess.Popen, path: str) -> subprocess.Popen:
    assert host.stdout is not None
    line = host.stdout.readline()
    if not line or json.loads(line).get("ready") != path:
        host.kill()
        raise RuntimeError("the session host did not start")
    return host


def _spawn(path: str, env: dict[str, str]) -> subprocess.Popen:
    return _wait_ready(_launch(path, env), path)


def start(*, instance: str, hostname: str, redis_url: str) -> str:
    """Launch the host before the pool forks (its pool children find it through the environment);
    `wait_ready` waits for it, so it boots while the pool does (a quarter of a worker's start)."""
    global _host, _dir, _booting
    _dir = tempfile.mkdtemp(prefix="toolq-sessions-")  # 0700: only this uid reaches the socket
    global _key
    _key = secrets.token_hex(32).encode()
    host_client.set_key(_key)
    path = os.path.join(_dir, "host.sock")
    env = dict(os.environ, TOOLQ_SESSION_SOCKET=path, TOOLQ_SESSION_REDIS=redis_url,
               TOOLQ_SESSION_INSTANCE=instance, TOOLQ_SESSION_HOSTNAME=hostname)
    _stopping.clear()
    _host = _launch(path, env)
    _booting = _host, path
    os.environ[SOCKET_ENV] = path
    threading.Thread(target=_watch, args=(path, env), name="toolq-session-watch", daemon=True).start()
    return path


def wait_ready() -> None:
    """Before the worker takes its first call: the host it launched listens. One that did not
    start is killed, and the watcher starts another (its calls meanwhile say the host does not
    answer)."""
    global _booting
    if _booting is None:
        return
    (host, path), _booting = _booting, None
    try:
        _wait_ready(host, path)
    except (OSError, ValueError, RuntimeError) as e:
        log.error("the session host did not start (%s); starting another", e)


def _watch(path: str, env: dict[str, str]) -> None:
    """Restart a host that died; the restarted one is tied (PDEATHSIG) to this thread, which
    lives until `stop()`."""
    global _host
    while _host is not None:
        code = _host.wait()
        # Exit 0 is a host stopped on request (SIGTERM): when it came to the worker's whole process
        # group, the worker's shutdown notice follows at once; restarting the host meanwhile made a
        # stopping worker start a new one.
        if _stopping.wait(STOP_NOTICE if code == 0 else 0):
            return
        log.warning("the session host exited (%s): its sessions are lost; starting a new one", code)
        limits.remove_stale_pool_cgroups()
        try:
            _host = _spawn(path, env)
        except (OSError, RuntimeError) as e:
            log.error("could not restart the session host: %s", e)
            return


def stopping() -> None:
    """The worker's warm shutdown began: a host that exits from now on is not restarted."""
    _stopping.set()


def stop() -> None:
    """At the worker's shutdown: the host kills every session, then exits."""
    global _host, _booting
    _stopping.set()
    host, _host, _booting = _host, None, None
    if host is None:
        return
    host.send_signal(signal.SIGTERM)
    try:
        host.wait(timeout=5)
    except subprocess.TimeoutExpired:
        host.kill()
    if _dir is not None:
        try:
            os.rmdir(_dir)
        except OSError:
            pass
    os.environ.pop(SOCKET_ENV, None)
    host_client.set_key(None)
