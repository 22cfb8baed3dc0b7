"""Bubblewrap cells (toolq/workers/isolation/cell.py): one sandbox per slot thread and workspace,
a fork per command in namespaces of its own. Real bwrap, real namespaces; each test's "slot" is a
thread of its own, as a session-host slot is."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from toolq.core.settings import Settings
from toolq.workers import isolation
from toolq.workers.isolation import cell, limits
from toolq.workers.isolation.policy import Policy

#: A sleep no other process on the machine runs, so pgrep (with `MINE`) finds or misses only ours.
SLEEP = f"sleep 300.{os.getpid()}"
MINE = rf"^sleep 300\.{os.getpid()}$"
SANDBOX = isolation.choose(Policy.from_settings(Settings(sandbox="bwrap", sandbox_cpu_seconds=1)))
pytestmark = pytest.mark.skipif(SANDBOX.unavailable is not None, reason=f"bwrap does not work here: {SANDBOX.unavailable}")


@pytest.fixture
def slot():
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-slot")
    yield thread
    thread.submit(cell.close_slot_cell).result()
    thread.shutdown()


def start(slot: ThreadPoolExecutor, workspace, script: str) -> cell.CellProcess:
    env = SANDBOX.policy.command_env({"PATH": os.environ["PATH"]}, home="/tmp")
    call_limits = limits.CallLimits(SANDBOX.policy.limits)
    return slot.submit(cell.spawn, SANDBOX.bwrap_path, SANDBOX.policy, str(workspace), ["/bin/sh", "-c", script],
                       env, str(workspace), call_limits.apply_to, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT).result()


def run(slot: ThreadPoolExecutor, workspace, script: str) -> tuple[int, str]:
    process = start(slot, workspace, script)
    assert process.stdout is not None
    out = process.stdout.read().decode()
    process.stdout.close()
    return process.wait(timeout=30), out


def the_cell(slot: ThreadPoolExecutor) -> cell.Cell:
    return slot.submit(lambda: cell._slot_cell.cell).result()


def test_commands_of_one_workspace_share_a_cell_but_not_their_tmp_processes_or_ipc(slot, tmp_path):
    code, out = run(slot, tmp_path, "ipcmk -M 4096 >/dev/null && ipcs -m | grep -q '^0x' || echo NO-IPC; echo kept > /tmp/left; echo x > /dev/shm/left; "
                                     f"setsid -f {SLEEP}; ({SLEEP} &); echo $$ ok")
    assert (code, out.split()) == (0, ["2", "ok"])  # pid 2: the cell's init is pid 1
    first = the_cell(slot)
    code, out = run(slot, tmp_path, "ls -A /tmp /dev/shm; echo segments $(ipcs -m | grep -c '^0x'); ps -e -o comm=")
    assert code == 0 and the_cell(slot) is first
    assert "left" not in out and "sleep" not in out and "segments 0" in out, out
    assert subprocess.run(["pgrep", "-f", MINE], capture_output=True).returncode == 1  # gone on the host too


def test_each_command_has_pseudo_terminals_of_its_own(slot, tmp_path):
    script = "python3 -c 'import os, pty; m, s = pty.openpty(); print(os.ttyname(s))'; ls /dev/pts"
    first, second = run(slot, tmp_path, script), run(slot, tmp_path, script)
    assert first == second == (0, "/dev/pts/0\nptmx\n")  # a fresh devpts instance each


def test_a_command_has_no_capabilities_and_cannot_read_its_init(slot, tmp_path):
    code, out = run(slot, tmp_path, "grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status; grep NoNewPrivs /proc/self/status;"
                                     " cat /proc/1/environ >/dev/null 2>&1 && echo READ-INIT; cat /proc/1/mem 2>&1 | head -c 0;"
                                     " kill -9 1 && echo KILLED-INIT")
    assert code == 0 and "READ-INIT" not in out, out
    caps = dict(line.split(":\t") for line in out.splitlines() if line.startswith(("Cap", "NoNewPrivs")))
    assert set(caps.values()) == {"0000000000000000", "1"} and caps["NoNewPrivs"] == "1", out


def test_a_command_cannot_make_a_git_where_there_was_none(slot, tmp_path):
    """Issue 24: a workspace without `.git` gets an empty one, bound read-only like any: `git
    init` there (then a `core.fsmonitor` a human's `git status` would run) fails."""
    code, out = run(slot, tmp_path, "git init -q . 2>&1; echo '[core] fsmonitor = evil' > .git/config; "
                                    "rmdir .git 2>&1; mv .git moved 2>&1; echo done")
    assert "done" in out and "Read-only file system" in out, out
    assert os.listdir(tmp_path / ".git") == []  # an empty .git, which git takes for no repository
    first = the_cell(slot)
    run(slot, tmp_path, "true")
    assert the_cell(slot) is first  # the placeholder made before the cell's start: no second cell


def test_another_workspace_gets_another_cell_which_cannot_see_the_first(slot, tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    (one / "secret").write_text("s")
    run(slot, one, "true")
    first = the_cell(slot)
    code, out = run(slot, two, f"cat {one}/secret 2>&1; echo done")
    assert the_cell(slot) is not first and first.proc.poll() is not None  # the old one is gone
    assert "done" in out and "s\n" not in out.split("done")[0].replace("No such", ""), out


def test_the_cpu_limit_is_named_by_its_signal_and_a_kill_takes_the_whole_namespace(slot, tmp_path):
    code, _ = run(slot, tmp_path, "exec python3 -c 'while True: pass'")
    assert code == 128 + signal.SIGXCPU  # the command is not pid 1, which would ignore SIGXCPU
    process = start(slot, tmp_path, f"{SLEEP} & {SLEEP} & wait")
    time.sleep(0.3)
    process.kill()
    assert process.wait(timeout=10) == -signal.SIGKILL
    process.stdout.close()
    assert subprocess.run(["pgrep", "-f", MINE], capture_output=True).returncode == 1


def test_a_dead_cell_is_replaced_and_a_missing_program_says_why(slot, tmp_path):
    run(slot, tmp_path, "true")
    first = the_cell(slot)
    first.proc.kill()
    first.proc.wait()
    code, out = run(slot, tmp_path, "echo again")
    assert (code, out) == (0, "again\n") and the_cell(slot) is not first
    env = SANDBOX.policy.command_env({"PATH": os.environ["PATH"]}, home="/tmp")
    process = slot.submit(cell.spawn, SANDBOX.bwrap_path, SANDBOX.policy, str(tmp_path), ["no-such-program"], env,
                          str(tmp_path), lambda pid: None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).result()
    out = process.stdout.read().decode()
    process.stdout.close()
    assert process.wait(timeout=10) == 127 and "could not start" in out and "no-such-program" in out
    with pytest.raises(FileNotFoundError):  # as Popen raises it: the worker reports a spawn error
        slot.submit(cell.spawn, SANDBOX.bwrap_path, SANDBOX.policy, str(tmp_path), ["true"], env,
                    str(tmp_path / "missing"), lambda pid: None, stdout=subprocess.PIPE).result()


def test_a_slot_idle_long_enough_stops_its_cell(tmp_path):
    from toolq.workers.sessions.slots import Slots

    slots = Slots(None, most=2)
    slot = slots.take()
    env = SANDBOX.policy.command_env({"PATH": os.environ["PATH"]}, home="/tmp")
    process = slot.run(cell.spawn, SANDBOX.bwrap_path, SANDBOX.policy, str(tmp_path), ["true"], env, str(tmp_path),
                       lambda pid: None, stdout=subprocess.DEVNULL)
    assert process.wait(timeout=10) == 0
    held = slot.run(lambda: cell._slot_cell.cell)
    slots.close_idle_cells(60)  # busy: kept
    slots.give_back(slot)
    slots.close_idle_cells(60)  # idle, but not long enough: kept
    assert held.proc.poll() is None
    slots.close_idle_cells(0)
    assert held.proc.wait(timeout=10) is not None and slot.run(lambda: cell._slot_cell.cell) is None


def test_a_workspace_reached_through_a_symlink_follows_it_when_it_is_pointed_elsewhere(slot, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "only-in-b").write_text("")
    link = tmp_path / "ws"
    link.symlink_to(tmp_path / "a")
    assert run(slot, link, "ls -A") == (0, ".git\n")  # the read-only placeholder (issue 24)
    link.unlink()
    link.symlink_to(tmp_path / "b")
    assert run(slot, link, "ls -A; touch made") == (0, ".git\nonly-in-b\n") and (tmp_path / "b" / "made").exists()


def test_a_cell_that_stops_answering_is_replaced_and_the_command_is_a_spawn_error(slot, tmp_path, monkeypatch):
    run(slot, tmp_path, "true")
    stuck = the_cell(slot)
    bwrap_init = int(subprocess.run(["pgrep", "-P", str(stuck.proc.pid)], capture_output=True, text=True).stdout)
    program = int(subprocess.run(["pgrep", "-P", str(bwrap_init)], capture_output=True, text=True).stdout)
    os.kill(program, signal.SIGSTOP)
    monkeypatch.setattr(cell, "START_TIMEOUT", 0.5)
    with pytest.raises(TimeoutError, match="did not start the command in time"):
        run(slot, tmp_path, "true")
    assert stuck.proc.wait(timeout=10) is not None  # killed, not left stopped
    assert run(slot, tmp_path, "echo fresh") == (0, "fresh\n") and the_cell(slot) is not stuck
