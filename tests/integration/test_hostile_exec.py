"""A hostile model against real workers: every attack of issue 12 on `exec_command` must fail,
and the model must read a clear output saying so.

The workers run with the fleet's secrets in their environment (a password-protected broker URL,
an OpenAI key, a Flower password), once per sandbox backend. Each test is one turn whose calls
are the attacks; each asserts on the outputs the model got back and on the machine afterwards.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import tests.integration.conftest as c
from tests import markers
from tests.integration import unprivileged
from tests.integration.test_builtin_tools import exec_parts, outputs
from tests.integration.test_cancel import pids_matching, wait_until
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess
from toolq.workers.isolation import choose, limits
from toolq.workers.isolation.policy import Policy

pytestmark = pytest.mark.integration

OPENAI_KEY = "sk-secret-" + secrets.token_hex(8)
FLOWER_PASSWORD = "flower-secret-" + secrets.token_hex(4)
REDIS_PASSWORD = "redis-secret-" + secrets.token_hex(4)
LIMITS = {"TOOLQ_SANDBOX_PROCESSES": "64", "TOOLQ_SANDBOX_CPU_SECONDS": "2", "TOOLQ_SANDBOX_FILE_MB": "1"}


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    yield from locked_redis_server(tmp_path_factory)


def locked_redis_server(tmp_path_factory):
    """A password-protected Redis of its own (a module's workers all take calls from theirs). A
    `RedisServer`, so it dies with the test process even when pytest is killed (it leaked before)."""
    with RedisServer(password=REDIS_PASSWORD, workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server


def hostile_workers(backend: str, locked_redis, tmp_path_factory, *, user: bool = False, **limits: str):
    """A worker with the fleet's secrets in its environment, sandboxed by `backend` (skipped
    where it cannot run), with LIMITS and `limits` (more TOOLQ_SANDBOX_* settings). `user`: run
    it as an unprivileged user (`unprivileged.py`; skipped where that cannot be done); its
    `workspace()` then makes workspaces that user owns."""
    why = choose(Policy.from_settings(Settings(sandbox=backend))).unavailable
    if why:
        pytest.skip(f"the {backend} sandbox cannot run on this machine: {why}")
    if user and (why := unprivileged.unavailable()):
        pytest.skip(f"no unprivileged worker here: {why}")
    # The user's log folder must be one it can reach (pytest's folders are root's, mode 0700).
    logdir = unprivileged.owned_dir("toolq-worker-") if user else tmp_path_factory.mktemp(f"worker-{backend}")
    (logdir / "worker-secret.txt").write_text("worker-private\n")
    env = {**c.WORKER_ENV, **LIMITS, **limits, "TOOLQ_SANDBOX": backend, "OPENAI_API_KEY": OPENAI_KEY,
           "FLOWER_PASSWORD": FLOWER_PASSWORD}
    kind = unprivileged.UserWorkerProcess if user else WorkerProcess
    w = kind(locked_redis.url, queues=["toolq"], concurrency=2, tools=[c.TEST_TOOLS], env=env,
             logdir=logdir, name=f"hostile-{backend}{'-user' if user else ''}@test")
    w.start()
    assert f"sandbox: {backend}" in w.log.read_text()  # the banner names the chosen sandbox
    made: list[Path] = []

    def workspace(tmp_path: Path) -> Path:
        """A workspace this worker may write: `tmp_path` for a root worker, else one the user owns."""
        if not user:
            return tmp_path
        made.append(unprivileged.owned_dir("toolq-ws-"))
        return made[-1]

    yield SimpleNamespace(proc=w, backend=backend, logdir=logdir, redis=locked_redis, user=user, workspace=workspace)
    w.stop()
    for d in made + ([logdir] if user else []):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", params=["bwrap", "landlock"])
def hostile_worker(request, locked_redis, tmp_path_factory):
    yield from hostile_workers(request.param, locked_redis, tmp_path_factory)


def attack(drive, hostile_worker, tmp_path, commands: dict[str, str], **kw) -> dict[str, tuple[int, str]]:
    """One turn whose calls are `commands` (call_id -> shell); the (exit code, output) of each."""
    script = [[b.function_call("exec_command", {"cmd": cmd}, call_id) for call_id, cmd in commands.items()],
              [b.message("done")]]
    run = drive(script, redis_url=hostile_worker.redis.url, workspace=tmp_path, **kw)
    got = outputs(run)
    parts = {call_id: exec_parts(text) for call_id, text in got.items()}
    return {call_id: (code, body) for call_id, (code, _, body) in parts.items()}


def no_secret(text: str) -> None:
    for secret in (OPENAI_KEY, FLOWER_PASSWORD, REDIS_PASSWORD):
        assert secret not in text


def test_no_secret_in_the_environment_and_the_broker_is_unreachable(drive, hostile_worker, tmp_path):
    port = hostile_worker.redis.port
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the host's loopback, as UDP
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(0.5)
    udp = listener.getsockname()[1]
    out = attack(drive, hostile_worker, tmp_path, {
        "call_env": "env",
        "call_tcp": f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED",
        "call_py": f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2); print('CONNECTED')\"",
        "call_udp": f"python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'leak', "
                    f"('127.0.0.1', {udp}))\"",
    })
    with pytest.raises(TimeoutError):
        listener.recvfrom(16)  # nothing crossed over from the sandbox
    listener.close()
    code, env = out["call_env"]
    assert code == 0 and "PATH=" in env  # the control: env did run
    no_secret(env)
    assert "REDIS_URL" not in env and "TOOLQ_" not in env and "OPENAI" not in env
    for call in ("call_tcp", "call_py"):
        code, body = out[call]
        assert code != 0 and "CONNECTED" not in body, body
        assert any(s in body for s in ("Permission denied", "Connection refused", "Network is unreachable")), body


def test_files_outside_the_workspace_are_out_of_reach(drive, hostile_worker, tmp_path, tmp_path_factory):
    other = tmp_path_factory.mktemp("other-turn")
    (other / "secret.txt").write_text("other-turn-private\n")
    (other / "secret.txt").chmod(0o600)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    worker_file = hostile_worker.logdir / "worker-secret.txt"
    planted = Path(f"/etc/toolq-planted-{secrets.token_hex(4)}")
    out = attack(drive, hostile_worker, tmp_path, {
        "call_inside": "echo ok > inside.txt && cat inside.txt",
        "call_other": f"cat {other}/secret.txt",
        "call_worker": f"cat {worker_file}; ls {hostile_worker.logdir}",
        "call_write_out": f"echo x > {other}/planted.txt; echo x > {planted}",
        "call_git": "echo '[core] fsmonitor = touch /tmp/pwned' >> .git/config",
        "call_home": f"ls {Path.home()}/ && cat {Path.home()}/.bashrc",
        "call_shadow": "cat /etc/shadow",
    })
    assert out["call_inside"] == (0, "ok\n")  # the control: the workspace is writable
    assert (tmp_path / "inside.txt").read_text() == "ok\n"
    code, body = out["call_other"]
    assert code != 0 and "other-turn-private" not in body
    assert "No such file" in body or "Permission denied" in body, body
    code, body = out["call_worker"]
    assert code != 0 and "worker-private" not in body and "hostile" not in body, body
    code, body = out["call_write_out"]
    assert code != 0 and ("Read-only" in body or "Permission denied" in body or "No such file" in body), body
    assert not (other / "planted.txt").exists() and not planted.exists()
    if hostile_worker.backend == "bwrap":  # Landlock cannot take write access back beneath the workspace
        code, body = out["call_git"]
        assert code != 0 and "Read-only file system" in body, body
        assert (tmp_path / ".git" / "config").read_text() == "[core]\n"
    code, body = out["call_home"]
    assert code != 0 or body.strip() == "", body
    code, body = out["call_shadow"]  # Landlock grants /etc entry by entry around it, for a root worker
    assert code != 0 and "root:" not in body, body


def test_the_worker_can_be_neither_read_nor_signalled(drive, hostile_worker, tmp_path):
    main = hostile_worker.proc.proc.pid
    pool = [p.pid for p in psutil.Process(main).children()]
    commands = {}
    for pid in (main, *pool):
        commands[f"call_mem_{pid}"] = f"exec 3</proc/{pid}/mem && echo OPENED"
        commands[f"call_environ_{pid}"] = f"cat /proc/{pid}/environ"
        commands[f"call_kill_{pid}"] = f"kill -STOP {pid} && echo SIGNALLED"
    out = attack(drive, hostile_worker, tmp_path, commands)
    for call_id, (code, body) in out.items():
        assert code != 0, (call_id, body)
        assert "OPENED" not in body and "SIGNALLED" not in body
        no_secret(body)
        assert any(s in body for s in ("No such file", "No such process", "Permission denied",
                                       "Operation not permitted")), (call_id, body)
    assert psutil.Process(main).status() != psutil.STATUS_STOPPED
    assert all(psutil.Process(pid).status() != psutil.STATUS_STOPPED for pid in pool)


def escapes(tag: str) -> str:
    # leaves the process group (setsid -f) and double-forks: both outlive the shell without a sandbox
    return f"setsid -f sleep 300.{tag}1; (sleep 300.{tag}2 &); bash -c 'sleep 300.{tag}3 & disown'"


def assert_gone(tag: str) -> None:
    deadline = time.monotonic() + 5
    while pids_matching(f"sleep 300.{tag}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_matching(f"sleep 300.{tag}") == [], "a process the call started outlived it"


def test_nothing_outlives_a_call_that_exits(drive, hostile_worker, tmp_path):
    tag = f"{markers.PROCESS}1"
    out = attack(drive, hostile_worker, tmp_path, {"call_escape": escapes(tag) + "; echo left"})
    assert out["call_escape"] == (0, "left\n")
    assert_gone(tag)


def test_nothing_outlives_a_call_that_times_out(drive, hostile_worker, tmp_path):
    tag = f"{markers.PROCESS}2"
    script = [[b.function_call("exec_command", {"cmd": escapes(tag) + "; sleep 100"}, "call_slow")],
              [b.message("done")]]
    drive(script, redis_url=hostile_worker.redis.url, workspace=tmp_path, turn_timeout=4)
    assert_gone(tag)


def test_nothing_outlives_a_cancelled_call(hostile_worker, tmp_path):
    tag = f"{markers.PROCESS}3"
    script = [[b.function_call("exec_command", {"cmd": escapes(tag) + "; sleep 100"}, "call_cancel")],
              [b.message("never")]]

    async def during(session, runtime):
        await wait_until(lambda: all(pids_matching(f"sleep 300.{tag}{i}") for i in (1, 2, 3)),
                         what="the escaped processes")
        session.cancel()

    with FakeModel(script) as fake:
        settings = c.settings_for(hostile_worker.redis.url, fake, tmp_path)
        (outcome,), _ = asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], [], during), 60))
    assert outcome.status == "cancelled"
    assert_gone(tag)


def test_limits_stop_a_fork_bomb_a_big_allocation_a_cpu_hog_and_a_big_file(drive, hostile_worker, tmp_path):
    tag = f"{markers.PROCESS}4"
    bomb = ("import os, sys, time\n"
            "for i in range(500):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(30); os._exit(0)\n")
    out = attack(drive, hostile_worker, tmp_path, {
        "call_bomb": f"python3 -c '{bomb}' bomb-{tag}",
        "call_alloc": "python3 -c 'b = bytearray(3 * 1024**3); print(\"ALLOCATED\")'",
        "call_cpu": "python3 -c 'while True: pass'",
        "call_file": "head -c 5000000 /dev/zero > big.bin",
    })
    code, body = out["call_bomb"]
    assert code != 0 and "the sandbox's limit of 64 processes" in body, body
    code, body = out["call_alloc"]
    assert code != 0 and "ALLOCATED" not in body and "the sandbox limits each process to 2048 MiB" in body, body
    code, body = out["call_cpu"]
    assert code == 128 + 24 and "CPU time limit of 2 s" in body, body
    code, body = out["call_file"]
    assert code != 0 and "file size limit of 1 MiB" in body, body
    assert (tmp_path / "big.bin").stat().st_size <= 1024 * 1024
    deadline = time.monotonic() + 5
    while pids_matching(f"bomb-{tag}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_matching(f"bomb-{tag}") == [], "the fork bomb's children outlived the call"


def test_nothing_outlives_a_pool_process_killed_mid_call(hostile_worker, tmp_path):
    if hostile_worker.backend == "landlock" and limits.pids_cgroup_base() is None:
        pytest.skip("without a pid namespace or a pids cgroup, a killed pool process's orphans escape")
    tag = f"{markers.PROCESS}5"
    script = [[b.function_call("exec_command", {"cmd": escapes(tag) + "; sleep 100"}, "call_killed")],
              [b.message("never")]]
    main = psutil.Process(hostile_worker.proc.proc.pid)

    async def during(session, runtime):
        await wait_until(lambda: all(pids_matching(f"sleep 300.{tag}{i}") for i in (1, 2, 3)),
                         what="the escaped processes")
        marked = set(pids_matching(f"sleep 300.{tag}"))
        (runner,) = [p for p in main.children() if marked & {c.pid for c in p.children(recursive=True)}]
        runner.kill()  # a pool process dying mid-call (OOM killer, Celery's hard time limit)
        await asyncio.sleep(0.5)
        session.cancel()

    with FakeModel(script) as fake:
        settings = c.settings_for(hostile_worker.redis.url, fake, tmp_path)
        asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], [], during), 60))
    assert_gone(tag)
