"""A hostile model makes the file tools work on a 64 MiB file, on real workers (issue 24, item 10).

File tools run in the worker's pool process, outside the sandbox: `apply_patch` on a 64 MiB file
of short lines grew a pool process from 200 MB to 1.9 GB and kept a core for a minute, and
`read_file` with the model's `limit` held every line. They are now held to the sandbox's per-call
memory limit (MEMORY_MB here) and the call's deadline: each call gets a clear refusal or a bounded
result, and the pool process's peak memory (VmHWM, a sanity bound, not a timing) grows by less
than the limit. As root and as an unprivileged worker user.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from tests.integration import unprivileged
from tests.integration.test_builtin_tools import outputs
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.dev.fake_model import builders as b

pytestmark = pytest.mark.integration

MEMORY_MB = 256
MIB = 1024 * 1024


@pytest.fixture(scope="module", params=["root", "nobody"])
def bounded_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    yield from hostile_workers("bwrap", locked_redis, tmp_path_factory, user=request.param == "nobody",
                               TOOLQ_SANDBOX_MEMORY_MB=str(MEMORY_MB))


def peak_rss(worker) -> dict[int, int]:
    """Each pool process's peak resident memory (VmHWM), in bytes."""
    peaks = {}
    for child in psutil.Process(worker.proc.proc.pid).children():
        for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peaks[child.pid] = int(line.split()[1]) * 1024
    return peaks


def test_a_64_mib_file_is_refused_or_read_within_the_memory_limit(drive, bounded_worker, tmp_path):
    ws = bounded_worker.workspace(tmp_path)
    big = ws / "big.txt"
    big.write_bytes(b"ab\n" * (64 * MIB // 3))  # 22 million 2-character lines
    lines = ws / "lines.txt"
    lines.write_bytes(b"ab\n" * (16 * MIB // 3))  # under the size bound, 24 bytes a byte as strings
    if bounded_worker.user:
        for path in (big, lines):
            os.chown(path, *unprivileged.ids())
    before = peak_rss(bounded_worker)

    def patch(name: str) -> str:
        return f"*** Begin Patch\n*** Update File: {name}\n@@\n-ab\n+cd\n*** End Patch\n"

    run = drive([
        [b.custom_tool_call("apply_patch", patch("big.txt"), "call_patch"),
         b.custom_tool_call("apply_patch", patch("lines.txt"), "call_patch_lines")],
        [b.function_call("read_file", {"file_path": "big.txt", "offset": 22_000_000, "limit": 10**9}, "call_read"),
         b.function_call("grep_files", {"pattern": "c", "path": "big.txt"}, "call_grep")],
        [b.message("done")],
    ], redis_url=bounded_worker.redis.url, workspace=ws, timeout=180)
    after = peak_rss(bounded_worker)
    root = ws.resolve()
    for call, path in (("call_patch", big), ("call_patch_lines", lines)):
        patched = outputs(run, 1)[call]
        assert patched.startswith(f"apply_patch verification failed: Failed to read file to update {root}/{path.name}: "
                                  ), patched
        assert patched.endswith(f"the sandbox limits a call to {MEMORY_MB} MiB"), patched
        assert path.read_bytes()[:6] == b"ab\nab\n"
    read, grep = outputs(run, 2)["call_read"], outputs(run, 2)["call_grep"]
    assert read.startswith("L22000000: ab\nL22000001: ab\n"), read[:200]  # a bounded result: the last lines
    assert grep == "No matches found."
    assert before.keys() == after.keys(), "a pool process was replaced (it died?)"
    grown = max(after[pid] - before[pid] for pid in after)
    assert grown < MEMORY_MB * MIB, f"a pool process grew by {grown // MIB} MiB (the limit is {MEMORY_MB} MiB)"
