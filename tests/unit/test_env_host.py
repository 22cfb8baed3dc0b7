"""A host's environments on disk (toolq/workers/environments/host.py), with a real redis-server
and the Redis store: made from an upload (overlay as root, a copy forced), checkpointed, taken up
by a second environment, destroyed to nothing, refused past the disk cap, reaped."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from toolq.core.environments import (
    BLOB_ID,
    EMPTY_BASE,
    Checkpoint,
    EnvironmentRecord,
    EnvSource,
    GitSource,
    env_key,
    host_envs_key,
    new_environment_id,
)
from toolq.workers.environments import archive
from toolq.workers.environments.host import EnvBusy, EnvError, EnvHost, _mount_points
from toolq.workers.store.redis_store import RedisStore

LIMITS = archive.Limits(max_bytes=64 << 20, max_files=10_000)
MODES = ["copy", pytest.param("overlay", marks=pytest.mark.skipif(os.geteuid() != 0, reason="overlay needs root"))]


@pytest.fixture
def store(r: redis.Redis) -> RedisStore:
    return RedisStore(r, ttl=600, max_bytes=64 << 20)


@pytest.fixture
def hosts() -> Iterator[list[EnvHost]]:
    made: list[EnvHost] = []
    yield made
    for h in made:  # never leave a mount behind on the machine
        for env_id in h.env_ids():
            h.destroy(env_id)
        for point in sorted(_mount_points(), reverse=True):
            if point.startswith(str(h.root) + "/"):
                os.system(f"umount -l '{point}'")


def make_host(hosts: list[EnvHost], root: Path, store: RedisStore, r: redis.Redis, mode: str,
              cap_mb: int = 1024) -> EnvHost:
    h = EnvHost(root, "h1", store, cap_mb << 20, LIMITS, r=r, mode=mode)  # type: ignore[arg-type]
    hosts.append(h)
    return h


def upload(tmp_path: Path, store: RedisStore) -> str:
    folder = tmp_path / "project"
    (folder / "src").mkdir(parents=True)
    (folder / "README").write_text("hello\n")
    (folder / "src" / "main.py").write_text("print('one')\n")
    (folder / "src" / "old.txt").write_text("to be deleted\n")
    (folder / "link").symlink_to("README")
    return store.put(archive.pack_dir(folder, LIMITS).tar)


def record(r: redis.Redis, base: str, *, owner: str = "owner:1", start: str | None = None,
           **kw: object) -> EnvironmentRecord:
    rec = EnvironmentRecord(id=new_environment_id(), host="h1", source=EnvSource(kind="upload", blob=base),
                            base=base, owner=owner, start=start, state="ready", **kw)  # type: ignore[arg-type]
    r.set(owner, "1")
    r.set(env_key(rec.id), rec.model_dump_json())
    r.sadd(host_envs_key("h1"), rec.id)
    return rec


@pytest.mark.parametrize("mode", MODES)
def test_an_environment_from_an_upload_is_the_folder_and_its_checkpoint_carries_it_to_a_second(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost], mode: str) -> None:
    base = upload(tmp_path, store)
    h = make_host(hosts, tmp_path / "root", store, r, mode)
    first = record(r, base)
    assert h.create(first) == mode
    ws = h.path(first.id)
    assert h.present(first.id)
    assert (ws / "README").read_text() == "hello\n" and os.readlink(ws / "link") == "README"
    assert (str(ws) in _mount_points()) == (mode == "overlay")
    base_tree = tmp_path / "root" / "bases" / base / "tree"

    # A turn's work: one file added, one changed, one deleted.
    (ws / "new.txt").write_text("added\n")
    (ws / "src" / "main.py").write_text("print('two')\n")
    (ws / "src" / "old.txt").unlink()
    checkpoint, diff = h.checkpoint(first)
    cp = Checkpoint.model_validate_json(store.get(checkpoint))
    assert (cp.base, cp.added, cp.changed, cp.deleted) == (base, ["new.txt"], ["src/main.py"], ["src/old.txt"])
    assert diff.checkpoint == checkpoint and "+print('two')" in diff.patch and "b/new.txt" in diff.patch
    assert diff.deleted == ["src/old.txt"]
    # The base cache is untouched by the environment's writes.
    assert (base_tree / "src" / "main.py").read_text() == "print('one')\n" and (base_tree / "src" / "old.txt").exists()

    second = record(r, base, start=checkpoint)
    h.create(second)
    ws2 = h.path(second.id)
    assert (ws2 / "new.txt").read_text() == "added\n"
    assert (ws2 / "src" / "main.py").read_text() == "print('two')\n"
    assert not (ws2 / "src" / "old.txt").exists() and (ws2 / "README").exists()
    # Environments never see each other's files.
    (ws2 / "only-second").write_text("x")
    assert not (ws / "only-second").exists()


@pytest.mark.parametrize("mode", MODES)
def test_destroy_kills_what_runs_inside_unmounts_and_leaves_nothing(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost], mode: str) -> None:
    h = make_host(hosts, tmp_path / "root", store, r, mode)
    rec = record(r, EMPTY_BASE)
    h.create(rec)
    ws = h.path(rec.id)
    (ws / "sub").mkdir()
    proc = subprocess.Popen(["sleep", "600"], cwd=ws / "sub")
    (ws / "escape").symlink_to("/etc")  # a link a careless removal would follow
    assert h.destroy(rec.id)
    assert proc.wait(timeout=30) == -9
    assert not h.env_dir(rec.id).exists() and not h.present(rec.id)
    assert not any(p.startswith(str(h.env_dir(rec.id))) for p in _mount_points())
    assert Path("/etc/hostname").exists() or Path("/etc/passwd").exists()
    assert not h.destroy(rec.id)  # twice: nothing left to do


def test_a_create_past_the_disk_cap_is_refused_in_one_line(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost]) -> None:
    h = make_host(hosts, tmp_path / "root", store, r, "copy", cap_mb=1)
    first = record(r, EMPTY_BASE)
    h.create(first)
    (h.path(first.id) / "big").write_bytes(os.urandom(2 << 20))
    h.env_bytes(first.id, fresh=True)
    with pytest.raises(EnvError) as refused:
        h.create(record(r, EMPTY_BASE))
    assert re.fullmatch(r"host h1: environments use [23] MB of TOOLQ_ENV_DISK_MB=1; not created", str(refused.value))
    assert h.env_ids() == [first.id]


@pytest.mark.parametrize("mode", MODES)
def test_the_reaper_ends_environments_whose_owner_is_gone_or_idle_also_after_a_restart(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost], mode: str) -> None:
    r.delete(host_envs_key("h1"))
    h = make_host(hosts, tmp_path / "root", store, r, mode)
    orphan, idle, kept = (record(r, EMPTY_BASE, owner=f"owner:{i}", idle_limit=60.0) for i in range(3))
    for rec in (orphan, idle, kept):
        h.create(rec)
    r.delete(orphan.owner)
    r.set(env_key(idle.id), idle.model_copy(update={"used_at": time.time() - 120}).model_dump_json())
    assert sorted(h.reap()) == sorted([orphan.id, idle.id])
    assert h.env_ids() == [kept.id]
    assert json.loads(r.get(env_key(orphan.id)) or b"{}")["state"] == "destroyed"
    assert r.smembers(host_envs_key("h1")) == {kept.id.encode()}

    # A worker restart with Redis's keys lost too: a new host on the same root finds the
    # environment on disk with no record, and ends it.
    r.delete(env_key(kept.id), host_envs_key("h1"))
    again = make_host(hosts, tmp_path / "root", store, r, mode)
    assert again.reap() == [kept.id]
    assert again.env_ids() == [] and not any(p.startswith(str(tmp_path / "root" / "envs")) for p in _mount_points())


def git(*args: str, cwd: Path) -> str:
    env = {"GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def test_a_git_source_is_cloned_on_the_host_cached_by_commit_and_becomes_the_base(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "app.py").write_text("v1\n")
    # A hook the clone must never run (hooks are off on the host: core.hooksPath=/dev/null).
    (repo / ".git" / "hooks" / "post-checkout").write_text(f"#!/bin/sh\ntouch {tmp_path}/hook-ran\n")
    (repo / ".git" / "hooks" / "post-checkout").chmod(0o755)
    git("add", "app.py", cwd=repo)
    git("commit", "-q", "-m", "one", cwd=repo)
    h = make_host(hosts, tmp_path / "root", store, r, "copy")
    source = GitSource(url=str(repo), ref="main")
    rec = EnvironmentRecord(id=new_environment_id(), host="h1", source=EnvSource(kind="git", git=source), base="",
                            owner="owner:git")
    h.create(rec)
    assert BLOB_ID.match(rec.base) and (h.path(rec.id) / "app.py").read_text() == "v1\n"
    assert not (h.path(rec.id) / ".git").exists() and not (tmp_path / "hook-ran").exists()
    assert h.git_base(source) == rec.base  # the same commit: the cached base

    (repo / "app.py").write_text("v2\n")
    git("commit", "-q", "-am", "two", cwd=repo)
    newer = h.git_base(source)  # fetched into the host's bare clone
    assert newer != rec.base and b"v2" in store.get(newer)
    with pytest.raises(EnvError, match="neither may start with '-'"):
        h.git_base(GitSource(url=str(repo), ref="--upload-pack=touch /tmp/x"))
    with pytest.raises(EnvError, match="git source"):
        h.git_base(GitSource(url=str(repo), ref="no-such-branch"))


def test_a_reaper_leaves_alone_what_another_fleet_made_on_a_shared_root(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost]) -> None:
    r.delete(host_envs_key("h1"))
    theirs = EnvHost(tmp_path / "root", "h1", store, 1 << 30, LIMITS, r=None, mode="copy", fleet="their-redis")
    hosts.append(theirs)
    env = EnvironmentRecord(id=new_environment_id(), host="h1", source=EnvSource(kind="empty"), base=EMPTY_BASE,
                            owner="owner:theirs")
    theirs.create(env)  # its record lives in their Redis, not in ours
    ours = EnvHost(tmp_path / "root", "h1", store, 1 << 30, LIMITS, r=r, mode="copy", fleet="our-redis")
    assert ours.reap() == [] and theirs.present(env.id)


def test_past_the_cap_unused_bases_are_evicted_first_and_a_base_in_use_never(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost]) -> None:
    def base_of(name: str) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "blob").write_bytes(os.urandom(2 << 20))
        return store.put(archive.pack_dir(folder, LIMITS).tar)

    a, b = base_of("a"), base_of("b")
    h = make_host(hosts, tmp_path / "root", store, r, "copy", cap_mb=5)
    first = record(r, a)
    h.create(first)  # base a (2 MB) and its copy (2 MB)
    h.destroy(first.id)
    second = record(r, b)
    h.create(second)  # base b and its copy would pass the cap with a still cached: a goes
    assert h.bases() == [b]
    with pytest.raises(EnvError, match="not created"):
        h.create(record(r, a))  # b is in use by an environment: never evicted, so a cannot fit
    assert b in h.bases()
    assert (h.path(second.id) / "blob").stat().st_size == 2 << 20


@pytest.mark.skipif(os.geteuid() != 0, reason="overlay needs root")
def test_an_overlay_whose_mount_is_gone_is_mounted_again_by_the_reaper(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost]) -> None:
    h = make_host(hosts, tmp_path / "root", store, r, "overlay")
    rec = record(r, EMPTY_BASE)
    h.create(rec)
    (h.path(rec.id) / "kept.txt").write_text("still here\n")
    subprocess.run(["umount", str(h.path(rec.id))], check=True)  # as after a reboot
    assert not h.present(rec.id)
    assert h.reap() == [] and h.present(rec.id)
    assert (h.path(rec.id) / "kept.txt").read_text() == "still here\n"


def test_is_mount_tells_a_mounted_overlay_from_its_empty_folder(tmp_path):
    """`present` asks on every call whether an overlay is still mounted: by device, not mountinfo."""
    from toolq.workers.environments.host import _is_mount

    assert not _is_mount(tmp_path)
    assert _is_mount(Path("/proc"))
    assert not _is_mount(tmp_path / "missing")


@pytest.mark.parametrize("mode", MODES)
def test_what_no_checkpoint_carries_is_named_in_the_diff(
        tmp_path: Path, store: RedisStore, r: redis.Redis, hosts: list[EnvHost], mode: str) -> None:
    """A link the model made to /etc/passwd stays on the host: the diff says so, where it vanished
    without a word before (newcomer's finding)."""
    h = make_host(hosts, tmp_path / "root", store, r, mode)
    env = record(r, upload(tmp_path, store))
    h.create(env)
    (h.path(env.id) / "pw").symlink_to("/etc/passwd")
    os.mkfifo(h.path(env.id) / "pipe")
    _, diff = h.checkpoint(env)
    assert any(line.startswith("pw") for line in diff.skipped), diff.skipped
    assert any(line.startswith("pipe") for line in diff.skipped), diff.skipped
    assert "passwd" not in diff.patch


def test_a_child_forked_while_a_lock_is_held_does_not_keep_it(tmp_path: Path, r: redis.Redis, store: RedisStore,
                                                               hosts: list[EnvHost]) -> None:
    """The worker's main process forks its pool's children while the agent's threads hold
    environments' locks. An flock lives while any copy of its descriptor is open: a child that kept
    one held the environment's lock for its whole life, and the next destroy waited for ever."""
    h = make_host(hosts, tmp_path / "root", store, r, "copy")
    rec = record(r, EMPTY_BASE)
    h.create(rec)
    go_on, done = os.pipe()
    started, says = os.pipe()
    with h._locked(rec.id) as mine:
        assert mine
        child = os.fork()
        if child == 0:  # lives on past the parent's release, as a pool child does
            os.close(done)
            os.write(says, b"1")  # its fork hooks ran before this
            os.read(go_on, 1)
            os._exit(0)
    os.close(go_on)
    os.close(says)
    try:
        assert os.read(started, 1) == b"1"
        with h._locked(rec.id, fcntl.LOCK_EX | fcntl.LOCK_NB) as free:
            assert free, "the forked child still holds the environment's lock"
        assert h.destroy(rec.id, wait=False)
    finally:
        os.close(started)
        os.close(done)  # the child's read ends: it exits
        os.waitpid(child, 0)


def test_the_reaper_passes_over_an_environment_a_request_holds(tmp_path: Path, r: redis.Redis, store: RedisStore,
                                                                hosts: list[EnvHost]) -> None:
    """The reaper runs on the agent's request loop: waiting there for a lock would hold up every
    request of the host. It leaves a busy environment to its next pass."""
    r.delete(host_envs_key("h1"))
    h = make_host(hosts, tmp_path / "root", store, r, "copy")
    busy, free = record(r, EMPTY_BASE, owner="owner:busy"), record(r, EMPTY_BASE, owner="owner:free")
    for rec in (busy, free):
        h.create(rec)
    r.delete(busy.owner, free.owner)
    other = make_host(hosts, tmp_path / "root", store, r, "copy")  # another process's request, as far as flock goes
    with other._locked(busy.id):
        assert h.reap() == [free.id]
        assert h.env_ids() == [busy.id]
        with pytest.raises(EnvBusy):
            h.destroy(busy.id, wait=False)
    assert h.reap() == [busy.id]
    assert h.env_ids() == []
