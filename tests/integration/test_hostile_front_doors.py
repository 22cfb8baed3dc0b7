"""Red team of the front doors (issue 29): `toolq exec-server`, `toolq mcp-server` and the
worker's front-door tools, attacked as an attacker would, on real Redis and real workers.

Each test is one attack and asserts that it fails. The attackers: a browser page the user visits
(a cross-site WebSocket to a loopback exec-server, DNS rebinding), the exec-server's client itself
(hostile ids, paths, env, frames), someone who can write to the fleet's Redis (forged and replayed
process events), and the commands the client runs (what they leave in the workspace, and races
against the worker's file operations)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import tests.integration.conftest as c
from tests.integration import unprivileged
from tests.integration.test_exec_server import (  # noqa: F401 - fixtures
    Client,
    exec_server,
    finished,
    process_start,
    run,
    server,
    server_env,
    uri,
    workspace,
)
from tests.integration.test_front_door_tools import Door, door_worker  # noqa: F401 - fixtures
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.core.front_doors import process_stream_key
from toolq.frontdoors.exec_server.session import process_key

pytestmark = pytest.mark.integration

TIMEOUT = 60.0


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


# ---- the network: who may talk to the exec-server ---------------------------------------------

def test_a_browser_page_cannot_drive_a_loopback_exec_server(server, workspace):
    """A page on any site may open a WebSocket to 127.0.0.1 (no CORS for WebSockets): it sends an
    `Origin` header, which Codex never does. With no token, a loopback server must refuse it, or any
    page the user visits runs commands in the workspace and reads its files back."""
    port = port_of(server.url)
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        with pytest.raises(InvalidStatus) as e, connect(f"ws://127.0.0.1:{port}", origin=origin):  # type: ignore[arg-type]
            pass
        assert e.value.response.status_code == 403, origin
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, so the browser sends its Host
    with socket.create_connection(("127.0.0.1", int(port))) as sock, pytest.raises(InvalidStatus) as e, \
            connect(f"ws://evil.example:{port}", sock=sock):
        pass
    assert e.value.response.status_code == 403
    # Codex (no Origin, a loopback Host) and a page served from loopback itself still get in
    for host, origin in (("127.0.0.1", None), ("localhost", None), ("127.0.0.1", f"http://localhost:{port}")):
        with Client.connect(f"ws://{host}:{port}", origin=origin) as client:
            client.initialize()
            assert run(client, workspace, "echo in") == (b"in\n", 0)
