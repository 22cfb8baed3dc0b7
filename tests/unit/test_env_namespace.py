"""The host's namespace (toolq/workers/environments/namespace.py): who stays out, and the holder's
handshake. Joining one runs on real workers as a user of their own in
tests/integration/test_env_namespace.py; here a real holder serves this (root) process, which
takes the descriptors and never joins."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from toolq.workers.environments import namespace

KEY = bytes(range(32))
FLEET = "f" * 16
NAME = namespace.name_of(FLEET)


def test_root_and_the_overflow_uid_stay_in_their_own_namespace(monkeypatch, tmp_path):
    # (the whole suite leaves threads in this process: a worker, at its start, has none)
    monkeypatch.setattr(namespace.threading, "active_count", lambda: 1)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "root" in (namespace.why_not(tmp_path) or "")
    assert namespace.enter(tmp_path, KEY, FLEET) == namespace.why_not(tmp_path)
    assert not namespace.inside()
    monkeypatch.setattr(os, "geteuid", lambda: namespace.overflow_uid())
    monkeypatch.setattr(os, "getuid", lambda: namespace.overflow_uid())
    assert "overflow uid" in (namespace.why_not(tmp_path) or "")
    monkeypatch.setattr(os, "geteuid", lambda: 4244)
    monkeypatch.setattr(os, "getuid", lambda: 4244)
    assert namespace.why_not(tmp_path) is None
    assert "overlay's options" in (namespace.why_not(tmp_path / "a,b") or "")
    monkeypatch.setattr(namespace.threading, "active_count", lambda: 2)
    assert "threads" in (namespace.why_not(tmp_path) or "")


@pytest.fixture
def root(tmp_path):
    (tmp_path / "locks").mkdir(mode=0o700)
    return tmp_path


def test_no_holder_listening_is_none(root):
    assert namespace._ask_holder(root, NAME, KEY) is None
    (root / "locks" / f"{NAME}.sock").write_text("")  # a stale name, nothing listening
    assert namespace._ask_holder(root, NAME, KEY) is None


def test_a_squatter_on_the_holders_socket_is_never_joined(root):
    """A process of the user that took the socket's name and hands over descriptors of its own
    namespaces does not know the key: its proof is refused and its descriptors closed."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(root / "locks" / f"{NAME}.sock"))
    server.listen(1)
    offered = [os.open("/proc/self/ns/user", os.O_RDONLY), os.open("/proc/self/ns/mnt", os.O_RDONLY)]

    def squat() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.recv(64)
            socket.send_fds(conn, [b"\0" * 32], offered)

    t = threading.Thread(target=squat)
    t.start()
    with pytest.raises(RuntimeError, match="does not prove this fleet's key"):
        namespace._ask_holder(root, NAME, KEY)
    t.join()
    server.close()
    for fd in offered:
        os.close(fd)


def test_a_holder_hands_its_namespaces_only_to_the_key_and_leaves_with_its_last_member(root):
    if (why := _no_user_namespaces()) is not None:
        pytest.skip(why)
    pid = namespace._start_holder(root, NAME, KEY)
    try:
        assert int((root / "locks" / f"{NAME}.pid").read_text()) == pid
        with pytest.raises(RuntimeError, match="does not prove"):  # another fleet's key
            namespace._ask_holder(root, NAME, bytes(32))
        fds = namespace._ask_holder(root, NAME, KEY)
        assert fds is not None and len(fds) == 2
        theirs = {os.fstat(fd).st_ino for fd in fds}
        ours = {os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("user", "mnt")}
        assert theirs.isdisjoint(ours)
        for fd in fds:
            os.close(fd)
        # No worker took its share of the members' lock: it leaves.
        end = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < end, "the holder stayed with no worker in its namespace"
            time.sleep(0.1)
        assert not (root / "locks" / f"{NAME}.sock").exists() and not (root / "locks" / f"{NAME}.pid").exists()
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _no_user_namespaces() -> str | None:
    r = os.system("unshare -U true >/dev/null 2>&1")
    return None if r == 0 else "user namespaces are not allowed here"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_join_that_fails_while_the_hosts_workers_live_strands_this_one(monkeypatch, root):
    """Whatever keeps it out (no holder, a holder that does not prove the key, one that is
    silent), a worker that finds others still in the namespace serves no environment."""
    monkeypatch.setattr(namespace, "why_not", lambda _: None)
    monkeypatch.setattr(namespace, "_stranded", False)
    member = os.open(root / "locks" / f"{NAME}-members.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(member, fcntl.LOCK_SH)  # a worker inside
    try:
        def refused(*_):
            raise RuntimeError("what answers on the namespace's socket does not prove this fleet's key")

        monkeypatch.setattr(namespace, "_ask_holder", refused)
        said = namespace.enter(root, KEY, FLEET)
        assert namespace.stranded() and not namespace.inside()
        assert "cannot be joined while workers still use it" in said and "does not prove" in said
    finally:
        os.close(member)
    # With nobody inside, the same refusal is no stranding: a new holder is made (here: refused too).
    monkeypatch.setattr(namespace, "_stranded", False)
    def no_holder(*_):
        raise RuntimeError("no holder")

    monkeypatch.setattr(namespace, "_start_holder", no_holder)
    assert namespace.enter(root, KEY, FLEET).startswith("no host namespace") and not namespace.stranded()


def test_a_process_half_in_its_hosts_namespace_stops(monkeypatch):
    calls = []

    class Libc:
        def setns(self, fd, kind):
            calls.append(kind)
            return 0 if len(calls) == 1 else -1

    monkeypatch.setattr(namespace, "libc", Libc())
    with pytest.raises(namespace.HalfJoined, match="user namespace but not its mount namespace"):
        namespace._setns([10, 11])
    assert len(calls) == 2
