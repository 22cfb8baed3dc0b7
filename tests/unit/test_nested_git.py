"""What the bubblewrap sandbox binds read-only below a workspace's top `.git` (issue 24 item 7),
and the link-free lookup its start gate checks each of them with."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

from toolq.workers.isolation import bwrap


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
    monkeypatch.setattr(bwrap, "NESTED_GIT_MOST", 2)
    assert len(bwrap.nested_gits(str(tmp_path))) == 2
    monkeypatch.setattr(bwrap, "NESTED_GIT_MOST", 256)
    monkeypatch.setattr(bwrap, "NESTED_GIT_SCAN", 1)
    assert len(bwrap.nested_gits(str(tmp_path))) < 5
    assert "stopped" in caplog.text


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
