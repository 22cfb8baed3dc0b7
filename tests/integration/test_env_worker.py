"""The host side of environments on real workers (toolq/workers/environments): two `toolq worker`
processes, each its own host (`TOOLQ_HOST_ID`, `TOOLQ_ENV_ROOT`), serve signed environment requests
pushed by the test, run a call routed to their host queue in the environment's workspace (through
the sandbox and the session host), refuse a call of another host's environment without running
it, and keep the base cache out of a command's reach.

Calls are sent as the orchestrator sends them (a signed task on `host_queue(host, tool_queue(spec))`),
so this file pins the worker's half without the orchestrator's placement."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.signed import SIGNER, bound, run_signed
from toolq.core.advert import tool_queue
from toolq.core.environments import (
    EnvironmentRecord,
    EnvReply,
    EnvRequest,
    EnvSource,
    HostAdvert,
    env_key,
    host_key,
    host_queue,
    host_requests_key,
    new_environment_id,
    reply_key,
)
from toolq.core.session_records import conversation_key
from toolq.core.signing import Signer
from toolq.local.embedded import WorkerProcess
from toolq.workers.environments import archive
from toolq.workers.environments.host import _mount_points
from toolq.workers.loader import load_catalog
from toolq.workers.store.redis_store import RedisStore

pytestmark = pytest.mark.integration

HOSTS = ("h1", "h2")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Each host's TOOLQ_ENV_ROOT; whatever a failed test left mounted there is unmounted after."""
    top = tmp_path_factory.mktemp("env-hosts")
    yield {h: top / f"root-{h}" for h in HOSTS}
    for point in sorted(_mount_points(), reverse=True):
        if point.startswith(str(top) + "/"):
            subprocess.run(["umount", "-l", point], check=False)


@pytest.fixture(scope="module")
def hosts(redis_env, roots, tmp_path_factory):
    """Two hosts, one worker process each (two pool children), for the whole module."""
    logdir = tmp_path_factory.mktemp("env-workers")
    made = {h: WorkerProcess(redis_env.url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                             env={**WORKER_ENV, "TOOLQ_HOST_ID": h, "TOOLQ_ENV_ROOT": str(roots[h])},
                             logdir=logdir, name=f"{h}@envtest") for h in HOSTS}
    for w in made.values():
        w.start(wait=False)
    for w in made.values():
        w.wait_ready()
    client = redis.Redis.from_url(redis_env.url)
    end = time.monotonic() + 60
    while not all(client.exists(host_key(h)) for h in HOSTS):
        assert time.monotonic() < end, "the hosts never advertised environments"
        time.sleep(0.1)
    client.close()
    yield made
    for w in made.values():
        w.stop(grace=3)


def ask(r: redis.Redis, op: str, env: EnvironmentRecord, timeout: float = 60) -> EnvReply:
    """As the orchestrator asks: a signed request on the host's list, a sealed reply back."""
    request = EnvRequest(op=op, env=env, deadline=time.time() + timeout)  # type: ignore[arg-type]
    body = request.model_dump(mode="json")
    r.lpush(host_requests_key(env.host), json.dumps({"request": body, "sig": SIGNER.sign_env_request(body)}))
    got = r.blpop([reply_key(request.id)], timeout=timeout)
    assert got is not None, f"host {env.host} did not answer {op}"
    message = json.loads(got[1])
    assert SIGNER.env_reply_genuine(request.id, message)
    return EnvReply.model_validate(message["reply"])


def exec_on(redis_url: str, host: str, env: EnvironmentRecord | Any, cmd: str, *,
            conversation: str | None = None, timeout: float = 60, yield_ms: int = 10_000) -> dict[str, Any]:
    """One exec_command call of `env`, signed and sent to `host`'s queue of the tool; its result."""
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "exec_command")
    inv = bound(spec, {"cmd": cmd, "yield_time_ms": yield_ms}, timeout=timeout,
                workspace="/nonexistent-shared-workspace", turn_prefix="turn-env",
                environment=env.ref() if isinstance(env, EnvironmentRecord) else env, conversation=conversation)
    return run_signed(redis_url, inv, host_queue(host, tool_queue(spec)), timeout=timeout)


def live_conversation(r: redis.Redis) -> str:
    """A conversation id whose key lives, as the orchestrator keeps it while a conversation runs:
    the session host kills the sessions of a conversation whose key is gone, at its next sweep."""
    conversation = "conv-" + secrets.token_hex(4)
    r.set(conversation_key(conversation), "1", ex=600)
    return conversation


def output(result: dict[str, Any]) -> str:
    out = result["output"]
    return out if isinstance(out, str) else json.dumps(out)


def upload_record(r: redis.Redis, tmp_path: Path, host: str) -> EnvironmentRecord:
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("hello from the upload\n")
    return record_of(r, folder, host)


def record_of(r: redis.Redis, folder: Path, host: str) -> EnvironmentRecord:
    """`folder` packed into the store and an environment's record of it on `host`, as the orchestrator
    writes them before it asks the host to create the environment."""
    store = RedisStore(r, ttl=600, max_bytes=64 << 20)
    blob = store.put(archive.pack_dir(folder).tar)
    owner = f"owner:{secrets.token_hex(4)}"
    r.set(owner, "1")
    env = EnvironmentRecord(id=new_environment_id(), host=host, source=EnvSource(kind="upload", blob=blob),
                            base=blob, owner=owner)
    r.set(env_key(env.id), env.model_dump_json())
    return env


def test_a_call_of_an_environment_runs_in_it_on_its_host_and_nowhere_else(redis_env, hosts, roots, r, tmp_path):
    advert = HostAdvert.model_validate_json(r.get(host_key("h1")) or b"")
    env = upload_record(r, tmp_path, "h1")
    reply = ask(r, "create", env)
    assert reply.ok, reply.error
    assert reply.mode == advert.mode
    assert json.loads(r.get(env_key(env.id)) or b"{}")["state"] == "ready"

    # Through the sandbox and the session host: the command sees the upload and writes beside it.
    used_at = json.loads(r.get(env_key(env.id)) or b"{}")["used_at"]
    ran = exec_on(redis_env.url, "h1", env, "cat notes.txt && echo made here > new.txt && pwd",
                  conversation="conv-" + secrets.token_hex(4))
    assert ran["status"] == "completed", ran
    assert "hello from the upload" in output(ran)
    workspace = roots["h1"] / "envs" / env.id / ("merged" if reply.mode == "overlay" else "tree")
    assert str(workspace) in output(ran)
    assert (workspace / "new.txt").read_text() == "made here\n"
    assert json.loads(r.get(env_key(env.id)) or b"{}")["used_at"] > used_at  # kept from its idle limit

    # The checkpoint carries it.
    taken = ask(r, "checkpoint", env)
    assert taken.ok and taken.diff is not None and "b/new.txt" in taken.diff.patch, taken

    # A worker of another host does not run it: not run, naming the environment and both hosts.
    elsewhere = exec_on(redis_env.url, "h2", env, "echo ran > ran-elsewhere.txt")
    assert elsewhere["status"] == "rejected", elsewhere
    text = output(elsewhere)
    assert "was not run" in text and env.id in text and "h1" in text and "h2" in text
    assert not (workspace / "ran-elsewhere.txt").exists()
    # Nor an environment its host does not hold.
    ghost = exec_on(redis_env.url, "h2", env.ref().model_copy(update={"host": "h2"}), "true")
    assert ghost["status"] == "rejected" and "not present on host h2" in output(ghost)

    # A session still running in it when it is destroyed goes with it.
    session = exec_on(redis_env.url, "h1", env, "sleep 600", conversation=live_conversation(r), yield_ms=300)
    assert "session id" in output(session).lower(), session
    end = time.monotonic() + 60  # the session is open once its shell started; its `sleep` may come later
    while not processes_in(workspace):
        assert time.monotonic() < end, f"the session's command never started: {session}"
        time.sleep(0.1)
    assert ask(r, "destroy", env).ok
    assert not (roots["h1"] / "envs" / env.id).exists()
    assert json.loads(r.get(env_key(env.id)) or b"{}")["state"] == "destroyed"
    end = time.monotonic() + 10  # SIGKILLed: gone once their parents reap them
    while processes_in(workspace):
        assert time.monotonic() < end, f"processes still run in the destroyed environment: {processes_in(workspace)}"
        time.sleep(0.1)


def processes_in(workspace: Path) -> list[int]:
    """Processes whose working directory is in `workspace` (as the host's destroy looks for them)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(workspace)):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_command_cannot_write_into_the_base_cache(redis_env, hosts, roots, r, tmp_path):
    env = upload_record(r, tmp_path, "h1")
    assert ask(r, "create", env).ok
    base_tree = roots["h1"] / "bases" / env.base / "tree"
    # Every path the command can learn: the overlay's lowerdir in its mount table, the cache's own path.
    cmd = ("for p in $(grep -o 'lowerdir=[^,]*' /proc/self/mountinfo | cut -d= -f2 | tr ':' ' ') "
           f"{base_tree}; do echo pwned > \"$p/notes.txt\" && echo WROTE $p; done; "
           "echo changed > notes.txt; echo done")
    ran = exec_on(redis_env.url, "h1", env, cmd)
    assert "done" in output(ran) and "WROTE" not in output(ran), output(ran)
    assert (base_tree / "notes.txt").read_text() == "hello from the upload\n"
    assert ask(r, "destroy", env).ok


def test_a_request_not_signed_by_the_fleet_key_is_not_run(redis_env, hosts, roots, r, tmp_path):
    env = upload_record(r, tmp_path, "h1")
    request = EnvRequest(op="create", env=env, deadline=time.time() + 30)
    body = request.model_dump(mode="json")
    forged = Signer(secrets.token_hex(32)).sign_env_request(body)
    r.lpush(host_requests_key("h1"), json.dumps({"request": body, "sig": forged}))
    assert r.blpop([reply_key(request.id)], timeout=3) is None
    assert not (roots["h1"] / "envs" / env.id).exists()
    assert f"refused request {request.id}: its signature does not match" in hosts["h1"].log.read_text()


def test_the_hosts_reaper_ends_an_environment_whose_owner_is_gone(redis_env, hosts, roots, r, tmp_path):
    env = upload_record(r, tmp_path, "h1")
    assert ask(r, "create", env).ok
    r.delete(env.owner)  # as an orchestrator SIGKILLed: its owner key expires
    end = time.monotonic() + 60
    while (roots["h1"] / "envs" / env.id).exists():
        assert time.monotonic() < end, "the reaper never ended the environment"
        time.sleep(0.2)
    assert json.loads(r.get(env_key(env.id)) or b"{}")["state"] == "destroyed"
    assert not any(env.id in point for point in _mount_points())
