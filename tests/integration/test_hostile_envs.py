"""Red team of environments (issue 28) on real workers: a model that controls the commands of one
environment tries to reach another environment's files, the base cache and the host's root, and
leaves in its workspace what a host's checkpoint (a trusted process) could follow, block on or
run. Each worker is tried as root and as `nobody` (skipped with one line where that cannot run)."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.integration import unprivileged
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.test_env_worker import ask, exec_on, live_conversation, output, record_of
from toolq.core.environments import EnvironmentRecord, EnvSource, HostAdvert, env_key, host_key, new_environment_id
from toolq.local.embedded import WorkerProcess
from toolq.workers.environments import archive
from toolq.workers.environments.host import _mount_points
from toolq.workers.store.redis_store import RedisStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["root", "nobody", "user"])
def host(request, redis_env, tmp_path_factory):
    """One host, one worker process: as root (overlay in the machine's namespace), as nobody (a
    copy: its uid is the overflow uid) or as a user of its own (overlay in the host's namespace).
    Yields (host id, root)."""
    user = request.param != "root"
    as_ids = unprivileged.OWN_IDS if request.param == "user" else None
    top = unprivileged.worker_folder(user, tmp_path_factory, "hostile-envs", as_ids)
    root, name = top / "envroot", f"hx-{request.param}"
    (top / "logs").mkdir(exist_ok=True)
    kw = {"as_ids": as_ids} if user else {}
    cls = unprivileged.UserWorkerProcess if user else WorkerProcess
    w = cls(redis_env.url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
            env={**WORKER_ENV, "TOOLQ_HOST_ID": name, "TOOLQ_ENV_ROOT": str(root)}, logdir=top / "logs",
            name=f"{name}@hostile", **kw)
    w.start()
    client = redis.Redis.from_url(redis_env.url)
    end = time.monotonic() + 60
    while not client.exists(host_key(name)):
        assert time.monotonic() < end, "the host never advertised environments"
        time.sleep(0.1)
    advert = HostAdvert.model_validate_json(client.get(host_key(name)) or b"")
    client.close()
    assert advert.mode == ("copy" if request.param == "nobody" else "overlay"), advert
    yield name, root
    w.stop(grace=3)
    for point in sorted(_mount_points(), reverse=True):
        if point.startswith(str(root) + "/"):
            subprocess.run(["umount", "-l", point], check=False)


def made(r: redis.Redis, host: str, files: dict[str, str], tmp_path: Path) -> EnvironmentRecord:
    folder = tmp_path / secrets.token_hex(4)
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    env = record_of(r, folder, host)
    reply = ask(r, "create", env)
    assert reply.ok, reply.error
    return env


def test_a_command_reaches_no_other_environment_nor_the_base_cache_nor_the_hosts_root(redis_env, host, r, tmp_path):
    name, root = host
    secret = "secret-" + secrets.token_hex(8)
    other = made(r, name, {"secret.txt": secret + "\n"}, tmp_path)
    mine = made(r, name, {"mine.txt": "mine\n"}, tmp_path)
    # Every way to name another environment's files: the host's root and each layer (from this
    # environment's own mount line), `..` above the workspace, /proc of other processes.
    cmd = (f"R={root}; O={other.id}; "
           "for p in $R/envs/$O/merged $R/envs/$O/upper $R/envs/$O/tree $R/bases/*/tree $R/envs "
           "$(grep -o '[a-z]*dir=[^, ]*' /proc/self/mountinfo | cut -d= -f2 | tr ':' ' ') ../$O/merged "
           "../../$O/tree ../../../envs; do cat $p/secret.txt 2>/dev/null; ls $p 2>/dev/null | head -3; done; "
           "for pid in $(ls /proc | grep '^[0-9]'); do cat /proc/$pid/root$R/envs/$O/*/secret.txt "
           "/proc/$pid/cwd/../../$O/*/secret.txt 2>/dev/null; done; "
           "grep -rs --include=secret.txt . / 2>/dev/null | head -3; "
           f"echo pwned > $R/envs/$O/merged/secret.txt 2>/dev/null; echo END")
    ran = exec_on(redis_env.url, name, mine, cmd, timeout=120, yield_ms=60_000)
    assert "END" in output(ran), ran
    assert secret not in output(ran)
    taken = ask(r, "checkpoint", other)
    assert taken.ok and taken.diff is not None and taken.diff.patch == "", taken  # untouched
    for env in (mine, other):
        assert ask(r, "destroy", env).ok


def test_what_a_command_leaves_is_neither_followed_nor_run_nor_blocked_on_by_the_checkpoint(
        redis_env, host, r, tmp_path):
    name, root = host
    marker = f"/tmp/toolq-pwned-{secrets.token_hex(4)}"
    env = made(r, name, {"a.txt": "a\n", "dir/b.txt": "b\n"}, tmp_path)
    cmd = ("mkfifo fifo; mkfifo dir/b.fifo; ln -s /etc/passwd passwd; ln -s ../../../../../etc/shadow up; "
           "ln -s . loop; ln -s loop/loop/.. esc; ln a.txt hard.txt; cp /bin/true suid; chmod 4755 suid; "
           "chmod 2777 dir; python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.bind(\"sock\")' ; "
           f"mkdir -p .git/hooks && printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/pre-commit; "
           f"printf '[core]\\n\\tfsmonitor = touch {marker}\\n\\tpager = touch {marker}\\n' >> .git/config 2>/dev/null; "
           f"printf '* filter=evil\\n' > .gitattributes; printf '[filter \"evil\"]\\n\\tclean = touch {marker}\\n' "
           "> .gitconfig; rm dir/b.txt; mv a.txt dir/b.txt; "
           "rm -f a.txt; ln -s /etc/passwd a.txt; echo END")
    ran = exec_on(redis_env.url, name, env, cmd)
    assert "END" in output(ran), ran
    taken = ask(r, "checkpoint", env, timeout=60)
    assert taken.ok and taken.diff is not None, taken
    text = json.dumps(taken.diff.model_dump())
    assert "root:x:0:0" not in text and not Path(marker).exists()
    store = RedisStore(r, ttl=600, max_bytes=64 << 20)
    from toolq.core.environments import Checkpoint
    cp = Checkpoint.model_validate_json(store.get(taken.checkpoint or ""))
    carried = archive.manifest_of(store.get(cp.delta)) if cp.delta else {}
    for path, entry in carried.items():
        assert entry.mode & 0o7000 == 0, (path, entry)
        assert entry.kind != "symlink" or not (entry.target or "").startswith("/"), (path, entry)
    assert "passwd" not in carried and "up" not in carried and "esc" not in carried
    assert not any(p in carried for p in ("fifo", "dir/b.fifo", "sock"))
    # the checkpoint taken up by a new environment brings none of it either
    again = EnvironmentRecord(id=new_environment_id(), host=name, source=EnvSource(kind="checkpoint",
                              checkpoint=taken.checkpoint), base=env.base, start=taken.checkpoint, owner=env.owner)
    r.set(env_key(again.id), again.model_dump_json())
    reply = ask(r, "create", again)
    assert reply.ok, reply.error
    seen = exec_on(redis_env.url, name, again, "ls -la; stat -c '%A %n' suid dir; cat dir/b.txt; echo END")
    assert "END" in output(seen) and "rws" not in output(seen) and "passwd ->" not in output(seen), seen
    assert not Path(marker).exists()
    for e in (env, again):
        assert ask(r, "destroy", e).ok


def test_destroy_ends_a_session_whose_processes_left_the_workspace(redis_env, host, r, tmp_path):
    """kill_processes_in finds processes by cwd or root under the environment: a command that
    moved to /tmp (the sandbox's own tmpfs) before idling must go with the environment too."""
    name, root = host
    env = made(r, name, {"a.txt": "a\n"}, tmp_path)
    tag = secrets.token_hex(6)
    # A live conversation: without its key the session host's sweep kills the session (this test
    # once raced that sweep and lost it under load).
    started = exec_on(redis_env.url, name, env, f"cd /tmp && exec -a toolq-idle-{tag} sleep 900",
                      conversation=live_conversation(r), yield_ms=500)
    assert "session id" in output(started).lower(), started
    # The session is open once its shell started; on a loaded machine the `exec -a` may come later.
    end = time.monotonic() + 60
    while not _running(tag):
        assert time.monotonic() < end, f"the session's command never started: {started}"
        time.sleep(0.2)
    assert ask(r, "destroy", env).ok
    end = time.monotonic() + 15
    while _running(tag):
        assert time.monotonic() < end, "a command of the destroyed environment still runs"
        time.sleep(0.2)


def _running(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, __import__("os").listdir("/proc")):
        try:
            if f"toolq-idle-{tag}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_folder_a_command_locked_is_still_checkpointed_and_destroyed(redis_env, host, r, tmp_path):
    """As nobody the host is the commands' own uid: a folder they made unreadable or unwritable
    (chmod 000, 500) is still read for the checkpoint and removed with the environment (no root
    to pass over the modes)."""
    name, root = host
    env = made(r, name, {"a.txt": "a\n"}, tmp_path)
    ran = exec_on(redis_env.url, name, env, "mkdir -p shut/in kept/in && echo s > shut/in/f && echo k > kept/in/f "
                  "&& chmod 000 shut/in && chmod 500 kept/in kept && chmod 000 shut && echo END")
    assert "END" in output(ran), ran
    gone = ask(r, "destroy", env)
    assert gone.ok, gone.error
    assert not (root / "envs" / env.id).exists()


def test_a_tree_thousands_deep_is_destroyed_and_the_reaper_goes_on_past_it(redis_env, host, r, tmp_path):
    """`mkdir d; cd d` 1100 times: shutil.rmtree recursed once a level and raised RecursionError;
    the environment stayed and the reaper, stopped at it, reaped no environment after it."""
    name, root = host
    deep = made(r, name, {"a.txt": "a\n"}, tmp_path)
    dig = "import os\nfor _ in range(1100): os.mkdir('d'); os.chdir('d')\nos.chmod('..', 0o500)"
    ran = exec_on(redis_env.url, name, deep, f'python3 -c "{dig}" && echo END', timeout=120)
    assert "END" in output(ran), ran
    again = exec_on(redis_env.url, name, deep, "echo STILL")
    assert "STILL" in output(again), again
    gone = ask(r, "destroy", deep)
    assert gone.ok, gone.error
    assert not (root / "envs" / deep.id).exists()
