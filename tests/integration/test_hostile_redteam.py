"""A second hostile model against real workers: the attacks `test_hostile_exec.py` did not try.

The workers are those of `test_hostile_exec.py` (the fleet's secrets in their environment, a
password-protected broker, once per sandbox backend), with a small memory limit so that a fill
can be seen to stop. Each test is one turn whose calls are the attacks. The holes these found,
now closed: a root worker's bwrap command kept every capability of its user namespace (it
unmounted the /etc/shadow mask and remounted the host's /etc read-write) and could write the
host's sysctls; /tmp and /dev/shm were unbounded tmpfs, and a call of many processes could hold
many times the memory limit; Landlock let a command connect to any unix socket on the host, and
io_uring made sockets past the seccomp filter; `.git` swapped for a symlink while bwrap started
got the host's directory bound in its place; an output flood kept a worker core busy. The xfail
tests are the holes still open.
"""

from __future__ import annotations

import secrets
import socket
import threading
from pathlib import Path

import pytest

from tests.hostile import Flipper, race_tree, restore_flipped
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.dev.fake_model import builders as b
from toolq.workers.isolation import limits

pytestmark = pytest.mark.integration

MEMORY_MB = 256


@pytest.fixture(scope="module", params=["bwrap", "landlock"])
def redteam_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    yield from hostile_workers(request.param, locked_redis, tmp_path_factory,
                               TOOLQ_SANDBOX_MEMORY_MB=str(MEMORY_MB))


def test_root_in_the_sandbox_has_no_capabilities(drive, redteam_worker, tmp_path):
    planted = Path(f"/etc/toolq-planted-{secrets.token_hex(4)}")
    (tmp_path / "m").mkdir()
    try:
        out = attack(drive, redteam_worker, tmp_path, {
            "call_caps": "grep CapEff /proc/self/status",
            "call_unmask": "umount /etc/shadow && head -c 5 /etc/shadow && echo UNMASKED",
            "call_remount": f"mount -o remount,bind,rw /etc && touch {planted} && echo REMOUNTED",
            "call_mount": "mount -t tmpfs none m && echo MOUNTED",
            # out of the pids cgroup: mount the hierarchy, or write to it where it is visible
            "call_cgroup": "mount -t cgroup -o pids none m && echo MOUNTED; "
                           "echo $$ > /sys/fs/cgroup/pids/cgroup.procs && echo MOVED",
        })
    finally:
        planted.unlink(missing_ok=True)
    assert out["call_caps"] == (0, "CapEff:\t0000000000000000\n"), out["call_caps"]
    for call, marker in (("call_unmask", "UNMASKED"), ("call_remount", "REMOUNTED"), ("call_mount", "MOUNTED"),
                         ("call_cgroup", "MOVED")):
        code, body = out[call]
        assert code != 0 and marker not in body and "MOUNTED" not in body, (call, body)
    assert not planted.exists()


def test_the_hosts_sysctls_are_read_only(drive, redteam_worker, tmp_path):
    """uid 0 in bwrap's sandbox is the host's root for /proc/sys' permission check, capabilities
    or not. The attack writes the value back unchanged, so a failing run changes nothing."""
    out = attack(drive, redteam_worker, tmp_path, {
        "call_sysctl": "v=$(cat /proc/sys/vm/swappiness) && echo \"$v\" > /proc/sys/vm/swappiness && echo WROTE",
    })
    code, body = out["call_sysctl"]
    assert code != 0 and "WROTE" not in body, body
    assert "Read-only file system" in body or "Permission denied" in body, body


def test_memory_outside_the_address_space_is_bounded(drive, redteam_worker, tmp_path):
    """Files in tmpfs are RAM that no process's RLIMIT_AS counts: each at the file size limit
    (1 MiB), as many as fit. `du -x`: a checkout under /tmp is bound read-only inside, not in the tmpfs."""
    fill = "for i in $(seq {n}); do head -c 1048576 /dev/zero > {d}/f$i || {{ echo FULL; break; }}; done; du -smx {d}"
    out = attack(drive, redteam_worker, tmp_path, {
        "call_tmp": fill.format(d="/tmp", n=MEMORY_MB + 20),
        "call_shm": fill.format(d="/dev/shm", n=MEMORY_MB + 20),
        "call_dev": "echo x > /dev/planted && echo WROTE",
    })
    for call in ("call_tmp", "call_shm"):
        _, body = out[call]
        assert "FULL" in body, (call, body)
        used = int(body.strip().splitlines()[-1].split()[0])
        assert used <= MEMORY_MB + 1, (call, body)  # du rounds up
    code, body = out["call_dev"]
    assert code != 0 and "WROTE" not in body, body


def test_host_unix_sockets_and_io_uring_are_out_of_reach(drive, redteam_worker, tmp_path, tmp_path_factory):
    """A Redis unix socket, docker.sock or systemd's private socket sit outside the workspace."""
    path = tmp_path_factory.mktemp("host-socket") / "broker.sock"
    abstract = f"\0toolq-redteam-{secrets.token_hex(4)}"
    got: list[bytes] = []
    servers = []
    for address in (str(path), abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.settimeout(0.2)
        servers.append(server)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for server in servers:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                got.append(conn.recv(64))
                conn.close()

    connect = ("python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect({!r}); "
               "s.send(b'sandboxed'); print('CONNECTED')\"")
    io_uring = ("python3 -c \"import ctypes; libc = ctypes.CDLL(None); "
                "print('io_uring_setup', libc.syscall(425, 8, ctypes.create_string_buffer(120)))\"")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out = attack(drive, redteam_worker, tmp_path, {
            "call_path": connect.format(str(path)),
            "call_abstract": connect.format(abstract),
            "call_io_uring": io_uring,
        })
    finally:
        stop.set()
        thread.join()
        for server in servers:
            server.close()
    assert got == [], "a sandboxed command reached a unix socket of the host"
    for call in ("call_path", "call_abstract"):
        code, body = out[call]
        assert code != 0 and "CONNECTED" not in body, (call, body)
        assert "Permission denied" in body or "No such file" in body or "Connection refused" in body, body
    if redteam_worker.backend == "landlock":  # bwrap: io_uring's sockets are in an empty network namespace
        assert out["call_io_uring"] == (0, "io_uring_setup -1\n"), out["call_io_uring"]


def test_git_swapped_for_a_symlink_while_bwrap_starts_binds_nothing_outside(drive, redteam_worker, tmp_path):
    """Another process flips `.git` between a directory and a symlink to `..` (the parent of the
    workspace, where a secret is) while the calls start: bwrap must never bind what it points to,
    and Landlock (which binds nothing) must never let the symlink read outside the workspace."""
    ws = tmp_path / "ws"
    (ws / ".git").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("outside-the-workspace\n")
    calls = [b.function_call("exec_command", {"cmd": "cat ../secret.txt .git/secret.txt 2>/dev/null; true"},
                             f"call_{i}") for i in range(60)]
    responses = [calls[i:i + 20] for i in range(0, len(calls), 20)]
    with Flipper(ws, "..", name=".git"):
        run = drive([*responses, [b.message("done")]], redis_url=redteam_worker.redis.url, workspace=ws,
                    timeout=120)
    outputs = [o["output"] for o in run.outputs_of(len(responses))]
    assert len(outputs) == 60
    assert not [o for o in outputs if "outside-the-workspace" in o], "a call read outside its workspace"
    if redteam_worker.backend == "bwrap":  # only bubblewrap binds .git, so only it can lose the race
        assert any(".git changed while the sandbox was set up" in o for o in outputs), "the race never hit"


def concurrent_calls(drive, worker, tmp_path) -> dict[str, tuple[int, str]]:
    """A victim call and, on the other pool process at the same time, one that looks for it in
    /proc, prints what it saw and tries to kill it."""
    token = secrets.token_hex(4)
    hunt = ("import os\n"
            f"mark = 'victim-' + '{token}'\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        seen = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n"
            "        continue\n"
            "    if mark in seen and 'import os' not in seen:\n"
            "        print('SAW', seen.replace(chr(0), ' '))\n"
            "        try:\n"
            "            os.kill(int(pid), 9); print('KILLED')\n"
            "        except OSError as e:\n"
            "            print(e)\n")
    (tmp_path / "hunt.py").write_text(hunt)
    return attack(drive, worker, tmp_path, {
        "call_victim": f"sleep 3; echo alive; : victim-{token}",
        "call_hunter": "sleep 1; python3 hunt.py",
    })


def test_a_concurrent_call_cannot_be_signalled(drive, redteam_worker, tmp_path):
    out = concurrent_calls(drive, redteam_worker, tmp_path)
    assert out["call_victim"] == (0, "alive\n"), out
    assert "KILLED" not in out["call_hunter"][1]


def test_a_concurrent_calls_command_line_is_not_visible(drive, redteam_worker, tmp_path, request):
    if redteam_worker.backend == "landlock":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "Landlock cannot hide /proc/<pid>/cmdline (world-readable) of another call's processes "
            "without a pid namespace; a rule per /proc entry would also hide /proc/self")))
    out = concurrent_calls(drive, redteam_worker, tmp_path)
    assert "SAW" not in out["call_hunter"][1], out["call_hunter"]


def test_the_memory_limit_holds_for_a_whole_call(drive, redteam_worker, tmp_path, request):
    """Four processes, each under the per-process limit (and bigger than the pool process, so
    that the OOM killer takes one of them), together far over it."""
    if limits.cgroup_base("memory") is None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "without a memory cgroup the limit is RLIMIT_AS, per process: a call of N processes may "
            "use N times it (and memfd/tmpfs pages besides)")))
    share = MEMORY_MB * 3 // 4
    # Each child says when it holds its share; the parent waits until every child holds or is
    # dead, then counts those alive and holding: "HELD" lines alone overcount, as the OOM killer
    # may take a child after it said so (it then held nothing while the next one did).
    hog = ("import os, select, time\n"
           "r, w = os.pipe()\n"
           "kids = set()\n"
           "for i in range(4):\n"
           "    pid = os.fork()\n"
           "    if pid == 0:\n"
           f"        b = bytearray({share} * 1024 * 1024); os.write(w, b'%d\\n' % os.getpid()); time.sleep(60)\n"
           "        os._exit(0)\n"
           "    kids.add(pid)\n"
           "os.close(w)\n"
           "held, dead, data, end = set(), set(), b'', time.monotonic() + 30\n"
           "while (held | dead) != kids and time.monotonic() < end:\n"
           "    if select.select([r], [], [], 0.05)[0]:\n"
           "        data += os.read(r, 4096)\n"
           "        held = {int(x) for x in data.split()}\n"
           "    while True:\n"
           "        try:\n"
           "            pid, _ = os.waitpid(-1, os.WNOHANG)\n"
           "        except ChildProcessError:\n"
           "            break\n"
           "        if not pid:\n"
           "            break\n"
           "        dead.add(pid)\n"
           "print('ALIVE-HOLDING', len(held - dead), flush=True)\n"
           "for pid in kids - dead:\n"
           "    os.kill(pid, 9)\n")
    (tmp_path / "hog.py").write_text(hog)
    _, body = attack(drive, redteam_worker, tmp_path, {"call_hog": "python3 hog.py"})["call_hog"]
    assert "ALIVE-HOLDING" in body, body
    held = int(body.split("ALIVE-HOLDING", 1)[1].split()[0])
    assert held * share <= MEMORY_MB + limits.OWN_MEMORY_SLACK_MB, f"{held} processes held {share} MiB each at once"
    assert f"the sandbox limits each call to {MEMORY_MB} MiB" in body, body
    after = attack(drive, redteam_worker, tmp_path, {"call_after": "echo fine"})
    assert after["call_after"] == (0, "fine\n")  # the worker still runs calls


def test_git_is_read_only(drive, redteam_worker, tmp_path, request):
    if redteam_worker.backend == "landlock":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "Landlock rules only add rights beneath a directory: .git/ under the writable workspace "
            "stays writable")))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    attack(drive, redteam_worker, tmp_path, {"call_git": "echo '[core] fsmonitor = touch /tmp/pwned' >> .git/config"})
    assert (tmp_path / ".git" / "config").read_text() == "[core]\n"


def test_a_workdir_swapped_for_a_symlink_reaches_nothing_outside(drive, redteam_worker, tmp_path):
    """`workdir` is checked as a string, then the sandbox enters it: another process flips it for a
    symlink to a directory outside (another turn's, with a secret) between the two."""
    ws, outside = race_tree(tmp_path)
    (outside / "f.txt").chmod(0o600)
    calls = [b.function_call("exec_command", {"cmd": "cat f.txt; echo x > planted.txt; pwd", "workdir": "d"},
                             f"call_{i}") for i in range(40)]
    responses = [calls[i:i + 20] for i in range(0, len(calls), 20)]
    with Flipper(ws, outside):
        run = drive([*responses, [b.message("done")]], redis_url=redteam_worker.redis.url, workspace=ws,
                    timeout=120)
    outputs = [o["output"] for o in run.outputs_of(len(responses))]
    assert len(outputs) == 40
    assert not [o for o in outputs if "s3cret" in o], "a command read outside the workspace through workdir"
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt"], "a command wrote outside through workdir"
    # The control, once the flipping stopped (under load every raced call may have met the link):
    # a call with the same workdir reads the workspace's own d.
    restore_flipped(ws)
    control = drive([[b.function_call("exec_command", {"cmd": "cat f.txt", "workdir": "d"}, "call_control")],
                     [b.message("done")]], redis_url=redteam_worker.redis.url, workspace=ws, timeout=120)
    assert "inside" in control.outputs_of(1)[0]["output"], control.outputs_of(1)


def test_an_output_flood_until_the_timeout_is_slowed_down(drive, redteam_worker, tmp_path):
    """Reading `yes` as fast as it writes kept most of a worker core busy for the whole timeout."""
    flood = ("import os\n"
             "n = 0\n"
             "while True:\n"
             "    os.write(1, b'y' * 65536)\n"
             "    n += 1\n"
             "    if n % 16 == 0:\n"
             "        open('written.new', 'w').write(str(n * 65536))\n"
             "        os.replace('written.new', 'written')\n")  # never read half-written
    (tmp_path / "flood.py").write_text(flood)
    script = [[b.function_call("exec_command", {"cmd": "python3 flood.py"}, "call_flood")], [b.message("done")]]
    drive(script, redis_url=redteam_worker.redis.url, workspace=tmp_path, turn_timeout=4)
    written = int((tmp_path / "written").read_text())
    assert written <= 256 * 1024 * 1024, f"the worker read {written / 2**20:.0f} MiB of one call's output in 4 s"


SESSION_HOST_TAKEOVER = r"""
import os, socket
host = None
pid = os.getpid()
while pid > 1:  # Landlock: the session host is an ancestor; bwrap: a pid namespace hides it
    pid = int(open(f'/proc/{pid}/status').read().split('PPid:')[1].split()[0])
    try:
        if b'sessions.host' in open(f'/proc/{pid}/cmdline', 'rb').read():
            host = pid
            break
    except OSError:
        break
print('HOST', host)
if host:
    for sig in (19, 9):
        try:
            os.kill(host, sig)
            print('SIGNALLED', sig)
        except OSError as e:
            print('kill', sig, e.errno)
dirs = set()
for line in open('/proc/net/unix').read().splitlines()[1:]:
    f = line.split()
    if len(f) > 7 and 'toolq-sessions-' in f[7]:
        dirs.add(os.path.dirname(f[7]))
print('DIRS', len(dirs))
for d in sorted(dirs) + [os.getcwd()]:
    for how in ('socket', 'pair'):
        try:
            s = socket.socket(socket.AF_UNIX) if how == 'socket' else socket.socketpair()[0]
            s.bind(os.path.join(d, 'stolen.sock'))
            s.listen()
            print('LISTENING', 'IN-WORKSPACE' if d == os.getcwd() else 'IN-HOSTS-FOLDER', how)
        except OSError as e:
            print(how, e.errno)
        finally:
            if d != os.getcwd():
                try:
                    os.unlink(os.path.join(d, 'stolen.sock'))
                except OSError:
                    pass
"""


def test_a_command_cannot_take_its_session_hosts_socket(drive, redteam_worker, tmp_path):
    """A pool child waits up to 10 s for a session host the worker restarts, then sends it the
    host's key and its own environment (REDIS_URL with its password, the signing key). A command
    that stopped or killed its host and listened on the socket's path would read them: it cannot
    signal the host (bwrap: a pid namespace; Landlock ABI 6: signals scoped), cannot make a unix
    socket (Landlock's filter), cannot bind in the host's 0700 folder (bwrap: not even visible),
    and under Landlock cannot listen on a socketpair's end bound in its workspace (it is
    connected). The worker serves the next call."""
    (tmp_path / "take.py").write_text(SESSION_HOST_TAKEOVER)
    out = attack(drive, redteam_worker, tmp_path, {"call_take": "python3 take.py 2>&1", "call_next": "sleep 2; echo NEXT"})
    code, body = out["call_take"]
    assert code == 0, body
    assert "SIGNALLED" not in body and "IN-HOSTS-FOLDER" not in body, body
    if redteam_worker.backend == "landlock":
        assert "HOST None" not in body and "DIRS 0" not in body, body  # the attack found its host and folder
        assert "LISTENING" not in body, body
    assert out["call_next"] == (0, "NEXT\n"), out["call_next"]


SENTINEL_PASSWORD = f"sentinel-{secrets.token_hex(8)}"


@pytest.fixture(scope="module", params=["bwrap", "landlock"])
def sentinel_env_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    yield from hostile_workers(request.param, locked_redis, tmp_path_factory,
                               TOOLQ_SENTINEL_PASSWORD=SENTINEL_PASSWORD, TOOLQ_SENTINEL_MASTER="toolq-master")


def test_the_sentinels_password_is_not_reachable_from_a_command(drive, sentinel_env_worker, tmp_path):
    """TOOLQ_SENTINEL_PASSWORD is in the worker's environment, so in its session host's (which
    reads it with `target_from_env`) and in the request a pool child sends that host (`env`): a
    command looks for it in its own environment, in every process's environ and command line it
    can read (its parents' included), and in the session host's socket folder."""
    out = attack(drive, sentinel_env_worker, tmp_path, {
        "call_env": "env; echo ENV-DONE",
        "call_proc": "for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f 2>/dev/null; done "
                     "| grep -a -c SENTINEL; echo PROC-DONE",
        "call_parent": "cat /proc/$PPID/environ /proc/1/environ 2>&1 | tr '\\0' '\\n'; echo PARENT-DONE",
        "call_dirs": "cat /tmp/toolq-sessions-*/* 2>&1 | head -c 300; echo DIRS-DONE",
    })
    for call, (_, body) in out.items():
        assert SENTINEL_PASSWORD not in body, (call, body)
        assert "-DONE" in body, (call, body)
