"""The real Codex CLI 0.171.0 (`codex exec`, on the fake model) running its commands through
`toolq exec-server` on real workers (issue 29), asserting on what the model saw. The tests that
hold for any exec-server run against Codex's own (`codex exec-server`, the reference) too, so what
they assert is what Codex does with its own executor.

`toolq exec-server --upload DIR` runs the commands in an environment made from DIR on a worker
host: what a command writes is not in Codex's DIR, and a file only the worker side has is seen by
the next command; apply_patch writes there too, through fs/*.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import markers
from tests.integration.codex_cli import codex_or_skip, environments_toml, running, turn
from tests.integration.conftest import SIGNING_KEY, WORKER_ENV
from tests.integration.test_environments import unmount_under
from toolq.core import import_path
from toolq.dev.bench.exec_server import codex_argv, listening, toolq_argv
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import WorkerProcess

pytestmark = pytest.mark.integration

HOST = "codex-host"
SEED = "seed from Codex's side\n"


def ex(call_id: str, cmd: str, **kw: object) -> dict:
    return b.function_call("exec_command", {"cmd": cmd, **kw}, call_id)


def stdin(call_id: str, chars: str, yield_ms: int = 2000) -> dict:
    return b.function_call("write_stdin", {"session_id": "{{SESSION_ID}}", "chars": chars,
                                           "yield_time_ms": yield_ms}, call_id)


def patch(call_id: str, body: str) -> dict:
    return {"type": "custom_tool_call", "name": "apply_patch", "call_id": call_id,
            "input": f"*** Begin Patch\n{body}*** End Patch\n"}


def exited(code: int) -> str:
    return f"Process exited with code {code}\n"


@pytest.fixture(scope="module")
def codex() -> str:
    return codex_or_skip()


@pytest.fixture(scope="module")
def host(redis_env, tmp_path_factory) -> Iterator[WorkerProcess]:
    """One worker host on this module's Redis (environments are placed on it)."""
    logdir = tmp_path_factory.mktemp("codex-host")
    w = WorkerProcess(redis_env.url, queues=["toolq"], concurrency=6, name=f"{HOST}@test", logdir=logdir,
                      env={**WORKER_ENV, "TOOLQ_HOST_ID": HOST, "TOOLQ_ENV_ROOT": str(logdir / "envs")})
    w.start()
    yield w
    w.stop(grace=3)
    unmount_under(logdir)


@dataclass
class Server:
    kind: str
    url: str
    workspace: Path
    """Codex's `-C`: the folder uploaded (toolq) or the one the commands run in (the reference)."""
    log: Callable[[], str]


@pytest.fixture
def serve(request, tmp_path, redis_env) -> Iterator[Callable[..., Server]]:
    """Factory: an exec-server of `kind` ("toolq": `toolq exec-server --upload WS` on the host;
    "codex": `codex exec-server`) for Codex's workspace WS (holding seed.txt)."""
    stack = ExitStack()
    homes = Path.home() / ".cache" / "toolq-tests" / "homes"

    def make(kind: str, env: dict[str, str] | None = None) -> Server:
        ws = tmp_path / f"ws-{kind}"
        ws.mkdir()
        (ws / "seed.txt").write_text(SEED)
        base = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
        if kind == "toolq":
            request.getfixturevalue("host")
            argv = toolq_argv("--upload", str(ws))
            base.update(WORKER_ENV, REDIS_URL=redis_env.url, TOOLQ_SIGNING_KEY=SIGNING_KEY)
        else:
            homes.mkdir(parents=True, exist_ok=True)
            home = stack.enter_context(_scratch(homes))
            argv, base["CODEX_HOME"] = codex_argv(request.getfixturevalue("codex")), str(home)
        s = stack.enter_context(listening(argv, {**base, **(env or {})}, tmp_path / f"{kind}-exec-server.log"))
        return Server(kind, s.url, ws, s.log_tail)

    with stack:
        yield make


@contextmanager
def _scratch(parent: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=parent) as d:
        yield Path(d)


BOTH = pytest.mark.parametrize("kind", ["codex", "toolq"])


# --- where the commands run ------------------------------------------------------------------------------

def test_commands_run_on_the_worker_in_an_environment_codex_does_not_see(codex, serve):
    s = serve("toolq")
    t = turn(codex, [[ex("c_write", "cat seed.txt; echo worker-side > made.txt")],
                     [ex("c_read", "cat made.txt; ls")], [b.message("done")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert exited(0) in t.said["c_write"] and SEED in t.said["c_write"], t.why()
    assert not (s.workspace / "made.txt").exists()  # written on the worker, in the environment
    assert "worker-side" in t.said["c_read"] and "made.txt" in t.said["c_read"], t.why()


@BOTH
def test_parallel_commands(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [[ex("c_one", "sleep 1; echo one"), ex("c_two", "echo two")], [b.message("both ran")]],
             s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert exited(0) in t.said["c_one"] and t.said["c_one"].endswith("one\n"), t.why()
    assert exited(0) in t.said["c_two"] and t.said["c_two"].endswith("two\n"), t.why()


@BOTH
def test_a_tty_session_takes_write_stdin(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [[ex("c_py", "python3 -i -q", tty=True, yield_time_ms=1500)],
                     [stdin("c_w1", "print(6*7)\n")], [stdin("c_w2", "exit()\n")], [b.message("done")]],
             s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert "Process running with session ID" in t.said["c_py"] and ">>> " in t.said["c_py"], t.why()
    assert "42\r\n" in t.said["c_w1"] and "Process running" in t.said["c_w1"], t.why()
    assert exited(0) in t.said["c_w2"], t.why()


@BOTH
def test_apply_patch_adds_updates_and_deletes_through_fs(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [
        [patch("p_add", "*** Add File: hello.txt\n+hello\n+world\n*** Add File: sub/dir/new.txt\n+nested\n")],
        [patch("p_upd", "*** Update File: hello.txt\n@@\n hello\n-world\n+there\n*** Delete File: sub/dir/new.txt\n")],
        [patch("p_bad", "*** Update File: missing.txt\n@@\n-a\n+b\n")],
        [ex("c_check", "cat hello.txt; ls sub/dir; test -e sub/dir/new.txt || echo new-gone")],
        [b.message("patched")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert "A hello.txt\nA sub/dir/new.txt" in t.said["p_add"], t.why()
    assert "M hello.txt\nD sub/dir/new.txt" in t.said["p_upd"], t.why()
    assert t.said["p_bad"].startswith("apply_patch verification failed: Failed to read file to update"), t.why()
    assert t.said["c_check"].endswith("Output:\nhello\nthere\nnew-gone\n"), t.why()
    assert (s.workspace / "hello.txt").exists() == (kind == "codex")  # toolq: written on the worker


@BOTH
def test_a_failing_command_gives_its_exit_code(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [[ex("c_exit3", "echo out; echo err >&2; exit 3")], [ex("c_127", "definitely_not_a_command_xyz")],
                     [ex("c_badcwd", "pwd", workdir="/nonexistent/dir")], [ex("c_sig", "kill -9 $$")],
                     [b.message("failures seen")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert exited(3) in t.said["c_exit3"] and "out\n" in t.said["c_exit3"] and "err\n" in t.said["c_exit3"], t.why()
    assert exited(127) in t.said["c_127"] and "command not found" in t.said["c_127"], t.why()
    assert t.said["c_badcwd"].startswith("exec_command failed:") and "(-32603)" in t.said["c_badcwd"], t.why()
    assert exited(137) in t.said["c_sig"], t.why()


@BOTH
def test_ctrl_c_to_a_tty_session_interrupts_it(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [[ex("c_tty", "echo ready; sleep 30; echo not-interrupted", tty=True, yield_time_ms=800)],
                     [stdin("c_ctrl_c", "\u0003")], [b.message("done")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert "Process running with session ID" in t.said["c_tty"] and "ready" in t.said["c_tty"], t.why()
    assert "Process exited with code" in t.said["c_ctrl_c"] and "not-interrupted" not in t.said["c_ctrl_c"], t.why()


@BOTH
def test_login_false_and_a_workdir(codex, serve, kind):
    s = serve(kind)
    (s.workspace / "sub").mkdir()
    (s.workspace / "sub" / "inner.txt").write_text("inner\n")
    t = turn(codex, [[ex("c_nologin", "echo $0; shopt -q login_shell && echo login || echo nologin", login=False)],
                     [ex("c_workdir", "cat inner.txt; basename $(pwd)", workdir="sub")], [b.message("done")]],
             s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert t.said["c_nologin"].endswith("nologin\n") and exited(0) in t.said["c_nologin"], t.why()
    assert t.said["c_workdir"].endswith("inner\nsub\n"), t.why()


@BOTH
def test_big_output_reaches_codex_whole_enough_for_its_truncation(codex, serve, kind):
    s = serve(kind)
    t = turn(codex, [[ex("c_3mb", "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo tail-marker")],
                     [b.message("big output seen")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert exited(0) in t.said["c_3mb"] and t.said["c_3mb"].endswith("tail-marker\n"), t.why()[:3000]
    assert "bytes omitted" in t.said["c_3mb"] or "truncated" in t.said["c_3mb"], t.why()[:3000]


@BOTH
def test_a_session_left_running_at_the_turn_end_is_terminated(codex, serve, kind):
    s = serve(kind)
    marker = f"42{markers.PROCESS}{int(time.time()) % 1000:03d}"
    t = turn(codex, [[ex("c_left", f"echo started; sleep {marker}; echo never", yield_time_ms=1500)],
                     [b.message("leaving it running")]], s.workspace, url=s.url)
    assert t.proc.returncode == 0, t.why()
    assert "Process running with session ID" in t.said["c_left"] and "started" in t.said["c_left"], t.why()
    # Codex terminates it as the turn ends (process/terminate): gone well before any reap window.
    assert _until(lambda: not _running_with(f"sleep\0{marker}".encode()), 30), s.log()


# --- faults ----------------------------------------------------------------------------------------------

class Proxy:
    """A TCP proxy between Codex and an exec-server whose connections the test can cut while it keeps
    accepting new ones: a network drop, Codex alive. `seen` is set once `watch` went to Codex."""

    def __init__(self, target: str, watch: bytes) -> None:
        host, port = target.removeprefix("ws://").split("/")[0].split(":")
        self.target = (host, int(port))
        self.watch, self.seen = watch, threading.Event()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.pairs.append((client, server))
            self.connections += 1
            done = threading.Barrier(2, action=_closing(client, server))
            threading.Thread(target=self._pipe, args=(client, server, False, done), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True, done), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watched: bool, done: threading.Barrier) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if watched and self.watch in tail + data:
                    self.seen.set()
                tail = data[-len(self.watch):]
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with _quiet():
                s.shutdown(socket.SHUT_RDWR)
        done.wait()  # both directions ended: only then are the sockets closed (no fd reused under a reader)

    def cut(self) -> None:
        """Drop every open connection (both ends see it end without a close frame)."""
        pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                with _quiet():
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        self.cut()


def _closing(*sockets: socket.socket) -> Callable[[], None]:
    def close() -> None:
        for s in sockets:
            s.close()
    return close


@contextmanager
def _quiet() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


@BOTH
def test_a_network_drop_mid_command_resumes(codex, serve, kind):
    s = serve(kind)
    proxy = Proxy(s.url, base64.b64encode(b"started\n")[:10])
    try:
        with running(codex, [[ex("c_sleep", "echo started; sleep 3; echo after-drop; sleep 1; echo end",
                                 yield_time_ms=20000)],
                             [ex("c_after", "echo second-call")], [b.message("after the drop")]],
                     s.workspace, url=proxy.url) as t:
            assert proxy.seen.wait(60), "the command's first output never came through"
            proxy.cut()
    finally:
        proxy.close()
    assert t.proc.returncode == 0, t.why()
    assert proxy.connections >= 2  # Codex came back on a new connection
    assert exited(0) in t.said["c_sleep"] and t.said["c_sleep"].endswith("started\nafter-drop\nend\n"), t.why()
    assert t.said["c_after"].endswith("second-call\n"), t.why()


def _running_with(marker: bytes) -> list[int]:
    """Pids whose command line holds `marker` (sandboxed commands too: their pid namespace is below ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _until(what: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.1)
    return what()


def test_codex_killed_mid_command_leaves_nothing_running_after_the_reap_window(codex, serve):
    s = serve("toolq", env={"TOOLQ_EXEC_SERVER_RESUME": "2"})
    marker = f"31{markers.PROCESS}{int(time.time()) % 1000:03d}"
    with running(codex, [[ex("c_long", f"echo started; sleep {marker}; echo never", yield_time_ms=30000)],
                         [b.message("never reached")]], s.workspace, url=s.url) as t:
        assert _until(lambda: bool(_running_with(f"sleep\0{marker}".encode())), 60), s.log()
        t.proc.send_signal(signal.SIGKILL)
    assert t.proc.returncode == -signal.SIGKILL
    left = _until(lambda: not _running_with(f"sleep\0{marker}".encode()), 60)
    assert left, f"still running after the reap window: {_running_with(marker.encode())}\n{s.log()}"


def test_toolq_cancel_of_the_session_turn_ends_its_processes(codex, serve, redis_env):
    s = serve("toolq")
    marker = f"43{markers.PROCESS}{int(time.time()) % 1000:03d}"
    with running(codex, [[ex("c_long", f"echo started; sleep {marker}; echo never", yield_time_ms=30000)],
                         [b.message("cancelled")]], s.workspace, url=s.url) as t:
        assert _until(lambda: bool(_running_with(f"sleep\0{marker}".encode())), 60), s.log()
        (turn_id,) = re.findall(r"exec-server session \S+: turn (turn-\S+)", s.log())
        env = {**os.environ, "REDIS_URL": redis_env.url, "TOOLQ_SIGNING_KEY": SIGNING_KEY}
        done = subprocess.run([*import_path.python_argv("-m", "toolq.cli.main"), "cancel", turn_id], env=env,
                              capture_output=True, text=True, timeout=60, cwd=import_path.NEUTRAL_CWD)
        assert done.returncode == 0, done.stderr
    assert t.proc.returncode == 0, t.why()
    said = t.said["c_long"]
    assert "Process exited with code -1" in said and "started" in said and "never" not in said, t.why()
    assert not _running_with(f"sleep\0{marker}".encode())


# --- stdio -----------------------------------------------------------------------------------------------

@BOTH
def test_stdio_mode_from_environments_toml(codex, request, redis_env, tmp_path, kind):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "seed.txt").write_text(SEED)
    if kind == "toolq":
        request.getfixturevalue("host")
        program, args = sys.executable, ["-P", "-m", "toolq.cli.main", "exec-server", "--listen", "stdio",
                                         "--upload", str(ws)]
        env = {**WORKER_ENV, "REDIS_URL": redis_env.url, "TOOLQ_SIGNING_KEY": SIGNING_KEY}
    else:
        program, args, env = codex, ["exec-server", "--listen", "stdio"], {}
    t = turn(codex, [[ex("c_echo", "cat seed.txt; echo hi")],
                     [patch("p_add", "*** Add File: stdio.txt\n+via stdio\n")],
                     [ex("c_cat", "cat stdio.txt")], [b.message("done")]],
             ws, environments=environments_toml(program, args, env))
    assert t.proc.returncode == 0, t.why()
    assert exited(0) in t.said["c_echo"] and t.said["c_echo"].endswith(f"{SEED}hi\n"), t.why()
    assert "A stdio.txt" in t.said["p_add"], t.why()
    assert t.said["c_cat"].endswith("via stdio\n"), t.why()
    assert (ws / "stdio.txt").exists() == (kind == "codex")


def test_stdio_eof_ends_the_session_at_once(codex, request, redis_env, tmp_path):
    """Codex SIGKILLed: the stdio server's stdin ends, so its session ends then (no resume over
    stdio): the process is killed and the server exits, though the resume window is long."""
    request.getfixturevalue("host")
    ws = tmp_path / "ws"
    ws.mkdir()
    marker = f"44{markers.PROCESS}{int(time.time()) % 1000:03d}"
    args = ["-P", "-m", "toolq.cli.main", "exec-server", "--listen", "stdio", "--upload", str(ws)]
    env = {**WORKER_ENV, "REDIS_URL": redis_env.url, "TOOLQ_SIGNING_KEY": SIGNING_KEY,
           "TOOLQ_EXEC_SERVER_RESUME": "600"}
    with running(codex, [[ex("c_long", f"echo started; sleep {marker}; echo never", yield_time_ms=30000)],
                         [b.message("never reached")]], ws, environments=environments_toml(sys.executable, args, env)) as t:
        assert _until(lambda: bool(_running_with(f"sleep\0{marker}".encode())), 60)
        servers = _running_with(f"--upload\0{ws}\0".encode())
        assert servers
        t.proc.send_signal(signal.SIGKILL)
    assert _until(lambda: not _running_with(f"sleep\0{marker}".encode()), 30)
    assert _until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in servers), 30), servers
