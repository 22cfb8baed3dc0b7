"""toolq.workers.processes: the process-group runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

from toolq.workers import processes as sandbox
from toolq.workers.processes import HeadTailBuffer, live_process_groups, run_command

REPO = Path(__file__).resolve().parents[2]


def surviving(pgid: int) -> list[psutil.Process]:
    """Processes of the group that are still alive (zombies waiting for init do not count)."""
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


def wait_until_gone(pgid: int, within: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + within
    while (left := surviving(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# --- run_command -----------------------------------------------------------------------------


def test_stdout_and_stderr_are_merged_and_exit_code_kept(tmp_path):
    r = run_command("echo out; echo err >&2; exit 3", cwd=tmp_path)
    assert (r.exit_code, r.output, r.timed_out, r.cancelled) == (3, b"out\nerr\n", False, False)


def test_command_runs_in_cwd_with_its_own_process_group(tmp_path):
    r = run_command('pwd; [ "$(ps -o pgid= $$ | tr -d " ")" = "$$" ] && echo leader', cwd=tmp_path)
    assert r.output.decode().splitlines() == [str(tmp_path), "leader"]


def test_argv_form_runs_without_a_shell(tmp_path):
    r = run_command(["printf", "%s|", "a b", "$HOME"], cwd=tmp_path)
    assert r.output == b"a b|$HOME|"


def test_missing_cwd_is_reported_not_raised(tmp_path):
    r = run_command("echo hi", cwd=tmp_path / "nope")
    assert r.exit_code == -1 and r.pid is None
    assert isinstance(r.spawn_error, FileNotFoundError) and r.spawn_error.errno == 2


def test_death_by_signal_reads_as_128_plus_signal(tmp_path):
    assert run_command("kill -KILL $$", cwd=tmp_path).exit_code == 128 + signal.SIGKILL


def test_timeout_kills_the_whole_group_including_grandchildren(tmp_path):
    started = time.monotonic()
    r = run_command("sleep 30 & sleep 30; wait", cwd=tmp_path, timeout=0.5)
    assert time.monotonic() - started < 10  # well before the 30 s sleeps
    assert r.timed_out and not r.cancelled
    assert wait_until_gone(r.pid) == []


def test_cancellation_is_polled_and_kills_the_group(tmp_path):
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    started = time.monotonic()
    r = run_command("sleep 30 & sleep 30; wait", cwd=tmp_path, is_cancelled=flag.is_set)
    assert time.monotonic() - started < 10
    assert r.cancelled and not r.timed_out
    assert wait_until_gone(r.pid) == []


def test_background_leftovers_are_killed_after_a_normal_exit(tmp_path):
    r = run_command("sleep 30 & echo started", cwd=tmp_path)
    assert (r.exit_code, r.output) == (0, b"started\n")
    assert r.wall_time < 10
    assert wait_until_gone(r.pid) == []


def test_detached_grandchild_holding_the_pipe_does_not_hang_the_call(tmp_path):
    # setsid leaves our process group, so it cannot be killed with it; the drain timeout saves us.
    started = time.monotonic()
    r = run_command("setsid sleep 30 & echo $!", cwd=tmp_path)
    elapsed = time.monotonic() - started
    os.kill(int(r.output), signal.SIGKILL)
    assert r.exit_code == 0
    assert elapsed < sandbox.DRAIN_TIMEOUT + 5


def test_process_group_is_registered_while_running_and_removed_after(tmp_path):
    seen: list[frozenset[int]] = []

    def probe() -> bool:
        seen.append(live_process_groups())
        return False

    r = run_command("sleep 0.3", cwd=tmp_path, is_cancelled=probe)
    assert any(r.pid in groups for groups in seen)
    assert r.pid not in live_process_groups()


def test_output_beyond_the_cap_keeps_head_and_tail(tmp_path):
    r = run_command("seq 1 100000", cwd=tmp_path, output_cap=1000)
    assert len(r.output) == 1000
    assert r.output.startswith(b"1\n2\n3\n") and r.output.endswith(b"99999\n100000\n")
    assert r.dropped_bytes == len(b"".join(b"%d\n" % i for i in range(1, 100001))) - 1000


def test_head_tail_buffer_drops_only_the_middle():
    buf = HeadTailBuffer(10)
    for chunk in [b"abc", b"defgh", b"ijklmnop", b"qrst"]:
        buf.write(chunk)
    assert buf.getvalue() == b"abcdepqrst" and buf.dropped == 10


# --- SIGTERM (Celery revoke(terminate=True)) ----------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from toolq.workers import processes as sandbox

    sandbox.install_sigterm_handler()
    threading.Thread(
        target=sandbox.run_command, args=("sleep 30 & sleep 30; wait",), kwargs={"cwd": "."}, daemon=True
    ).start()
    while not sandbox.live_process_groups():
        time.sleep(0.01)
    time.sleep(0.2)  # let bash start its children
    print(next(iter(sandbox.live_process_groups())), flush=True)
    time.sleep(60)
    """
)


def test_sigterm_kills_live_groups_then_the_process_dies_of_sigterm(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        pgid = int(child.stdout.readline())
        assert len(surviving(pgid)) == 3  # bash and its two sleeps
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert wait_until_gone(pgid) == []
    finally:
        child.kill()
        child.wait()


def test_installing_the_sigterm_handler_twice_is_a_no_op():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        first = sandbox.install_sigterm_handler()
        assert sandbox.install_sigterm_handler() is False
        assert first is True or previous is sandbox._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)
