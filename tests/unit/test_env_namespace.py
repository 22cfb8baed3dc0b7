"""The host's namespace's pure parts (toolq/workers/environments/namespace.py): who stays out, and
which `namespace.pid` names a holder. Joining and making one run on real workers as a user of
their own in tests/integration/test_env_namespace.py."""

from __future__ import annotations

import os

from toolq.workers.environments import namespace


def test_root_and_the_overflow_uid_stay_in_their_own_namespace(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "root" in (namespace.why_not(tmp_path) or "")
    assert namespace.enter(tmp_path) == namespace.why_not(tmp_path)
    assert not namespace.inside()
    monkeypatch.setattr(os, "geteuid", lambda: namespace.overflow_uid())
    monkeypatch.setattr(os, "getuid", lambda: namespace.overflow_uid())
    assert "overflow uid" in (namespace.why_not(tmp_path) or "")
    monkeypatch.setattr(os, "geteuid", lambda: 4244)
    monkeypatch.setattr(os, "getuid", lambda: 4244)
    assert namespace.why_not(tmp_path) is None
    assert "overlay's options" in (namespace.why_not(tmp_path / "a,b") or "")


def test_a_pid_file_names_a_holder_only_while_that_process_lives_in_another_namespace(tmp_path):
    (tmp_path / "locks").mkdir()
    pid_file = tmp_path / "locks" / "namespace.pid"
    assert namespace._live_holder(tmp_path) is None  # none yet
    for text in ("", "garbage", "12 x y", f"{2**22 + 7} 100"):
        pid_file.write_text(text)
        assert namespace._live_holder(tmp_path) is None, text
    started = namespace._start_time(os.getpid())
    assert started is not None
    pid_file.write_text(f"{os.getpid()} {int(started) + 1}")  # a reused pid: another start time
    assert namespace._live_holder(tmp_path) is None
    pid_file.write_text(f"{os.getpid()} {started}")  # alive, but in our own user namespace
    assert namespace._live_holder(tmp_path) is None
