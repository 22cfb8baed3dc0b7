"""Issue 24 item 7, as the attacker would: the model plants a git configuration whose
`core.fsmonitor` (a command git runs) a human's later `git status` on the host would run.

Each test is one turn of the model's commands and `apply_patch` calls on a real worker, then a
real `git status` by the test, on the host, in the workspace and its subfolders, with a marker
file that the planted command would write. The xfail tests are the layouts still open (strict:
one that starts to pass must lose its mark).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_builtin_tools import outputs
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.orchestrator.fake_model import builders as b

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=[("bwrap", "1", False), ("bwrap", "0", False), ("bwrap", "1", True)],
                ids=["bwrap-cells-root", "bwrap-per-command-root", "bwrap-cells-user"])
def git_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    backend, cells, user = request.param
    yield from hostile_workers(backend, locked_redis, tmp_path_factory, user=user, TOOLQ_SANDBOX_CELLS=cells)


@pytest.fixture(scope="module")
def landlock_worker(locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    yield from hostile_workers("landlock", locked_redis, tmp_path_factory)


def evil(marker: Path) -> str:
    return f"[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n"


def human_git_status(where: Path) -> None:
    """What a human does after the turn: `git status` (and `git diff`) there, on the host."""
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(where)}
    for args in (["status"], ["diff"]):
        subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=where, env=env, capture_output=True, timeout=30)


def test_a_command_cannot_make_a_repository_where_there_was_none(drive, git_worker, tmp_path):
    ws = git_worker.workspace(tmp_path)
    marker = tmp_path.with_name(tmp_path.name + "-ran")
    out = attack(drive, git_worker, ws, {
        "call_init": f"git init -q . 2>&1; printf '{evil(marker)}' >> .git/config 2>&1; echo done",
        "call_mkdir": "rm -rf .git 2>&1; mkdir -p .git/hooks 2>&1; echo done",
    })
    assert all("done" in body for _, body in out.values()), out
    human_git_status(ws)
    assert not marker.exists()
    assert os.listdir(ws / ".git") == []  # the empty placeholder: no repository for git


def test_apply_patch_writes_no_git_directory_however_it_is_named(drive, git_worker, tmp_path):
    ws = git_worker.workspace(tmp_path)
    (ws / "modules").mkdir()
    subprocess.run(["git", "init", "-q", "--separate-git-dir", str(ws / "modules" / "sub"), str(ws / "sub")],
                   check=True, capture_output=True)
    if git_worker.user:
        subprocess.run(["chown", "-R", str(os.stat(ws).st_uid), str(ws)], check=True)
    config = (ws / "modules" / "sub" / "config").read_text()
    patches = {"call_upper": ".GIT/config", "call_gitdir": "modules/sub/config", "call_hook": "modules/sub/hooks/x",
               "call_nested": "sub/.git"}
    script = [[b.custom_tool_call("apply_patch", f"*** Begin Patch\n*** Add File: {path}\n+[core]\n*** End Patch\n",
                                  call_id) for call_id, path in patches.items()], [b.message("done")]]
    got = outputs(drive(script, redis_url=git_worker.redis.url, workspace=ws))
    for call_id in patches:
        assert "git` directory" in got[call_id] or "verification failed" in got[call_id], (call_id, got[call_id])
    assert (ws / "modules" / "sub" / "config").read_text() == config
    assert not (ws / ".GIT").exists()


def git_init(*args: str) -> None:
    subprocess.run(["git", "init", "-q", *args], check=True, capture_output=True)


def test_the_repositories_found_below_the_top_cannot_be_changed(drive, git_worker, tmp_path):
    """A nested repository, a submodule-style `.git` file with its gitdir elsewhere in the
    workspace, and a `.git` link, made before the turn: each is bound read-only when the sandbox
    starts, so the model can neither plant a config nor point the `.git` file at a gitdir of its own."""
    ws = git_worker.workspace(tmp_path)
    git_init(str(ws / "nested"))
    (ws / "modules").mkdir()
    git_init("--separate-git-dir", str(ws / "modules" / "sub"), str(ws / "sub"))
    git_init(str(ws / "real"))
    (ws / "lnk").mkdir()
    (ws / "lnk" / ".git").symlink_to("../real/.git")
    if git_worker.user:
        subprocess.run(["chown", "-R", str(os.stat(ws).st_uid), str(ws)], check=True)
    marker = tmp_path.with_name(tmp_path.name + "-ran")
    config = evil(marker)
    out = attack(drive, git_worker, ws, {
        "call_nested": f"printf '{config}' >> nested/.git/config 2>&1; echo done",
        "call_gitdir": f"printf '{config}' >> modules/sub/config 2>&1; echo done",
        "call_file": "mkdir -p mine && git init -q --bare mine/gd 2>&1; "
                     f"printf '{config}' >> mine/gd/config; printf 'gitdir: ../mine/gd\\n' > sub/.git 2>&1; echo done",
        "call_link": f"printf '{config}' >> lnk/.git/config 2>&1; echo done",
        "call_move": "mv nested/.git nested/old 2>&1; mkdir -p nested/.git 2>&1; echo done",
    })
    assert all("done" in body for _, body in out.values()), out
    assert "Read-only file system" in out["call_nested"][1] and "Read-only file system" in out["call_link"][1], out
    assert (ws / "sub" / ".git").read_text().startswith("gitdir: ") and "mine" not in (ws / "sub" / ".git").read_text()
    for where in ("nested", "sub", "real", "lnk", "."):
        human_git_status(ws / where)
    assert not marker.exists()


NESTED = {
    "nested": "mkdir -p sub && cd sub && git init -q . && printf '{evil}' >> .git/config",
    "separate-git-dir": "git init -q --separate-git-dir \"$PWD/gitdir\" sub && printf '{evil}' >> gitdir/config",
    "symlinked": "mkdir -p real && cd real && git init -q . && cd .. && mkdir -p lnk && ln -s ../real/.git lnk/.git "
                 "&& printf '{evil}' >> real/.git/config",
}


@pytest.mark.xfail(strict=True, reason="open: a repository a command makes below the top (a nested one, a "
                                       "--separate-git-dir, a symlinked .git) is writable in the sandbox it was made in")
@pytest.mark.parametrize("layout", list(NESTED))
def test_a_nested_repository_a_command_makes_is_not_obeyed(drive, git_worker, tmp_path, layout):
    ws = git_worker.workspace(tmp_path)
    marker = tmp_path.with_name(tmp_path.name + "-ran")
    attack(drive, git_worker, ws, {"call_plant": NESTED[layout].format(evil=evil(marker))})
    for where in (ws / "sub", ws / "lnk", ws / "real"):
        if where.is_dir():
            human_git_status(where)
    assert not marker.exists()


@pytest.mark.xfail(strict=True, reason="open: Landlock rules only add rights beneath a folder, so .git stays "
                                       "writable (docs/security.md); use bubblewrap")
def test_landlock_cannot_keep_a_command_from_making_a_repository(drive, landlock_worker, tmp_path):
    marker = tmp_path.with_name(tmp_path.name + "-ran")
    attack(drive, landlock_worker, tmp_path, {"call_init": f"git init -q . && printf '{evil(marker)}' >> .git/config"})
    human_git_status(tmp_path)
    assert not marker.exists()
