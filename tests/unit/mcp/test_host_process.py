"""The MCP host's process handle (toolq/workers/mcp/launch.py): what it leaves behind when stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from toolq.workers.mcp.host import HostConfig
from toolq.workers.mcp.launch import HostProcess


def test_a_stopped_host_leaves_no_socket_folder_in_tmp():
    """A worker started with --mcp left its `toolq-mcp-*` folder behind after a warm shutdown."""
    folder = tempfile.mkdtemp(prefix="toolq-mcp-")
    path = os.path.join(folder, "host.sock")
    open(path, "w").close()  # as a host that died without removing its socket leaves it
    host = HostProcess(path, HostConfig(servers={}, environments={}), {}, None)
    host.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host.stop()
    assert host.proc.poll() is not None and not os.path.exists(folder)


def test_a_file_someone_else_put_in_the_folder_stays_with_the_folder():
    folder = tempfile.mkdtemp(prefix="toolq-mcp-")
    keep = os.path.join(folder, "not-ours")
    open(keep, "w").close()
    host = HostProcess(os.path.join(folder, "host.sock"), HostConfig(servers={}, environments={}), {}, None)
    host.stop()
    assert os.path.exists(keep)
    os.unlink(keep)
    os.rmdir(folder)
