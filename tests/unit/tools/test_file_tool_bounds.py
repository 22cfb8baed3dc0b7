"""File tools run in the pool process, outside the sandbox: they are held to the memory and time a
command gets (issue 24, item 10). The real-worker test, with the pool's RSS, is
tests/integration/test_hostile_file_bounds.py."""

from __future__ import annotations

import json

import pytest

from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.workers import isolation
from toolq.workers.tools.apply_patch import apply_patch
from toolq.workers.tools.grep_files import grep_files
from toolq.workers.tools.list_dir import list_dir
from toolq.workers.tools.read_file import read_file

MEMORY_MB = 16


@pytest.fixture
def small_sandbox(monkeypatch):
    """A worker whose sandbox gives each call MEMORY_MB."""
    monkeypatch.setenv("TOOLQ_SANDBOX_MEMORY_MB", str(MEMORY_MB))
    isolation.reset()
    yield
    isolation.reset()


def refusal(fn, tmp_path, arguments, **kw) -> str:
    with pytest.raises(RespondToModel) as e:
        call(fn, tmp_path, arguments, **kw)
    return e.value.message


def test_a_file_whose_lines_would_pass_the_memory_limit_is_not_patched(tmp_path, small_sandbox):
    # 1.8 MB of 2-character lines (under a sixth of the limit): about 45 MiB once split into strings.
    (tmp_path / "big.txt").write_bytes(b"ab\n" * 600_000)
    message = refusal(apply_patch, tmp_path, "*** Begin Patch\n*** Update File: big.txt\n@@\n-ab\n+cd\n*** End Patch")
    assert message.startswith(f"apply_patch verification failed: Failed to read file to update {tmp_path.resolve()}/big.txt: ")
    assert "needs about" in message and message.endswith(f"the sandbox limits a call to {MEMORY_MB} MiB")
    assert (tmp_path / "big.txt").read_bytes()[:6] == b"ab\nab\n"


def test_a_file_larger_than_the_memory_limit_allows_is_refused_unread(tmp_path, small_sandbox):
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(8 * 1024 * 1024)  # sparse, over a sixth of 16 MiB
    message = refusal(apply_patch, tmp_path, "*** Begin Patch\n*** Update File: big.txt\n@@\n-a\n+b\n*** End Patch")
    assert message.endswith(f"larger than 2 MiB: the sandbox limits a call to {MEMORY_MB} MiB")


def test_a_pattern_that_almost_matches_everywhere_stops_at_the_deadline(tmp_path):
    # 200,000 identical lines and 300 lines that match up to the last: 60 million comparisons for
    # each of the four ways of matching; the call has a second.
    (tmp_path / "f.txt").write_text("a\n" * 200_000)
    patch = "*** Begin Patch\n*** Update File: f.txt\n@@\n" + "-a\n" * 299 + "-b\n+c\n*** End Patch"
    message = refusal(apply_patch, tmp_path, patch, deadline_in=1)
    assert message == "apply_patch verification failed: apply_patch timed out after 1 seconds"


def test_read_file_holds_no_more_lines_than_the_memory_limit(tmp_path, small_sandbox):
    (tmp_path / "empty_lines.txt").write_bytes(b"\n" * (4 * 1024 * 1024))  # 4 Mi lines of ~75 bytes
    message = refusal(read_file, tmp_path, json.dumps({"file_path": "empty_lines.txt", "limit": 10**9}))
    assert message.startswith("reading ") and message.endswith(f"the sandbox limits a call to {MEMORY_MB} MiB")
    assert call(read_file, tmp_path, json.dumps({"file_path": "empty_lines.txt", "limit": 2})) == "L1: \nL2: "


def test_list_dir_and_grep_files_hold_no_more_entries_than_the_memory_limit(tmp_path, small_sandbox):
    names = [f"{i:03d}-" + "n" * 240 for i in range(256)]
    for top in range(256):  # 65,536 entries of ~500 bytes each as held
        d = tmp_path / f"d{top:03d}"
        d.mkdir()
        for name in names:
            (d / name).write_text("needle\n")
    listed = refusal(list_dir, tmp_path, json.dumps({"dir_path": ".", "depth": 2}))
    assert listed.startswith("listing ") and listed.endswith(f"the sandbox limits a call to {MEMORY_MB} MiB")
    found = refusal(grep_files, tmp_path, json.dumps({"pattern": "needle"}))
    assert "matching paths needs about" in found and found.endswith(f"limits a call to {MEMORY_MB} MiB")
