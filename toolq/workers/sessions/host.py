"""The session host: one per worker, it runs that worker's `exec_command` processes and keeps
those still running at `yield_time_ms` as sessions (see the package docstring for why).

Run as `python -m toolq.workers.sessions.host` by the worker's main process (`start.py`), with
PR_SET_PDEATHSIG=SIGTERM, so it dies with the worker; on SIGTERM it kills every session's
process group first. Requests are one JSON line per connection (`protocol.py`); a connection
that closes before its reply (the pool child was revoked or killed) kills a command that has
not yielded yet. Commands launch through the worker's sandbox (`toolq.workers.isolation`), as
`run_command` launches them.
"""

from __future__ import annotations

import base64
import errno
import fnmatch
import functools
import hmac
import itertools
import json
import logging
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import redis

from toolq.core.contracts import STREAM_BYTES
from toolq.core.redis_target import target_from_env
from toolq.core.session_records import CONVERSATION_TTL, SessionRecord, conversation_key, next_id_key, sessions_key
from toolq.core.settings import Settings
from toolq.telemetry import metrics
from toolq.workers import hardening, isolation, redis_clients
from toolq.workers.isolation import limits, policy, reaper, spawner
from toolq.workers.isolation.cell import CellProcess
from toolq.workers.processes import DEFAULT_OUTPUT_CAP, DRAIN_TIMEOUT, POLL_INTERVAL, HeadTailBuffer, _killpg, flooded
from toolq.workers.sessions.protocol import (
    ExecRequest,
    InputRequest,
    KillRequest,
    OutputFrame,
    Reply,
    WriteRequest,
    parse_request,
)
from toolq.workers.sessions.slots import Slot, Slots

log = logging.getLogger("toolq.sessions.host")

STDIN_CLOSED = ("write_stdin failed: stdin is closed for this session; rerun exec_command with tty=true "
                "to keep stdin open")
#: How often a waiting call checks its connection, and the reaper its limits.
STEP = 0.05
REAP_INTERVAL = 1.0
TAIL_BYTES = 4096
#: Seconds a spawn slot keeps its bubblewrap cell without running a command.
CELL_IDLE = 60.0
#: Conversations a worker may hold sessions of at their limit, at once.
SLOTS_PER_SESSION_LIMIT = 4
#: A front door's process waits (its pipe fills) while this much of its output is not yet sent.
FRONT_DOOR_BACKLOG = 4 << 20
#: Names a front door's `env` may not set: what the sandbox sets itself, and what it never passes.
SANDBOX_SET_ENV = frozenset({"HOME", "TMPDIR", "PATH", *policy.ENV_OVERRIDES})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(eq=False)
class Watcher:
    """A streaming request's share of a process's output: not yet sent to it (each piece with the
    stream it came from), and what it may still get (None: all of it, a front door's process)."""

    left: int | None
    unsent: list[tuple[str, bytearray]] = field(default_factory=list)
    size: int = 0
    """Bytes in `unsent`."""

    def add(self, stream: str, chunk: bytes) -> None:
        if self.left is not None:
            chunk = chunk[:self.left]
            self.left -= len(chunk)
        if not chunk:
            return
        if self.unsent and self.unsent[-1][0] == stream:
            self.unsent[-1][1].extend(chunk)
        else:
            self.unsent.append((stream, bytearray(chunk)))
        self.size += len(chunk)

    def take(self) -> list[tuple[str, bytearray]]:
        pieces, self.unsent, self.size = self.unsent, [], 0
        return pieces


@dataclass(eq=False)  # hashed by identity: held in sets
class Process:
    proc: subprocess.Popen | CellProcess
    fd: int
    """Read end: the pipe, or the pty's master (which is also where stdin is written)."""
    tty: bool
    command: str
    conversation: str
    launch: isolation.Launch | None
    shell: str = "bash"
    started: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    pending: HeadTailBuffer = field(default_factory=lambda: HeadTailBuffer(DEFAULT_OUTPUT_CAP))
    exit_code: int | None = None
    exited_at: float | None = None
    """When its leader was seen gone (monotonic), before its output is drained."""
    done: bool = False
    """Exited and its output fully read."""
    session_id: int | None = None
    slot: Slot | None = None
    tail: bytearray = field(default_factory=bytearray)
    """The last output bytes, for the line naming a sandbox limit the command hit."""
    limit_note: str | None = None
    killed_for: str | None = None
    """Why toolq killed it while it ran (a bound of its conversation), for its last output."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    watchers: list[Watcher] = field(default_factory=list)
    """The streaming requests waiting on it (a session may have two polls at once)."""
    err_fd: int | None = None
    """A front door's process without a tty: stderr's read end (else stderr goes to `fd`)."""
    stdin_fd: int | None = None
    """Where its stdin is written: the pty's master, a front door's stdin pipe, or None (closed)."""
    front_door: bool = False
    """A front door's process: its one watcher (made with it) gets every byte, `pending` none."""
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while writing to `stdin_fd`, and while the finished process's fds are closed."""

    @property
    def stream(self) -> str:
        return "pty" if self.tty else "stdout"

    def take_output(self) -> bytes:
        with self.cond:
            data = self.pending.getvalue()
            self.pending = HeadTailBuffer(DEFAULT_OUTPUT_CAP)
            return data

    def kill(self) -> None:
        _kill_group(self.proc)
        if self.launch is not None:
            self.launch.kill(frozenset())


class Host:
    def __init__(self, settings: Settings, instance: str, hostname: str, r: redis.Redis | None,
                 key: bytes = b"") -> None:
        """`key`: what every request must start with (`client._key`); none, no request is served."""
        self.settings, self.key = settings, key
        self.instance, self.hostname, self.r = instance, hostname, r
        self.lock = threading.Lock()
        self.live: dict[tuple[str, int], Process] = {}
        """Sessions (processes that outlived their exec_command) by (conversation, session id): each
        conversation counts its ids from 1, and one host serves every conversation on its worker."""
        self.running: set[Process] = set()
        self._spawning = 0
        """Commands being started, not yet in `running` (see _reap_orphans)."""
        self._ids = itertools.count(1)  # without Redis (tests of the host alone)
        sandbox = isolation.current(settings)
        confined = not sandbox.unavailable and sandbox.backend != "none"
        # bwrap starts faster from a thread whose mount table is smaller (`isolation/spawner.py`).
        prepare = functools.partial(spawner.prepare_spawning_thread, sandbox.policy, sandbox.policy.hidden) if (
            confined and sandbox.backend == "bwrap") else None
        self.slots = Slots(sandbox.policy.limits if confined else None,
                           most=settings.concurrency + SLOTS_PER_SESSION_LIMIT * settings.session_limit,
                           prepare=prepare)
        if confined and sandbox.backend == "landlock":
            # No pid namespace: what leaves a command's group comes back to the host, which reaps
            # it (the slot's cgroup kills it), instead of to an init that may never reap it, and
            # a zombie still counts against the slot's process limit.
            reaper.become_subreaper()

    # --- starting a command ----------------------------------------------------------------

    def spawn(self, req: ExecRequest) -> Process:
        """Raises OSError (spawn failure) or SandboxUnavailable."""
        argv = [req.shell, "-c", req.cmd]
        if req.extra_env:  # set by `env` inside the sandbox: never bubblewrap's or a launcher's own
            argv = ["env", "--", *(f"{k}={v}" for k, v in sorted(_front_door_env(req.extra_env).items())), *argv]
        master = slave = None
        ours: list[int] = []  # the parent's ends of a front door's pipes
        theirs: list[int] = []  # the child's ends, closed here once it has them
        if req.tty:
            master, slave = pty.openpty()
            stdio: dict[str, int] = dict(stdin=slave, stdout=slave, stderr=slave)
            theirs.append(slave)
        elif req.front_door:
            stdin: int = subprocess.DEVNULL
            if req.pipe_stdin:
                stdin, writer = os.pipe2(os.O_CLOEXEC)
                theirs.append(stdin)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            ours += [out_r, err_r] + ([writer] if req.pipe_stdin else [])
            theirs += [out_w, err_w]
            stdio = dict(stdin=stdin, stdout=out_w, stderr=err_w)
        else:
            stdio = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            return self._spawn(req, argv, stdio, master, ours, theirs)
        except BaseException:
            for fd in (*ours, *theirs, *([master] if master is not None else [])):
                os.close(fd)
            raise

    def _spawn(self, req: ExecRequest, argv: list[str], stdio: dict[str, int], master: int | None, ours: list[int],
               theirs: list[int]) -> Process:
        # ctty: a tty command takes its pty as its controlling terminal, so ^C interrupts it.
        popen = dict(cwd=req.cwd, start_new_session=True, close_fds=True, ctty=master is not None, **stdio)
        sandbox = isolation.current(self.settings)
        if over := self._conversation_over(req.conversation):
            raise OSError(errno.EAGAIN, f"{over}; end a session first")
        slot = self.slots.take()
        began = time.monotonic()  # the sandbox's start: its launch until the command's process exists
        try:
            launch = sandbox.launch(argv, workspace=req.workspace, cwd=req.cwd, env=req.env, in_slot=True)
        except BaseException:
            self.slots.give_back(slot)
            raise
        if launch.call_limits is not None:
            launch.call_limits.use_cgroups(slot.cgroup, slot.memory_cgroup)
        launch.reap = False  # a sweep would kill the other sessions' processes: see _reap_orphans
        with self.lock:
            self._spawning += 1  # until it is in `running`: _reap_orphans must not take it for an orphan
        try:
            proc = slot.run(launch.spawn, **popen)
        except BaseException as e:
            with self.lock:
                self._spawning -= 1
            launch.close()
            self.slots.give_back(slot)
            if isinstance(e, OSError) and (full := self.slots.full()):
                raise OSError(errno.EAGAIN, full) from None  # what made the start fail, not how it failed
            raise
        if sandbox.backend != "none":
            metrics.sandbox_started(sandbox.backend, time.monotonic() - began)
        while theirs:
            os.close(theirs.pop())
        p = Process(proc=proc, fd=0, tty=req.tty, command=req.cmd, conversation=req.conversation, launch=launch,
                    shell=req.shell, slot=slot, front_door=req.front_door)
        if master is not None:
            p.fd = p.stdin_fd = master
        elif ours:  # a front door's pipes: stdout, stderr, and stdin's write end if it has one
            p.fd, p.err_fd = ours[0], ours[1]
            p.stdin_fd = ours[2] if len(ours) > 2 else None
        else:
            assert proc.stdout is not None
            p.fd = proc.stdout.fileno()
        if p.front_door:
            p.watchers.append(Watcher(None))  # before the pump starts: no byte is missed
        with self.lock:
            self.running.add(p)
            self._spawning -= 1
        threading.Thread(target=self._pump, args=(p,), name="toolq-session-pump", daemon=True).start()
        return p

    def _pump(self, p: Process) -> None:
        """Read the process's output until it exits (and its output is drained), then finish it."""
        exited_at: float | None = None
        reading = {p.fd: p.stream} | ({p.err_fd: "stderr"} if p.err_fd is not None else {})
        while True:
            if exited_at is None and _has_exited(p.proc):
                exited_at = p.exited_at = time.monotonic()
                _kill_group(p.proc)  # leftovers of the group (background children) go with it
            timeout = STEP if exited_at is None else max(0.0, min(STEP, exited_at + DRAIN_TIMEOUT - time.monotonic()))
            if exited_at is None and (flooded(p.pending) or p.front_door and p.watchers[0].size > FRONT_DOOR_BACKLOG):
                time.sleep(POLL_INTERVAL)  # nobody polls the flood (or reads it): let it block on the full pipe
            _read_ready(p, reading, timeout)
            eof = not reading
            if exited_at is not None and (eof or time.monotonic() >= exited_at + DRAIN_TIMEOUT):
                break
            if eof:  # the output closed before the leader exited: just wait for the exit
                p.proc.wait()
        if p.launch is not None:
            p.launch.kill(frozenset())
        returncode = p.proc.wait()
        exit_code = returncode if returncode >= 0 else 128 - returncode
        if p.launch is not None:
            p.launch.close()
            p.limit_note = p.killed_for or isolation.current(self.settings).explain(
                p.launch, exit_code, p.tail.decode("utf-8", errors="replace"))
        self._reap_orphans()
        if p.slot is not None:
            self.slots.give_back(p.slot)
        with p.stdin_lock:  # no write may meet a closed fd, or its number reused by another file
            if p.proc.stdout is not None:
                p.proc.stdout.close()
            else:
                os.close(p.fd)
            for fd in {p.err_fd, p.stdin_fd} - {None, p.fd}:
                assert fd is not None
                os.close(fd)
            p.stdin_fd = None
        with p.cond:
            p.exit_code = exit_code
            p.done = True
            p.cond.notify_all()
        with self.lock:
            self.running.discard(p)

    # --- waiting for output ----------------------------------------------------------------

    def collect(self, p: Process, yield_s: float, conn: socket.socket, stream: bool = False) -> bool:
        """Wait until the process is done or `yield_s` passes; False if the caller hung up. With
        `stream`, what the process prints meanwhile is sent to the caller as it comes; a front
        door's process sends all of it, each piece tagged with its stream, the last ones too."""
        deadline = time.monotonic() + yield_s
        with p.cond:
            watcher = None
            if p.front_door:
                watcher = p.watchers[0]
            elif stream:  # a poll shows what its reply will hold: what came since the last call, too
                watcher = Watcher(STREAM_BYTES)
                watcher.add(p.stream, p.pending.getvalue())
                p.watchers.append(watcher)
            try:
                while not p.done and (left := deadline - time.monotonic()) > 0:
                    p.cond.wait(min(left, STEP))
                    if _hung_up(conn):
                        return False
                    if watcher is not None and watcher.unsent and not self._send(p, watcher, conn):
                        return False
                if p.front_door and watcher is not None and watcher.unsent and not self._send(p, watcher, conn):
                    return False
            finally:
                if watcher is not None and not p.front_door:
                    p.watchers.remove(watcher)
        return True

    @staticmethod
    def _send(p: Process, watcher: Watcher, conn: socket.socket) -> bool:
        """Send what the watcher holds (called holding `p.cond`); False if the caller is gone."""
        pieces = watcher.take()
        if p.front_door:
            lines = [OutputFrame(progress=_b64(data), stream=name) for name, data in pieces]  # type: ignore[arg-type]
        else:
            lines = [OutputFrame(progress=_b64(b"".join(data for _, data in pieces)))]
        p.cond.release()  # a slow reader must not hold up the pump
        try:
            conn.sendall(b"".join(f.model_dump_json().encode() + b"\n" for f in lines))
        except OSError:
            return False
        finally:
            p.cond.acquire()
        return True

    def reply_for(self, p: Process, started: float) -> Reply:
        output = p.take_output()
        p.last_used = time.monotonic()
        wall = time.monotonic() - started
        if p.done:
            self._forget(p)
            return Reply(output=_b64(output), exit_code=p.exit_code, wall_time=wall, limit_note=p.limit_note)
        if p.session_id is None:
            live = self._live_in(p.conversation)
            if live >= self.settings.session_limit:
                p.kill()
                return Reply(error=(
                    f"exec_command failed: this conversation already has {live} live sessions (the limit is "
                    f"{self.settings.session_limit}), so the command, still running after yield_time_ms, was "
                    "killed; end a session (let it exit, or send it exit/Ctrl-D with write_stdin) first"))
            p.session_id = self._register(p)
        return Reply(output=_b64(output), session_id=p.session_id, wall_time=wall)

    def _conversation_over(self, conversation: str) -> str | None:
        """Which bound of one conversation's commands and sessions together it holds, in words
        (None: none). Each command's own cgroup bounds it in the kernel; their sum per conversation
        is checked here, before a start and by the reaper each second, as slots are not moved
        between conversations' cgroups (a move costs 8-16 ms per controller on cgroup v1)."""
        held = [h for _, h in self._holdings(conversation)]
        return self._past_bound(conversation, sum(h[0] for h in held), sum(h[1] for h in held))

    def _holdings(self, conversation: str) -> list[tuple[Process, tuple[int, int]]]:
        """The conversation's running commands and sessions here, each with what its slot holds."""
        with self.lock:
            return [(p, p.slot.held()) for p in self.running if p.conversation == conversation and p.slot is not None]

    def _past_bound(self, conversation: str, processes: int, memory: int) -> str | None:
        lim = self.slots.lim
        if lim is None or not conversation:
            return None
        if lim.conversation_processes and processes >= lim.conversation_processes:
            return (f"this conversation's commands and sessions on this worker hold {processes} processes, its "
                    f"limit is {lim.conversation_processes} (TOOLQ_SANDBOX_CONVERSATION_PROCESSES)")
        if lim.conversation_memory_mb and memory >= lim.conversation_memory_mb * limits.MIB:
            return (f"this conversation's commands and sessions on this worker hold {memory // limits.MIB} MiB, its "
                    f"limit is {lim.conversation_memory_mb} MiB (TOOLQ_SANDBOX_CONVERSATION_MEMORY_MB)")
        return None

    def _enforce_conversation_bounds(self, sessions: list[Process], ended: set[str]) -> None:
        """A conversation past its bound loses its newest sessions until it is within it again."""
        for conversation in {p.conversation for p in sessions} - ended:
            mine = self._holdings(conversation)
            processes, memory = sum(h[0] for _, h in mine), sum(h[1] for _, h in mine)
            for p, (p_processes, p_memory) in sorted(mine, key=lambda m: m[0].started, reverse=True):
                note = self._past_bound(conversation, processes, memory)
                if note is None:
                    break
                if p.session_id is None or p.killed_for:  # a command inside its call: the call's limits bound it
                    continue
                log.info("killing session %s: %s", p.session_id, note)
                p.killed_for = f"toolq killed this session: {note}"
                p.kill()  # kept until the model's next poll, which gets its last output and this line
                processes, memory = processes - p_processes, memory - p_memory

    def _live_in(self, conversation: str) -> int:
        """Sessions of the conversation across the fleet (this host's alone without Redis)."""
        if self.r is None:
            with self.lock:
                return sum(1 for p in self.live.values() if p.conversation == conversation)
        return int(self.r.hlen(sessions_key(conversation)))

    def _register(self, p: Process) -> int:
        session_id = int(self.r.incr(next_id_key(p.conversation))) if self.r is not None else next(self._ids)
        record = SessionRecord.new(session_id, self.instance, self.hostname, p.command, p.tty, p.shell)
        if self.r is not None:
            with self.r.pipeline(transaction=True) as pipe:
                pipe.hset(sessions_key(p.conversation), str(session_id), record.model_dump_json())
                pipe.expire(sessions_key(p.conversation), int(self.settings.session_lifetime) + CONVERSATION_TTL)
                pipe.expire(next_id_key(p.conversation), int(self.settings.session_lifetime) + 86400)
                pipe.execute()
        with self.lock:
            self.live[(p.conversation, session_id)] = p
            metrics.sessions_in_flight(len(self.live))
        return session_id

    def _forget(self, p: Process) -> None:
        if p.session_id is None:
            return
        with self.lock:
            self.live.pop((p.conversation, p.session_id), None)
            metrics.sessions_in_flight(len(self.live))
        if self.r is not None:
            try:
                self.r.hdel(sessions_key(p.conversation), str(p.session_id))
            except redis.RedisError as e:
                log.warning("could not unregister session %s: %s", p.session_id, e)

    # --- requests --------------------------------------------------------------------------

    def handle_exec(self, req: ExecRequest, conn: socket.socket) -> Reply | None:
        started = time.monotonic()
        tool = "process_start" if req.front_door else "exec_command"
        if req.front_door and (live := self._live_in(req.conversation)) >= self.settings.session_limit:
            return Reply(error=(f"{tool} failed: this conversation already has {live} live sessions (the limit is "
                                f"{self.settings.session_limit}, TOOLQ_SESSION_LIMIT); end one first"))
        spawn_at = time.time() if req.traced else 0.0
        try:
            p = self.spawn(req)
        except isolation.SandboxUnavailable as e:
            return Reply(error=f"{tool} refused: {e}")
        except OSError as e:
            return Reply(spawn_errno=e.errno or 0, spawn_strerror=e.strerror or str(e), wall_time=0.0)
        # A traced call's `toolq.sandbox.start` (the pool child makes the span): the spawn's times.
        spawned = (spawn_at, time.time(), isolation.current(self.settings).backend) if req.traced else None
        if req.front_door:
            return _with_spawn(self._run_front_door(p, req, conn, started), spawned)
        if not self.collect(p, req.yield_ms / 1000, conn, stream=req.stream):
            seen = time.monotonic()
            p.kill()  # its call was cancelled (or its pool child died): the caller hung up
            if metrics.on():  # cancel-to-dead: from the hang-up seen until the process is gone
                with p.cond:
                    if p.cond.wait_for(lambda: p.done, timeout=DRAIN_TIMEOUT + REAP_INTERVAL) and p.exited_at:
                        metrics.cancel_to_dead(max(0.0, p.exited_at - seen), "exec_command")
            return None
        return _with_spawn(self.reply_for(p, started), spawned)

    def _run_front_door(self, p: Process, req: ExecRequest, conn: socket.socket, started: float) -> Reply | None:
        """A session at once (write/terminate find it), then all its output as it comes, until it
        has exited and its output is drained; the reply is its exit. A caller that hangs up (its
        call cancelled, or its pool child gone) takes the process with it."""
        try:
            p.session_id = self._register(p)
        except redis.RedisError as e:
            p.kill()
            return Reply(error=f"process_start failed: the worker could not record its session in Redis ({e})")
        first = OutputFrame(progress="", session_id=p.session_id, instance=self.instance)
        try:
            conn.sendall(first.model_dump_json().encode() + b"\n")
            ok = self.collect(p, req.yield_ms / 1000, conn)
            if ok and not p.done:  # its call's time is up: it ends now, with what it printed last
                p.killed_for = "toolq killed the process: its call reached its time limit"
                p.kill()
                ok = self.collect(p, DRAIN_TIMEOUT + REAP_INTERVAL, conn)
        except OSError:
            ok = False
        if not ok:
            p.kill()
            self._forget(p)
            return None
        return self.reply_for(p, started)

    def handle_input(self, req: InputRequest) -> Reply:
        with self.lock:
            p = self.live.get((req.conversation, req.session_id))
        if p is None:
            return Reply(status="unknownProcess")
        p.last_used = time.monotonic()
        try:
            _write_stdin(p, base64.b64decode(req.data))
        except OSError:  # EPIPE (it closed its stdin, or exited), EIO (the pty's last slave closed), none
            return Reply(status="stdinClosed")
        return Reply(status="accepted")

    def handle_kill(self, req: KillRequest) -> Reply:
        with self.lock:
            p = self.live.get((req.conversation, req.session_id))
        if p is None or p.exit_code is not None:
            return Reply(running=False)
        p.kill()  # its own call (process_start) then ends with the exit the kill gave it
        return Reply(running=True)

    def handle_write(self, req: WriteRequest, conn: socket.socket) -> Reply | None:
        started = time.monotonic()
        with self.lock:
            p = self.live.get((req.conversation, req.session_id))
        if p is None:
            return Reply(error=f"write_stdin failed: Unknown process id {req.session_id}")
        if req.chars:
            if not p.tty:
                return Reply(error=STDIN_CLOSED)
            try:
                _write_stdin(p, req.chars.encode())
            except OSError as e:
                return Reply(error=f"write_stdin failed: {e.strerror or e}")
        if not self.collect(p, req.yield_ms / 1000, conn, stream=req.stream):
            return None  # the session stays: only its poll was cut short
        return self.reply_for(p, started)

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                key, rest = _read_key(conn, len(self.key))
                if not self.key or not hmac.compare_digest(key, self.key):
                    log.warning("refused a request without this worker's key (from pid %s)", _peer_pid(conn))
                    return
                line = _read_line(conn, rest)
                req = parse_request(line)
                reply: Reply | None
                if isinstance(req, ExecRequest):
                    reply = self.handle_exec(req, conn)
                elif isinstance(req, WriteRequest):
                    reply = self.handle_write(req, conn)
                elif isinstance(req, InputRequest):
                    reply = self.handle_input(req)
                else:
                    reply = self.handle_kill(req)
                if reply is not None:
                    conn.sendall(reply.model_dump_json().encode() + b"\n")
            except (OSError, ValueError) as e:
                log.warning("session host request failed: %s", e)

    # --- limits ----------------------------------------------------------------------------

    def reap_once(self) -> None:
        """Kill sessions past the idle or lifetime limit, or whose conversation has ended."""
        now = time.monotonic()
        with self.lock:
            sessions = list(self.live.values())
        ended: set[str] = set()
        if self.r is not None and sessions:
            conversations = sorted({p.conversation for p in sessions})
            try:
                alive = [self.r.exists(conversation_key(c)) for c in conversations]
                ended = {c for c, a in zip(conversations, alive, strict=True) if not a}
            except redis.RedisError:
                ended = set()
        self._enforce_conversation_bounds(sessions, ended)
        for p in sessions:
            why = None
            if p.conversation in ended:
                why = "its conversation ended"
            elif now - p.last_used > self.settings.session_idle and not p.front_door:  # its call watches it
                why = "idle limit"
            elif now - p.started > self.settings.session_lifetime:
                why = "lifetime limit"
            if why:
                log.info("killing session %s (%s): %s", p.session_id, why, p.command[:80])
                p.killed_for = f"toolq killed the session: {why}"  # a front door's process_start tells it
                p.kill()
                self._forget(p)

    def _reap_orphans(self) -> None:
        """Reap the dead orphans that came back to the host (never a command's own leader).

        Only a subreaper (Landlock) gets orphans back; elsewhere its only children are the
        leaders, and reading every thread's children list (~20 files) cost a quarter of the
        host's CPU per command."""
        if not reaper.is_subreaper():
            return
        # Under the lock throughout, and not while a spawn is under way: a command that started
        # (and maybe ended) after the leaders were listed was reaped here as an "orphan", and its
        # own wait then read exit code 0 (ECHILD) for a command that had failed.
        with self.lock:
            if self._spawning:
                return
            leaders = {p.proc.pid for p in self.running} | {p.proc.pid for p in self.live.values()}
            for pid in reaper.children(os.getpid()):
                if pid not in leaders:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass

    def kill_all(self) -> None:
        with self.lock:
            procs = list(self.running) + list(self.live.values())
        for p in procs:
            p.kill()


def _write_stdin(p: Process, data: bytes) -> None:
    """All of `data` to the process's stdin (OSError: it has none, or it is closed)."""
    view = memoryview(data)
    with p.stdin_lock:
        if p.stdin_fd is None:
            raise OSError(errno.EPIPE, os.strerror(errno.EPIPE))
        while view:
            view = view[os.write(p.stdin_fd, view):]


def _read_ready(p: Process, reading: dict[int, str], timeout: float) -> None:
    """Read what is ready of `reading` (fd -> its stream) within `timeout`, into the process's
    pending output and its watchers; an fd at its end is taken out of `reading`."""
    ready, _, _ = select.select(list(reading), [], [], timeout) if reading else ([], [], [])
    for fd in ready:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the pty's last slave closed
            chunk = b""
        if not chunk:
            del reading[fd]
            continue
        with p.cond:
            if not p.front_door:
                p.pending.write(chunk)
            p.tail = (p.tail + chunk)[-TAIL_BYTES:]
            for w in p.watchers:
                w.add(reading[fd], chunk)
            p.cond.notify_all()


def _front_door_env(env: dict[str, str]) -> dict[str, str]:
    """A front door's `env` less what the sandbox sets itself or never passes, and names that are
    no shell variable's (`env` would take one for an option or a command)."""
    return {k: v for k, v in env.items()
            if _ENV_NAME.fullmatch(k) and "\0" not in v and k not in SANDBOX_SET_ENV
            and not any(fnmatch.fnmatchcase(k, pattern) for pattern in policy.FORBIDDEN_ENV)}


def _has_exited(proc: subprocess.Popen | CellProcess) -> bool:
    if isinstance(proc, CellProcess):
        return proc.poll() is not None
    return reaper.has_exited(proc.pid)


def _kill_group(proc: subprocess.Popen | CellProcess) -> None:
    """The command and what it started: its process group, or a cell command's pid namespace."""
    if isinstance(proc, CellProcess):
        proc.kill()
    else:
        _killpg(proc.pid)


def _with_spawn(reply: Reply | None, spawned: tuple[float, float, str] | None) -> Reply | None:
    if reply is not None and spawned is not None:
        reply.spawn_started, reply.spawn_ended, reply.sandbox = spawned
    return reply


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _hung_up(conn: socket.socket) -> bool:
    """The client closed its end (it only ever sends one line, so readable means closed)."""
    ready, _, _ = select.select([conn], [], [], 0)
    if not ready:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_key(conn: socket.socket, size: int) -> tuple[bytes, bytes]:
    """A request's first line, the worker's key (`size` bytes), and what came after it: nothing
    past the key's length is read before the caller has found it right."""
    data = bytearray()
    while b"\n" not in data and len(data) <= size:
        chunk = conn.recv(size + 1 - len(data))
        if not chunk:
            break
        data += chunk
    key, _, rest = bytes(data).partition(b"\n")
    return key, rest


def _read_line(conn: socket.socket, data: bytes = b"", limit: int = 16 * 1024 * 1024) -> bytes:
    line = bytearray(data)
    while not line.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        line += chunk
        if len(line) > limit:
            raise ValueError("request too large")
    return bytes(line)


def _peer_pid(conn: socket.socket) -> int:
    try:
        return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    except OSError:
        return 0


def main() -> None:
    hardening.harden()  # it starts the sandboxes: nothing it holds may be read from outside
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/session-host] %(message)s",
                        stream=sys.stderr)  # stamped like the worker's own lines, which share its log
    path = os.environ["TOOLQ_SESSION_SOCKET"]
    settings = Settings.load()
    url = os.environ.get("TOOLQ_SESSION_REDIS")
    r = redis_clients.sync_client(target_from_env(url, os.environ)) if url else None
    host = Host(settings, os.environ.get("TOOLQ_SESSION_INSTANCE", ""), os.environ.get("TOOLQ_SESSION_HOSTNAME", ""),
                r, key=sys.stdin.buffer.readline().strip())
    if not host.key:
        sys.exit("session host: no key on its standard input (start it with toolq.workers.sessions.start)")
    # The worker serves metrics: its sessions are counted in its directory, and the one tool this
    # host names (cancel-to-dead of exec_command's commands) is a label value.
    if metrics.join_worker(tools=["exec_command"]):
        metrics.sessions_in_flight(0)

    def stop(signum: int, frame: object) -> None:
        # Once: a second SIGTERM during the cleanup re-entered it and blocked on the slots' lock,
        # which its first run held, so the host lived on, orphaned (found by helper-25).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        host.kill_all()
        host.slots.remove_all()
        try:
            os.unlink(path)
        except OSError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's Ctrl-C is its own; SIGTERM follows
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(64)

    def reaper() -> None:
        while True:
            time.sleep(REAP_INTERVAL)
            try:
                host.reap_once()
                host._reap_orphans()
                host.slots.close_idle_cells(CELL_IDLE)
            except Exception:  # the reaper must outlive any one bad session
                log.exception("session reaper failed")

    threading.Thread(target=reaper, name="toolq-session-reaper", daemon=True).start()
    print(json.dumps({"ready": path}), flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=host.serve, args=(conn,), name="toolq-session-call", daemon=True).start()


if __name__ == "__main__":
    main()
