"""toolq.workers.workspace: model-named paths confined to the workspace, as an attacker would test it.

Every `Workspace` test runs with the kernel's openat2 and again with the O_NOFOLLOW walk.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.hostile import Flipper, race_tree
from toolq.core.errors import RespondToModel
from toolq.workers import workspace
from toolq.workers.workspace import Workspace, resolve_in_workspace


def test_relative_path_resolves_inside_the_workspace(tmp_path):
    assert resolve_in_workspace(tmp_path, "src/a.py") == tmp_path.resolve() / "src" / "a.py"


def test_absolute_path_inside_the_workspace_is_allowed(tmp_path):
    target = tmp_path / "a.txt"
    assert resolve_in_workspace(tmp_path, str(target)) == target.resolve()


def test_workspace_root_itself_is_allowed(tmp_path):
    assert resolve_in_workspace(tmp_path, ".") == tmp_path.resolve()
    assert resolve_in_workspace(tmp_path, str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("path", ["../outside.txt", "src/../../etc/passwd", "a/../b"])
def test_dotdot_components_are_refused_and_named(tmp_path, path):
    with pytest.raises(RespondToModel) as e:
        resolve_in_workspace(tmp_path, path)
    assert f"`{path}`" in e.value.message and "`..`" in e.value.message


def test_absolute_path_outside_the_workspace_is_refused(tmp_path):
    with pytest.raises(RespondToModel) as e:
        resolve_in_workspace(tmp_path, "/etc/passwd")
    assert e.value.message == f"path `/etc/passwd` is outside the workspace `{tmp_path.resolve()}`"


def test_sibling_directory_with_shared_prefix_is_outside(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "ws2").mkdir()
    with pytest.raises(RespondToModel):
        resolve_in_workspace(ws, str(tmp_path / "ws2" / "x"))


def test_symlink_leading_out_is_refused(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    (ws / "link.txt").symlink_to(secret)
    (ws / "dirlink").symlink_to(tmp_path)
    for path in ["link.txt", "dirlink/secret.txt", str(ws / "link.txt")]:
        with pytest.raises(RespondToModel) as e:
            resolve_in_workspace(ws, path)
        assert f"`{path}`" in e.value.message and "symlink" in e.value.message


def test_symlink_staying_inside_is_followed(tmp_path):
    (tmp_path / "real.txt").write_text("x")
    (tmp_path / "alias.txt").symlink_to(tmp_path / "real.txt")
    assert resolve_in_workspace(tmp_path, "alias.txt") == (tmp_path / "real.txt").resolve()


def test_nul_byte_in_path_is_refused(tmp_path):
    with pytest.raises(RespondToModel, match="NUL"):
        resolve_in_workspace(tmp_path, "a\0b")


# --- Workspace: the kernel's openat2 and the O_NOFOLLOW walk, both ------------------------------


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Every Workspace test runs twice: with openat2 (if this kernel has it) and with the walk."""
    if request.param == "openat2" and not workspace.USE_OPENAT2:
        pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(workspace, "USE_OPENAT2", request.param == "openat2")
    return request.param


@pytest.fixture
def tree(tmp_path, resolver):
    """ws/ with in-tree symlinks of every kind, and ways out next to it."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub" / "deep").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cret\n")
    (ws / "real.txt").write_text("real\n")
    (ws / "sub" / "deep" / "f.txt").write_text("deep\n")
    (ws / "rel_link").symlink_to("real.txt")
    (ws / "abs_link").symlink_to(ws / "real.txt")  # RESOLVE_BENEATH refuses this one: the walk takes it
    (ws / "sub" / "up").symlink_to("../real.txt")
    (ws / "dir_link").symlink_to("sub")
    (ws / "chain").symlink_to("dir_link/deep")
    (ws / "out_rel").symlink_to("../outside")
    (ws / "out_abs").symlink_to(outside)
    (ws / "out_file").symlink_to(outside / "secret.txt")
    (ws / "loop").symlink_to("loop")
    return ws


def read(ws: Path, path: str) -> str:
    with Workspace(ws) as w:
        fd, _ = w.open_file(w.locate(path))
    with open(fd, "rb") as f:
        return f.read().decode()


@pytest.mark.parametrize(
    ("path", "text"),
    [("real.txt", "real\n"), ("rel_link", "real\n"), ("abs_link", "real\n"), ("sub/up", "real\n"),
     ("dir_link/up", "real\n"), ("chain/f.txt", "deep\n"), ("dir_link/deep/../deep/f.txt", None)],
)
def test_symlinks_that_stay_inside_are_followed(tree, path, text):
    if text is None:  # `..` is refused before any lookup, whatever the resolver
        with pytest.raises(RespondToModel, match="`..` components may not be used"):
            read(tree, path)
        return
    assert read(tree, path) == text
    assert read(tree, str(tree / path)) == text


@pytest.mark.parametrize("path", ["out_rel/secret.txt", "out_abs/secret.txt", "out_file", "sub/../out_file"[7:]])
def test_symlinks_that_lead_out_are_refused_with_the_path_named(tree, path):
    with pytest.raises(RespondToModel) as e:
        read(tree, path)
    assert e.value.message == f"path `{path}` leads outside the workspace `{tree.resolve()}` through a symlink"


def test_symlink_loop_is_an_os_error_not_a_hang(tree):
    with pytest.raises(OSError) as e:
        read(tree, "loop")
    assert e.value.errno == errno.ELOOP


def test_only_regular_files_are_read_and_a_fifo_never_blocks(tree):
    os.mkfifo(tree / "pipe")
    started = time.monotonic()
    with pytest.raises(workspace.NotARegularFile, match=r"not a regular file \(a FIFO\)"):
        read(tree, "pipe")
    assert time.monotonic() - started < 5  # opening a FIFO for reading without O_NONBLOCK waits for a writer
    with pytest.raises(IsADirectoryError):
        read(tree, "dir_link")


def test_a_file_where_a_directory_is_named_is_not_a_directory(tree):
    with pytest.raises(NotADirectoryError):
        read(tree, "real.txt/x")


def test_hard_linked_file_is_never_written_but_may_be_read(tree, tmp_path):
    victim = tmp_path / "outside" / "secret.txt"
    os.link(victim, tree / "hard.txt")
    with Workspace(tree) as w:
        target = w.locate("hard.txt")
        for attempt in (w.check_writable, w.open_for_writing):
            with pytest.raises(RespondToModel, match="`hard.txt` has 2 hard links"):
                attempt(target)
    assert victim.read_text() == "s3cret\n"
    assert read(tree, "hard.txt") == "s3cret\n"  # reading it reads a file the worker can read anyway


@pytest.mark.parametrize("path", [".git/config", ".git/hooks/pre-commit", "sub/.git/config", "git_link/config",
                                  "git_link/hooks/new/x", "git_parent/.git/config"[11:]])
def test_nothing_under_a_git_directory_is_written(tree, path):
    (tree / ".git").mkdir()
    (tree / ".git" / "config").write_text("[core]\n")
    (tree / "git_link").symlink_to(".git")
    with Workspace(tree) as w:
        target = w.locate(path)
        attempts = [w.check_writable, w.open_for_writing]
        if path.endswith("config"):
            attempts += [w.check_removable, w.unlink]
        for attempt in attempts:
            with pytest.raises(RespondToModel, match=r"is inside a `\.git` directory"):
                attempt(target)
    assert (tree / ".git" / "config").read_text() == "[core]\n"
    assert sorted(p.name for p in (tree / ".git").iterdir()) == ["config"]  # no hooks/ made on the way


def test_writing_creates_missing_directories_inside_and_follows_inside_links(tree):
    with Workspace(tree) as w:
        for path in ("new/a/b.txt", "dir_link/c.txt", "rel_link"):
            with open(w.open_for_writing(w.locate(path)), "wb") as f:
                f.truncate(0)
                f.write(b"written\n")
    assert (tree / "new/a/b.txt").read_text() == (tree / "sub/c.txt").read_text() == "written\n"
    assert (tree / "real.txt").read_text() == "written\n" and (tree / "rel_link").is_symlink()


def test_writing_through_a_link_out_is_refused_and_creates_nothing(tree, tmp_path):
    with Workspace(tree) as w:
        for path in ("out_abs/new.txt", "out_rel/new/deeper.txt", "out_file"):
            with pytest.raises(RespondToModel, match="leads outside the workspace"):
                w.open_for_writing(w.locate(path))
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["secret.txt"]
    assert (tmp_path / "outside" / "secret.txt").read_text() == "s3cret\n"


def test_unlink_removes_the_name_not_what_a_symlink_points_to(tree):
    with Workspace(tree) as w:
        w.unlink(w.locate("rel_link"))
        w.unlink(w.locate("absent.txt"))  # absent is fine
    assert not (tree / "rel_link").is_symlink() and (tree / "real.txt").read_text() == "real\n"


# --- the race: a directory swapped for a symlink to outside while the tools open through it ------


@pytest.fixture
def racing(tmp_path, resolver):
    return race_tree(tmp_path)


#: At least 200 tries each; more (up to this) until the race has been seen both ways, so that a
#: run on a busy machine still tests the swap and not only one side of it.
MAX_TRIES = 5000


def race(attempt, done) -> dict[str, int]:
    """Run `attempt()` at least 200 times while the flipper runs, and until `done(seen)`."""
    seen: dict[str, int] = {}
    tries = 0
    while tries < 200 or (not done(seen) and tries < MAX_TRIES):
        try:
            outcome = attempt(tries)
        except RespondToModel:
            outcome = "refused"
        except OSError as e:
            outcome = type(e).__name__  # between the renames: an error, not an escape
        seen[outcome] = seen.get(outcome, 0) + 1
        tries += 1
    return seen


def test_symlink_swap_race_never_reads_outside(racing):
    ws, outside = racing
    with Flipper(ws, outside):
        seen = race(lambda _: read(ws, "d/f.txt"), lambda seen: "inside\n" in seen and "refused" in seen)
    assert "s3cret\n" not in seen, seen
    assert "inside\n" in seen and "refused" in seen, f"the race never hit both ways: {seen}"


def test_symlink_swap_race_never_writes_outside(racing):
    ws, outside = racing

    def write(i: int) -> str:
        with Workspace(ws) as w:
            with open(w.open_for_writing(w.locate(f"d/new{i}.txt" if i % 2 else "d/f.txt")), "wb") as f:
                f.write(b"pwned\n")
        return "written"

    with Flipper(ws, outside):
        seen = race(write, lambda seen: "written" in seen and "refused" in seen)
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt"]
    assert (outside / "f.txt").read_text() == "s3cret\n"
    assert "written" in seen and "refused" in seen, f"the race never hit both ways: {seen}"


def test_the_same_race_beats_a_path_checked_as_a_string(tmp_path):
    """The harness has teeth: checking the string and opening it later (the old way) escapes."""
    ws, outside = race_tree(tmp_path)

    def checked_then_opened(_: int) -> str:
        return resolve_in_workspace(ws, "d/f.txt").read_text()

    with Flipper(ws, outside):
        seen = race(checked_then_opened, lambda seen: "s3cret\n" in seen)
    assert "s3cret\n" in seen, seen


# --- walk ---------------------------------------------------------------------------------------


def test_walk_is_top_down_in_name_order_within_its_depth(tmp_path):
    for d in ("b/x", "a/y/z", ".hidden"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "link").symlink_to("a")
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = [(rel, [e.name for e in entries]) for _, rel, entries in
                workspace.walk(top, depth=3, enter=lambda e: not e.name.startswith("."))]
    finally:
        os.close(top)
    assert seen == [("", [".hidden", "a", "b", "link"]), ("a", ["y"]), ("a/y", ["z"]), ("b", ["x"]), ("b/x", [])]


def test_an_unfinished_walk_closes_its_fds_when_closed(tmp_path):
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    before = len(os.listdir("/proc/self/fd"))
    walker = workspace.walk(top)
    for _, rel, _ in walker:
        if rel == "a/b":
            break
    assert len(os.listdir("/proc/self/fd")) > before
    walker.close()
    assert len(os.listdir("/proc/self/fd")) == before
    os.close(top)


@pytest.mark.parametrize("path", [".GIT/config", "sub/.Git/hooks/x", "modules/sub/config", "modules/sub/hooks/post-checkout",
                                  "gitdir_link/config"])
def test_no_git_directory_is_written_however_it_is_named(tree, path):
    """Issue 24: a `.git` in another case (a case-insensitive file system), and the git directory
    a `.git` file names (`gitdir: modules/sub`, as submodules and --separate-git-dir make), which
    git reads as it reads `.git`, through a symlink too."""
    gitdir = tree / "modules" / "sub"
    for d in ("objects", "refs"):
        (gitdir / d).mkdir(parents=True)
    (gitdir / "HEAD").write_text("ref: refs/heads/main\n")
    (gitdir / "config").write_text("[core]\n")
    (tree / "sub").mkdir(exist_ok=True)
    (tree / "sub" / ".git").write_text("gitdir: ../modules/sub\n")
    (tree / "gitdir_link").symlink_to("modules/sub")
    with Workspace(tree) as w:
        target = w.locate(path)
        for attempt in (w.check_writable, w.open_for_writing):
            with pytest.raises(RespondToModel, match=r"is inside a `\.git` directory"):
                attempt(target)
    assert (gitdir / "config").read_text() == "[core]\n"
    with Workspace(tree) as w:  # the control: beside it, files are written
        w.check_writable(w.locate("modules/readme.txt"))
