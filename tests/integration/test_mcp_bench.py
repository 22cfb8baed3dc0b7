"""`toolq bench mcp` end to end at a tiny size (no timing judged), and on a fleet without its worker."""

import io

import pytest

from toolq.dev.bench import mcp

pytestmark = pytest.mark.integration


def test_mcp_bench_measures_both_tools(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)  # the bench starts its own Redis and MCP worker
    out = io.StringIO()
    res = mcp.run(out, rounds=1, per_round=5)
    assert res["calls"] == 5 and res["builtin_p50"] > 0 and res["mcp_p50"] > 0
    assert "ratio MCP/built-in" in out.getvalue()


def test_mcp_bench_on_a_fleet_without_its_worker_says_what_to_start(monkeypatch, capsys):
    from toolq.cli import main as cli
    from toolq.local.embedded import RedisServer

    with RedisServer() as server:
        monkeypatch.setenv("REDIS_URL", server.url)
        assert cli.main(["bench", "mcp"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "queue toolq-bench, mcp.bench" in line and "--mcp 'bench=" in line
