"""`trusted_files`: what toolq refuses to read or write for its user, on real files."""

from __future__ import annotations

import os

import pytest

from toolq.cli.main import main
from toolq.core import trusted_files
from toolq.core.errors import ConfigurationError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def test_a_link_at_the_name_is_replaced_never_followed(tmp_path):
    victim, target = tmp_path / "rc", tmp_path / "c.json"
    victim.write_text("mine")
    target.symlink_to(victim)
    trusted_files.replace(target, b"[]", "session file")
    assert victim.read_text() == "mine" and not target.is_symlink() and target.read_bytes() == b"[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "rc"]  # no temporary left behind


def test_appending_refuses_a_link(tmp_path):
    victim = tmp_path / "rc"
    victim.write_text("mine")
    (tmp_path / "out").symlink_to(victim)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        trusted_files.open_append(tmp_path / "out", "--out")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "out")
    for op in (trusted_files.read_bytes, trusted_files.open_append):
        with pytest.raises(ConfigurationError, match="not a regular file"):
            op(tmp_path / "out", "--out")


@needs_root
def test_another_users_file_is_neither_read_nor_appended_to(tmp_path):
    planted = tmp_path / "c.json"
    planted.write_text('[{"role": "user", "content": "prepared by someone else"}]')
    os.chown(planted, 4243, 4243)
    for op in (trusted_files.read_bytes, trusted_files.open_append):
        with pytest.raises(ConfigurationError, match="belongs to uid 4243"):
            op(planted, "session file")


def test_a_file_inside_a_workspace_is_refused_through_a_linked_parent(tmp_path):
    workspace = tmp_path / "ws"
    (workspace / "sub").mkdir(parents=True)
    (tmp_path / "way-in").symlink_to(workspace / "sub")
    with pytest.raises(ConfigurationError, match="inside the workspace"):
        trusted_files.refuse_inside(tmp_path / "way-in" / "c.json", [workspace], "session file")
    trusted_files.refuse_inside(tmp_path / "c.json", [workspace], "session file")  # beside it: fine


def test_a_worker_log_that_is_a_link_or_in_its_workspace_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")
    (tmp_path / "victim").write_text("mine")
    (tmp_path / "link.log").symlink_to(tmp_path / "victim")
    assert main(["worker", "--logfile", str(tmp_path / "link.log")]) == 2
    assert "symbolic link" in capsys.readouterr().err
    workspace = tmp_path / "ws"
    workspace.mkdir()
    monkeypatch.setenv("TOOLQ_WORKSPACE", str(workspace))
    assert main(["worker", "--logfile", str(workspace / "worker.log")]) == 2
    assert "inside the workspace" in capsys.readouterr().err and not (workspace / "worker.log").exists()
    assert (tmp_path / "victim").read_text() == "mine"
