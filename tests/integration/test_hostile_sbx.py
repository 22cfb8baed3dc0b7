"""A third hostile model, against the sandbox start of the 'sbx' merge: the gate that checks `.git`
through /proc/<pid>/root, masks made only for readable files, and the session host's spawn slot
threads that start bwrap from a mount namespace of their own (no /sys, the masks made once).

The workers are `test_hostile_redteam.py`'s (bwrap only: the rest is about bubblewrap's mounts).
Commands run through the session host, so from its slot threads' namespaces.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.hostile import Exchanger
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.dev.fake_model import builders as b

pytestmark = pytest.mark.integration

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the slot threads' namespaces and the masks need root")


@pytest.fixture(scope="module")
def sbx_worker(locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    class Param:
        param = "bwrap"
    yield from hostile_workers(Param.param, locked_redis, tmp_path_factory, TOOLQ_SANDBOX_MEMORY_MB="256")


def session_hosts(worker) -> list[psutil.Process]:
    return [p for p in psutil.Process(worker.proc.proc.pid).children(recursive=True)
            if "toolq.workers.sessions.host" in " ".join(p.cmdline())]


def mount_points(pid: int | str = "self") -> set[str]:
    return {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}


def shadow_lines() -> list[str]:
    """The host's secret lines (those with a field past the name), for a root worker's command to miss."""
    found = []
    for path in ("/etc/shadow", "/etc/gshadow"):
        try:
            found += [line for line in Path(path).read_text().splitlines() if line.count(":") >= 2]
        except OSError:
            pass
    return found


#: mount(2) from a shell, given `source target fstype flags`: prints `mount <result> <errno>`.
MOUNT = ("echo mount $(python3 -c \"import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
         "print(libc.mount(*[a.encode() or None for a in sys.argv[1:4]], int(sys.argv[4]), None), "
         "ctypes.get_errno())\" {})")
REBIND = "; ".join(MOUNT.format(f'/etc /tmp/m "" {flags}') for flags in (4096, 4096 | 16384))  # MS_BIND, | MS_REC
SYSFS = MOUNT.format("none /tmp/s sysfs 0")


@needs_root
def test_masks_hold_against_nested_namespaces_and_sys_stays_out(drive, sbx_worker, tmp_path):
    """uid 0 in the sandbox owns /etc/shadow: only the mask hides it. A nested user namespace gives
    back capabilities over copies of the mounts, which must come locked."""
    out = attack(drive, sbx_worker, tmp_path, {
        "call_read": "cat /etc/shadow /etc/shadow- /etc/gshadow /etc/gshadow- 2>&1; ls /etc/ssl/private /etc/ssh",
        "call_umount": "unshare -Um sh -c 'umount /etc/shadow; umount -l /etc/shadow; cat /etc/shadow; "
                       "umount /etc/ssh; ls /etc/ssh' 2>&1",
        "call_etc": "unshare -Um sh -c 'umount -l /etc; cat /etc/shadow' 2>&1",
        # mount(2) itself: util-linux's mount refuses a uid with no mapping before it calls it
        "call_rebind": f"mkdir -p /tmp/m; unshare -Um sh -c '{REBIND}; cat /tmp/m/shadow' 2>&1",
        "call_sys": f"ls /sys 2>&1; mkdir -p /tmp/s; unshare -Umn sh -c '{SYSFS}; ls /tmp/s' 2>&1",
        "call_proc": "mkdir -p /tmp/p; unshare -Umpf --mount-proc=/tmp/p sh -c 'ls /tmp/p/1/root/etc/shadow && "
                     "cat /tmp/p/1/root/etc/shadow' 2>&1",
        "call_mounts": "cat /proc/self/mountinfo",
    })
    secrets = shadow_lines()
    for call, (_code, body) in out.items():
        assert not [s for s in secrets if s in body], (call, body)
    assert "ssh_config" not in out["call_umount"][1]
    assert "devices" not in out["call_sys"][1] and "kernel" not in out["call_sys"][1], out["call_sys"]
    # No nested user namespace at all now (issue 24: the seccomp filter refuses CLONE_NEWUSER), so
    # not even the locked copies of the mounts are reached.
    for call in ("call_umount", "call_etc", "call_rebind", "call_sys", "call_proc"):
        assert "unshare failed: Operation not permitted" in out[call][1], (call, out[call])
    mounts = {line.split()[4] for line in out["call_mounts"][1].splitlines()}
    assert "/sys" not in mounts and not [m for m in mounts if m.startswith("/sys/")], mounts
    assert str(sbx_worker.logdir) not in out["call_mounts"][1]


@needs_root
def test_the_slot_threads_namespaces_do_not_leak_into_the_hosts(drive, sbx_worker, tmp_path):
    """The slot threads unmount /sys and mask /etc/shadow in their own namespaces: the worker's,
    the session host's main thread and this process keep theirs."""
    before = mount_points()
    out = attack(drive, sbx_worker, tmp_path, {"call_a": "echo a", "call_b": "echo b"})
    assert out == {"call_a": (0, "a\n"), "call_b": (0, "b\n")}
    assert os.path.ismount("/sys") and "/sys" in mount_points() and "/etc/shadow" not in mount_points()
    assert mount_points() == before
    own = os.readlink("/proc/self/ns/mnt")
    hosts = session_hosts(sbx_worker)
    assert hosts, "no session host: the calls did not go through the slot threads"
    slot_namespaces = set()
    for host in hosts:
        assert os.readlink(f"/proc/{host.pid}/ns/mnt") == own
        assert "/sys" in mount_points(host.pid) and "/etc/shadow" not in mount_points(host.pid)
        slot_namespaces |= {os.readlink(f"/proc/{host.pid}/task/{tid}/ns/mnt")
                            for tid in os.listdir(f"/proc/{host.pid}/task")} - {own}
    assert slot_namespaces  # the control: slot threads of their own namespace ran the calls


@needs_root
def test_a_workspace_on_a_file_system_mounted_after_the_worker_started(drive, sbx_worker, tmp_path):
    """The slot threads' copies of the mount table do not follow the host's private mounts. A tmpfs
    mounted over a directory after the worker started: a workspace inside it (where the thread's
    copy has nothing, or a decoy of the same path on the file system beneath) must be the host's."""
    volume = tmp_path / "volume"
    (volume / "decoyed").mkdir(parents=True)
    (volume / "decoyed" / "marker").write_text("the decoy beneath\n")
    attack(drive, sbx_worker, tmp_path, {"call_warm": "true", "call_warm2": "true"})  # slots prepared before
    subprocess.run(["mount", "--make-private", "-t", "tmpfs", "toolq-redteam", str(volume)], check=True)
    try:
        outs = {}
        for name in ("fresh", "decoyed"):  # fresh first: a decoyed one makes the copy again
            ws = volume / name
            ws.mkdir()
            (ws / "marker").write_text(f"the new file system's {name}\n")
            outs[name] = attack(drive, sbx_worker, ws, {"call_cat": "cat marker && echo written > out"})["call_cat"]
            outs[name + "_out"] = (ws / "out").read_text() if (ws / "out").exists() else None
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=True)
    assert outs["decoyed"] == (0, "the new file system's decoyed\n"), outs
    assert outs["decoyed_out"] == "written\n"
    assert outs["fresh"] == (0, "the new file system's fresh\n"), outs
    assert outs["fresh_out"] == "written\n"
    assert not (volume / "decoyed" / "out").exists()  # nothing landed on the file system beneath
    for host in session_hosts(sbx_worker):  # the copies made again left the host's table alone too
        assert "/sys" in mount_points(host.pid) and str(volume) not in mount_points(host.pid)
    assert os.path.ismount("/sys") and str(volume) not in mount_points()


@pytest.mark.parametrize("target", ["/newroot/dev/shm", ".."])
def test_git_exchanged_with_a_symlink_never_runs_a_command_with_a_writable_git_or_the_parent(
        drive, sbx_worker, tmp_path, target):
    """bwrap binds `.git` (`mount(2)` follows the target's path), then finds the new mount again
    by `realpath` of that path to make it read-only. A `.git` swapped for a symlink to another
    mount point of the sandbox (`/newroot/dev/shm` as bwrap sees it while it builds the root) in
    between makes bwrap remount that one read-only instead and leaves `.git` bound read-write.
    Swapped atomically (no moment without a `.git`) for `..`: the workspace's parent bound."""
    ws = tmp_path / "ws"
    (ws / ".git").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("outside-the-workspace\n")
    # the mount of .git, wherever the swaps have moved its dentry since (.git or .git.link)
    probe = ("awk -v ws=\"$PWD\" 'index($5, ws \"/.git\") == 1 && $6 ~ /^rw/ {print \"RW-GIT\", $5}' "
             "/proc/self/mountinfo > /tmp/rw; cat /tmp/rw; while read -r _ m; do touch \"$m/pwned-$$\" && "
             "echo WROTE; done < /tmp/rw; cat ../secret.txt .git/secret.txt .git.link/secret.txt 2>/dev/null; true")
    calls = [b.function_call("exec_command", {"cmd": probe}, f"call_{i}") for i in range(200)]
    responses = [calls[i:i + 20] for i in range(0, len(calls), 20)]
    with Exchanger(ws, target, name=".git"):
        run = drive([*responses, [b.message("done")]], redis_url=sbx_worker.redis.url, workspace=ws, timeout=300)
    outputs = [o["output"] for o in run.outputs_of(len(responses))]
    assert len(outputs) == 200
    real = ws / ".git" if (ws / ".git").is_dir() and not (ws / ".git").is_symlink() else ws / ".git.link"
    assert not [o for o in outputs if "RW-GIT" in o], [o for o in outputs if "RW-GIT" in o][:3]
    assert not list(real.glob("pwned-*"))
    assert not [o for o in outputs if "outside-the-workspace" in o], "a call read outside its workspace"


def test_a_real_git_cannot_be_moved_exchanged_or_linked_from_inside(drive, sbx_worker, tmp_path):
    """The races above need a `.git` that a parallel call can swap: the workspace's own, bound in
    every sandbox, is a mount point there (EBUSY), and a hard link out of it crosses a mount (EXDEV)."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / "other").mkdir()
    exchange = ("python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                "print('exchange', libc.renameat2(-100, b'.git', -100, b'other', 2), os.strerror(ctypes.get_errno()))\"")
    out = attack(drive, sbx_worker, tmp_path, {
        "call_mv": "mv .git moved 2>&1; mv other .git 2>&1",
        "call_exchange": exchange,
        "call_link": "ln .git/config cfg 2>&1 && echo '[core] fsmonitor = true' >> cfg && echo LINKED",
        "call_rm": "rm -rf .git 2>&1; ls .git",
    })
    assert "exchange -1 Device or resource busy" in out["call_exchange"][1], out["call_exchange"]
    assert "LINKED" not in out["call_link"][1], out["call_link"]
    assert "busy" in out["call_mv"][1], out["call_mv"]  # (mv moves `other` into .git: read-only)
    assert (tmp_path / ".git" / "config").read_text() == "[core]\n" and not (tmp_path / "moved").exists()
    assert (tmp_path / "other").is_dir()
