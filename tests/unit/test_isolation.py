"""toolq.workers.isolation: the policy, the bubblewrap command line, limits' texts, the choice of
a backend, the subreaper, and a worker that refuses to start without a sandbox."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests import markers
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings
from toolq.workers import isolation
from toolq.workers.isolation import bwrap, choose, landlock, limits, spawner
from toolq.workers.isolation import policy as policy_module
from toolq.workers.isolation.policy import Limits, Policy
from toolq.workers.processes import run_command

SECRET_ENV = {"REDIS_URL": "redis://:pw@h/0", "CELERY_BROKER_URL": "redis://:pw@h/0", "OPENAI_API_KEY": "sk-x",
              "FLOWER_PASSWORD": "f", "TOOLQ_SIGNING_KEY": "k", "AWS_SECRET_ACCESS_KEY": "a"}


def policy(**settings) -> Policy:
    return Policy.from_settings(Settings(**settings))


def test_the_environment_is_an_allowlist_without_the_fleets_secrets():
    source = {**SECRET_ENV, "PATH": "/usr/bin:/root/.local/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
              "HOME": "/root", "MY_TOOL_CONFIG": "1"}
    env = policy(sandbox_env=["MY_TOOL_CONFIG"]).command_env(source, home="/tmp")
    assert not set(SECRET_ENV) & set(env)
    assert env["LANG"] == "C.UTF-8" and env["LC_ALL"] == "C" and env["MY_TOOL_CONFIG"] == "1"
    assert (env["TERM"], env["PAGER"], env["GIT_PAGER"], env["NO_COLOR"]) == ("dumb", "cat", "cat", "1")
    assert env["HOME"] == env["TMPDIR"] == "/tmp"  # the worker's home is not visible in the sandbox
    assert env["PATH"] == "/usr/bin"  # a directory the command cannot read is no use on its PATH


def test_unconfined_commands_keep_home_and_path_but_not_the_secrets():
    env = policy(sandbox="none").command_env({**SECRET_ENV, "PATH": "/x:/usr/bin", "HOME": "/root"}, home="/",
                                             confined=False)
    assert (env["PATH"], env["HOME"]) == ("/x:/usr/bin", "/root") and not set(SECRET_ENV) & set(env)


@pytest.mark.parametrize("name", ["REDIS_URL", "OPENAI_API_KEY", "FLOWER_PASSWORD", "TOOLQ_SIGNING_KEY"])
def test_the_operator_cannot_hand_a_fleet_credential_to_commands(name):
    with pytest.raises(ConfigurationError, match=f"invalid setting sandbox_env .*{name}"):
        policy(sandbox_env=[name])


def test_sandbox_settings_come_from_the_environment_with_clear_errors():
    s = Settings.load({"TOOLQ_SANDBOX": "landlock", "TOOLQ_SANDBOX_ENV": "A, B", "TOOLQ_SANDBOX_PROCESSES": "99"})
    assert (s.sandbox, s.sandbox_env, s.sandbox_processes) == ("landlock", ["A", "B"], 99)
    with pytest.raises(ConfigurationError, match=r"^invalid setting sandbox \(TOOLQ_SANDBOX\)"):
        Settings.load({"TOOLQ_SANDBOX": "chroot"})


def test_bwrap_command_line_isolates_everything_and_protects_git(tmp_path):
    (tmp_path / ".git").mkdir()
    args = bwrap.argv("bwrap", policy(), str(tmp_path), str(tmp_path), ["bash", "-c", "true"])
    assert args[:6] == ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    assert "--share-net" not in args
    ws, git = args.index("--bind"), args.index(str(tmp_path / ".git")) - 1
    assert args[ws:ws + 3] == ["--bind", str(tmp_path), str(tmp_path)]
    assert args[git:git + 3] == ["--ro-bind", str(tmp_path / ".git"), str(tmp_path / ".git")] and git > ws
    # /etc by its allowlist: the passwords, host keys and sudoers are not there at all (issue 24).
    assert "/etc" not in [args[i + 1] for i, a in enumerate(args) if a.startswith("--ro-bind")]
    assert "/etc/passwd" in args and not any(a.startswith(("/etc/shadow", "/etc/ssh", "/etc/sudoers")) for a in args)
    command = args[args.index("--") + 1:]  # .git is checked in the sandbox before the command runs
    assert command[:3] == ["/bin/sh", "-c", bwrap.GIT_CHECK] and command[-3:] == ["bash", "-c", "true"]
    assert "/root" not in args and os.path.expanduser("~") not in args
    assert "--share-net" in bwrap.argv("bwrap", policy(sandbox_network="host"), "/w", "/w", ["true"])


def test_a_symlinked_git_dir_is_hidden_not_followed(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".git").symlink_to(tmp_path / "elsewhere")
    args = bwrap.argv("bwrap", policy(), str(tmp_path), str(tmp_path), ["true"])
    assert str(tmp_path / ".git") not in args  # inside, it resolves within the sandbox only
    assert args[-2:] == ["--", "true"]


@pytest.mark.skipif(bwrap.executable() is None, reason="bubblewrap is not installed")
def test_a_command_does_not_run_when_git_is_not_the_workspaces_own(tmp_path):
    """What a parallel call's swap of .git for a symlink makes bwrap bind: another directory."""
    (tmp_path / ".git").mkdir()
    args = bwrap.argv(bwrap.executable(), policy(), str(tmp_path), str(tmp_path), ["sh", "-c", "echo RAN"])
    run = functools.partial(subprocess.run, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert run(args).stdout == "RAN\n"  # the control
    expected = args.index(bwrap.GIT_CHECK) + 3
    args[expected] = args[expected].rpartition("/")[0]  # the workspace's parent bound as .git
    refused = run(args)
    assert refused.returncode == 125 and "RAN" not in refused.stdout
    assert ".git changed while the sandbox was set up" in refused.stderr


needs_bwrap = pytest.mark.skipif(bwrap.executable() is None or choose(policy(sandbox="bwrap")).unavailable is not None,
                                 reason="bubblewrap cannot run here")


def gated_argv(tmp_path) -> list[str]:
    gate = bwrap.Gate()
    try:
        return bwrap.argv("bwrap", policy(), str(tmp_path), str(tmp_path), ["bash", "-c", "true"], gate)
    finally:
        gate.close()


def test_through_the_gate_nothing_runs_before_the_command(tmp_path):
    """The gate sets the limits and checks .git from outside: no prlimit, no checking shell."""
    (tmp_path / ".git").mkdir()
    args = gated_argv(tmp_path)
    assert "--info-fd" in args and "--block-fd" in args
    assert args[args.index("--") + 1:] == ["bash", "-c", "true"]
    git = args.index(str(tmp_path / ".git")) - 1
    assert args[git:git + 3] == ["--ro-bind", str(tmp_path / ".git"), str(tmp_path / ".git")]
    assert args[git + 3] == "--file" and args[git + 5] == "/dev/null"  # after the bind: its done sign


def test_a_read_dir_under_the_workspace_is_left_to_the_workspaces_bind(tmp_path):
    inner = tmp_path / "venv"
    inner.mkdir()
    args = bwrap.argv("bwrap", policy(sandbox_read=[str(inner)]), str(tmp_path), str(tmp_path), ["true"])
    assert str(inner) not in args
    assert str(inner) in bwrap.argv("bwrap", policy(sandbox_read=[str(inner)]), "/w", "/w", ["true"])


def sandbox_root(tmp_path, stage: str):
    """A tree shaped like what /proc/<pid>/root shows at each stage of bwrap's set-up."""
    root = tmp_path / stage
    if stage == "staging":  # bwrap's own tmpfs: only the new root being built and the old one
        (root / "newroot" / "w" / "ws" / ".git").mkdir(parents=True)
        (root / "oldroot").mkdir()
    else:
        (root / "w" / "ws" / ".git").mkdir(parents=True)
    return root


def own_git(root) -> bwrap.GitMount:
    """What the gate expects: the final root's workspace and .git (the host's, when bound)."""
    ws = root / "w" / "ws"
    return bwrap.GitMount("/w/ws/.git", "/w/ws", bwrap._identity(str(ws / ".git")), bwrap._identity(str(ws)),
                          bwrap._identity("/", follow=True))


def test_the_gate_judges_git_only_in_the_final_root(tmp_path):
    final = sandbox_root(tmp_path, "final")
    expected = own_git(final)
    assert expected.judge(str(sandbox_root(tmp_path, "staging"))) is None
    assert expected.judge(str(tmp_path / "gone")) is None  # the sandbox ended: its caller asks bwrap
    # the race the other way: the .git bind landed on the workspace's parent, .git is no mount
    assert expected.judge(str(final)) is False
    (final / "w" / "ws" / ".git").rmdir()  # nothing there at all
    assert expected.judge(str(final)) is False


@pytest.mark.skipif(os.geteuid() != 0, reason="binds .git as bwrap does")
def test_the_gate_takes_only_the_workspaces_own_git_bound_at_git(tmp_path):
    final = sandbox_root(tmp_path, "final")
    git = final / "w" / "ws" / ".git"
    expected = own_git(final)
    subprocess.run(["mount", "--bind", str(git), str(git)], check=True)
    try:
        # the race at the remount: bwrap made another mount read-only (a symlink swapped in for
        # the realpath it takes after the bind), .git stayed writable
        assert expected.judge(str(final)) is False
        subprocess.run(["mount", "-o", "remount,bind,ro", str(git)], check=True)
        assert expected.judge(str(final)) is True
        # the race: bwrap bound the workspace's parent (a symlink to ..) as .git
        raced = bwrap.GitMount(expected.path, expected.workspace, bwrap._identity(str(final / "w")),
                               expected.workspace_id, expected.host_root)
        assert raced.judge(str(final)) is False
    finally:
        subprocess.run(["umount", str(git)], check=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="binds .git as bwrap does")
def test_the_inside_check_takes_only_a_read_only_git(tmp_path):
    """The inside check's side of the remount race: the workspace's own .git, bound writable."""
    git = tmp_path / ".git"
    git.mkdir()
    mount = bwrap._git_mount(str(git))
    assert mount is not None
    bind = 'mount --bind "$1" "$1" && { [ "$2" = rw ] || mount -o remount,bind,ro "$1"; } && shift 2 && exec "$@"'
    for mode, expected in (("rw", 125), ("ro", 0)):
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "/bin/sh", "-c", bind, "bind", str(git), mode,
                            "/bin/sh", "-c", bwrap.GIT_CHECK, "toolq-sandbox", bwrap._escape(str(git)), mount[0], "true"],
                           capture_output=True, text=True)
        assert r.returncode == expected, (mode, r.stderr)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes .git a mount point")
def test_a_git_that_is_a_mount_point_here_is_checked_from_inside(tmp_path):
    """The workspace's recursive bind would carry that mount to .git, writable, whatever the .git bind did."""
    (tmp_path / ".git").mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / ".git"), str(tmp_path / ".git")], check=True)
    try:
        args = gated_argv(tmp_path)
    finally:
        subprocess.run(["umount", str(tmp_path / ".git")], check=True)
    assert "--file" not in args and args[args.index("--") + 1:][:3] == ["/bin/sh", "-c", bwrap.GIT_CHECK]
    assert "--file" in gated_argv(tmp_path)  # the control


def test_before_bwraps_first_pivot_the_hosts_own_git_is_not_taken_for_the_sandboxs(tmp_path):
    """Until bwrap pivots, /proc/<pid>/root is the host's root, where .git is the workspace's own."""
    (tmp_path / ".git").mkdir()
    host = bwrap.GitMount(str(tmp_path / ".git"), str(tmp_path), bwrap._identity(str(tmp_path / ".git")),
                          bwrap._identity(str(tmp_path)), bwrap._identity("/", follow=True))
    assert host.judge("/") is None


def test_bwrap_reports_its_sandboxs_pid_before_its_json_ends():
    """bwrap 0.8 writes --info-fd a member at a time: the gate goes on at the first."""
    r, w = os.pipe()
    try:
        os.write(w, b'{\n    "child-pid": 4242')
        os.write(w, b',\n    "cgroup-namespace": 4026531835')  # the number above is complete now
        assert bwrap._read_child_pid(r) == 4242
    finally:
        os.close(r)
        os.close(w)


def test_the_gate_reads_bwraps_json_to_its_end_before_the_release():
    """bwrap may still be writing it (with no .git to wait for): a pipe closed under it is a SIGPIPE."""
    gate = bwrap.Gate()
    try:
        os.write(gate.info_w, b'{\n    "child-pid": 4242,\n    "cgroup-namespace": 1')
        os.write(gate.info_w, b',\n    "uts-namespace": 2\n}\n')
        os.close(gate.info_w)  # bwrap's end, closed after its last member
        gate.info_w = -1
        gate.release(lambda pid: None, alive=lambda: True)
        assert gate.child == 4242 and os.read(gate.block_r, 1) == b"1"
        assert os.read(gate.info_r, 100) == b""  # nothing left for a close to cut off
    finally:
        gate.close()


def test_bwrap_info_without_a_pid_is_an_error_and_none_means_bwrap_ended():
    for data, outcome in ((b'{"error": "x"}', OSError), (b"", None)):
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        try:
            if outcome is None:
                assert bwrap._read_child_pid(r) is None
            else:
                with pytest.raises(OSError, match="--info-fd said"):
                    bwrap._read_child_pid(r)
        finally:
            os.close(r)


def test_masks_only_what_the_command_could_read(tmp_path, monkeypatch):
    """A bind costs bwrap a read of its whole mount table: a file this uid cannot read needs none."""
    readable, unreadable, secrets_dir = tmp_path / "shadow", tmp_path / "gshadow", tmp_path / "ssh"
    readable.write_text("x")
    unreadable.write_text("x")
    secrets_dir.mkdir()
    hidden = (str(readable), str(unreadable), str(secrets_dir), str(tmp_path / "absent"))
    real_access = os.access
    monkeypatch.setattr(bwrap.os, "access", lambda p, mode: p != str(unreadable) and real_access(p, mode))
    assert bwrap._masks(hidden) == ["--ro-bind", "/dev/null", str(readable), "--tmpfs", str(secrets_dir)]


def test_what_other_users_may_not_read_beneath_the_site_folders_is_hidden(tmp_path):
    """Issue 24: a root worker's command owns root's private files under /opt and /usr/local."""
    (tmp_path / "app" / "conf").mkdir(parents=True)
    (tmp_path / "app" / "conf" / "tls.key").write_text("k")
    (tmp_path / "app" / "conf" / "tls.key").chmod(0o600)
    (tmp_path / "app" / "conf" / "public.pem").write_text("p")
    (tmp_path / "vault").mkdir(mode=0o700)
    (tmp_path / "vault" / "open").write_text("o")
    (tmp_path / "link").symlink_to("/etc/shadow")
    found = policy_module.private_entries((str(tmp_path),))
    assert sorted(found) == [str(tmp_path / "app" / "conf" / "tls.key"), str(tmp_path / "vault")]


@needs_bwrap
def test_the_gate_holds_the_command_until_its_limits_are_set(tmp_path):
    (tmp_path / ".git").mkdir()
    sandbox = choose(policy(sandbox="bwrap", sandbox_cpu_seconds=7, sandbox_file_mb=3))
    r = run_command("ulimit -t; ulimit -f; ulimit -c; touch .git/x 2>/dev/null || echo RO", cwd=tmp_path,
                    sandbox=sandbox, env={"PATH": "/usr/bin:/bin"})
    assert r.output.decode().split() == ["7", str(3 * 1024), "0", "RO"], r.output
    assert not (tmp_path / ".git" / "x").exists()


@needs_bwrap
def test_a_command_does_not_run_when_the_gate_finds_git_is_not_the_workspaces_own(tmp_path, monkeypatch):
    """What a parallel call's swap of .git for a symlink makes bwrap bind: another directory. The
    gate kills the held sandbox; the tool says why."""
    (tmp_path / ".git").mkdir()
    sandbox = choose(policy(sandbox="bwrap"))  # its probe checks a .git too
    real = bwrap._identity

    def parents(path: str, found=None, follow=False):
        if path == str(tmp_path / ".git") and found is not None:  # what the command line expects
            return real(str(tmp_path.parent))  # the workspace's parent, as the race binds it
        return real(path, found, follow)

    monkeypatch.setattr(bwrap, "_identity", parents)
    with pytest.raises(isolation.SandboxRefused, match=".git changed while the sandbox was set up"):
        run_command("touch ran", cwd=tmp_path, sandbox=sandbox, env={"PATH": "/usr/bin:/bin"})
    assert not (tmp_path / "ran").exists()
    monkeypatch.setattr(bwrap, "_identity", real)  # the control
    assert run_command("touch ran", cwd=tmp_path, sandbox=sandbox, env={"PATH": "/usr/bin:/bin"}).exit_code == 0
    assert (tmp_path / "ran").exists()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs CAP_SYS_ADMIN")
def test_a_spawning_threads_own_mounts_hide_sys_and_mask_secrets_once(tmp_path):
    """What bwrap copies from the spawning thread shrinks; the sandbox sees the same, the host too."""
    seen = {}

    def spawning_thread(read: list[str]) -> None:
        assert spawner.prepare_spawning_thread(policy(sandbox_read=read), ("/etc/shadow",))
        seen["sys"] = os.path.ismount("/sys")
        sandbox = choose(policy(sandbox="bwrap"))
        seen["argv"] = bwrap.argv("bwrap", sandbox.policy, str(tmp_path), str(tmp_path), ["true"])
        r = run_command("touch ran; cat /etc/shadow; ls /sys", cwd=tmp_path, sandbox=sandbox,
                        env={"PATH": "/usr/bin:/bin"})
        seen["exit"], seen["output"] = r.exit_code, r.output.decode()

    for read in ([], ["/sys/kernel"]):  # a policy that reads under /sys keeps it
        thread = threading.Thread(target=spawning_thread, args=(read,))
        thread.start()
        thread.join()
        assert seen["sys"] is bool(read)
        assert seen["exit"] != 0 and (tmp_path / "ran").exists()  # the sandbox never had /sys either way
        (tmp_path / "ran").unlink()
        if os.path.isfile("/etc/shadow"):  # masked in the thread, so not by bwrap, and still masked
            assert "/etc/shadow" not in seen["argv"] and "root:" not in seen["output"], seen
            assert os.stat("/etc/shadow").st_rdev != os.stat("/dev/null").st_rdev
        assert os.path.ismount("/sys")  # the rest of the process keeps its mounts


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs CAP_SYS_ADMIN")
def test_a_secret_replaced_on_the_host_since_the_thread_masked_it_stays_masked(tmp_path, monkeypatch):
    """A rename over a mount point in another namespace detaches that mount there (`passwd`
    rewrites /etc/shadow so): the thread's mask is gone, and bwrap's own mask must take over."""
    secret, ws = tmp_path / "secret", tmp_path / "ws"
    secret.write_text("before\n")
    ws.mkdir()
    ready, replaced, seen, masked_here = threading.Event(), threading.Event(), [], []

    def spawning_thread() -> None:
        hiding = dataclasses.replace(policy(sandbox="bwrap", sandbox_read=[str(tmp_path)]), hidden=(str(secret),))
        sandbox = choose(hiding)
        assert spawner.prepare_spawning_thread(sandbox.policy, sandbox.policy.hidden)
        for event in (ready, replaced):
            masked_here.append(os.path.exists(secret) and os.stat(secret).st_rdev == os.stat("/dev/null").st_rdev)
            seen.append(run_command(f"cat {secret}", cwd=ws, sandbox=sandbox, env={"PATH": "/usr/bin:/bin"}).output)
            event.set()
            replaced.wait(10)

    thread = threading.Thread(target=spawning_thread)
    thread.start()
    ready.wait(10)
    (tmp_path / "secret.new").write_text("after\n")
    os.rename(tmp_path / "secret.new", secret)
    replaced.set()
    thread.join()
    assert masked_here == [True, False]  # the thread's mask, then none: bwrap masks it
    assert len(seen) == 2 and not [o for o in seen if b"before" in o or b"after" in o], seen


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs CAP_SYS_ADMIN")
@pytest.mark.parametrize("inside", [False, True], ids=["at-the-mount", "made-inside-it-since"])
def test_a_spawning_thread_sees_a_workspace_mounted_after_it_prepared(tmp_path, inside):
    """Where the host's mounts do not propagate, the thread's copy is made again; also for a
    workspace that its copy has no such directory for (made on the new file system)."""
    mount = tmp_path / "volume"
    mount.mkdir()
    volume = mount / "ws" if inside else mount
    ready, mounted, seen = threading.Event(), threading.Event(), {}

    def spawning_thread() -> None:
        assert spawner.prepare_spawning_thread(policy(), ())
        ready.set()
        mounted.wait(10)
        r = run_command("cat marker", cwd=volume, sandbox=choose(policy(sandbox="bwrap")), env={"PATH": "/usr/bin:/bin"})
        seen["output"] = r.output

    thread = threading.Thread(target=spawning_thread)
    thread.start()
    ready.wait(10)
    subprocess.run(["mount", "--make-private", "-t", "tmpfs", "toolq-test", str(mount)], check=True)
    try:
        volume.mkdir(exist_ok=True)
        (volume / "marker").write_text("on the new file system\n")
        mounted.set()
        thread.join()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    assert seen["output"] == b"on the new file system\n"


@needs_bwrap
def test_a_gate_that_fails_kills_the_held_sandbox(tmp_path, monkeypatch):
    """Closing --block-fd without a release would let bwrap go on: the gate kills it first."""
    def refuse(self, pid):
        raise PermissionError(1, "Operation not permitted", "prlimit")

    monkeypatch.setattr(limits.CallLimits, "apply_to", refuse)
    r = run_command("touch ran", cwd=tmp_path, sandbox=choose(policy(sandbox="bwrap")), env={"PATH": "/usr/bin:/bin"})
    assert isinstance(r.spawn_error, PermissionError)
    time.sleep(0.2)
    assert not (tmp_path / "ran").exists()


@needs_bwrap
def test_a_sandbox_held_at_the_gate_never_runs_once_its_gatekeeper_is_gone(tmp_path):
    """The worker dying at the gate closes its end of --block-fd: bwrap must not read that as go."""
    gate = bwrap.Gate()
    args = bwrap.argv(bwrap.executable(), policy(), str(tmp_path), str(tmp_path), ["touch", "ran"], gate)
    proc = subprocess.Popen(args, pass_fds=gate.child_fds, start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    try:
        gate.opened()
        assert bwrap._read_child_pid(gate.info_r)
        os.close(gate.block_w)  # as if this process died here
        gate.block_w = -1
        time.sleep(1)
        assert proc.poll() is None and not (tmp_path / "ran").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        gate.close()


LIM = Limits(memory_mb=512, processes=32, cpu_seconds=7, file_mb=3)


@pytest.mark.parametrize("exit_code, output, hit, expected", [
    (128 + signal.SIGXCPU, "", False, "CPU time limit of 7 s"),
    (0, "bash: line 1: 12 CPU time limit exceeded python3", False, "CPU time limit of 7 s"),
    (128 + signal.SIGXFSZ, "", False, "file size limit of 3 MiB"),
    (1, "bash: fork: retry: Resource temporarily unavailable", False, "limit of 32 processes"),
    (0, "", True, "limit of 32 processes"),
    (1, "Traceback...\nMemoryError\n", False, "each process to 512 MiB"),
    (0, "MemoryError is a class", False, None),
    (3, "plain failure", False, None),
])
def test_a_command_that_hits_a_limit_is_told_which(exit_code, output, hit, expected):
    note = limits.explain(LIM, exit_code, output, hit)
    assert (note is None) if expected is None else (expected in note)


def test_none_is_chosen_only_when_asked_and_says_so():
    sandbox = choose(policy(sandbox="none"))
    assert sandbox.backend == "none" and sandbox.unavailable is None
    assert "UNCONFINED" in sandbox.describe()


def test_landlock_abi_is_read_from_the_kernel():
    abi = landlock.abi_version()
    assert isinstance(abi, int) and abi >= 0
    sandbox = choose(policy(sandbox="landlock"))
    assert (sandbox.unavailable is None) == (abi >= 4), sandbox.describe()


def test_a_worker_with_shell_tools_refuses_to_start_when_no_sandbox_works(tmp_path):
    env = {"PATH": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0", "TOOLQ_SANDBOX": "bwrap",
           "TOOLQ_SIGNING_KEY": "k" * 64,
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "toolq.cli.main", "worker"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("toolq worker: exec_command"), proc.stderr
    assert "bwrap is not installed" in lines[0] and "TOOLQ_SANDBOX=bwrap does not work here" in lines[0]


def test_the_subreaper_sweep_kills_what_left_the_process_group(tmp_path):
    # In a child process: a sweep kills every child of the process that runs it.
    marker = f"300.{markers.PROCESS}9"
    script = textwrap.dedent(f"""
        import subprocess, time
        from toolq.workers.isolation import reaper
        reaper.become_subreaper()
        subprocess.run(["bash", "-c", "setsid -f sleep {marker}; (sleep {marker} &)"], check=True)
        time.sleep(0.3)
        print(reaper.sweep())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2", out.stderr
    ps = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert ps.stdout == ""


@pytest.mark.parametrize("backend", ["bwrap", "landlock"])
def test_a_workspace_reached_through_a_symlink_is_writable_at_its_own_path(tmp_path, backend):
    sandbox = choose(policy(sandbox=backend))
    if sandbox.unavailable:
        pytest.skip(f"{backend} cannot run here: {sandbox.unavailable}")
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    # exec_command's workdir arrives resolved; the workspace as configured
    r = run_command("echo ok > f && cat f && cat ../sub/f", cwd=tmp_path / "real" / "sub", sandbox=sandbox,
                    workspace=tmp_path / "link", env=dict(os.environ))
    assert (r.exit_code, r.output) == (0, b"ok\nok\n"), r.output
    assert (tmp_path / "real" / "sub" / "f").read_text() == "ok\n"


def test_exec_command_refuses_with_the_reason_when_no_sandbox_works(tmp_path, monkeypatch):
    import json

    from tests.unit.tools import call
    from toolq.core.errors import RespondToModel
    from toolq.workers import isolation
    from toolq.workers.tools.exec_command import exec_command

    broken = isolation.Sandbox("bwrap", policy(), "none", unavailable="bwrap is not installed: install it")
    monkeypatch.setattr(isolation, "_current", broken)
    with pytest.raises(RespondToModel, match="^exec_command refused: bwrap is not installed: install it$"):
        call(exec_command, tmp_path, json.dumps({"cmd": "touch ran"}))
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("backend", ["bwrap", "landlock"])
@pytest.mark.parametrize("network", ["none", "host"])
def test_the_network_setting_decides_whether_a_host_port_is_reachable(tmp_path, backend, network):
    import socket

    sandbox = choose(policy(sandbox=backend, sandbox_network=network))
    if sandbox.unavailable:
        pytest.skip(f"{backend} cannot run here: {sandbox.unavailable}")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        r = run_command(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED", cwd=tmp_path, sandbox=sandbox,
                        env=dict(os.environ), timeout=20)
    assert (b"CONNECTED" in r.output) == (network == "host"), r.output


@needs_bwrap
def test_the_shell_argument_does_not_tell_which_host_files_exist(tmp_path):
    """Issue 24: `shell` named an absolute path, and the answer told whether an executable was
    there on the host, outside what the sandbox shows. Now a path the sandbox hides is missing."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    tool = outside / "secret-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    sandbox = choose(policy(sandbox="bwrap"))
    answers = []
    for program in (str(tool), str(outside / "absent")):
        with pytest.raises(FileNotFoundError) as refused:
            sandbox.launch([program, "-c", "true"], workspace=str(ws), cwd=str(ws), env={"PATH": "/usr/bin:/bin"})
        answers.append(str(refused.value).replace(program, "X"))
    assert answers[0] == answers[1]  # the same answer whether the file is there or not
    sandbox.launch(["/bin/sh", "-c", "true"], workspace=str(ws), cwd=str(ws), env={"PATH": "/usr/bin:/bin"}).close()
