"""The file tools hold directory and file fds; none may outlive a call (a pool child runs thousands)."""

from __future__ import annotations

import json
import os

from tests.unit.tools import call
from tests.unit.tools.test_view_image import PNG
from toolq.core.errors import RespondToModel
from toolq.workers.tools.apply_patch import apply_patch
from toolq.workers.tools.grep_files import grep_files
from toolq.workers.tools.list_dir import list_dir
from toolq.workers.tools.read_file import read_file
from toolq.workers.tools.view_image import view_image


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_call_leaks_an_fd_on_success_or_refusal(tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "a.txt").write_text("needle\n")
    (ws / "img.png").write_bytes(PNG)
    (ws / "bin").write_bytes(b"\0needle")
    os.mkfifo(ws / "pipe")
    (ws / "out").symlink_to(tmp_path)
    (tmp_path / "victim.txt").write_text("v\n")
    os.link(tmp_path / "victim.txt", ws / "hard.txt")
    (ws / ".git").mkdir()
    calls = [
        (read_file, {"file_path": "a.txt"}), (read_file, {"file_path": "pipe"}), (read_file, {"file_path": "out/victim.txt"}),
        (read_file, {"file_path": "a.txt", "offset": 9}),
        (list_dir, {"dir_path": ".", "depth": 3}), (list_dir, {"dir_path": "out"}), (list_dir, {"dir_path": "a.txt"}),
        (grep_files, {"pattern": "needle"}), (grep_files, {"pattern": "needle", "path": "pipe"}),
        (grep_files, {"pattern": "(a)\\1"}),
        (view_image, {"path": "img.png"}), (view_image, {"path": "pipe"}), (view_image, {"path": "nope.png"}),
        (apply_patch, "*** Begin Patch\n*** Add File: sub/new.txt\n+x\n*** End Patch\n"),
        (apply_patch, "*** Begin Patch\n*** Update File: hard.txt\n@@\n-v\n+w\n*** End Patch\n"),
        (apply_patch, "*** Begin Patch\n*** Add File: .git/hooks/x\n+x\n*** End Patch\n"),
        (apply_patch, "*** Begin Patch\n*** Delete File: sub/new.txt\n*** End Patch\n"),
    ]
    before = open_fds()
    for _ in range(5):
        for tool, arguments in calls:
            try:
                call(tool, ws, arguments if isinstance(arguments, str) else json.dumps(arguments))
            except RespondToModel:
                pass
    assert open_fds() == before
