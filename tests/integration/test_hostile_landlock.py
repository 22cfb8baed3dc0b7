"""Issue 24, the red team's two critical Landlock findings, as the attacker would.

Landlock confines reading, writing, making and removing files and TCP; it confines neither a
file's metadata (mode, owner, times, extended attributes) nor connecting to a Unix socket by its
path. A Landlock worker's command (root, or an unprivileged user) therefore:

- changed the mode, times and ACLs of any file its uid owns outside its workspace (as root,
  `chmod 0666` on any root file: then every user writes it);
- with the network on, found the worker's session host in `/proc/net/unix` and asked it for a
  command whose workspace was `/`: one that could write the whole file system.

Each attack runs in one turn on a real Landlock worker with the network on; the host then checks
that the victim files outside the workspace are untouched and that no command ran for the
forged request, while the same calls on workspace files still work.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from tests.integration import unprivileged
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

MTIME = 1_000_000_000  # the victims' times, set by the test


def _victims(folder: Path, uid: int, gid: int) -> dict[str, Path]:
    made = {}
    for name in ("plain", "by_fd", "by_link", "by_proc", "times", "attrs", "owner", "race", "linked"):
        path = folder / name
        path.write_text("the host's\n")
        os.chown(path, uid, gid)
        path.chmod(0o600 if name != "by_fd" else 0o644)  # by_fd: opened for reading first
        os.utime(path, (MTIME, MTIME))
        made[name] = path
    return made


@pytest.fixture(scope="module", params=[False, True], ids=["landlock-root", "landlock-user"])
def landlock_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    user = request.param
    folder = unprivileged.worker_folder(user, tmp_path_factory, "victims")
    folder.chmod(0o755)
    uid, gid = unprivileged.ids() if user else (0, 0)
    victims = _victims(folder, uid, gid)
    # The victims' folder is readable in the sandbox, so that a command can open a victim and use
    # the descriptor (fchmod, futimens): Landlock checks the open, not what follows.
    for worker in hostile_workers("landlock", locked_redis, tmp_path_factory, user=user,
                                  TOOLQ_SANDBOX_NETWORK="host", TOOLQ_SANDBOX_READ=str(folder)):
        worker.victims = victims
        yield worker


def _metadata(path: Path) -> tuple:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, sorted(os.listxattr(path))


PY = "python3 -c"


def _attacks(v: dict[str, Path]) -> dict[str, str]:
    return {
        "call_chmod": f"chmod 0666 {v['plain']}; chmod o+w {v['plain']}; stat -c %a {v['plain']}",
        "call_py_chmod": f"{PY} \"import os; os.chmod('{v['plain']}', 0o777)\"",
        "call_fchmod": f"{PY} \"import os; fd = os.open('{v['by_fd']}', os.O_RDONLY); os.fchmod(fd, 0o666)\"",
        "call_link": f"ln -s {v['by_link']} lnk && chmod 0666 lnk; chmod -h 0666 lnk; ls -l lnk",
        "call_proc": f"exec 3<{v['by_proc']}; chmod 0666 /proc/self/fd/3; chmod 0666 /proc/$$/fd/3",
        # Through the command's own descriptor of (and cwd in) the victims' folder, which the worker
        # now resolves as the command's: what it finds must still be inside the workspace.
        "call_proc_dir": (f"exec 4<{v['by_proc'].parent}; chmod 0666 /proc/self/fd/4/by_proc; "
                          f"chmod 0666 /proc/self/fd/4/../{v['by_proc'].parent.name}/by_proc; "
                          f"touch /proc/self/fd/4/times; cd {v['by_proc'].parent} && chmod 0666 /proc/self/cwd/by_proc; "
                          "chmod 0666 /proc/thread-self/cwd/plain; echo PROC-DIR-DONE"),
        "call_dirfd": (f"{PY} \"import os; d = os.open('{v['plain'].parent}', os.O_RDONLY | os.O_DIRECTORY); "
                       f"os.chmod('{v['plain'].name}', 0o666, dir_fd=d)\""),
        "call_touch": f"touch -d @5 {v['times']}; touch {v['times']}",
        "call_futimens": f"{PY} \"import os; fd = os.open('{v['by_fd']}', os.O_RDONLY); os.utime(fd, (7, 7))\"",
        "call_utime_path": f"{PY} \"import os; os.utime('{v['times']}', ns=(9, 9))\"",
        "call_xattr": (f"{PY} \"import os; os.setxattr('{v['attrs']}', 'user.evil', b'1')\"; "
                       f"{PY} \"import os; os.setxattr('{v['attrs']}', 'system.posix_acl_access', "
                       "bytes.fromhex('02000000' '0100060000000000' '0400040000000000' '2000060000000000'))\""),
        "call_chown": f"chown $(id -u):$(id -g) {v['owner']}; chgrp $(id -g) {v['owner']}; "
                      f"{PY} \"import os; os.chown('{v['owner']}', 0, 0)\"",
        # A folder on the way swapped for a link to the victims' in a loop, while chmod goes on:
        # the worker resolves the path once, by descriptor, and checks what it found.
        "call_race": (
            f"{PY} \"import os, threading\n"
            "os.makedirs('r', exist_ok=True); open('r/race', 'w').close()\n"
            "def swap():\n"
            "    for i in range(3000):\n"
            f"        os.rename('r', 'r.d'); os.symlink('{v['race'].parent}', 'r'); os.unlink('r'); os.rename('r.d', 'r')\n"
            "t = threading.Thread(target=swap); t.start()\n"
            "done = 0\n"
            "for i in range(3000):\n"
            "    try:\n"
            "        os.chmod('r/race', 0o666); done += 1\n"
            "    except OSError:\n"
            "        pass\n"
            "t.join(); print('RACED', done)\""
        ),
        # No pid namespace: the worker's session host (the command's parent) is a process of the
        # same uid, whose limits a command could lower (no descriptors left: no command served).
        "call_prlimit": "prlimit --pid $PPID --nofile=5:5; echo rc=$?; prlimit --pid $PPID --nproc=1:1; echo rc=$?",
        # Inode flags by ioctl on a descriptor opened for reading (FS_IOC_SETFLAGS, nodump).
        "call_ioctl": (f"{PY} \"import fcntl, os, struct; fd = os.open('{v['by_fd']}', os.O_RDONLY)\n"
                       "try:\n    fcntl.ioctl(fd, 0x40086602, struct.pack('l', 0x40)); print('SET')\n"
                       "except OSError as e:\n    print('ioctl errno', e.errno)\""),
        # The worker's scheduling: its nice value, CPUs, policy and I/O class (as nobody these
        # passed: same uid, no capability asked); then the command's own, which still works.
        "call_sched": (f"{PY} \"import ctypes, os\n"
                       "libc = ctypes.CDLL(None, use_errno=True)\n"
                       # A sibling thread's id: it could exit and its id go to another process
                       # between the worker's check and the call (a red team timed it).
                       "import threading\n"
                       "ev = threading.Event(); sib = threading.Thread(target=ev.wait); sib.start()\n"
                       "tries = dict(sibling=lambda: os.sched_setaffinity(sib.native_id, os.sched_getaffinity(0)),\n"
                       "    nice=lambda: os.setpriority(os.PRIO_PROCESS, os.getppid(), 19),\n"
                       "    user=lambda: os.setpriority(os.PRIO_USER, 0, 19),\n"
                       "    cpus=lambda: os.sched_setaffinity(os.getppid(), {0}),\n"
                       "    idle=lambda: os.sched_setscheduler(os.getppid(), os.SCHED_IDLE, os.sched_param(0)),\n"
                       "    io=lambda: libc.syscall(251, 1, os.getppid(), 3 << 13) == 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), 'io')))\n"
                       "for name, f in tries.items():\n"
                       "    try:\n        f(); print(name, 'CHANGED')\n"
                       "    except OSError as e:\n        print(name, 'errno', e.errno)\n"
                       "ev.set(); sib.join()\n"
                       "os.nice(1); os.sched_setaffinity(0, os.sched_getaffinity(0))\n"
                       # Its own process and threads, by id (pthread_setaffinity_np passes a tid).
                       "import threading\n"
                       "os.setpriority(os.PRIO_PROCESS, os.getpid(), os.getpriority(os.PRIO_PROCESS, 0))\n"
                       "t = threading.Thread(target=lambda: os.sched_setaffinity(threading.get_native_id(), os.sched_getaffinity(0)))\n"
                       "t.start(); t.join()\n"
                       "os.sched_setaffinity(os.getpid(), os.sched_getaffinity(0)); print('OWN-OK')\""),
        # A datagram socket pair sends to any socket by its path.
        "call_dgram": (f"{PY} \"import socket\n"
                       "try:\n    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                       f"    a.sendto(b'forged', '{v['plain'].parent}/log.sock'); print('SENT')\n"
                       "except OSError as e:\n    print('dgram errno', e.errno)\n"
                       "a, b = socket.socketpair(); a.sendall(b'x')\n"
                       "c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET); c.send(b'y')\n"
                       "print('PAIR-OK', b.recv(1), d.recv(1))\""),
        # A file of the workspace hard-linked to one outside (a local git clone's objects).
        "call_linked": "chmod 0666 linked; touch -d @5 linked; stat -c %a linked",
        # The session host: its socket is in /proc/net/unix; a request naming / as the workspace.
        "call_host": (
            f"{PY} \"import json, socket\n"
            "paths = [l.split()[-1] for l in open('/proc/net/unix') if 'toolq-sessions-' in l]\n"
            "print('found', len(paths))\n"
            "for p in paths:\n"
            "    try:\n"
            "        s = socket.socket(socket.AF_UNIX)\n"
            "        s.connect(p)\n"
            "        s.sendall(b'\\\\n' + json.dumps(dict(op='exec', conversation='x', yield_ms=1000, cmd='touch /FORGED',"
            " cwd='/', workspace='/', env={})).encode() + b'\\\\n')\n"
            "        print('sent', s.recv(100))\n"
            "    except OSError as e:\n"
            "        print('refused', e)\n\""
        ),
    }


CONTROL = ("touch f && chmod 751 f && touch -d @981173106 f && mkdir -p d/e && chmod 700 d && "
           f"{PY} \"import os; fd = os.open('g', os.O_CREAT | os.O_WRONLY, 0o600); os.fchmod(fd, 0o640); "
           "os.utime(fd, (5, 6)); os.chown('g', os.getuid(), os.getgid())\" && "
           "t=$TMPDIR/x && touch $t && chmod 700 $t && mkdir -p tree/sub && chmod 750 tree/sub && "
           "tar cpf a.tar f tree && mkdir -p out && tar xpf a.tar -C out && stat -c %a out/f out/tree/sub && "
           # glibc < 2.39 makes these a chmod of /proc/self/fd/N (tar xp of a folder does the same):
           f"{PY} \"import os; os.chmod('g', 0o604, follow_symlinks=False); fd = os.open('f', os.O_RDONLY); "
           "os.chmod(f'/proc/self/fd/{fd}', 0o741); os.chmod(f'/proc/{os.getpid()}/fd/{fd}', 0o751)\" && "
           # Setting a file's times to now needs only write access (another uid's file, mode 0666).
           "touch others && echo CONTROL-OK")


#: A filter of the command's own that hands chmod to a listener of its own, which answers "go on"
#: (SECCOMP_USER_NOTIF_FLAG_CONTINUE): the newest filter wins a tie of user notifications. The
#: kernel allows one listener per filter chain (EBUSY), which is what keeps this out.
OWN_LISTENER = """
import ctypes, fcntl, os, struct, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
ld, jeq, ret = 0x20, 0x15, 0x06
prog = [(ld, 0, 0, 0), (jeq, 2, 0, 90), (jeq, 1, 0, 268), (ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x7FC00000)]
code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))
fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(code))
fd = libc.syscall(317, 1, 8, ctypes.c_char_p(fprog))
print("listener", fd, ctypes.get_errno(), flush=True)
if fd >= 0:
    def serve():
        b = bytearray(80)
        fcntl.ioctl(fd, 0xC0502100, b, True)
        fcntl.ioctl(fd, 0xC0182101, struct.pack("=QqiI", struct.unpack_from("=Q", b)[0], 0, 0, 1))
    threading.Thread(target=serve, daemon=True).start()
    os.chmod(sys.argv[1], 0o666)
"""


def test_a_landlock_command_changes_no_metadata_outside_its_workspace(drive, landlock_worker, tmp_path):
    v = landlock_worker.victims
    before = {name: _metadata(path) for name, path in v.items()}
    ws = landlock_worker.workspace(tmp_path)
    (ws / "own_listener.py").write_text(OWN_LISTENER)
    os.link(v["linked"], ws / "linked")
    others = ws / "others"  # a file of the workspace another uid owns, that the command may write
    others.write_text("")
    os.chown(others, *(unprivileged.ids() if os.stat(ws).st_uid == 0 else (0, 0)))
    others.chmod(0o666)
    os.utime(others, (MTIME, MTIME))
    others_ro = ws / "others_ro"  # and one it may not write: touch-to-now is refused, root worker or not
    others_ro.write_text("")
    os.chown(others_ro, *(unprivileged.ids() if os.stat(ws).st_uid == 0 else (0, 0)))
    others_ro.chmod(0o600)
    os.utime(others_ro, (MTIME, MTIME))
    log = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # as /dev/log would be
    log_path = v["plain"].parent / "log.sock"
    log_path.unlink(missing_ok=True)
    log.bind(str(log_path))
    log_path.chmod(0o777)
    log.setblocking(False)
    attacks = {**_attacks(v), "call_own_listener": f"python3 own_listener.py {v['plain']}",
               "call_touch_ro": "touch others_ro; echo rc=$?"}
    if os.uname().machine != "x86_64":
        del attacks["call_own_listener"]  # its syscall numbers are x86_64's
    out = attack(drive, landlock_worker, ws, {**attacks, "call_control": CONTROL})
    after = {name: _metadata(path) for name, path in v.items()}
    assert after == before, {name: (before[name], after[name]) for name in v if before[name] != after[name]}
    code, body = out["call_control"]
    assert code == 0 and "CONTROL-OK" in body and "751" in body, body  # the workspace's own metadata changes
    assert stat.S_IMODE((ws / "f").stat().st_mode) == 0o751 and (ws / "f").stat().st_mtime == 981173106
    assert stat.S_IMODE((ws / "g").stat().st_mode) == 0o604 and (ws / "g").stat().st_mtime == 6
    assert stat.S_IMODE((ws / "out/tree/sub").stat().st_mode) == 0o750 and "750" in body
    assert (ws / "others").stat().st_mtime > MTIME
    assert stat.S_IMODE((ws / "d").stat().st_mode) == 0o700
    assert "Operation not permitted" in out["call_chmod"][1], out["call_chmod"]
    assert "RACED" in out["call_race"][1], out["call_race"]  # the race ran (its own file's chmods pass)
    assert "Operation not supported" in out["call_xattr"][1], out["call_xattr"]
    assert "rc=0" not in out["call_prlimit"][1] and "rc=1" in out["call_prlimit"][1], out["call_prlimit"]
    assert "ioctl errno 95" in out["call_ioctl"][1], out["call_ioctl"]
    sched = out["call_sched"][1]
    assert "CHANGED" not in sched and sched.count("errno 1") == 6 and "OWN-OK" in sched, sched
    assert "dgram errno 13" in out["call_dgram"][1] and "PAIR-OK" in out["call_dgram"][1], out["call_dgram"]
    with pytest.raises(BlockingIOError):
        log.recv(100)  # nothing arrived
    log.close()
    assert "Operation not permitted" in out["call_linked"][1], out["call_linked"]
    assert "Permission denied" in out["call_touch_ro"][1] and (ws / "others_ro").stat().st_mtime == MTIME, \
        out["call_touch_ro"]
    proc_dir = out["call_proc_dir"][1]
    assert "PROC-DIR-DONE" in proc_dir and proc_dir.count("Operation not permitted") >= 4, proc_dir


def test_a_landlock_command_cannot_reach_the_session_host(drive, landlock_worker, tmp_path):
    ws = landlock_worker.workspace(tmp_path)
    out = attack(drive, landlock_worker, ws, {"call_host": _attacks(landlock_worker.victims)["call_host"]})
    _, body = out["call_host"]
    assert "found 0" not in body and "sent" not in body, body  # the attack found its target, and was refused
    assert not Path("/FORGED").exists()
