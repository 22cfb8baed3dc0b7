"""The sandbox every process of a shell tool runs in, chosen once per worker.

`current()` is this worker's `Sandbox` (probed at `toolq worker` start, inherited by the pool
children); `Sandbox.launch` turns one command into what `run_command` spawns: the argv (wrapped by
bubblewrap, or as is), the allowlisted environment, and a pre-exec step (rlimits, the per-call
pids cgroup, Landlock). Backends: `bwrap.py`, `landlock.py`; limits: `limits.py`; orphans
without a pid namespace: `reaper.py`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import termios
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from toolq.core.errors import ConfigurationError
from toolq.core.libc import die_with_parent
from toolq.core.settings import Settings
from toolq.workers.isolation import bwrap, cell, landlock, limits, metadata, reaper
from toolq.workers.isolation.policy import Backend, Policy

INSTALL_HINT = ("no sandbox works here for shell tools: install bubblewrap (apt-get install bubblewrap) with "
                "unprivileged user namespaces allowed, or use a kernel with Landlock ABI >= 4 (Linux >= 6.7); "
                "or set TOOLQ_SANDBOX=none to run commands unconfined")
#: Landlock ABI that can deny TCP (the broker must be unreachable).
LANDLOCK_NET_ABI = 4


class SandboxUnavailable(Exception):
    """The configured sandbox cannot run here; shell tools refuse to run."""


class SandboxRefused(SandboxUnavailable):
    """This command's sandbox was tampered with while it was set up: the command did not run."""


class Launch:
    """One command's spawn: `spawn` it, `kill` what is left after the group kill, `close` at the end."""

    def __init__(self, argv: list[str], env: dict[str, str], preexec_fn: Callable[[], None] | None,
                 call_limits: limits.CallLimits | None = None, tmpdir: str | None = None,
                 reap: bool = False, ruleset: landlock.Ruleset | None = None,
                 confine_thread: Callable[[], int] | None = None) -> None:
        self.argv, self.env, self.preexec_fn = argv, env, preexec_fn
        self.call_limits, self.tmpdir, self.reap, self.ruleset = call_limits, tmpdir, reap, ruleset
        self.confine_thread = confine_thread
        self.process_limit_hit = self.memory_limit_hit = False
        #: Landlock with a pre-exec function: the child sends its metadata listener through this.
        self.listener_channel: tuple[socket.socket, socket.socket] | None = None

    def spawn(self, **popen: Any) -> subprocess.Popen:
        """Popen the command. With `confine_thread`, from a new thread that confines itself first:
        Landlock, no_new_privs and the capability bounding set are per thread and inherited by
        the child, so the spawn needs no pre-exec function and Python can use vfork.
        `ctty=True` (with start_new_session, stdin the command's own pty): the pty becomes the
        command's controlling terminal (`take_ctty`), so ^C written to it interrupts it."""
        preexec_fn = self.preexec_fn
        if popen.pop("ctty", False):
            preexec_fn = _then_take_ctty(preexec_fn)
        if self.confine_thread is None:
            proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=preexec_fn, **popen)
            if self.listener_channel is not None:
                self._watch(_received_fd(self.listener_channel[0]))
            return proc
        spawned: dict[str, Any] = {}

        def confined() -> None:
            try:
                listener = self.confine_thread()  # type: ignore[misc]
                try:
                    spawned["proc"] = subprocess.Popen(self.argv, env=self.env, preexec_fn=preexec_fn, **popen)
                except BaseException:
                    os.close(listener)
                    raise
                spawned["listener"] = listener
            except BaseException as e:  # handed to the caller
                spawned["error"] = e

        thread = threading.Thread(target=confined, name="toolq-confined-spawn")
        try:
            thread.start()
        except RuntimeError:  # the spawning thread's cgroup is full (the worker's bound on processes)
            raise OSError(errno.EAGAIN, "no thread could be started to spawn the command") from None
        thread.join()
        if "error" in spawned:
            raise spawned["error"]
        self._watch(spawned["listener"])
        return spawned["proc"]

    def _watch(self, listener: int | None) -> None:
        """Landlock: the command's metadata calls wait on `listener` until served (`metadata.py`)."""
        if listener is None:
            return
        assert self.ruleset is not None
        metadata.watch(listener, self.ruleset.writable)

    def kill(self, spare: frozenset[int]) -> None:
        """Kill what left the process group: the cgroup's members, the worker's adopted orphans."""
        if self.call_limits is not None:
            self.call_limits.kill_all()
        if self.reap:
            reaper.sweep(spare)

    def close(self) -> None:
        if self.ruleset is not None:
            self.ruleset.close()
        for end in self.listener_channel or ():
            end.close()
        if self.call_limits is not None:
            self.process_limit_hit = self.call_limits.close()
            self.memory_limit_hit = self.call_limits.memory_limit_hit
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


@contextlib.contextmanager
def _refusal() -> Iterator[None]:
    """bwrap's gate refused the sandbox (its `.git` was swapped): the tool's SandboxRefused."""
    try:
        yield
    except bwrap.GateRefused as e:
        raise SandboxRefused(str(e)) from None


def take_ctty() -> None:
    """In the child, after its setsid: stdin (the command's own pty, made for it alone by the
    session host) becomes its controlling terminal and its group the foreground one, as a
    terminal emulator does, so the line discipline sends SIGINT for ^C. TIOCSTI on it reaches only
    what reads that pty: the command itself. ^C and ^\\ get their default action back (the session
    host ignores SIGINT, and an ignored signal stays ignored across exec)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _then_take_ctty(preexec_fn: Callable[[], None] | None) -> Callable[[], None]:
    def both() -> None:
        take_ctty()  # before a Landlock confinement, which may limit ioctls
        if preexec_fn is not None:
            preexec_fn()
    return both


class GatedLaunch(Launch):
    """A bubblewrap spawn through its start gate (`bwrap.Gate`): the rlimits are set on the held
    sandbox and `.git` checked before the command runs, with no process in between."""

    def __init__(self, build: Callable[[bwrap.Gate | None], list[str]], env: dict[str, str],
                 call_limits: limits.CallLimits) -> None:
        super().__init__([], env, None, call_limits)  # the command line needs the gate's fds
        self.build = build

    def spawn(self, **popen: Any) -> subprocess.Popen:
        assert self.call_limits is not None
        build = self.build
        if popen.pop("ctty", False):
            # The command keeps bwrap's session, whose terminal is its own pty (`take_ctty`): bwrap's
            # --new-session guards a terminal shared with others, and would leave ^C no group to signal.
            def build(gate: bwrap.Gate | None) -> list[str]:
                args = self.build(gate)
                args.remove("--new-session")  # bwrap's own, the first (the command's words come after)
                return args
            popen["preexec_fn"] = take_ctty
        with _refusal():
            return bwrap.spawn(build, self.call_limits.apply_to, env=self.env, **popen)


class CellLaunch(Launch):
    """A command forked in the spawning slot thread's bubblewrap cell (`cell.py`): the cell's root
    was built and checked once; the command's own namespaces end with it, so nothing is left in
    the slot's cgroup to kill but the cell, which stays."""

    def __init__(self, bwrap_path: str, policy: Policy, workspace: str, cwd: str, argv: list[str],
                 env: dict[str, str], call_limits: limits.CallLimits) -> None:
        super().__init__(argv, env, None, call_limits)
        self.bwrap_path, self.policy, self.workspace, self.cwd = bwrap_path, policy, workspace, cwd

    def spawn(self, **popen: Any) -> Any:
        assert self.call_limits is not None
        with _refusal():
            return cell.spawn(self.bwrap_path, self.policy, self.workspace, self.argv, self.env, self.cwd,
                              self.call_limits.apply_to, **popen)

    def kill(self, spare: frozenset[int]) -> None:
        pass  # the command's pid namespace died with its pid 1; the cell must live on

    def close(self) -> None:
        if self.call_limits is not None:
            self.process_limit_hit = self.call_limits.close(kill=False)
            self.memory_limit_hit = self.call_limits.memory_limit_hit


@dataclass
class Sandbox:
    backend: Backend
    policy: Policy
    detail: str
    bwrap_path: str | None = None
    landlock_abi: int = 0
    unavailable: str | None = None
    """Why no command may run (the configured sandbox does not work here)."""

    def describe(self) -> str:
        if self.unavailable:
            return f"sandbox: NONE WORKS ({self.unavailable}): shell tools refuse to run"
        if self.backend == "none":
            return "sandbox: none (TOOLQ_SANDBOX=none): commands run UNCONFINED with this worker's rights"
        lim = self.policy.limits
        cells = ", a cell per workspace and slot" if self.backend == "bwrap" and self.policy.cells else ""
        return (f"sandbox: {self.detail}{cells} (network {self.policy.network}; per call: memory {lim.memory_mb} MiB "
                f"[{limits.memory_limit_mode()}], "
                f"{lim.processes} processes [{limits.process_limit_mode()}], CPU {lim.cpu_seconds} s, "
                f"files {lim.file_mb} MiB)")

    def launch(self, argv: list[str], *, workspace: str, cwd: str, env: dict[str, str],
               in_slot: bool = False) -> Launch:
        """Raises SandboxUnavailable, or FileNotFoundError for a program that is not there. `in_slot`:
        spawned from a session-host slot's thread, where bubblewrap keeps a cell per workspace."""
        if self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        if self.backend == "none":
            command_env = self.policy.command_env(env, home="/", confined=False)
            _require_program(argv[0], command_env)
            return Launch(argv, command_env, None)
        call_limits = limits.CallLimits(self.policy.limits)
        if self.backend == "bwrap":
            command_env = self.policy.command_env(env, home=bwrap.SANDBOX_TMP)
            _require_program(argv[0], command_env, self._shows(workspace))
            path, ws = self.bwrap_path or "bwrap", os.path.abspath(workspace)
            if in_slot and self.policy.cells:
                return CellLaunch(path, self.policy, ws, cwd, argv, command_env, call_limits)
            return GatedLaunch(  # the prefix: the worker's bound on the user namespace's processes (limits.py)
                lambda gate: [*limits.uid_ceiling_prefix(), *bwrap.argv(path, self.policy, ws, cwd, argv, gate)],
                command_env, call_limits)
        prefix = call_limits.prlimit_prefix()  # None: the limits are set by a pre-exec function
        tmpdir = tempfile.mkdtemp(prefix="toolq-call-")
        command_env = self.policy.command_env(env, home=tmpdir)
        try:
            _require_program(argv[0], command_env, self._shows(workspace))
            readable = [*self.policy.read_dirs, *self.policy.etc, "/proc", "/sys"]
            ruleset = landlock.Ruleset(self.landlock_abi, read=readable,
                                       write=[workspace, tmpdir], deny_tcp=self.policy.network == "none",
                                       hidden=self.policy.hidden)
        except BaseException:
            shutil.rmtree(tmpdir, ignore_errors=True)
            call_limits.close()
            raise

        reap = reaper.is_subreaper()
        if prefix:
            return Launch(prefix + argv, command_env, None, call_limits, tmpdir, reap=reap, ruleset=ruleset,
                          confine_thread=ruleset.restrict_self)

        ours, theirs = socket.socketpair()

        def confine() -> None:
            call_limits.apply_in_child()
            die_with_parent(signal.SIGKILL)
            socket.send_fds(theirs, [b"L"], [ruleset.restrict_self()])  # the listener, to the worker

        launch = Launch(argv, command_env, confine, call_limits, tmpdir, reap=reap, ruleset=ruleset)
        launch.listener_channel = ours, theirs
        return launch

    def _shows(self, workspace: str) -> Callable[[str], bool]:
        """Whether a command of this sandbox sees `path` (its workspace, the read directories less
        what is hidden, /etc's allowlist)."""
        inside = _prefixes((os.path.abspath(workspace), *self.policy.etc))
        hidden = _prefixes(self.policy.hidden)
        return lambda path: (inside(path) or self.policy.readable(path)) and not hidden(path)

    def explain(self, launch: Launch, exit_code: int, output: str) -> str | None:
        if self.backend == "none":
            return None
        return limits.explain(self.policy.limits, exit_code, output, launch.process_limit_hit,
                              launch.memory_limit_hit)


def _received_fd(channel: socket.socket) -> int:
    """The listener a Landlock child sent before its exec (it had, or Popen would have raised)."""
    channel.settimeout(5)
    _, fds, _, _ = socket.recv_fds(channel, 1, 1)
    if not fds:
        raise OSError(errno.EPROTO, "the sandboxed command sent no metadata listener")
    return fds[0]


def _require_program(program: str, env: dict[str, str], visible: Callable[[str], bool] | None = None) -> None:
    """A missing shell is a spawn failure here, as without a sandbox (bwrap would exit 1 instead).
    `visible`: whether the sandbox shows a path; a program it does not show is missing whatever
    the host holds there (the model's `shell` must not tell which host files exist)."""
    found = shutil.which(program, path=env.get("PATH"))
    if found is None or (visible is not None and "/" in program and not visible(os.path.abspath(found))):
        raise FileNotFoundError(2, os.strerror(2), program)


def choose(policy: Policy) -> Sandbox:
    """Probe what works here, once: auto takes bubblewrap, else Landlock, else none works."""
    wanted = policy.requested
    if wanted == "none":
        return Sandbox("none", policy, "none")
    reasons = []
    if wanted in ("auto", "bwrap"):
        why = bwrap.probe(policy)
        path = bwrap.executable()
        if why is None and path:
            return Sandbox("bwrap", policy, f"bwrap {bwrap.version(path)}", bwrap_path=path)
        reasons.append(why or "bwrap is not installed")
    if wanted in ("auto", "landlock"):
        abi = landlock.abi_version()
        if abi == 0:
            reasons.append("the kernel has no Landlock")
        elif policy.network == "none" and abi < LANDLOCK_NET_ABI:
            reasons.append(f"Landlock ABI {abi} cannot deny TCP (needs {LANDLOCK_NET_ABI})")
        else:
            return Sandbox("landlock", policy, f"landlock ABI {abi}", landlock_abi=abi)
    backend: Backend = "bwrap" if wanted == "bwrap" else "landlock"
    hint = INSTALL_HINT if wanted == "auto" else f"TOOLQ_SANDBOX={wanted} does not work here"
    return Sandbox(backend, policy, "none", unavailable=f"{'; '.join(reasons)}: {hint}")


_current: Sandbox | None = None


def current(settings: Settings | None = None) -> Sandbox:
    """This process's sandbox (chosen on first use; a forked pool child inherits its parent's)."""
    global _current
    if _current is None:
        try:
            policy = Policy.from_settings(settings or Settings.load())
        except ConfigurationError as e:
            return Sandbox("none", Policy.from_settings(Settings()), "none", unavailable=str(e))
        _current = choose(policy)
    return _current


def reset() -> None:
    """Forget the choice (tests that change the settings)."""
    global _current
    _current = None


def worker_started(shell_tools: list[str]) -> str:
    """At `toolq worker` start: choose (and probe) the sandbox; the banner line. Raises
    ConfigurationError when no sandbox works and the catalog has shell tools."""
    sandbox = current()
    if sandbox.unavailable and shell_tools:
        raise ConfigurationError(f"{', '.join(shell_tools)}: {sandbox.unavailable}")
    return sandbox.describe()


def worker_stopped() -> None:
    """At the worker's shutdown, once its pool children are gone: remove their cgroups."""
    limits.remove_stale_pool_cgroups()


def pool_child_started() -> None:
    """In each pool child: enter its pids cgroup (where it may); without a pid namespace, it also
    adopts its calls' orphans."""
    sandbox = current()
    if sandbox.unavailable or sandbox.backend == "none":
        return
    limits.enter_pool_cgroup(sandbox.policy.limits)
    if sandbox.backend == "landlock":
        reaper.become_subreaper()


def _prefixes(roots: tuple[str, ...]) -> Callable[[str], bool]:
    return lambda path: any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)
