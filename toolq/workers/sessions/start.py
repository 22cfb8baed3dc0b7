"""Starting and stopping a worker's session host, from the worker's main process."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile

from toolq.workers.sessions.client import SOCKET_ENV

_PR_SET_PDEATHSIG = 1
_host: subprocess.Popen | None = None
_dir: str | None = None


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start(*, instance: str, hostname: str, redis_url: str) -> str:
    """Start the host before the pool forks; its pool children find it through the environment."""
    global _host, _dir
    _dir = tempfile.mkdtemp(prefix="toolq-sessions-")  # 0700: only this uid reaches the socket
    path = os.path.join(_dir, "host.sock")
    env = dict(os.environ, TOOLQ_SESSION_SOCKET=path, TOOLQ_SESSION_REDIS=redis_url,
               TOOLQ_SESSION_INSTANCE=instance, TOOLQ_SESSION_HOSTNAME=hostname)
    _host = subprocess.Popen([sys.executable, "-m", "toolq.workers.sessions.host"], env=env,
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    assert _host.stdout is not None
    line = _host.stdout.readline()
    if not line or json.loads(line).get("ready") != path:
        raise RuntimeError("the session host did not start")
    os.environ[SOCKET_ENV] = path
    return path


def stop() -> None:
    """At the worker's shutdown: the host kills every session, then exits."""
    global _host
    if _host is None:
        return
    _host.send_signal(signal.SIGTERM)
    try:
        _host.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _host.kill()
    _host = None
    if _dir is not None:
        try:
            os.rmdir(_dir)
        except OSError:
            pass
    os.environ.pop(SOCKET_ENV, None)
