"""The seccomp filter every sandboxed command runs under (`cell_init.seccomp_program`): what it
decides for each call and argument, read by a small classic-BPF interpreter for both machines it
knows, that every backend installs the same program, and what it does under the real kernel."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from toolq.workers.isolation import bwrap, cell_init, landlock

ALLOW, KILL, NOTIFY = "allow", "kill", "notify"
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x40000000, 0x20000, 17
O_WRONLY, O_CREAT, O_TMPFILE = 0o1, 0o100, 0o20000000 | 0o200000


def verdict(program: bytes, machine: str, nr: int, *args: int, arch: int | None = None) -> str | int:
    """What the kernel would do with syscall `nr`: ALLOW, KILL or the errno it fails with. Only
    the instructions the builder emits are known (a load of seccomp_data, AND, JEQ/JGE/JSET, RET)."""
    data = struct.pack("iIQ6Q", nr, AUDIT_ARCH[machine] if arch is None else arch, 0,
                       *[a & (1 << 64) - 1 for a in (*args, *[0] * (6 - len(args)))])
    ops = [struct.unpack_from("HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:
            acc = struct.unpack_from("I", data, k)[0]
        elif code == 0x54:  # ALU AND K
            acc &= k
        elif code in (0x15, 0x35, 0x45):
            taken = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += jt if taken else jf
        elif code == 0x06:
            if k == 0x7FFF0000:
                return ALLOW
            if k == 0x80000000:
                return KILL
            if k == cell_init.SECCOMP_RET_USER_NOTIF:
                return NOTIFY
            assert k & 0xFFFF0000 == 0x00050000, hex(k)
            return k & 0xFFFF
        else:
            raise AssertionError(f"unknown instruction {code:#x}")
        pc += 1


NR = {machine: {name: n for name, n in numbers.items() if n is not None} for machine, numbers in cell_init._NR.items()}
MACHINES = sorted(NR)


@pytest.mark.parametrize("machine", MACHINES)
def test_landlock_hands_metadata_calls_to_the_worker_and_refuses_unix_sockets(machine):
    # Landlock confines neither a file's metadata nor connecting to a Unix socket by its path.
    nr = NR[machine]
    program = cell_init.seccomp_program(False, machine, deny_unix=True, metadata=True)
    assert verdict(program, machine, nr["socket"], 1, 1) == errno.EACCES  # AF_UNIX
    assert verdict(program, machine, nr["socket"], 2, 1) == ALLOW  # AF_INET: the network is on
    assert verdict(program, machine, nr["socket"], 10, 2) == ALLOW  # AF_INET6
    for name in cell_init.SUPERVISED:
        if name in nr:
            assert verdict(program, machine, nr[name], 3, 0o755, 0o755, 0) == NOTIFY, name
    for name, mode_arg, _ in cell_init.MODE_ARGS:
        if "chmod" in name and name in nr:
            args = [0] * 4
            args[mode_arg] = 0o755
            assert verdict(program, machine, nr[name], *args) == NOTIFY, name
            args[mode_arg] = 0o4755
            assert verdict(program, machine, nr[name], *args) == errno.EPERM, name  # never reaches the worker
    for name in cell_init.NO_ATTRIBUTES:
        assert verdict(program, machine, nr[name], 0, 0) == errno.EOPNOTSUPP, name
    assert verdict(program, machine, nr["prlimit64"], 0, 7, 0, 0) == ALLOW  # its own limits
    # Another pid: the worker's supervisor decides (the caller's own threads only).
    assert verdict(program, machine, nr["prlimit64"], 4242, 7, 0, 0) == NOTIFY
    for name, _ in cell_init.OWN_PROCESS_ONLY:
        assert verdict(program, machine, nr[name], 0, 1, 0) == ALLOW, name
        assert verdict(program, machine, nr[name], 4242, 1, 0) == NOTIFY, name
    for name, which in cell_init.WHO_SELF_ONLY:
        assert verdict(program, machine, nr[name], which, 0, 19) == ALLOW, name
        assert verdict(program, machine, nr[name], which, 4242, 19) == NOTIFY, name
        assert verdict(program, machine, nr[name], which + 1, 0, 19) == errno.EPERM, name  # a group, a user
        assert verdict(program, machine, nr[name], which + 1, 4242, 19) == errno.EPERM, name
    for code in cell_init.FILE_IOCTLS:
        assert verdict(program, machine, nr["ioctl"], 3, code) == errno.EOPNOTSUPP, hex(code)
    assert verdict(program, machine, nr["ioctl"], 3, 0x5401) == ALLOW  # TCGETS: a terminal's
    assert verdict(program, machine, nr["socketpair"], 1, 1) == ALLOW  # AF_UNIX, SOCK_STREAM
    assert verdict(program, machine, nr["socketpair"], 1, 1 | 0o2000000) == ALLOW  # with SOCK_CLOEXEC
    for kind in (2, 3, 2 | 0o4000, 3 | 0o2000000):  # DGRAM, RAW (a datagram socket in AF_UNIX), with flags
        assert verdict(program, machine, nr["socketpair"], 1, kind) == errno.EACCES, kind
    assert verdict(program, machine, nr["socketpair"], 1, 5) == ALLOW  # SEQPACKET: connected, as a stream
    assert verdict(program, machine, nr["socketpair"], 2, 2) == ALLOW  # not AF_UNIX: the kernel refuses it
    off = cell_init.seccomp_program(True, machine, deny_unix=True, metadata=True)
    assert verdict(off, machine, nr["socket"], 2, 1) == errno.EACCES  # network off: every family
    # The other backends keep what they had: their mounts confine metadata already.
    plain = cell_init.seccomp_program(machine=machine)
    assert verdict(plain, machine, nr["socket"], 1, 1) == ALLOW
    assert verdict(plain, machine, nr["fchmodat"], 0, 0, 0o755) == ALLOW
    assert verdict(plain, machine, nr["utimensat"], 0, 0, 0, 0) == ALLOW
    assert verdict(plain, machine, nr["prlimit64"], 4242, 7, 0, 0) == ALLOW  # a pid namespace of its own
    assert verdict(plain, machine, nr["ioctl"], 3, cell_init.FILE_IOCTLS[0]) == ALLOW  # its mounts confine it
    assert verdict(plain, machine, nr["socketpair"], 1, 2) == ALLOW


@pytest.mark.parametrize("machine", MACHINES)
def test_setuid_and_setgid_modes_are_refused_and_other_modes_pass(machine):
    prog, nr = cell_init.seccomp_program(machine=machine), NR[machine]
    for name, mode_arg, flags_arg in cell_init.MODE_ARGS:
        if name not in nr:
            continue
        for mode, expected in ((0o4755, errno.EPERM), (0o2755, errno.EPERM), (0o6777, errno.EPERM),
                               (0o755, ALLOW), (0o1777, ALLOW), ((1 << 32) | 0o755, ALLOW)):
            args = [3, 0, 0, 0]
            args[mode_arg] = mode
            if flags_arg is not None:
                args[flags_arg] = O_WRONLY | O_CREAT
            assert verdict(prog, machine, nr[name], *args) == expected, (name, oct(mode))
    # open's mode counts only when it may create a file (O_CREAT or O_TMPFILE); otherwise it is junk.
    openat = nr["openat"]
    assert verdict(prog, machine, openat, -100, 0, O_TMPFILE | O_WRONLY, 0o2700) == errno.EPERM
    assert verdict(prog, machine, openat, -100, 0, os.O_RDONLY, 0o4755) == ALLOW
    assert verdict(prog, machine, openat, -100, 0, O_WRONLY | O_CREAT, 0o644) == ALLOW


@pytest.mark.parametrize("machine", MACHINES)
def test_no_new_user_namespace_but_other_clones_pass(machine):
    prog, nr = cell_init.seccomp_program(machine=machine), NR[machine]
    for name in ("unshare", "clone"):
        assert verdict(prog, machine, nr[name], CLONE_NEWUSER) == errno.EPERM
        assert verdict(prog, machine, nr[name], CLONE_NEWUSER | CLONE_NEWNET | SIGCHLD) == errno.EPERM
        assert verdict(prog, machine, nr[name], CLONE_NEWNS) == ALLOW  # the kernel asks CAP_SYS_ADMIN for that
    assert verdict(prog, machine, nr["clone"], SIGCHLD) == ALLOW  # fork, threads


@pytest.mark.parametrize("machine", MACHINES)
def test_kernel_attack_surface_fails_as_missing_and_the_rest_is_allowed(machine):
    prog, nr = cell_init.seccomp_program(machine=machine), NR[machine]
    for name in cell_init.REFUSED:
        assert verdict(prog, machine, nr[name]) == errno.ENOSYS, name
    assert {"io_uring_setup", "clone3", "openat2", "userfaultfd", "perf_event_open", "bpf"} <= set(cell_init.REFUSED)
    checked = set(cell_init.REFUSED) | {m[0] for m in cell_init.MODE_ARGS} | {n[0] for n in cell_init.NAMESPACE_ARGS}
    for number in range(460):
        if number not in {nr[name] for name in checked if name in nr}:
            assert verdict(prog, machine, number, 0o7777, 0o7777, 0o7777, 0o7777) == ALLOW, number
    assert verdict(prog, machine, nr["socket"], 1) == ALLOW
    assert verdict(cell_init.seccomp_program(True, machine=machine), machine, nr["socket"], 1) == errno.EACCES


def test_a_foreign_abi_cannot_reach_the_same_calls_by_other_numbers():
    prog = cell_init.seccomp_program(machine="x86_64")
    assert verdict(prog, "x86_64", 0x40000000 | 90, 0, 0o4755) == errno.ENOSYS  # x32's chmod
    assert verdict(prog, "x86_64", 15, 0, 0o4755, arch=0x40000003) == KILL  # i386's chmod
    assert cell_init.seccomp_program(machine="mips") is None


def test_every_backend_installs_the_one_program(monkeypatch):
    """Cells build it in cell_init (its source runs alone in the sandbox); bubblewrap per command
    and Landlock take theirs from there, so the three cannot drift apart."""
    assert bwrap._program() == cell_init.seccomp_program()
    installed: list[tuple[bytes | None, bool]] = []
    monkeypatch.setattr(cell_init, "install_seccomp", lambda code, listener=False: installed.append((code, listener)) or 7)
    assert landlock.confine_syscalls(False) == 7  # the metadata listener, for the worker to serve
    landlock.confine_syscalls(True)
    # Landlock's: the same program, with what Landlock itself does not confine (the test above).
    assert installed == [(cell_init.seccomp_program(deny_unix=True, metadata=True), True),
                         (cell_init.seccomp_program(True, deny_unix=True, metadata=True), True)]


def under_filter(shell: str, cwd: Path) -> subprocess.CompletedProcess:
    """`shell` run by bash under the filter, as the sandbox's commands are (no_new_privs first)."""
    start = ("import ctypes, os, sys; from toolq.workers.isolation import cell_init; "
             "assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0; "
             "cell_init.install_seccomp(cell_init.seccomp_program()); os.execvp('bash', ['bash', '-c', sys.argv[1]])")
    return subprocess.run([sys.executable, "-c", start, shell], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(cell_init.seccomp_program() is None, reason="no seccomp filter for this machine")
def test_under_the_real_kernel_the_modes_go_and_ordinary_work_stays(tmp_path):
    (tmp_path / "suid").write_bytes(b"#!/bin/sh\n")
    (tmp_path / "suid").chmod(0o4755)
    tries = ("cp /bin/true t && chmod 4755 t; chmod u+s t; chmod g+s t; install -m 2755 /bin/true i; "
             "python3 -c \"import os; os.mkdir('d', 0o2755)\"; "
             "python3 -c \"import os; os.close(os.open('o', os.O_CREAT | os.O_WRONLY, 0o4755))\"; "
             "cp -a suid copy; echo cp=$?; ")
    work = ("python3 -c \"import subprocess, threading; t = threading.Thread(target=print, args=('thread',)); "
            "t.start(); t.join(); subprocess.run(['true'], check=True)\" && mkdir -p w/x && chmod 0750 w && "
            "tar cf a.tar w t && git init -q repo && echo WORK-OK")
    run = under_filter(tries + work, tmp_path)
    assert "WORK-OK" in run.stdout and "thread" in run.stdout, run
    assert "cp=1" in run.stdout and "preserving permissions" in run.stderr, run  # cp -a copies, says so
    assert (tmp_path / "copy").read_bytes() == b"#!/bin/sh\n"
    left = {p.name: stat.filemode(p.lstat().st_mode) for p in tmp_path.iterdir()
            if p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID) and p.name != "suid"}
    assert left == {}
    names = {p.name for p in tmp_path.iterdir()}
    assert {"t", "i"} <= names and "o" not in names  # copies made, their bits refused; that open failed whole


@pytest.mark.skipif(cell_init.seccomp_program() is None, reason="no seccomp filter for this machine")
@pytest.mark.skipif(not shutil.which("unshare"), reason="no unshare(1) here")
def test_under_the_real_kernel_no_user_namespace_and_no_io_uring(tmp_path):
    calls = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "print('uring', libc.syscall(425, 8, ctypes.create_string_buffer(120)), ctypes.get_errno()); "
             "print('uffd', libc.syscall(NR_UFFD, 1 | os.O_CLOEXEC), ctypes.get_errno())")
    uffd = cell_init._NR[os.uname().machine]["userfaultfd"]
    run = under_filter(f"unshare -Urn true; echo unshare=$?; python3 -c \"{calls.replace('NR_UFFD', str(uffd))}\"",
                       tmp_path)
    assert "unshare=1" in run.stdout and "Operation not permitted" in run.stderr, run
    assert f"uring -1 {errno.ENOSYS}" in run.stdout and f"uffd -1 {errno.ENOSYS}" in run.stdout, run
