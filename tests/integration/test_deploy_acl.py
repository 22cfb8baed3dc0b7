"""The Redis users that docker-compose.yml and deploy/k8s/redis.yaml create, on a real server; and a
worker's wrong login, which stops it at start, unlike a Redis that is down, which it waits for.

The rules are read from the deploy files themselves. A real worker logs in as `worker`, a real
orchestrator (and `toolq cancel/status/turns`) as `orchestrator`; a turn runs, a running call is
cancelled and the worker shuts down warm. Redis's ACL LOG must then hold no refused command, and
each role must be refused what could wipe, reconfigure or stop the server.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import redis
import yaml

import tests.integration.conftest as c
from tests import markers
from tests.integration.test_cancel import pids_matching
from tests.unit.test_deploy import COMPOSE, K8S
from toolq.cli.flower import FlowerProcess
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess, free_port

pytestmark = pytest.mark.integration

PASSWORDS = {"REDIS_PASSWORD": "4dminpw", "REDIS_WORKER_PASSWORD": "w0rkerpw",
             "REDIS_ORCHESTRATOR_PASSWORD": "0rchpw", "REDIS_KEDA_PASSWORD": "k3dapw"}
USER_PASSWORDS = {"worker": "w0rkerpw", "orchestrator": "0rchpw", "keda": "k3dapw"}
#: Commands no role may run (plus whatever else Redis files under @dangerous).
REFUSED = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "dir", "/tmp"), ("SHUTDOWN",),
           ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST"), ("ACL", "LIST"), ("KEYS", "*"), ("SAVE",),
           ("REPLICAOF", "NO", "ONE"), ("CLIENT", "KILL", "TYPE", "normal"), ("MIGRATE", "h", "1", "k", "0", "1")]


def substituted(args: list[str]) -> list[str]:
    """The server's argv as Compose (`${VAR:?msg}`) or Kubernetes (`$(VAR)`) would expand it."""
    def one(m: re.Match) -> str:
        return PASSWORDS[m[1] or m[2]]
    return [re.sub(r"\$\{([A-Z_]+)(?::[?-][^}]*)?\}|\$\(([A-Z_]+)\)", one, a) for a in args]


def compose_args() -> list[str]:
    return substituted(yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"])


def k8s_args() -> list[str]:
    (deployment,) = [d for d in yaml.safe_load_all((K8S / "redis.yaml").read_text()) if d["kind"] == "Deployment"]
    return substituted(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def users(args: list[str]) -> dict[str, list[str]]:
    """`--user NAME RULE...` options: name -> its rules."""
    out: dict[str, list[str]] = {}
    for i, a in enumerate(args):
        if a == "--user":
            rest = args[i + 1:]
            end = next((j for j, x in enumerate(rest) if x.startswith("--")), len(rest))
            out[rest[0]] = rest[1:end]
    return out


def test_compose_and_kubernetes_give_the_roles_the_same_rules():
    compose, k8s = users(compose_args()), users(k8s_args())
    assert set(compose) == {"worker", "orchestrator"} and set(k8s) == {"worker", "orchestrator", "keda"}
    assert {k: v for k, v in k8s.items() if k in compose} == compose
    assert all(isinstance(w, str) for rules in k8s.values() for w in rules)  # YAML read none as a bool or null


def url(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{USER_PASSWORDS[user]}@127.0.0.1:{server.port}/0"


def test_the_roles_run_a_whole_turn_and_nothing_that_could_wipe_or_stop_the_server(tmp_path):
    marker = f"sleep 30.{markers.PROCESS}5"
    script = [[b.function_call("exec_command", {"cmd": "echo ok"}, "call_ok"),
               b.function_call("read_file", {"file_path": "missing.txt"}, "call_missing"),
               b.function_call("exec_command", {"cmd": marker}, "call_long")],
              [b.message("after the cancel")]]
    # The server starts with the deploy file's own arguments (Kubernetes': it has every user).
    data = tmp_path / "data"
    data.mkdir()
    args = [str(data) if a == "/data" else a for a in k8s_args()]
    assert args[0] == "redis-server"
    with RedisServer(password=PASSWORDS["REDIS_PASSWORD"], args=args[1:], workdir=data) as server:
        admin = redis.Redis.from_url(server.url)
        worker = WorkerProcess(url(server, "worker"), queues=["toolq"], concurrency=3, tools=[c.TEST_TOOLS],
                               env=c.WORKER_ENV, logdir=tmp_path, name="acl-worker@test").start()
        orchestrator_env = {**os.environ, "REDIS_URL": url(server, "orchestrator")}

        def toolq(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], env=orchestrator_env,
                                  capture_output=True, text=True, timeout=60)

        async def during(session, runtime):
            deadline = time.monotonic() + 30
            while not pids_matching(marker):
                assert time.monotonic() < deadline, "the long call never started"
                await asyncio.sleep(0.05)
            for args in (["turns"], ["status", session.turn_id], ["cancel", session.turn_id, "--call", "call_long"]):
                out = await asyncio.to_thread(toolq, *args)
                assert out.returncode == 0, (args, out.stderr)

        flower = FlowerProcess(Settings(redis_url=url(server, "orchestrator"), flower_user="u", flower_password="p"),
                               logdir=tmp_path)
        try:
            with FakeModel(script) as fake, flower:
                settings = c.settings_for(url(server, "orchestrator"), fake, tmp_path)
                (outcome,), _ = asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], [], during), 90))
                # Flower as the orchestrator user: its task list, queue lengths (LLEN) and a live inspect
                flower.wait_for_workers([worker.name])
                for path in ("/api/tasks", "/api/queues/length", "/api/workers?refresh=1"):
                    assert httpx.get(flower.url + path, auth=("u", "p"), timeout=30).status_code == 200, path
        finally:
            worker.stop()  # a warm shutdown: the draining record is written and removed
        assert outcome.status == "completed", outcome.error
        outputs = {i["call_id"]: i["output"] for i in fake.requests[1]["input"]
                   if i.get("type") == "function_call_output"}
        assert "ok" in outputs["call_ok"] and "aborted" in outputs["call_long"]
        assert admin.acl_log() == [], "a role was refused a command toolq needs"

        def allowed(user: str, *command: str) -> bool:
            # ACL DRYRUN checks a command against the user's rules without running it
            return admin.execute_command("ACL", "DRYRUN", user, *command) == b"OK"

        for user in ("worker", "orchestrator"):
            assert [cmd for cmd in REFUSED if allowed(user, *cmd)] == []
            client = redis.Redis.from_url(url(server, user))
            for command in (("FLUSHALL",), ("CONFIG", "SET", "dir", "/tmp"), ("KEYS", "*")):  # and for real
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
            assert allowed(user, "SET", "k", "v") and allowed(user, "PUBLISH", "c", "m") and client.ping()
        assert allowed("keda", "LLEN", "toolq") and redis.Redis.from_url(url(server, "keda")).llen("toolq") == 0
        assert [cmd for cmd in (("LLEN", "celery-task-meta-x"), ("GET", "toolq:turns"), ("SET", "toolq", "1"),
                                ("PUBLISH", "toolq", "x"), ("KEYS", "*"), *REFUSED) if allowed("keda", *cmd)] == []
        assert admin.dbsize() > 0  # the turn's records: nobody could wipe them


# --- issue 26 item 3: a wrong login stops a worker at start; a Redis that is down is waited for


def worker_run(redis_url: str, tmp_path) -> subprocess.CompletedProcess:
    """`toolq worker` as a user starts it, its stderr captured (the log file would hold Celery's)."""
    w = WorkerProcess(redis_url, queues=["toolq"], concurrency=1, tools=[c.TEST_TOOLS], env=c.WORKER_ENV,
                      logdir=tmp_path, name="login@test")
    env = {**os.environ, **c.WORKER_ENV, "REDIS_URL": redis_url}
    return subprocess.run(w.argv(), env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_whose_login_redis_refuses_exits_at_start_in_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    args = [str(data) if a == "/data" else a for a in k8s_args()]
    with RedisServer(password=PASSWORDS["REDIS_PASSWORD"], args=args[1:], workdir=data) as server:
        logins = {"a wrong password (WRONGPASS)": f"redis://worker:wrong-pw@127.0.0.1:{server.port}/0",
                  "an unknown user": f"redis://nobody:{USER_PASSWORDS['worker']}@127.0.0.1:{server.port}/0",
                  "no password (NOAUTH)": f"redis://127.0.0.1:{server.port}/0",
                  "the default user's wrong password": f"redis://:wrong-pw@127.0.0.1:{server.port}/0"}
        for what, login in logins.items():
            out = worker_run(login, tmp_path)
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 2, (what, out.returncode, out.stderr[-2000:])
            assert len(lines) == 1 and "Traceback" not in out.stderr, (what, out.stderr[-2000:])
            assert "refused the worker's login" in lines[0] and f":{server.port}/0" in lines[0], (what, lines[0])
            assert "wrong-pw" not in lines[0] and USER_PASSWORDS["worker"] not in lines[0], "a password in the line"
        # The right login still starts the worker.
        WorkerProcess(url(server, "worker"), queues=["toolq"], concurrency=1, tools=[c.TEST_TOOLS], env=c.WORKER_ENV,
                      logdir=tmp_path, name="right-login@test").start().stop()


def test_a_worker_waits_for_a_redis_that_is_down_and_serves_once_it_is_up(tmp_path):
    port = free_port()
    password = "d0wn-then-up"
    w = WorkerProcess(f"redis://:{password}@127.0.0.1:{port}/0", queues=["toolq"], concurrency=1,
                      tools=[c.TEST_TOOLS], env=c.WORKER_ENV, logdir=tmp_path, name="patient@test").start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while "Trying again" not in w.log.read_text(errors="replace"):  # Celery's retry of the broker connection
            assert w.proc is not None and w.proc.poll() is None, f"the worker exited:\n{w.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the worker never said it retries"
            time.sleep(0.1)
        with RedisServer(port=port, password=password):
            w.wait_ready(timeout=90)
            assert w.proc is not None and w.proc.poll() is None
    finally:
        w.stop()
