"""Issue 24 items 3 and 6, as the attacker would: no privilege leaves a cell.

A root worker's command owns what it writes as the host's root: a setuid copy of a shell left in
the workspace is a root shell for every local user (an unprivileged worker's, a shell of that
worker's user). And a command that makes a user namespace of its own holds every capability in
it (`unshare -Urn`: mounts, nf_tables), and io_uring is the way into many kernel escalations:
Docker's default profile refuses both. Each attack runs on real workers of every backend
(bubblewrap cells, bubblewrap per command, Landlock), as root and as an unprivileged user; the
test then looks at the workspace from the host and runs what was left there as another user.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.integration import unprivileged
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

FCHMODAT2 = 452
SETUID_TRIES = {
    "call_chmod": "cp /bin/sh sh4 && chmod 4755 sh4; chmod u+s sh4; chmod g+s sh4; ls -l sh4",
    "call_install": "install -m 4755 /bin/sh sh5; install -m 2755 -d gdir; ls -ld sh5 gdir",
    "call_open": "python3 -c \"import os; os.close(os.open('sh6', os.O_CREAT | os.O_WRONLY, 0o4755))\"",
    "call_mkdir": "python3 -c \"import os; os.mkdir('sgid', 0o2755)\"",
    "call_fchmodat2": ("cp /bin/sh sh7 && python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                       f"print(libc.syscall({FCHMODAT2}, -100, b'sh7', 0o4755, 0), ctypes.get_errno())\""),
    "call_tar": "tar -x -p -f suid.tar; ls -l sh8",
}
NAMESPACE_TRIES = {
    "call_unshare": "unshare -Urn id -u; echo rc=$?",
    "call_py_unshare": "python3 -c \"import os; os.unshare(os.CLONE_NEWUSER); print('UNSHARED')\"",
    "call_uring": ("python3 -c \"import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                   "fd = libc.syscall(425, 8, ctypes.create_string_buffer(120)); print('fd', fd, 'errno', "
                   "ctypes.get_errno())\""),
}
CONTROL = {"call_control": "cp -a /bin/true ok && ./ok && mkdir -p x/y && chmod 700 x && tar cf t.tar ok x "
                           "&& git init -q repo && echo CONTROL-OK"}


@pytest.fixture(scope="module", params=[("bwrap", True, False), ("bwrap", False, False), ("landlock", True, False),
                                        ("bwrap", True, True), ("landlock", True, True)],
                ids=["bwrap-cells-root", "bwrap-per-command-root", "landlock-root", "bwrap-cells-user",
                     "landlock-user"])
def priv_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    backend, cells, user = request.param
    yield from hostile_workers(backend, locked_redis, tmp_path_factory, user=user,
                               TOOLQ_SANDBOX_CELLS="1" if cells else "0")


def setuid_tar(path: Path) -> None:
    with tarfile.open(path, "w") as tar:
        data = Path("/bin/sh").read_bytes()
        info = tarfile.TarInfo("sh8")
        info.size, info.mode = len(data), 0o4755
        tar.addfile(info, io.BytesIO(data))


def privileged_files(workspace: Path) -> list[str]:
    found = []
    for where, dirs, files in os.walk(workspace):
        for name in dirs + files:
            mode = os.lstat(os.path.join(where, name)).st_mode
            if mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(f"{os.path.relpath(os.path.join(where, name), workspace)} {stat.filemode(mode)}")
    return found


def test_no_setuid_or_setgid_file_leaves_a_cell(drive, priv_worker, tmp_path):
    ws = priv_worker.workspace(tmp_path)
    setuid_tar(ws / "suid.tar")
    out = attack(drive, priv_worker, ws, {**SETUID_TRIES, **CONTROL})
    code, body = out["call_control"]
    assert code == 0 and "CONTROL-OK" in body, body  # ordinary work still works, modes included
    assert (ws / "sh4").exists() and (ws / "sh7").exists()  # the copies were made: only their bits were refused
    assert privileged_files(ws) == []
    # Another local user runs the copy: it must run as that user, not as the file's owner.
    ws.chmod(0o755)
    other = unprivileged.OTHER_UID
    run = subprocess.run(["setpriv", f"--reuid={other}", f"--regid={other}", "--clear-groups", str(ws / "sh4"), "-p",
                          "-c", "id -u"], capture_output=True, text=True, timeout=30)
    assert run.stdout.strip() == str(other), run


def test_no_new_user_namespace_and_no_io_uring_in_a_cell(drive, priv_worker, tmp_path):
    ws = priv_worker.workspace(tmp_path)
    out = attack(drive, priv_worker, ws, {**NAMESPACE_TRIES, **CONTROL})
    assert out["call_control"][0] == 0
    _, unshared = out["call_unshare"]
    assert "rc=0" not in unshared and "Operation not permitted" in unshared, unshared
    code, body = out["call_py_unshare"]
    assert code != 0 and "UNSHARED" not in body, body
    _, uring = out["call_uring"]
    assert "fd -1" in uring, uring  # io_uring_setup failed
