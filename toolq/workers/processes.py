"""How tools run processes: a process-group runner (confinement of paths: `toolq.workers.workspace`).

Processes: `run_command` starts each command in its own session (pid = pgid) and always ends by
SIGKILLing that whole group, so no grandchild outlives its call. Celery's `revoke(terminate=True)`
SIGTERMs the pool child but not its subprocesses
(docs/reference/celery-notes.md#terminating-a-running-task); `install_sigterm_handler` closes
that gap by killing every live group before the child dies.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolq.core import tracing as names
from toolq.telemetry import metrics
from toolq.workers import spans
from toolq.workers.isolation import reaper

if TYPE_CHECKING:
    from toolq.core.catalog import LiveOutput
    from toolq.workers.isolation import Launch, Sandbox

#: Output kept per command (Codex's `DEFAULT_OUTPUT_BYTES_CAP`): half head, half tail.
DEFAULT_OUTPUT_CAP = 1024 * 1024
#: How long to keep reading after the kill (Codex's `IO_DRAIN_TIMEOUT_MS`): a process that left the
#: group (setsid) may still hold the pipe, and must not hang the call.
DRAIN_TIMEOUT = 2.0
#: How often a running command checks its deadline and `is_cancelled`.
POLL_INTERVAL = 0.05
_READ_CHUNK = 8192
#: Output dropped past the cap after which reading slows to one pipe's worth per poll step. A
#: flood (`yes` until the timeout) kept most of a worker's core busy reading ~5 GB in 4 s; slowed,
#: the command blocks on the full pipe, and the tail kept is still the output's true tail.
FLOOD_BYTES = 64 * 1024 * 1024
_PIPE_CHUNK = 65536


class CallCancelled(Exception):
    """The call was cancelled while it ran; its process group is already dead."""


# --- live process groups ---------------------------------------------------------------------

_groups_lock = threading.Lock()
_live_groups: set[int] = set()
_previous_sigterm: object = None


def live_process_groups() -> frozenset[int]:
    """The process groups this process started and has not finished with yet."""
    with _groups_lock:
        return frozenset(_live_groups)


def kill_live_groups() -> None:
    """SIGKILL every live group, and what left them (safe to call from a signal handler)."""
    for pgid in live_process_groups():
        _killpg(pgid)
    reaper.sweep()


def install_sigterm_handler() -> bool:
    """On SIGTERM, kill every live group, then die of SIGTERM as before.

    Call it from the main thread of the process that runs tools (the pool child). Returns False if
    it was already installed. The previous handler is restored before the signal is re-delivered,
    so a process that had SIG_DFL still terminates, and one with a Python handler still runs it.
    """
    global _previous_sigterm
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return False
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum: int, frame: object) -> None:
    seen, leaders = time.monotonic(), live_process_groups()
    kill_live_groups()
    if leaders and metrics.on():  # a revoke (terminate=True): cancel-to-dead, until each leader is reaped
        if _reap_within(leaders, seen + 1.0):  # SIGKILLed: at once; never held up past a second
            metrics.cancel_to_dead(time.monotonic() - seen)
    previous = _previous_sigterm if _previous_sigterm is not None else signal.SIG_DFL
    signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGTERM)


def _reap_within(leaders: frozenset[int], deadline: float) -> bool:
    """Reap each group's leader (this process dies next: nothing else waits for them); False if
    one is still there at the deadline."""
    for pgid in leaders:
        while True:
            try:
                if os.waitpid(pgid, os.WNOHANG)[0]:
                    break
            except (ChildProcessError, InterruptedError):  # reaped already, or not ours
                break
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
    return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- running commands ------------------------------------------------------------------------


@dataclass
class CommandResult:
    exit_code: int
    """The process's exit status; a death by signal N reads 128+N, as a shell reports it; -1 if
    it never started."""
    output: bytes
    """stdout and stderr merged in arrival order, capped (head and tail kept, middle dropped)."""
    wall_time: float
    timed_out: bool = False
    cancelled: bool = False
    pid: int | None = None
    """Also the process group id."""
    dropped_bytes: int = 0
    """Bytes cut from the middle of the output to respect the cap."""
    spawn_error: OSError | None = None
    """Set when the process could not be started (missing cwd, missing shell...)."""
    limit_note: str | None = None
    """The sandbox limit the command ran into, in words (CPU time, file size, processes, memory)."""


class HeadTailBuffer:
    """Keeps the first and last `cap // 2` bytes of a stream (Codex's `HeadTailBuffer`)."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.listener: Callable[[bytes], None] | None = None
        """Also hears every byte written (a call's output stream)."""

    def write(self, data: bytes) -> None:
        if self.listener is not None:
            self.listener(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        excess = len(self.tail) - self.tail_cap
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def getvalue(self) -> bytes:
        return bytes(self.head + self.tail)


def run_command(
    command: str | Sequence[str],
    *,
    cwd: Path | str,
    timeout: float | None = None,
    is_cancelled: Callable[[], bool] | None = None,
    output_cap: int = DEFAULT_OUTPUT_CAP,
    env: dict[str, str] | None = None,
    shell: str = "bash",
    sandbox: Sandbox | None = None,
    workspace: Path | str | None = None,
    output: LiveOutput | None = None,
) -> CommandResult:
    """Run `command` (a script for `shell -c`, or an argv) in its own process group.

    Returns when the process exits, the timeout passes, or `is_cancelled()` turns true (checked
    every `POLL_INTERVAL`). Whatever the reason, the whole group is SIGKILLed before returning,
    so background children and grandchildren never outlive the call. A spawn failure is reported
    in `spawn_error`, never raised. With a `sandbox`, the command runs confined to `workspace`
    (default: `cwd`) with the sandbox's environment and limits (toolq/workers/isolation). With an
    `output` stream, what the command prints is also published as it comes (toolq/workers/streaming.py).
    """
    argv = [shell, "-c", command] if isinstance(command, str) else list(command)
    start = time.monotonic()
    launch: Launch | None = None
    # Traces: the sandbox's start and the command's run, under the call's `toolq.tool` (None when off).
    backend = sandbox.backend if sandbox is not None and sandbox.backend != "none" else None
    span = spans.start_command(command, backend)
    spawning = spans.now() if span is not None else 0.0
    try:
        popen: dict[str, Any] = dict(cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        if sandbox is not None:
            launch = sandbox.launch(argv, workspace=str(workspace or cwd), cwd=str(cwd), env=env or dict(os.environ))
            proc = launch.spawn(**popen)
            if sandbox.backend != "none":
                metrics.sandbox_started(sandbox.backend, time.monotonic() - start)
        else:
            proc = subprocess.Popen(argv, env=env, **popen)
    except BaseException as e:  # OSError: a spawn failure; SandboxRefused goes to the tool
        if launch is not None:
            launch.close()
        spans.end(span, error=type(e).__name__)
        if not isinstance(e, OSError):
            raise
        return CommandResult(exit_code=-1, output=b"", wall_time=time.monotonic() - start, spawn_error=e)
    if span is not None and backend is not None:
        spans.sandbox_started(backend, spawning)
    try:
        result = _run(proc, launch, sandbox, start, timeout, is_cancelled, output_cap, output)
    except BaseException as e:
        spans.end(span, error=type(e).__name__)
        raise
    spans.end(span, **{names.EXIT_CODE: result.exit_code},
              error="timeout" if result.timed_out else "cancelled" if result.cancelled else None)
    return result


def _run(proc: Any, launch: Launch | None, sandbox: Sandbox | None, start: float, timeout: float | None,
         is_cancelled: Callable[[], bool] | None, output_cap: int, output: LiveOutput | None) -> CommandResult:
    """`run_command` once the process is spawned: read, bound, stream, and kill and reap at the end."""
    pgid = proc.pid
    with _groups_lock:
        _live_groups.add(pgid)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    buf = HeadTailBuffer(output_cap)
    if output is not None:
        buf.listener = output.write
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    timed_out = cancelled = eof = False
    seen = 0.0  # when the cancel was seen
    exit_wait = 0.001
    try:
        while True:
            if not eof and flooded(buf):
                time.sleep(POLL_INTERVAL)
                eof = _read_once(fd, buf)
            elif not eof:
                if selector.select(POLL_INTERVAL):
                    eof = _read_available(fd, buf)
            else:
                # The pipe closed but the leader has not exited yet: back off up to the poll step.
                time.sleep(exit_wait)
                exit_wait = min(exit_wait * 2, POLL_INTERVAL)
            if output is not None:
                output.tick()
            if _has_exited(pgid):
                break
            if timeout is not None and time.monotonic() - start >= timeout:
                timed_out = True
                break
            if is_cancelled is not None and is_cancelled():
                cancelled, seen = True, time.monotonic()
                break
        # The leader is still unreaped here (alive or a zombie), so its pgid cannot be reused:
        # this kills the command on timeout/cancel, and any leftover members after a normal exit.
        _killpg(pgid)
        if launch is not None:
            launch.kill(live_process_groups())
        if not eof:
            _drain(fd, buf, selector, DRAIN_TIMEOUT)
        returncode = proc.wait()
        if cancelled:  # the cancel seen until the call's process is reaped
            metrics.cancel_to_dead(time.monotonic() - seen)
    finally:
        selector.close()
        proc.stdout.close()
        with _groups_lock:
            _live_groups.discard(pgid)
        if launch is not None:
            launch.close()
    exit_code = returncode if returncode >= 0 else 128 - returncode
    printed = buf.getvalue()
    return CommandResult(
        exit_code=exit_code,
        output=printed,
        limit_note=None if launch is None or sandbox is None else sandbox.explain(
            launch, exit_code, printed.decode("utf-8", errors="replace")),
        wall_time=time.monotonic() - start,
        timed_out=timed_out,
        cancelled=cancelled,
        pid=pgid,
        dropped_bytes=buf.dropped,
    )


def flooded(buf: HeadTailBuffer) -> bool:
    """Past `FLOOD_BYTES` dropped: read at most one pipe's worth per poll step from now on."""
    return buf.dropped > FLOOD_BYTES


def _read_available(fd: int, buf: HeadTailBuffer) -> bool:
    """Read everything the pipe holds now; True at end of file."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        buf.write(chunk)


def _read_once(fd: int, buf: HeadTailBuffer) -> bool:
    """Read at most one pipe's worth; True at end of file."""
    try:
        chunk = os.read(fd, _PIPE_CHUNK)
    except BlockingIOError:
        return False
    buf.write(chunk)
    return not chunk


def _drain(fd: int, buf: HeadTailBuffer, selector: selectors.BaseSelector, limit: float) -> None:
    deadline = time.monotonic() + limit
    while (left := deadline - time.monotonic()) > 0:
        if selector.select(min(left, POLL_INTERVAL)) and _read_available(fd, buf):
            return


_has_exited = reaper.has_exited

