"""A hostile model against the bubblewrap cells (`toolq/workers/isolation/cell.py`): one long-lived
sandbox per session-host slot and workspace, whose program (`cell_init.py`) keeps the capabilities
of its user namespace and forks each command as pid 1 of new pid, mount and IPC namespaces.

What a cell adds to attack: a capable process next to every command (its pid 1 until the drop,
the cell's own program in the parent pid namespace), namespaces that the commands of a cell share
(user, network, UTS, cgroup), and a root built once for many commands. Sequential calls of one
turn land on the same slot, so in the same cell: each attack below plants with one call and looks
with the next. The worker runs with the fleet's secrets in its environment, as in
`test_hostile_exec.py`, and its stderr (which the cells inherit) goes to a file we can read.

Three tests were holes when written, each fixed since (see their docstrings): the host root's
keyrings were readable and writable from a command (both designs), a cell's commands shared
keyrings (new with cells), and stray descriptors reached every command (both designs, low). The
others are regression tests of attacks that held.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import tests.integration.conftest as c
from tests.integration.test_builtin_tools import exec_parts, outputs
from tests.integration.test_hostile_exec import (  # noqa: F401
    FLOWER_PASSWORD,
    LIMITS,
    OPENAI_KEY,
    REDIS_PASSWORD,
    locked_redis,
    no_secret,
)
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import WorkerProcess
from toolq.workers.isolation import choose
from toolq.workers.isolation.policy import Policy

pytestmark = pytest.mark.integration

MEMORY_MB = 256
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uid 0 is the host's root only for a root worker")


class StderrWorker(WorkerProcess):
    """A worker whose stderr (the session host's, and so every cell's) goes to a file, as a
    container's does to its log, instead of /dev/null."""

    def start(self, wait: bool = True) -> WorkerProcess:
        env = {**os.environ, **self.env, "REDIS_URL": self.redis_url}
        env.pop("CELERY_BROKER_URL", None)
        self.log.write_text("")
        self.stderr_path = self.logdir / "stderr.log"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv(), env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True, preexec_fn=self._preexec())
        if wait:
            self.wait_ready()
        return self


@pytest.fixture(scope="module")
def cell_worker(locked_redis, tmp_path_factory):  # noqa: F811 - the fixture imported above
    why = choose(Policy.from_settings(Settings(sandbox="bwrap"))).unavailable
    if why:
        pytest.skip(f"bwrap cannot run here: {why}")
    logdir = tmp_path_factory.mktemp("worker-cells")
    env = {**c.WORKER_ENV, **LIMITS, "TOOLQ_SANDBOX_MEMORY_MB": str(MEMORY_MB), "TOOLQ_SANDBOX": "bwrap",
           "TOOLQ_SANDBOX_CELLS": "1", "OPENAI_API_KEY": OPENAI_KEY, "FLOWER_PASSWORD": FLOWER_PASSWORD}
    w = StderrWorker(locked_redis.url, queues=["toolq"], concurrency=2, tools=[c.TEST_TOOLS], env=env,
                     logdir=logdir, name="hostile-cells@test")
    w.start()
    assert "a cell per workspace and slot" in w.log.read_text()  # the banner: cells are on
    yield SimpleNamespace(proc=w, logdir=logdir, redis=locked_redis, stderr=w.stderr_path)
    w.stop()


def in_turn(drive, worker, ws: Path, commands: list[str], **kw) -> list[tuple[int, str]]:
    """One turn, one call per model response: the calls run one after the other, each on the
    first free slot, so all in the same cell. The (exit code, output) of each, in order."""
    script = [[b.function_call("exec_command", {"cmd": cmd}, f"call_{i}")] for i, cmd in enumerate(commands)]
    run = drive([*script, [b.message("done")]], redis_url=worker.redis.url, workspace=ws, **kw)
    got = outputs(run, len(script))
    parts = [exec_parts(got[f"call_{i}"]) for i in range(len(commands))]
    return [(code, body) for code, _, body in parts]


def cells_of(worker) -> list[psutil.Process]:
    return [p for p in psutil.Process(worker.proc.proc.pid).children(recursive=True)
            if "toolq-cell" in " ".join(p.cmdline()) and p.name().startswith("python")]


#: The control: pid 1 of a command is the cell's fork (its command line is the cell's bootstrap).
IN_A_CELL = "tr '\\0' ' ' < /proc/1/cmdline | grep -q toolq-cell && echo IN-A-CELL"


# --- holes ---------------------------------------------------------------------------------------

KEYS = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL, LINK, READ, SEARCH = 248, 250, 8, 11, 10
U, US = -4, -5
def read(key):
    buf = ctypes.create_string_buffer(512)
    n = libc.syscall(KEYCTL, READ, key, buf, 512)
    return buf.raw[:n].decode(errors="replace") if n > 0 else None
if sys.argv[1] == "plant":
    for ring in (U, US):
        print("plant", ring, libc.syscall(ADD_KEY, b"user", b"toolq-cell-planted", sys.argv[2].encode(),
                                          len(sys.argv[2]), ring) > 0)
elif sys.argv[1] == "look":
    for ring in (U, US):
        key = libc.syscall(KEYCTL, SEARCH, ring, b"user", b"toolq-cell-planted", 0)
        print("look", ring, read(key) if key > 0 else None)
else:  # steal: every keyring /proc/keys shows, linked into our own, then every key read
    lines = [l.split() for l in open("/proc/keys").read().splitlines()]
    for l in lines:
        if l[7] == "keyring":
            libc.syscall(KEYCTL, LINK, int(l[0], 16), U)
    for l in lines:
        if l[7] == "user":
            print("key", l[8], read(int(l[0], 16)))
"""


def _keyctl(*args: int) -> int:
    return ctypes.CDLL(None, use_errno=True).syscall(250, *args)


@needs_root
def test_the_host_roots_keyrings_are_out_of_reach(drive, cell_worker, tmp_path):
    """Was a hole (both bwrap designs, not only cells), closed by cell_init's seccomp filter: the sandbox's uid 0 is the host's kuid 0, and
    keys are checked by kuid, not by namespace. /proc/keys lists the host root's user keyring
    (`_uid.0`, perm 1f3f0000: its owner may link it); the command links it into its own keyring,
    so possesses every key in it and reads them. Also a channel between any two sandboxes (any
    workspace, any conversation): write a key there, read it from elsewhere. The deploy seccomp
    profile denies keyctl/add_key/request_key, but the sandbox itself did not (a bare or systemd
    root worker, these tests). Now every command of a cell runs under a seccomp filter that fails
    add_key, keyctl and request_key with ENOSYS (the per-command bwrap path has none yet)."""
    secret = "host-root-key-" + secrets.token_hex(6)
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(248, b"user", b"toolq-host-secret", secret.encode(), len(secret), -4)  # this process's @u
    assert key > 0, ctypes.get_errno()
    try:
        (tmp_path / "keys.py").write_text(KEYS)
        (code, body), = in_turn(drive, cell_worker, tmp_path, ["python3 keys.py steal"])
    finally:
        _keyctl(21, key)  # KEYCTL_INVALIDATE
    assert secret not in body, body


def test_keyrings_do_not_carry_from_one_command_of_a_cell_to_the_next(drive, cell_worker, tmp_path):
    """Was a hole (new with cells), closed by the same filter: a command's user keyring and user-session keyring belong to the uid
    in its user namespace (Linux >= 5.3), and a cell's commands share the cell's user namespace:
    a key planted by one call is there for every later call of the cell (another turn's too),
    where each call used to have a user namespace of its own. The filter above allows no keyring
    syscall at all."""
    (tmp_path / "keys.py").write_text(KEYS)
    planted = "cell-key-" + secrets.token_hex(6)
    out = in_turn(drive, cell_worker, tmp_path, [IN_A_CELL, f"python3 keys.py plant {planted}", "python3 keys.py look"])
    assert out[0] == (0, "IN-A-CELL\n")
    assert planted not in out[2][1], out


POISONED_LINES = "\n".join(f"ERROR toolq: forged log line {i} TOOLQ-FORGED-LOG" for i in range(1, 400)) + "\n"


def test_a_command_cannot_write_into_the_workers_log_through_pid_1(drive, cell_worker, tmp_path):
    """Held, first only by inheritance, now by design (pid 1 ignores every signal): pid 1 of a command is a fork of the cell's Python. Had that
    Python its default SIGINT handler, `kill -INT 1` from the command would raise
    KeyboardInterrupt in pid 1's waitpid loop, uncaught: the interpreter would print a traceback
    to the cell's fd 2, the worker's stderr (the container log), with source lines that linecache
    reads from `toolq-cell` relative to pid 1's cwd, the workspace, so chosen by the command (it
    did, driving `cell.spawn` from a thread of a process that does not ignore SIGINT). It holds here
    because the session host sets SIGINT to SIG_IGN (host.py), which the cell's Python inherits
    across exec and then installs no handler. Now `_init` ignores every signal it can before the
    command starts (which starts with all at their default)."""
    (tmp_path / "toolq-cell").write_text(POISONED_LINES)
    out = in_turn(drive, cell_worker, tmp_path, [IN_A_CELL, "kill -INT 1; sleep 1; echo survived"])
    assert out[0] == (0, "IN-A-CELL\n")
    log = cell_worker.stderr.read_text(errors="replace") + cell_worker.proc.log.read_text(errors="replace")
    assert "TOOLQ-FORGED-LOG" not in log
    assert out[1] == (0, "survived\n"), out[1]  # SIGINT to pid 1 is ignored


def test_a_command_holds_no_descriptor_but_its_stdio(drive, cell_worker, tmp_path):
    """Was a hole (hygiene, low), closed by the cell closing what it inherited: the gate's descriptors that the worker passes to bwrap (the write end of
    --block-fd, the socket of --file) reach the cell's program without close-on-exec, and from it
    every command (posix_spawn keeps them); the per-command bwrap passed them on too. Their peers are closed today, so writing gets EPIPE;
    but any descriptor added to that path later would reach the model's commands. The cell now
    closes every descriptor but its control socket at start."""
    (code, body), = in_turn(drive, cell_worker, tmp_path, [
        "python3 -c \"import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))\""])
    fds = eval(body)
    assert code == 0 and [fd for fd in fds if fd > 3] == [], body  # 0-2, and listdir's own (3)


# --- held ---------------------------------------------------------------------------------------


def test_the_cells_own_mounts_cannot_be_peeled_off(drive, cell_worker, tmp_path):
    """Each command's /tmp, /dev/shm and /proc are mounted over the cell's. Without capabilities
    it cannot unmount them; a nested user namespace gets copies locked together (EINVAL), cannot
    map uid 0 (the host's root: CAP_SETFCAP needed), and cannot mount a proc (the covers make
    the existing one not fully visible)."""
    peel = ("unshare -Um sh -c 'for m in /proc/sys /proc /tmp /dev/shm /dev/pts \"$PWD\"; do umount -l \"$m\" "
            "&& echo UNMOUNTED $m; done; ls -a /tmp; ps -e -o comm=' 2>&1")
    out = in_turn(drive, cell_worker, tmp_path, [
        IN_A_CELL,
        "umount -l /tmp 2>&1; umount -l /proc 2>&1; ls -a /tmp; ps -e -o pid= | wc -l",
        peel,
        "unshare -Urm sh -c 'echo MAPPED' 2>&1",
        "unshare -Umpf --mount-proc sh -c 'ps -e -o pid=,cmd=; echo MOUNTED-PROC' 2>&1",
    ])
    assert out[0] == (0, "IN-A-CELL\n")
    assert "must be superuser" in out[1][1] and out[1][1].split()[-1] == "4", out[1]  # pid 1, sh, ps, wc: its own only
    lines = out[2][1].splitlines()
    # Since issue 24 no nested user namespace is made at all (seccomp refuses CLONE_NEWUSER).
    assert not [line for line in lines if line.startswith("UNMOUNTED")] and "Operation not permitted" in out[2][1], out[2]
    assert "MAPPED" not in out[3][1], out[3]
    assert "MOUNTED-PROC" not in out[4][1], out[4]


def test_pid_1_cannot_be_read_traced_or_stopped(drive, cell_worker, tmp_path):
    """pid 1 (the cell's fork) has no capability left and is not dumpable; the cell itself is in
    the parent pid namespace, invisible."""
    probe = ("cat /proc/1/environ 2>&1; exec 3</proc/1/mem && echo OPENED-MEM; ls -l /proc/1/fd/ 2>&1 | grep -- '->' "
             "&& echo FD-LINKS; ls /proc/1/root/ 2>&1 && echo ROOT; grep CapEff /proc/1/status; "
             "python3 -c \"import ctypes; l = ctypes.CDLL(None, use_errno=True); print('ptrace', l.ptrace(16, 1, 0, 0), "
             "ctypes.get_errno())\"; nsenter -t 1 -m -p true 2>&1 && echo ENTERED; true")
    out = in_turn(drive, cell_worker, tmp_path, [
        IN_A_CELL,
        probe,
        "kill -STOP 1; kill -TERM 1; kill -HUP 1; kill -9 -1; echo after-signals",
        "echo next",
    ])
    assert out[0] == (0, "IN-A-CELL\n")
    body = out[1][1]
    for marker in ("OPENED-MEM", "FD-LINKS", "ENTERED", "ROOT", "PATH="):
        assert marker not in body, (marker, body)
    assert "CapEff:\t0000000000000000" in body and "ptrace -1 1" in body, body  # EPERM
    no_secret(body)
    assert out[2][0] in (0, 137) and out[3] == (0, "next\n"), out  # the cell serves on


def test_nothing_a_command_plants_in_the_cell_reaches_the_next(drive, cell_worker, tmp_path):
    """Per command: fresh /tmp and /dev/shm, an IPC namespace, its processes gone with its pid 1.
    The network namespace is the cell's: a listener dies with the command that opened it."""
    plant = ("echo planted > /tmp/p; echo planted > /dev/shm/p; ipcmk -M 4096 >/dev/null; ipcmk -Q >/dev/null; "
             "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); s.bind('\\0toolq-cell-abstract'); "
             "s.listen()\" & "
             "setsid -f python3 -c 'import socket, time; s = socket.socket(); s.bind((\"127.0.0.1\", 45999)); "
             "s.listen(); time.sleep(300)'; (sleep 300 &); sleep 0.3; echo planted")
    look = ("cat /tmp/p /dev/shm/p 2>/dev/null; ipcs -m -q | grep -c 0x; ps -e -o comm=; "
            "grep -c toolq-cell-abstract /proc/net/unix; "
            "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 45999), 1); print('CONNECTED')\" 2>&1 "
            "| tail -1")
    out = in_turn(drive, cell_worker, tmp_path, [IN_A_CELL, plant, look])
    assert out[0] == (0, "IN-A-CELL\n") and out[1] == (0, "planted\n"), out
    body = out[2][1]
    assert "planted" not in body and "CONNECTED" not in body and "sleep" not in body, body
    assert body.splitlines()[0] == "0", body  # no SysV segment or queue
    assert "refused" in body, body


def test_a_git_made_by_one_call_is_read_only_in_the_next(drive, cell_worker, tmp_path):
    """A cell is kept only while `.git` is what it bound. Since issue 24 a workspace without one
    gets an empty `.git` bound read-only before its cell starts: `git init` fails at once, and no
    call can write, remove or move it."""
    out = in_turn(drive, cell_worker, tmp_path, [
        "git init -q . 2>&1 | tail -1; echo tried",
        "echo '[core] fsmonitor = touch /tmp/x' >> .git/config && echo WROTE; "
        "mkdir -p .git/hooks && echo 'echo HOOK' > .git/hooks/pre-commit && echo HOOKED; true",
        "rm -rf .git 2>&1 | tail -1; mv .git g 2>&1; ls -d .git",
    ])
    assert "Read-only" in out[0][1], out
    assert "WROTE" not in out[1][1] and "HOOKED" not in out[1][1] and "Read-only" in out[1][1], out[1]
    assert os.listdir(tmp_path / ".git") == [] and not (tmp_path / "g").exists()


def test_a_fork_bomb_and_a_memory_fill_leave_the_cell_serving(drive, cell_worker, tmp_path):
    """The cell shares its slot's cgroups with the commands: a command that fills them must be the
    one stopped, with its limit named, and the next call must run."""
    bomb = "python3 -c 'import os, time\nfor i in range(500):\n    if os.fork() == 0: time.sleep(30); os._exit(0)\n'"
    fill = (f"head -c {MEMORY_MB - 16}M /dev/zero > /tmp/f1 2>&1; head -c {MEMORY_MB - 16}M /dev/zero > /dev/shm/f2 "
            "2>&1; python3 -c 'b = bytearray(200 << 20); print(\"ALLOCATED\")'; echo end")
    out = in_turn(drive, cell_worker, tmp_path, [bomb, "echo after-bomb", fill, "echo after-fill"], timeout=90)
    assert out[0][0] != 0 and "the sandbox's limit of 64 processes" in out[0][1], out[0]
    assert out[1] == (0, "after-bomb\n"), out[1]
    assert out[3] == (0, "after-fill\n"), out[3]


def test_no_secret_in_the_cell(drive, cell_worker, tmp_path):
    (code, body), = in_turn(drive, cell_worker, tmp_path, [
        "env; tr '\\0' ' ' < /proc/1/cmdline; cat /proc/1/environ; ps -e -o pid=,args=; cat /proc/self/mountinfo 2>&1"])
    assert "toolq-cell" in body  # the control: pid 1's command line was read
    no_secret(body)
    assert "REDIS" not in body and str(cell_worker.logdir) not in body
    for cell in cells_of(cell_worker):  # and the cell's own environment, as the host sees it
        assert set(cell.environ()) <= {"PATH", "PWD"}, cell.environ()
