"""bubblewrap: the default sandbox where unprivileged user namespaces work.

Each command gets new user, pid, network, ipc, uts and cgroup namespaces and a root built from
nothing: the system directories read-only, a fresh `/dev`, its own `/proc` (only its own
processes), a private `/tmp`, and the call's workspace read-write with `.git/` read-only again
(as in Codex's workspace-write sandbox). The worker's home, its logs and other workspaces are
not mounted at all. `--die-with-parent` and pid 1 of the namespace take every process down when
the call ends, `setsid -f` and double forks included.

The command has no capabilities, even in its own user namespace: run by a root worker, bwrap
would otherwise keep them all, and the command could `umount` a mask or remount `/usr`
read-write (uid 0 in the sandbox is the host's root). Memory the command could fill outside its
processes' address space is bounded: `/tmp` and `/dev/shm` are tmpfs of the call's memory limit,
and the rest of `/dev` is read-only. `/proc/sys` is read-only too: uid 0 in the sandbox passes the
sysctls' permission check, capabilities or not (it rewrote `vm.swappiness` of the host). A command that finds `.git` bound from anywhere but the
workspace does not run (`GIT_CHECK`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from toolq.workers.isolation.policy import Policy

#: Where the private /tmp is: HOME and TMPDIR point here inside the sandbox.
SANDBOX_TMP = "/tmp"
#: Host secrets under the read-only system directories, masked: a root worker's command is uid 0
#: (without capabilities), and uid 0 owns them.
MASKED = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/ssl/private",
          "/etc/sudoers", "/etc/sudoers.d")


def executable() -> str | None:
    return shutil.which("bwrap")


def argv(bwrap: str, policy: Policy, workspace: str, cwd: str, command: list[str]) -> list[str]:
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if policy.network == "host":
        args.append("--share-net")
    size = str(policy.limits.memory_mb * 1024 * 1024)
    args += ["--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger",
             "/proc/sysrq-trigger", "--size", size, "--tmpfs", SANDBOX_TMP]
    for d in policy.read_dirs:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        else:
            args += ["--ro-bind-try", d, d]
    for path in MASKED:
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--tmpfs", path]
        elif os.path.lexists(path):
            args += ["--ro-bind", "/dev/null", path]
    real = os.path.realpath(workspace)
    args += ["--bind", real, real]
    if real != workspace:  # reached through a symlink: the same path inside as outside
        args += ["--symlink", real, workspace]
    git = os.path.join(real, ".git")
    expected = _git_mount(git) if os.path.lexists(git) and not os.path.islink(git) else None
    if expected is not None:
        # A symlinked .git is not bound: it resolves inside the sandbox only.
        args += ["--ro-bind", git, git]
        command = ["/bin/sh", "-c", GIT_CHECK, "toolq-sandbox", _escape(git), expected, *command]
    args += ["--remount-ro", "/", "--chdir", cwd, "--", *command]
    return args


#: Runs first in the sandbox when `.git` is bound: bwrap resolves the bind's source and target by
#: path (even with --ro-bind-fd), so a parallel call that swaps `.git` for a symlink (`..`) while
#: bwrap starts gets the symlink's target (the host's directory) bound instead. The mount table
#: is final here: the command runs only if `.git`'s mount is the workspace's own `.git`.
GIT_CHECK = """ok=
while read -r _ _ dev root mount _; do
  [ "$mount" = "$1" ] && [ "$dev $root" = "$2" ] && ok=1
done < /proc/self/mountinfo
[ -n "$ok" ] || { echo "sandbox refused the command: .git changed while the sandbox was set up" >&2; exit 125; }
shift 2
exec "$@"
"""


def _escape(path: str) -> str:
    """A path as /proc/<pid>/mountinfo writes it."""
    for char, code in (("\\", "\\134"), (" ", "\\040"), ("\t", "\\011"), ("\n", "\\012")):
        path = path.replace(char, code)
    return path


def _git_mount(git: str) -> str | None:
    """`major:minor root` of a bind mount of `git`, as mountinfo shows it (the root is the path
    within its filesystem); None when no mount of this process's table contains it."""
    best: tuple[str, str, str] | None = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                _, _, dev, root, mount = line.split(" ", 5)[:5]
                mount = mount.encode().decode("unicode_escape") if "\\" in mount else mount
                inside = git == mount or git.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[2])):
                    best = (dev, root, mount)
    except OSError:
        return None
    if best is None:
        return None
    dev, root, mount = best
    rest = os.path.relpath(git, mount)
    return f"{dev} {os.path.normpath(root.rstrip('/') + '/' + _escape(rest))}"


def probe(policy: Policy) -> str | None:
    """None when bubblewrap runs a command here with this policy; else why not (one line)."""
    bwrap = executable()
    if bwrap is None:
        return "bwrap is not installed"
    with tempfile.TemporaryDirectory(prefix="toolq-probe-") as ws:
        try:
            proc = subprocess.run(argv(bwrap, policy, ws, ws, ["/bin/sh", "-c", "echo ok > probe"]),
                                  env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap did not run: {e}"
        if proc.returncode != 0 or not (Path(ws) / "probe").exists():
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            return f"bwrap failed here ({err[-1] if err else f'exit {proc.returncode}'})"
    return None


def version(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.split()
        return out[-1] if out else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"
