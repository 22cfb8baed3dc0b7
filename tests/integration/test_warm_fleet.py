"""A warm local fleet (`toolq up` / `toolq down`, toolq/local/warm.py), as a user drives it: real
`toolq` processes with no REDIS_URL, a private runtime directory per test, the fake model over TCP.

A run with the same tools uses the warm stack (no server or workers of its own, the turn in the
warm stack's ledger); a run with other tools starts its own; `toolq down` stops it, and so does
its idle timeout; the entry that carries the fleet key is the user's own and private."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from toolq.core import keys
from toolq.core.settings import Settings
from toolq.dev.fake_model import FakeModel
from toolq.dev.fake_model.builders import function_call, message
from toolq.local.warm import settings_digest

pytestmark = pytest.mark.integration

PATIENCE = 90.0


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    the_env = {**base, "XDG_RUNTIME_DIR": str(runtime), "TOOLQ_WORKSPACE": str(workspace),
               "TOOLQ_TOOLS_PATH": os.environ["TOOLQ_TOOLS_PATH"]}
    yield the_env
    for path in entries(the_env):  # whatever a failed test left up, readable by toolq or not
        path.chmod(0o600)
    toolq("down", env=the_env)


def toolq(*args: str, env: dict[str, str], timeout: float = PATIENCE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def entries(env: dict[str, str]) -> list[Path]:
    return sorted((Path(env["XDG_RUNTIME_DIR"]) / "toolq").glob("stack-*.json"))


def warm_entry(env: dict[str, str]) -> dict:
    found = [json.loads(p.read_text()) for p in entries(env)]
    warm = [e for e in found if e.get("warm")]
    assert len(warm) == 1, found
    return warm[0]


def one_call_script() -> list:
    return [[function_call("exec_command", {"cmd": "echo warm"}, "call_w")], [message("done")]]


def run_turn(env: dict[str, str], fake: FakeModel, *extra: str) -> subprocess.CompletedProcess:
    out = toolq("run", "--json", *extra, "say hi",
                env={**env, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test"})
    assert out.returncode == 0, out.stderr
    return out


def turn_id_of(out: subprocess.CompletedProcess) -> str:
    return json.loads(out.stdout.splitlines()[0])["turn_id"]


def in_ledger(entry: dict, turn_id: str) -> bytes | None:
    """The turn's state in the warm stack's ledger, None if the turn never went there."""
    ledger = redis.Redis.from_url(entry["redis_url"])
    try:
        return ledger.hget(keys.turn(turn_id), "state")
    finally:
        ledger.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def wait_until(check, what: str) -> None:
    end = time.monotonic() + PATIENCE
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_run_uses_the_warm_fleet_for_its_tools_and_down_stops_it(env):
    up = toolq("up", env=env)
    assert up.returncode == 0 and "a warm fleet is up" in up.stdout, up.stderr
    entry = warm_entry(env)
    path = next(p for p in entries(env) if json.loads(p.read_text()).get("warm"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the fleet key and the server's password
    again = toolq("up", env=env)
    assert again.returncode == 0 and "already up" in again.stdout and len(entries(env)) == 1

    with FakeModel(one_call_script() * 2, loop=True) as fake:
        warm_run = run_turn(env, fake)
        assert "embedded workers starting" not in warm_run.stderr, "the run waited for a boot"
        assert in_ledger(entry, turn_id_of(warm_run)) == b"completed"  # the turn and its call went there
        output = [e for e in map(json.loads, warm_run.stdout.splitlines()) if e["type"] == "item.completed"]
        assert any("warm" in json.dumps(e) for e in output), warm_run.stdout

        down = toolq("down", env=env)
        assert down.returncode == 0 and f"stopped the warm fleet (pid {entry['pid']})" in down.stdout, down.stderr
        assert not alive(entry["pid"]) and entries(env) == []
        assert "no warm fleet" in toolq("down", env=env).stdout

        cold_run = run_turn(env, fake)  # nothing warm any more: the run starts its own, as before
        assert "embedded workers starting" in cold_run.stderr


def test_a_run_asking_for_other_tools_starts_its_own_stack(env):
    assert toolq("up", env=env).returncode == 0
    entry = warm_entry(env)
    with FakeModel(one_call_script(), loop=True) as fake:
        other = run_turn(env, fake, "--tools", "tests.integration.testtools")
    assert not in_ledger(entry, turn_id_of(other)), "a run with other tools used the warm fleet"


def test_a_warm_fleet_stops_by_itself_once_idle(env):
    up = toolq("up", "--idle", "1", env=env)
    assert up.returncode == 0, up.stderr
    pid = warm_entry(env)["pid"]
    wait_until(lambda: not alive(pid), "the idle warm fleet to stop")
    assert entries(env) == []


def test_sigterm_stops_a_warm_fleet_with_its_workers(env):
    assert toolq("up", env=env).returncode == 0
    pid = warm_entry(env)["pid"]
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert children, "the warm fleet runs its server and workers as children"
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not alive(pid) and not any(alive(c) for c in children), "the fleet and its children to stop")
    assert entries(env) == []


def test_a_warm_entry_another_user_could_read_is_not_used(env):
    assert toolq("up", env=env).returncode == 0
    path = entries(env)[0]
    path.chmod(0o644)  # as if planted or loosened: toolq never trusts a readable entry
    entry = json.loads(path.read_text())
    with FakeModel(one_call_script(), loop=True) as fake:
        run = run_turn(env, fake)
    path.chmod(0o600)
    assert not in_ledger(entry, turn_id_of(run)), "a run trusted a readable entry"


def test_a_run_with_other_sandbox_settings_starts_its_own_stack_rather_than_lose_them(env):
    """`toolq up` with the network open, then a run asking for none: the run's commands must not get
    the warm fleet's sandbox (found by helper-25: the settings were silently replaced)."""
    assert toolq("up", env={**env, "TOOLQ_SANDBOX_NETWORK": "host"}).returncode == 0
    entry = warm_entry(env)
    with FakeModel(one_call_script(), loop=True) as fake:
        run = run_turn({**env, "TOOLQ_SANDBOX_NETWORK": "none"}, fake)
    assert not in_ledger(entry, turn_id_of(run)), "the run's sandbox settings were replaced by the warm fleet's"
    assert "runs with other settings" in run.stderr


def test_a_warm_fleet_whose_server_dies_unannounces_itself_and_stops(env):
    """Its port, once free, could be bound by another local user: no run may be sent there."""
    assert toolq("up", env=env).returncode == 0
    entry = warm_entry(env)
    port = entry["redis_url"].rsplit(":", 1)[1].split("/")[0]
    server = next(int(p) for p in Path(f"/proc/{entry['pid']}/task/{entry['pid']}/children").read_text().split()
                  if f"127.0.0.1:{port}" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                  or port in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: entries(env) == [] and not alive(entry["pid"]), "the fleet to unannounce itself and stop")


def test_an_entry_that_names_another_process_is_never_trusted_nor_signalled(env, tmp_path):
    """Planted in the user's own runtime directory (by a command, were it in a workspace): pid 1 or
    any process of the user's, a fleet key, a server of the planter's."""
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        started = Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
        root = Path(env["XDG_RUNTIME_DIR"]) / "toolq"
        root.mkdir(mode=0o700, exist_ok=True)
        planted = root / "stack-planted.json"
        fd = os.open(planted, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, json.dumps({"pid": bystander.pid, "pid_started": started, "redis_url": "redis://127.0.0.1:9/0",
                                 "started_at": 0, "logdir": "/tmp", "warm": {
                                     "signing_key": "k" * 64, "tools": [],
                                     # the digest a run would accept: only the process check refuses it
                                     "settings_digest": settings_digest(Settings.load(env))}}).encode())
        os.close(fd)
        assert "no warm fleet" in toolq("down", env=env).stdout
        assert bystander.poll() is None, "toolq down signalled a process that is not a warm fleet"
        with FakeModel(one_call_script(), loop=True) as fake:
            run_turn(env, fake)  # completes on a stack of its own: the planted server is never reached
    finally:
        bystander.kill()
        bystander.wait()


def test_a_runtime_directory_inside_the_workspace_is_never_used_for_a_warm_fleet(env):
    """What a command writes must not be able to plant or read an entry the run then trusts."""
    inside = Path(env["TOOLQ_WORKSPACE"]) / "xdg"
    inside.mkdir(mode=0o700)
    at_home = {**env, "XDG_RUNTIME_DIR": str(inside)}
    assert toolq("up", env=at_home).returncode == 0
    try:
        entry = warm_entry(at_home)
        with FakeModel(one_call_script(), loop=True) as fake:
            run = run_turn(at_home, fake)
        assert not in_ledger(entry, turn_id_of(run))
    finally:
        toolq("down", env=at_home)


def test_a_run_with_its_own_turn_timeout_still_uses_the_warm_fleet(env):
    """Only what the workers read must match: a turn's timeout is the orchestrator's alone."""
    assert toolq("up", env=env).returncode == 0
    entry = warm_entry(env)
    with FakeModel(one_call_script(), loop=True) as fake:
        run = run_turn({**env, "TOOLQ_TURN_TIMEOUT": "123"}, fake)
    assert in_ledger(entry, turn_id_of(run)) == b"completed", run.stderr


# ---- the launcher (toolq/cli/launcher.py): runs fork from a process that imported toolq once ----

def launcher_children(env: dict[str, str]) -> list[int]:
    """The runs the warm fleet's launcher forked that are still running."""
    sock = Path(env["XDG_RUNTIME_DIR"]) / "toolq" / "launcher.sock"
    wait_until(sock.exists, "the launcher's socket")
    # The forked runs carry the launcher's command line too: the launcher is the one whose parent is not.
    same = {int(p.name): _ppid(p) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).endswith(
        f"-m toolq.cli.launcher {sock.parent}")}
    (launcher,) = [pid for pid, parent in same.items() if parent not in same]
    return [pid for pid, parent in same.items() if parent == launcher]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


HANGING = [[function_call("exec_command", {"cmd": "sleep 60.4242"}, "call_h")], [message("done")]]


def start_hanging_run(env: dict[str, str], fake: FakeModel) -> tuple[subprocess.Popen, int]:
    launcher_children(env)  # `toolq up` waited for the launcher: it listens
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "--json", "hang"],
                            env={**env, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: bool(launcher_children(env)), "the run forked by the launcher")
    (child,) = launcher_children(env)
    wait_until(lambda: any("sleep 60.4242" in _cmdline(p) for p in Path("/proc").iterdir() if p.name.isdigit()),
               "the command to start")
    return proc, child


def test_a_run_on_a_warm_fleet_is_forked_by_its_launcher_and_ctrl_c_reaches_it(env):
    """The run is the launcher's child (the caller imports nothing of toolq's), it writes to the
    caller's own stdout, and a SIGINT to the caller cancels the turn as it would the run itself."""
    assert toolq("up", env=env).returncode == 0
    sock = Path(env["XDG_RUNTIME_DIR"]) / "toolq" / "launcher.sock"
    wait_until(sock.exists, "the launcher's socket")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    entry = warm_entry(env)
    with FakeModel(HANGING) as fake:
        proc, child = start_hanging_run(env, fake)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 130, err
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0]["type"] == "turn.started" and events[-1]["type"] == "turn.aborted", out
    assert in_ledger(entry, events[0]["turn_id"]) == b"cancelled"
    wait_until(lambda: not alive(child), "the forked run to end")


def test_a_caller_killed_outright_takes_its_forked_run_with_it(env):
    assert toolq("up", env=env).returncode == 0
    with FakeModel(HANGING) as fake:
        proc, child = start_hanging_run(env, fake)
        proc.kill()
        proc.wait()
        wait_until(lambda: not alive(child), "the forked run to be killed with its caller")


def test_a_caller_with_another_import_path_runs_the_ordinary_way(env, tmp_path):
    """The launcher's child would import the launcher's modules, not the caller's: refused."""
    assert toolq("up", env=env).returncode == 0
    entry = warm_entry(env)
    (tmp_path / "lib").mkdir()
    other = {**env, "PYTHONPATH": str(tmp_path / "lib")}
    with FakeModel(HANGING) as fake:
        proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "hang"],
                                env={**other, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: len(fake.requests) >= 1, "the run's first request")
            assert launcher_children(env) == []  # the run is the caller's own process
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=PATIENCE)
    assert entry  # the warm fleet itself was still used by the ordinary run: only the fork was refused


def test_toolq_envs_finds_the_warm_fleet_as_toolq_turns_does(env):
    """With no REDIS_URL, `toolq envs` reads the user's running local fleet (newcomer's finding:
    it asked for REDIS_URL although `toolq turns` found the fleet)."""
    assert toolq("up", env=env).returncode == 0
    listed = toolq("envs", env=env)
    assert listed.returncode == 0 and "no environments" in listed.stdout, listed.stderr
    gone = toolq("envs", "rm", "env_0123456789abcdef", env=env)
    assert gone.returncode == 2 and "no environment env_0123456789abcdef" in gone.stderr, gone.stderr
