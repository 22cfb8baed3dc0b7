"""What the bubblewrap sandbox binds read-only below a workspace's top `.git` (issue 24 item 7),
and the link-free lookup its start gate checks each of them with."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

from toolq.workers.isolation import bwrap, cell_init


def init(*args: str) -> None:
    subprocess.run(["git", "init", "-q", *args], check=True, capture_output=True)


def test_every_git_directory_and_file_below_the_top_is_found(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    init(str(ws))
    init(str(ws / "nested"))
    init("--separate-git-dir", str(ws / "gd"), str(ws / "sep"))
    init(str(ws / "real"))
    (ws / "lnk").mkdir()
    (ws / "lnk" / ".git").symlink_to("../real/.git")
    (ws / "modules").mkdir()
    (ws / "submodule").mkdir()
    (ws / "submodule" / ".git").write_text("gitdir: ../.git/modules/submodule\n")  # inside the top: bound already
    (ws / "away").mkdir()
    (ws / "away" / ".git").write_text(f"gitdir: {tmp_path / 'outside'}\n")  # outside: nothing to bind
    (tmp_path / "outside").mkdir()
    (ws / "out").symlink_to(tmp_path / "elsewhere")  # never followed while searching
    init(str(tmp_path / "elsewhere"))
    found = dict(bwrap.nested_gits(str(ws)))
    expected = {ws / "nested" / ".git", ws / "gd", ws / "sep" / ".git", ws / "real" / ".git", ws / "submodule" / ".git",
                ws / "away" / ".git"}
    assert set(found) == {str(p) for p in expected}
    assert found[str(ws / "real" / ".git")] == (os.stat(ws / "real" / ".git").st_dev, os.stat(ws / "real" / ".git").st_ino)


def test_the_search_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    for k in range(5):
        init(str(tmp_path / f"r{k}"))
    monkeypatch.setattr(cell_init, "GITS_MOST", 4)  # more than that: refused, not some left writable
    with pytest.raises(bwrap.GateRefused, match="more than 4 git directories"):
        bwrap.nested_gits(str(tmp_path))
    monkeypatch.setattr(cell_init, "GITS_MOST", 5)
    assert len(bwrap.nested_gits(str(tmp_path))) == 5
    monkeypatch.setattr(cell_init, "SCAN_ENTRIES", 1)
    assert len(cell_init.GitScan(str(tmp_path)).search()) < 5
    bwrap.nested_gits(str(tmp_path))
    assert "stopped" in caplog.text


def test_a_later_search_lists_only_what_changed_and_misses_nothing(tmp_path: Path, monkeypatch) -> None:
    """The search keeps each folder's listing while its ctime is unchanged (a command can set an
    mtime, not a ctime); a folder listed in the same clock tick it changed is listed again."""
    ws = tmp_path / "ws"
    for k in range(20):
        (ws / f"d{k}" / "e").mkdir(parents=True)
    monkeypatch.setattr(cell_init, "_RACY_NS", 0)  # folders made just now count as listed after their change
    scan = cell_init.GitScan(str(ws))
    assert scan.search() == {}
    listed = []
    real = scan._list
    monkeypatch.setattr(scan, "_list", lambda folder, st, fd=None: listed.append(folder) or real(folder, st, fd))
    assert scan.search() == {} and listed == []  # nothing changed: nothing listed again
    init(str(ws / "d3" / "e" / "sub"))
    os.utime(ws / "d3" / "e", ns=(0, 0))  # its mtime set back: its ctime still tells
    found = scan.search()
    assert set(found) == {str(ws / "d3" / "e" / "sub" / ".git")}
    assert str(ws / "d3" / "e") in listed and str(ws / "d7") not in listed
    # Made in the same tick as the listing (the ctime the same): the listing was racy, so it is redone.
    listed.clear()
    (ws / "d5" / "e" / ".git").mkdir()
    scan.search()
    st = os.lstat(ws / "d5" / "e")
    scan._folders[str(ws / "d5" / "e")] = (*scan._folders[str(ws / "d5" / "e")][:3], st.st_ctime_ns, (), 0, 0)
    assert str(ws / "d5" / "e" / ".git") in scan.search()


def test_a_cell_binds_by_descriptor_what_it_found(tmp_path: Path) -> None:
    """`bind_read_only` needs a mount namespace of its own: run it in one (unshare -rm)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here")
    ws = tmp_path / "ws"
    init(str(ws / "made"))
    (ws / "sep").mkdir()
    (ws / "gd").mkdir()
    (ws / "sep" / ".git").write_text("gitdir: ../gd\n")
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(cell_init.__file__)!r})
import cell_init
guard = cell_init.GitGuard({str(ws)!r})
guard.refresh()
for path in ("made/.git/config", "sep/.git", "gd/x"):
    try:
        open(os.path.join({str(ws)!r}, path), "a").close()
        print("WROTE", path)
    except OSError as e:
        print("REFUSED", path, e.errno)
os.mkdir({str(ws / "later")!r})
"""
    out = subprocess.run(["unshare", "-rm", "python3", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert "WROTE" not in out.stdout and out.stdout.count("REFUSED") == 3, (out.stdout, out.stderr)
    assert (ws / "later").is_dir()  # the rest of the workspace stays writable


def test_the_gate_follows_no_link_on_the_way(tmp_path: Path) -> None:
    (tmp_path / "ws" / "real" / ".git").mkdir(parents=True)
    (tmp_path / "ws" / "sub").symlink_to("real")
    fd = bwrap.open_no_links(str(tmp_path), "/ws/real/.git")
    os.close(fd)
    with pytest.raises(OSError) as e:
        bwrap.open_no_links(str(tmp_path), "/ws/sub/.git")
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
    fd = bwrap.open_no_links(str(tmp_path), "/ws/sub")  # a link at the end: the link itself, never its target
    try:
        assert stat.S_ISLNK(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def test_an_identity_is_never_taken_through_a_link(tmp_path: Path) -> None:
    """What a folder swapped for a link mid-search shows: a path below the workspace that leads out
    through a link. By path (`lstat`) it gave the outside folder's identity, which the start gate
    then took for the nested gitdir's (a red team's race); looked up without links it is skipped."""
    from toolq.workers.isolation import cell_init

    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "a").mkdir(parents=True)
    (outside / "gd").mkdir(parents=True)
    (ws / "a" / "lnk").symlink_to("../../outside")
    found: dict[str, tuple[int, int]] = {}
    cell_init.GitScan(str(ws))._add(found, str(ws / "a" / "lnk" / "gd"), real=False)
    assert found == {}
    (ws / "a" / "gd").mkdir()
    cell_init.GitScan(str(ws))._add(found, str(ws / "a" / "gd"), real=False)
    assert list(found) == [str(ws / "a" / "gd")]


def _deep(top: Path, levels: int = 24) -> tuple[str, int]:
    """Folders of 200-character names `levels` deep below `top` (past PATH_MAX), made by descriptor;
    the path of the deepest and an O_PATH descriptor of it."""
    fd = os.open(top, os.O_PATH | os.O_DIRECTORY)
    path = str(top)
    for _ in range(levels):
        name = "d" * 200
        os.mkdir(name, dir_fd=fd)
        nxt = os.open(name, os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd, path = nxt, path + "/" + name
    return path, fd


def test_a_git_directory_deeper_than_path_max_is_found(tmp_path: Path) -> None:
    # Red team: the search listed folders by path, and past PATH_MAX the kernel refuses a path
    # (ENAMETOOLONG): a repository made that deep stayed writable.
    ws = tmp_path / "ws"
    ws.mkdir()
    path, fd = _deep(ws)
    try:
        assert len(path) > 4096
        os.mkdir(".git", dir_fd=fd)
        os.mkdir("sub", dir_fd=fd)
        sub = os.open("sub", os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
        with open(os.open(".git", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=sub), "w") as f:
            f.write("gitdir: ../gd\n")
        os.mkdir("gd", dir_fd=fd)
        os.close(sub)
    finally:
        os.close(fd)
    found = cell_init.GitScan(str(ws)).search()
    assert set(found) == {path + "/.git", path + "/sub/.git", path + "/gd"}, [p[-20:] for p in found]


def _deep_repository(ws: Path) -> str:
    """A workspace `ws` with a git directory past PATH_MAX: the path of the folder holding it."""
    ws.mkdir()
    path, fd = _deep(ws)
    try:
        os.mkdir(".git", dir_fd=fd)
    finally:
        os.close(fd)
    return path


def test_a_cell_binds_a_git_directory_deeper_than_path_max(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here")
    ws = tmp_path / "ws"
    path = _deep_repository(ws)
    code = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(cell_init.__file__)!r})
import cell_init
cell_init.GitGuard({str(ws)!r}).refresh()
fd = cell_init.open_no_links({str(ws)!r}, {path[len(str(ws)):] + "/.git"!r})
try:
    os.open("config", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=os.open(f"/proc/self/fd/{{fd}}", os.O_DIRECTORY))
    print("WROTE")
except OSError as e:
    print("REFUSED", e.errno)
"""
    out = subprocess.run(["unshare", "-rm", "python3", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "REFUSED 30", (out.stdout, out.stderr)  # EROFS


def test_a_sandbox_per_command_refuses_a_git_directory_it_cannot_bind(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    _deep_repository(ws)
    with pytest.raises(bwrap.GateRefused, match="deeper below the workspace than the kernel's path limit"):
        bwrap.nested_gits(str(ws))
