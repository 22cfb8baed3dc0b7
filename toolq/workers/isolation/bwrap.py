"""bubblewrap: the default sandbox where unprivileged user namespaces work.

Each command gets new user, pid, network, ipc, uts and cgroup namespaces and a root built from
nothing: the system directories read-only, a fresh `/dev`, its own `/proc` (only its own
processes), a private `/tmp`, and the call's workspace read-write with `.git/` read-only again
(as in Codex's workspace-write sandbox). The worker's home, its logs and other workspaces are
not mounted at all. `--die-with-parent` and pid 1 of the namespace take every process down when
the call ends, `setsid -f` and double forks included.
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
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
    if policy.network == "host":
        args.append("--share-net")
    args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", SANDBOX_TMP]
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
    workspace = real
    git = os.path.join(workspace, ".git")
    if os.path.lexists(git):
        # a symlinked .git is hidden rather than followed: its target could be anywhere
        args += ["--ro-bind", "/dev/null" if os.path.islink(git) else git, git]
    args += ["--remount-ro", "/", "--chdir", cwd, "--", *command]
    return args


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
