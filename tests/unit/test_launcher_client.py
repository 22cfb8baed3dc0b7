"""The launcher's client (toolq/cli/launcher.py) as an attacker in the workspace would try it.

A command can write anything in its workspace, including a socket that listens. If the user's
runtime directory lies inside the workspace, a planted `launcher.sock` there must never be
connected to: the client would hand it the run's environment (the API key) and terminal."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from toolq.cli import launch as launcher


def planted_listener(path: Path) -> tuple[socket.socket, list[bool]]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(0.5)
    reached: list[bool] = []

    def accept() -> None:
        try:
            conn, _ = server.accept()
            reached.append(True)
            conn.close()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return server, reached


@pytest.fixture
def runtime_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def make(where: Path) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        root = where / "toolq"
        root.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(where))
        return root
    monkeypatch.delenv("TOOLQ_LAUNCHER", raising=False)
    monkeypatch.delenv("TOOLQ_WORKSPACE", raising=False)
    return make


@pytest.mark.parametrize("how", ["cwd", "flag", "env"])
def test_a_launcher_socket_planted_in_the_workspace_is_never_reached(tmp_path, monkeypatch, runtime_in, how):
    workspace = tmp_path / "ws"
    root = runtime_in(workspace / "xdg")
    (root / launcher.KEY_NAME).write_text("planted")
    (root / launcher.KEY_NAME).chmod(0o600)
    server, reached = planted_listener(root / launcher.SOCKET_NAME)
    argv = ["run", "hi"]
    if how == "cwd":
        monkeypatch.chdir(workspace)
    elif how == "flag":
        argv = ["run", "--workspace", str(workspace), "hi"]
    else:
        monkeypatch.setenv("TOOLQ_WORKSPACE", str(workspace))
    try:
        assert launcher.try_launch(argv) is None
    finally:
        server.close()
    assert reached == []


@pytest.mark.parametrize("cwd", ["ws", "/"])
def test_the_same_socket_outside_the_workspace_is_reached_and_a_refusal_runs_the_ordinary_way(
        tmp_path, monkeypatch, runtime_in, cwd):
    """The control: the client does connect where it may (the workspace is --workspace's, not the
    current directory, which may hold the runtime directory), and a listener that answers anything
    but a child's pid leaves the run to the caller's own process."""
    root = runtime_in(tmp_path / "runtime")
    (root / launcher.KEY_NAME).write_text("k")
    (root / launcher.KEY_NAME).chmod(0o600)
    (tmp_path / "ws").mkdir()
    monkeypatch.chdir(tmp_path / cwd)
    server, reached = planted_listener(root / launcher.SOCKET_NAME)
    try:
        assert launcher.try_launch(["run", "--workspace", str(tmp_path / "ws"), "hi"]) is None
    finally:
        server.close()
    assert reached == [True]


def test_a_runtime_directory_others_may_read_or_another_command_is_not_used(tmp_path, monkeypatch, runtime_in):
    root = runtime_in(tmp_path / "runtime")
    server, reached = planted_listener(root / launcher.SOCKET_NAME)
    try:
        assert launcher.try_launch(["workers"]) is None  # not a command the launcher runs
        os.chmod(root, 0o755)
        assert launcher.try_launch(["run", "hi"]) is None
        monkeypatch.setenv("TOOLQ_LAUNCHER", "0")
        os.chmod(root, 0o700)
        assert launcher.try_launch(["run", "hi"]) is None
    finally:
        server.close()
    assert reached == []


def test_the_warm_fleet_names_the_launchers_socket_as_the_client_does():
    from toolq.local import warm

    assert warm.LAUNCHER_SOCKET == launcher.SOCKET_NAME


def test_the_launcher_forks_nothing_for_a_request_without_its_key_or_from_another_interpreter(tmp_path):
    """A process that can reach the socket but not read the key (or brings its own interpreter's
    identity) is refused before anything is forked."""
    import json

    from toolq.cli.launcher import Launcher

    root = tmp_path / "rt"
    root.mkdir(mode=0o700)
    server_side = Launcher(root)
    server = server_side.listen()
    assert oct((root / launcher.KEY_NAME).stat().st_mode & 0o777) == "0o600"
    stop: list[bool] = []
    serving = threading.Thread(target=server_side.serve, args=(server, lambda: bool(stop)), daemon=True)
    serving.start()

    def ask(**fields: object) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(root / launcher.SOCKET_NAME))
            request = {"argv": ["run", "hi"], "env": {}, "cwd": "/", "umask": 0o22,
                       "python": launcher.python_identity(os.environ), **fields}
            r, w = os.pipe()
            try:
                socket.send_fds(sock, [json.dumps(request).encode()], [r, w, w])
                return json.loads(sock.recv(4096))
            finally:
                os.close(r)
                os.close(w)

    try:
        assert ask() == {"refused": True}
        assert ask(key="0" * 64) == {"refused": True}
        key = launcher.read_key(root)
        assert ask(key=key, python={"executable": "/elsewhere/python"}) == {"refused": True}
        assert ask(key=key, argv=["batch", "x.jsonl"]) == {"refused": True}
    finally:
        stop.append(True)
        serving.join(timeout=5)
        server.close()
    assert server_side.children == {}
