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
from toolq.dev.fake_model import builders as b

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

#: The same layouts made by one command, then attacked by the next: (what the first makes, what
#: the second tries: write the config, point the `.git` file at a gitdir of its own, move the
#: repository aside and make another in its place).
LATER = {
    "nested": ("mkdir -p sub && git init -q sub && echo made",
               "printf '{evil}' >> sub/.git/config 2>&1; mv sub/.git sub/old 2>&1; rm -rf sub/.git 2>&1; "
               "mv sub moved 2>&1; printf '{evil}' >> moved/.git/config 2>&1; echo done"),
    "separate-git-dir": ("git init -q --separate-git-dir \"$PWD/gitdir\" sub && echo made",
                         "printf '{evil}' >> gitdir/config 2>&1; git init -q --bare mine 2>&1; "
                         "printf '{evil}' >> mine/config; printf 'gitdir: ../mine\\n' > sub/.git 2>&1; echo done"),
    "symlinked": ("mkdir -p real lnk && git init -q real && ln -s ../real/.git lnk/.git && echo made",
                  "printf '{evil}' >> lnk/.git/config 2>&1; printf '{evil}' >> real/.git/config 2>&1; echo done"),
    # A folder its owner cannot list, to hide the repository from the search: the cell's search
    # lists it with its user namespace's capabilities.
    "hidden": ("mkdir -p sub && git init -q sub && chmod 0 sub && echo made",
               "chmod 755 sub; printf '{evil}' >> sub/.git/config 2>&1; echo done"),
}


def attack_in_order(drive, worker, ws: Path, commands: list[tuple[str, str]]) -> dict[str, str]:
    """One turn whose model steps are one command each, in order (each waits for the one before)."""
    script = [*([b.function_call("exec_command", {"cmd": cmd}, call_id)] for call_id, cmd in commands),
              [b.message("done")]]
    return outputs(drive(script, redis_url=worker.redis.url, workspace=ws), k=len(commands))


@pytest.mark.parametrize("layout", list(LATER))
def test_a_repository_one_command_makes_is_read_only_to_the_next(drive, git_worker, tmp_path, layout):
    """In a cell, before each command, every git directory an earlier command made is bound
    read-only (`cell_init.GitGuard`); per command, bwrap binds what it finds at the start."""
    ws = git_worker.workspace(tmp_path)
    marker = tmp_path.with_name(tmp_path.name + "-ran")
    make, change = LATER[layout]
    got = attack_in_order(drive, git_worker, ws, [("call_make", make), ("call_change", change.format(evil=evil(marker)))])
    assert "made" in got["call_make"] and "done" in got["call_change"], got
    assert "Read-only file system" in got["call_change"], got
    if layout == "separate-git-dir":
        assert "mine" not in (ws / "sub" / ".git").read_text()
    for where in ("sub", "moved", "lnk", "real", "."):
        if (ws / where).is_dir():
            human_git_status(ws / where)
    assert not marker.exists()


def test_more_repositories_than_can_be_made_read_only_refuse_the_next_command(drive, git_worker, tmp_path):
    ws = git_worker.workspace(tmp_path)
    got = attack_in_order(drive, git_worker, ws, [("call_many", "for i in $(seq 300); do mkdir -p r$i/.git; done; "
                                                                "echo made"),
                                                  ("call_next", "mkdir r1/.git/hooks && echo WROTE")])
    assert "made" in got["call_many"], got
    assert "WROTE" not in got["call_next"] and "more than 256 git directories" in got["call_next"], got


@pytest.mark.xfail(strict=True, reason="open: a repository a command makes below the top (a nested one, a "
                                       "--separate-git-dir, a symlinked .git) is writable to that same command")
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
