"""The per-user runtime directory that lets `toolq cancel/status/turns` find embedded stacks.

Played as an attacker would: another user's directory, a planted or symlinked entry, a world-
readable directory, a dead or reused pid. Real files and processes; no mocks.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from toolq.core.errors import ConfigurationError
from toolq.local import runtime_dir

NOBODY = 65534


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    return base


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_registered_stack_is_private_found_and_gone_when_unregistered(xdg, tmp_path):
    path = runtime_dir.register("redis://:secret@127.0.0.1:1/0", tmp_path)
    assert path is not None and path.parent == xdg / "toolq"
    assert mode(xdg / "toolq") == 0o700 and mode(path) == 0o600
    (entry,) = runtime_dir.running_stacks()
    assert (entry.pid, entry.redis_url) == (os.getpid(), "redis://:secret@127.0.0.1:1/0")
    assert runtime_dir.ledger_urls(None) == ["redis://:secret@127.0.0.1:1/0"]
    assert runtime_dir.ledger_urls("redis://elsewhere:6379/0") == ["redis://elsewhere:6379/0"]  # REDIS_URL wins
    runtime_dir.unregister(path)
    assert runtime_dir.running_stacks() == []
    with pytest.raises(ConfigurationError, match="no REDIS_URL and no embedded"):
        runtime_dir.ledger_urls(None)


def test_without_xdg_runtime_dir_the_directory_is_per_uid_in_tmp():
    assert str(runtime_dir.runtime_root({})) == f"/tmp/toolq-{os.geteuid()}"
    assert str(runtime_dir.runtime_root({"XDG_RUNTIME_DIR": "relative"})) == f"/tmp/toolq-{os.geteuid()}"


def test_stale_entries_of_dead_or_reused_pids_are_ignored_and_removed(xdg, tmp_path):
    live = runtime_dir.register("redis://:live@127.0.0.1:1/0", tmp_path)
    root = xdg / "toolq"
    dead = root / "stack-dead.json"
    reused = root / "stack-reused.json"
    for path, pid, started in ((dead, dead_pid(), None), (reused, os.getpid(), "1")):  # our pid, another start time
        path.write_text(json.dumps({"pid": pid, "pid_started": started, "redis_url": "redis://:old@127.0.0.1:2/0",
                                    "started_at": 0, "logdir": str(tmp_path)}))
        path.chmod(0o600)
    assert [e.redis_url for e in runtime_dir.running_stacks()] == ["redis://:live@127.0.0.1:1/0"]
    assert not dead.exists() and not reused.exists() and live.exists()


def test_a_directory_another_user_made_is_refused(xdg, tmp_path, capsys):
    root = xdg / "toolq"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)  # an attacker made it first, to read or plant URLs
    with pytest.raises(ConfigurationError, match=f"belongs to uid {NOBODY}"):
        runtime_dir.ledger_urls(None)
    assert runtime_dir.register("redis://:secret@127.0.0.1:1/0", tmp_path) is None  # the secret is not written
    assert "will not find this run" in capsys.readouterr().err
    assert os.listdir(root) == []


def test_a_directory_others_can_read_is_refused(xdg, tmp_path):
    root = xdg / "toolq"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # mkdir's mode is cut by the umask
    with pytest.raises(ConfigurationError, match="mode 755"):
        runtime_dir.private_root()
    assert runtime_dir.register("redis://:secret@127.0.0.1:1/0", tmp_path) is None


def test_a_symlinked_directory_is_refused(xdg, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (xdg / "toolq").symlink_to(elsewhere)
    with pytest.raises(ConfigurationError, match="not a directory"):
        runtime_dir.private_root()


def test_planted_entries_are_not_trusted(xdg, tmp_path):
    """An entry owned by another user, readable by others, or a symlink is never read: it could
    point `toolq cancel` at an attacker's server."""
    runtime_dir.private_root()
    root = xdg / "toolq"
    planted = {"pid": os.getpid(), "redis_url": "redis://evil:6379/0", "started_at": 0, "logdir": "/"}
    theirs, loose, target = root / "stack-theirs.json", root / "stack-loose.json", tmp_path / "t.json"
    for path in (theirs, loose, target):
        path.write_text(json.dumps(planted))
        path.chmod(0o600)
    os.chown(theirs, NOBODY, NOBODY)
    loose.chmod(0o644)
    (root / "stack-link.json").symlink_to(target)
    (root / "stack-junk.json").write_text("not json")
    assert runtime_dir.running_stacks() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_read_the_entry_or_use_the_directory(xdg, tmp_path):
    tmp_path.chmod(0o755)
    xdg.chmod(0o755)  # even with the parents open, the directory and file stay closed to others
    path = runtime_dir.register("redis://:secret@127.0.0.1:1/0", tmp_path)
    out = subprocess.run(["cat", str(path)], user=NOBODY, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "Permission denied" in out.stderr and "secret" not in out.stdout
