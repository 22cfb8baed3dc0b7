"""A hostile model against the file tools on real workers: each attack fails with a clear output.

The fake model plays the attacker; calls go through Redis to prefork `celery worker` processes.
Covered: a symlink-swap race on read_file and apply_patch (another process flips a workspace
directory for a symlink to outside while the calls run), a hard link to a file outside, a 3 GiB
line, a FIFO, a brace bomb and a catastrophic regex (each ends within its deadline, and the pool
child's peak memory stays small), and apply_patch on `.git/config`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.hostile import Flipper, race_tree
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import RedisServer, WorkerProcess

pytestmark = pytest.mark.integration

TRIES = 200
#: Calls per model response. 200 parallel calls in one response exhaust the orchestrator's Redis
#: connections ("Too many connections"), which is not what this test is about.
PER_RESPONSE = 25
SECRET = "s3cret"


def outputs(run, k=1) -> dict[str, str]:
    return {o["call_id"]: o["output"] for o in run.outputs_of(k)}


def patch(*body: str) -> str:
    return "\n".join(["*** Begin Patch", *body, "*** End Patch"]) + "\n"


def final():
    return [b.message("done")]


# --- the symlink-swap race -------------------------------------------------------------------------


def test_symlink_swap_race_gives_no_escape_in_200_reads_and_200_patches(fleet, drive, tmp_path):
    ws, outside = race_tree(tmp_path)
    reads = [b.function_call("read_file", {"file_path": "d/f.txt"}, f"call_read_{i}") for i in range(TRIES)]
    patches = [
        b.custom_tool_call("apply_patch", patch(f"*** Add File: d/new{i}.txt", "+pwned") if i % 2 else
                           patch("*** Update File: d/f.txt", "@@", "-inside", "+pwned"), f"call_patch_{i}")
        for i in range(TRIES)
    ]
    calls = reads + patches
    responses = [calls[i : i + PER_RESPONSE] for i in range(0, len(calls), PER_RESPONSE)]
    with Flipper(ws, outside):
        run = drive([*responses, final()], workspace=ws, timeout=240)
    assert run.outcome.status == "completed"
    out = outputs(run, len(responses))  # the last request carries every output of the turn
    read_out = {k: v for k, v in out.items() if k.startswith("call_read_")}
    patch_out = {k: v for k, v in out.items() if k.startswith("call_patch_")}
    assert len(read_out) == len(patch_out) == TRIES
    assert not [o for o in read_out.values() if SECRET in o], "read_file read outside the workspace"
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt"], "apply_patch created a file outside"
    assert (outside / "f.txt").read_text() == f"{SECRET}\n", "apply_patch wrote outside the workspace"
    escapes = f"path `d/f.txt` leads outside the workspace `{ws.resolve()}` through a symlink"
    kinds = {"inside" if o == "L1: inside" else "refused" if o == escapes else "other" for o in read_out.values()}
    assert {"inside", "refused"} <= kinds, f"the race never hit both ways: {set(read_out.values())}"


# --- hard links and .git ---------------------------------------------------------------------------


def test_a_hard_link_to_a_file_outside_cannot_be_written_through(fleet, drive, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    os.link(victim, ws / "linked.txt")
    run = drive([
        [b.custom_tool_call("apply_patch", patch("*** Update File: linked.txt", "@@", "-keep", "+pwned"), "call_update"),
         b.custom_tool_call("apply_patch", patch("*** Add File: linked.txt", "+pwned"), "call_add"),
         b.function_call("read_file", {"file_path": "linked.txt"}, "call_read")],
        final(),
    ], workspace=ws)
    out = outputs(run)
    refused = ("apply_patch verification failed: path `linked.txt` has 2 hard links: writing it would change a "
               "file elsewhere too, so it is not written")
    assert out["call_update"] == out["call_add"] == refused
    assert victim.read_text() == "keep\n"
    assert out["call_read"] == "L1: keep"  # reading reads a file the worker could read anyway (documented)


def test_apply_patch_cannot_touch_git_config_directly_or_through_a_symlink(fleet, drive, tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / "g").symlink_to(".git")
    fsmonitor = ["@@", " [core]", "+\tfsmonitor = touch pwned"]
    run = drive([
        [b.custom_tool_call("apply_patch", patch("*** Update File: .git/config", *fsmonitor), "call_direct"),
         b.custom_tool_call("apply_patch", patch("*** Update File: g/config", *fsmonitor), "call_link"),
         b.custom_tool_call("apply_patch", patch("*** Add File: ok.txt", "+ok", "*** Add File: g/hooks/pre-commit",
                                                 "+touch pwned"), "call_hook")],
        final(),
    ])
    out = outputs(run)
    for call_id, named in (("call_direct", ".git/config"), ("call_link", "g/config"),
                           ("call_hook", "g/hooks/pre-commit")):
        assert out[call_id] == (f"apply_patch verification failed: path `{named}` is inside a `.git` directory, "
                                "which file tools do not change")
    assert (tmp_path / ".git" / "config").read_text() == "[core]\n"
    assert sorted(p.name for p in (tmp_path / ".git").iterdir()) == ["config"]
    assert not (tmp_path / "ok.txt").exists(), "a refused patch wrote part of itself"


# --- costs: memory and time bounded --------------------------------------------------------------


@pytest.fixture
def lone_worker(tmp_path):
    """A broker and a worker with one pool child of our own, so its peak memory is this test's."""
    with RedisServer() as server, WorkerProcess(server.url, name="hostile@test", queues=["toolq"], concurrency=1,
                                                tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path) as worker:
        yield server, worker


def peak_rss(worker: WorkerProcess) -> dict[int, int]:
    """Each pool child's peak resident memory (VmHWM), in bytes."""
    peaks = {}
    for child in psutil.Process(worker.proc.pid).children(recursive=True):
        for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peaks[child.pid] = int(line.split()[1]) * 1024
    return peaks


def test_huge_line_fifo_brace_bomb_and_bad_regex_end_quickly_in_bounded_memory(lone_worker, drive, tmp_path):
    server, worker = lone_worker
    ws = tmp_path / "ws"
    ws.mkdir()
    with open(ws / "huge.bin", "wb") as f:
        f.truncate(3 * 1024**3)  # sparse: 3 GiB of NUL bytes, no newline
    (ws / "long.txt").write_bytes(b"y" * (64 * 1024 * 1024))  # 64 MiB of text, no newline
    os.mkfifo(ws / "pipe")
    (ws / "aaa.txt").write_text("a" * 100_000 + "b\n")
    before = peak_rss(worker)
    bomb = "{a,b}" * 40
    started = time.monotonic()
    run = drive([
        [b.function_call("read_file", {"file_path": "huge.bin", "limit": 1}, "call_huge"),
         b.function_call("read_file", {"file_path": "long.txt", "offset": 2}, "call_long"),
         b.function_call("grep_files", {"pattern": "needle"}, "call_grep_all"),
         b.function_call("read_file", {"file_path": "pipe"}, "call_read_fifo"),
         b.function_call("grep_files", {"pattern": "x", "path": "pipe"}, "call_grep_fifo"),
         b.function_call("view_image", {"path": "pipe"}, "call_image_fifo"),
         b.function_call("grep_files", {"pattern": "x", "include": bomb}, "call_bomb"),
         b.function_call("grep_files", {"pattern": "(a+)+$", "path": "aaa.txt"}, "call_regex")],
        final(),
    ], redis_url=server.url, workspace=ws, timeout=90)
    elapsed = time.monotonic() - started
    after = peak_rss(worker)
    out = outputs(run)
    root = ws.resolve()
    assert out["call_huge"] == "L1: " + "\0" * 500
    assert out["call_long"] == "offset exceeds file length"
    assert out["call_grep_all"] == "No matches found."
    assert out["call_read_fifo"] == "failed to read file: not a regular file (a FIFO)"
    assert out["call_grep_fifo"] == "No matches found."
    assert out["call_image_fifo"] == f"image path `{root}/pipe` is not a file"
    assert out["call_bomb"] == f"include glob `{bomb}` expands to more than 1024 globs"
    assert out["call_regex"] == "No matches found."
    # Before, the FIFO alone held the pool child until the call's 60 s deadline; 8 calls in a row here.
    assert elapsed < 45, f"the attack calls took {elapsed:.1f}s"
    assert before.keys() == after.keys(), "the pool child was replaced (it died?)"
    grown = {pid: after[pid] - before[pid] for pid in after}
    assert max(after.values()) < 512 * 1024**2 and max(grown.values()) < 128 * 1024**2, (before, after)
