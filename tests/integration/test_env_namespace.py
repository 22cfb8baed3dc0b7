"""An unprivileged host's environments are overlays (issue 28, item 3), mounted in the host's
namespace (toolq/workers/environments/namespace.py): the host's worker processes join one
namespace, so a call served by either sees the one mount of its environment; the namespace ends
with the host's last worker, and a worker started later mounts the environments again.

The workers run as a uid of their own with no /etc/passwd entry (`unprivileged.OWN_IDS`); the
test process (root) sees the environments' files in their upper dirs, never a mount."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.integration import unprivileged
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.test_env_worker import ask, exec_on, output, record_of
from toolq.core.environments import HostAdvert, host_key

pytestmark = pytest.mark.integration

HOST = "hns"


def start_workers(redis_url: str, top: Path, n: int, host: str = HOST, tag: str = "") -> list[unprivileged.UserWorkerProcess]:
    """`n` workers of one host as `unprivileged.OWN_IDS`, its environments under `top/envroot`."""
    workers = [unprivileged.UserWorkerProcess(
        redis_url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS], as_ids=unprivileged.OWN_IDS,
        env={**WORKER_ENV, "TOOLQ_HOST_ID": host, "TOOLQ_ENV_ROOT": str(top / "envroot")}, logdir=top / "logs",
        name=f"{host}{tag}{i}-{secrets.token_hex(2)}@ns") for i in range(n)]
    for w in workers:
        w.start(wait=False)
    for w in workers:
        w.wait_ready()
    return workers


def advert(r: redis.Redis, host: str = HOST) -> HostAdvert:
    end = time.monotonic() + 60
    while not r.exists(host_key(host)):
        assert time.monotonic() < end, "the host never advertised environments"
        time.sleep(0.1)
    return HostAdvert.model_validate_json(r.get(host_key(host)) or b"")


def holder_of(root: Path) -> int | None:
    try:
        (pid_file,) = (root / "locks").glob("namespace-*.pid")
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def printed(result: dict) -> list[str]:
    """The words a command printed (after exec_command's header)."""
    return output(result).split("Output:", 1)[-1].split()


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def mount_namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


@pytest.fixture
def top(tmp_path_factory):
    folder = unprivileged.worker_folder(True, tmp_path_factory, "env-namespace", unprivileged.OWN_IDS)
    (folder / "logs").mkdir()
    os.chown(folder / "logs", *unprivileged.OWN_IDS)
    return folder


def test_a_hosts_unprivileged_workers_share_one_namespace_and_each_call_sees_the_one_overlay(redis_env, r, top,
                                                                                             tmp_path):
    workers = start_workers(redis_env.url, top, 2)
    try:
        assert advert(r).mode == "overlay"
        root = top / "envroot"
        holder = holder_of(root)
        assert holder is not None
        # Not dumpable: /proc/<holder>/* is root's, so no process of its user opens its ns/* or ptraces it.
        assert os.stat(f"/proc/{holder}").st_uid == unprivileged.OWN_IDS[0] and os.stat(f"/proc/{holder}/fd").st_uid == 0
        # Both workers and their pool children live in the holder's mount namespace, not ours.
        family = [pid for w in workers for pid in (w.pid, *children(w.pid))]
        assert len(family) >= 6, family
        assert {mount_namespace(pid) for pid in family} == {mount_namespace(holder)} != {mount_namespace(os.getpid())}

        folder = tmp_path / "project"
        folder.mkdir()
        (folder / "notes.txt").write_text("from the upload\n")
        env = record_of(r, folder, HOST)
        reply = ask(r, "create", env)
        assert reply.ok and reply.mode == "overlay", reply
        # Eight calls at once: the host's two workers serve them, each writing its own file, and
        # every call sees the upload and the others' files through the same mount.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            ran = list(pool.map(lambda i: exec_on(redis_env.url, HOST, env, f"cat notes.txt && echo {i} > f{i}.txt "
                                                  "&& sleep 1 && ls"), range(8)))
        for result in ran:
            assert result["status"] == "completed" and "from the upload" in output(result), result
        seen = exec_on(redis_env.url, HOST, env, "cat f*.txt | sort | tr '\\n' ' '")
        assert printed(seen) == [str(i) for i in range(8)], seen
        # An overlay: the calls' files are in the upper dir, the upload's file only in the base.
        upper = root / "envs" / env.id / "upper"
        made = sorted(p.name for p in upper.iterdir() if p.name != ".git")  # (the sandbox's empty .git)
        assert made == [f"f{i}.txt" for i in range(8)]
        assert not (root / "envs" / env.id / "tree").exists()
        taken = ask(r, "checkpoint", env)
        assert taken.ok and taken.diff is not None and all(f"b/f{i}.txt" in taken.diff.patch for i in range(8))
        assert ask(r, "destroy", env).ok
        assert not (root / "envs" / env.id).exists()
    finally:
        for w in workers:
            w.stop(grace=3)


def test_the_namespace_ends_with_the_hosts_last_worker_and_a_later_worker_mounts_again(redis_env, r, top, tmp_path):
    root = top / "envroot"
    (first,) = start_workers(redis_env.url, top, 1)
    try:
        assert advert(r).mode == "overlay"
        folder = tmp_path / "project"
        folder.mkdir()
        (folder / "a.txt").write_text("a\n")
        env = record_of(r, folder, HOST)
        assert ask(r, "create", env).ok
        made = exec_on(redis_env.url, HOST, env, "echo kept > kept.txt && echo DONE")
        assert "DONE" in output(made), made
        holder = holder_of(root)
        assert holder is not None
    finally:
        first.stop(grace=3)
    # The holder leaves once no worker holds the namespace: its mounts go with it.
    end = time.monotonic() + 60
    while _alive(holder):
        assert time.monotonic() < end, "the namespace's holder outlived the host's last worker"
        time.sleep(0.2)
    assert holder_of(root) is None
    (again,) = start_workers(redis_env.url, top, 1)
    try:
        assert holder_of(root) not in (None, holder)
        # The reaper mounts the environment found whole on disk again; its files are all there.
        end = time.monotonic() + 60
        while True:
            seen = exec_on(redis_env.url, HOST, env, "cat kept.txt a.txt")
            if seen["status"] == "completed":
                break
            assert time.monotonic() < end, seen
            time.sleep(0.5)
        assert printed(seen) == ["kept", "a"], seen
        assert ask(r, "destroy", env).ok
    finally:
        again.stop(grace=3)


def test_a_holder_killed_under_live_workers_makes_no_second_namespace(redis_env, r, top):
    """SIGTERM is a worker's stop, not the host's: the holder ignores it. SIGKILLed while a worker
    lives, a worker started then serves no environment (and says why) rather than mount that
    worker's environments a second time in a namespace of its own."""
    root = top / "envroot"
    (first,) = start_workers(redis_env.url, top, 1)
    second = None
    try:
        holder = holder_of(root)
        assert holder is not None
        os.kill(holder, signal.SIGTERM)
        time.sleep(1)
        assert _alive(holder) and holder_of(root) == holder
        os.kill(holder, signal.SIGKILL)
        end = time.monotonic() + 30
        while _alive(holder):
            assert time.monotonic() < end, "the holder outlived SIGKILL"
            time.sleep(0.1)
        (second,) = start_workers(redis_env.url, top, 1)
        assert holder_of(root) in (None, holder)  # no new holder
        assert mount_namespace(second.pid) != mount_namespace(first.pid)
        end = time.monotonic() + 30
        while "this worker serves none" not in second.log.read_text():
            assert time.monotonic() < end, second.log.read_text()[-2000:]
            time.sleep(0.2)
    finally:
        for w in (first, second):
            if w is not None:
                w.stop(grace=3)


def _alive(pid: int) -> bool:
    """Alive and not a zombie (the holder's parent may not have reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
