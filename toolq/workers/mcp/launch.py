"""The worker's MCP host process: started before Celery forks its pool, started again when it dies.

The host (`host.py`) holds every server's session, so a host that dies (killed, out of memory)
takes them all with it. The worker's main process waits on it from a thread and starts it again
on the same socket path after a backoff (`backoff.py`); pool children, which inherited only the
path, reconnect once it is back (`HostClient`). Each start's listing generations begin past the
previous start's, so a listing after a restart never looks unchanged to a process that saw one
from before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from toolq.core import import_path, trusted_files
from toolq.core.errors import ConfigurationError
from toolq.workers.environments import namespace
from toolq.workers.mcp.backoff import Backoff
from toolq.workers.mcp.wire import Listing

if TYPE_CHECKING:
    from toolq.workers.mcp.host import HostConfig

log = logging.getLogger("toolq.worker")

#: Generations one start of the host may use before the next start's begin.
GENERATIONS_PER_START = 1 << 32


class HostProcess:
    def __init__(self, path: str, config: HostConfig, env: dict[str, str], logfile: str | None) -> None:
        self.path, self.config, self.env, self.logfile = path, config, env, logfile
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self) -> Listing | None:
        """Start the host and wait for its first listing (every server started or failed its first
        start); None if it exited before giving one."""
        with self._lock:
            if self._stopping.is_set():
                return None
            config = self.config.model_copy(update={"first_generation": self.starts * GENERATIONS_PER_START})
            # The host's log and its servers' stderr go to the worker's logfile when it has one.
            log_to = self._log()
            # Its own session: a signal to the worker's process group (Ctrl-C, a supervisor's group
            # SIGTERM) must neither take the host down while a warm shutdown lets calls finish nor
            # look like a crash to restart. The worker stops it at shutdown (`stop`), and it exits
            # by itself once the worker is gone (it polls its parent).
            try:
                proc = subprocess.Popen(import_path.python_argv("-m", "toolq.workers.mcp.host", self.path),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_to, env=self.env,
                                        cwd=import_path.NEUTRAL_CWD, start_new_session=True,
                                        pass_fds=namespace.member_fds())  # keeps its host's namespace
            finally:
                if log_to is not None:
                    log_to.close()
            self.proc, self.started_at = proc, time.monotonic()
            self.starts += 1
        assert proc.stdin is not None and proc.stdout is not None
        with proc.stdin:
            proc.stdin.write(config.model_dump_json().encode())
        with proc.stdout:
            first = proc.stdout.readline()
        return Listing.model_validate_json(first) if first else None

    def _log(self) -> IO[bytes] | None:
        """The worker's logfile, opened again at each start: never through a link planted since."""
        if not self.logfile:
            return None
        try:
            return trusted_files.open_append(Path(self.logfile), "the worker's --logfile")
        except (ConfigurationError, OSError) as e:
            log.error("MCP host: %s; its log goes to the worker's stderr", e)
            return None

    def supervise(self) -> None:
        """From now on, a host that exits is started again, until `stop`."""
        threading.Thread(target=self._watch, name="toolq-mcp-host", daemon=True).start()

    def _watch(self) -> None:
        backoff = Backoff()
        while self.proc is not None:
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            delay = backoff.after_crash(time.monotonic() - self.started_at)
            log.warning("the MCP host exited with %s, and its servers with it; restarting it in %.1fs", code, delay)
            if self._stopping.wait(delay):
                return
            listing = self.start()
            if listing is not None:
                log.info("the MCP host is back: %s",
                         ", ".join(f"{s.name} {s.state} ({len(s.tools)} tools)" for s in listing.servers))

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        # The socket's folder is ours (mkdtemp, 0700): a warm shutdown left it in /tmp. Anything
        # else found in it stays, and so does the folder (rmdir removes only an empty one).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))
