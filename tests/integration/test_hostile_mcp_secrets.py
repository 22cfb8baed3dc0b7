"""Issue 24 item 5, as the attacker would: the model asks an MCP server's "read a path" tool (MCP
servers run unsandboxed, as the worker's user) for `/proc/<pid>/environ` and `/proc/<pid>/mem` of
the worker, its pool children, its session host and its MCP host. None may hand over a fleet
secret (the broker's password, the OpenAI key, the Flower password, the signing key): those
processes are not dumpable, their initial environment holds no secret, and a root worker's MCP
servers lack CAP_SYS_PTRACE. As root and as an unprivileged worker user.
"""

from __future__ import annotations

import json
import shutil
import sys

import psutil
import pytest

import tests.integration.conftest as c
from tests.integration import unprivileged
from tests.integration.test_builtin_tools import outputs
from tests.integration.test_hostile_exec import (  # noqa: F401
    FLOWER_PASSWORD,
    OPENAI_KEY,
    REDIS_PASSWORD,
    hostile_workers,
    locked_redis,
)
from toolq.dev.fake_model import builders as b

pytestmark = pytest.mark.integration

READER = c.ROOT / "tests" / "mcp_servers" / "reader.py"
SECRETS = (OPENAI_KEY, FLOWER_PASSWORD, REDIS_PASSWORD, c.SIGNING_KEY)


@pytest.fixture(scope="module", params=[False, True], ids=["root", "user"])
def mcp_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    user = request.param
    folder = unprivileged.worker_folder(user, tmp_path_factory, "mcp")
    config = folder / "mcp.toml"
    config.write_text(f'[mcp_servers.reader]\ncommand = "{sys.executable}"\nargs = ["{READER}"]\n')
    config.chmod(0o644)
    yield from hostile_workers("bwrap", locked_redis, tmp_path_factory, user=user, TOOLQ_MCP_CONFIG=str(config))
    if user:
        shutil.rmtree(folder, ignore_errors=True)


def fleet_processes(worker) -> list[psutil.Process]:
    """The worker and every process of toolq's under it (pool children, session host, MCP host),
    not the MCP server itself (the attacker)."""
    main = psutil.Process(worker.proc.proc.pid)
    return [main] + [p for p in main.children(recursive=True) if "reader.py" not in " ".join(p.cmdline())]


def no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


def test_an_mcp_tool_cannot_read_the_fleets_secrets_out_of_its_processes(drive, mcp_worker, tmp_path):
    procs = fleet_processes(mcp_worker)
    assert len(procs) >= 4, procs  # the worker, its pool children, the session host, the MCP host
    paths = [f"/proc/{p.pid}/{what}" for p in procs for what in ("environ", "mem", "cmdline")]
    paths += [f"/proc/{p.pid}/task/{p.pid}/environ" for p in procs]
    calls = [b.function_call("read_path", {"path": path}, f"call_{i}", namespace="reader")
             for i, path in enumerate(paths)]
    calls.append(b.function_call("own_environment", {}, "call_own", namespace="reader"))
    ws = mcp_worker.workspace(tmp_path)
    run = drive([calls, [b.message("done")]], redis_url=mcp_worker.redis.url, workspace=ws)
    got = outputs(run)
    assert set(got) == {f"call_{i}" for i in range(len(paths))} | {"call_own"}
    for text in got.values():
        no_secret(text)
    # The control: the tool did read what it may (a process's own command line).
    assert any("toolq" in text for call_id, text in got.items() if call_id != "call_own"), json.dumps(got)[:2000]
    # And what even root reads from outside holds no secret: the values are gone from the environment block.
    for p in procs:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            no_secret(f.read().decode(errors="replace"))
