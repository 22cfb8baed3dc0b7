"""What a call nobody serves is told, and `toolq workers`' rendering (pure; the Redis side is in
tests/integration/test_fleet_catalog.py)."""

from __future__ import annotations

import json

from toolq.orchestrator.catalog_reader import FleetSnapshot, unserved_message
from toolq.orchestrator.workers_cmd import render_workers
from toolq.workers.advert import ToolRef, WorkerAdvert
from toolq.workers.catalog import ToolSpec
from toolq.workers.loader import load_catalog
from tests.unit.test_advert import declared, only


def worker(*specs: ToolSpec, **kw) -> WorkerAdvert:
    return WorkerAdvert(**{"instance": "0123456789abcdef" * 2, "hostname": "w1@h", "host": "h", "pid": 42,
                           "started_at": 1000.0, "concurrency": 4, "queues": ["toolq"],
                           "tools": [ToolRef.of(s) for s in specs], **kw})


def test_an_unserved_user_tool_names_its_module_and_the_worker_to_start():
    spec = only(declared())
    assert unserved_message(spec, FleetSnapshot((), 0.0)) == (
        "no live worker serves tool `echo` (declared in module `tests.unit.test_advert`): "
        "start one with `toolq worker --tools tests.unit.test_advert`")


def test_an_unserved_tool_says_when_live_workers_serve_another_declaration_of_it():
    ours, theirs = only(declared()), only(declared(timeout=5))
    text = unserved_message(ours, FleetSnapshot((worker(theirs),), 0.0))
    assert "1 live worker(s) serve another declaration of it" in text
    assert FleetSnapshot((worker(theirs),), 0.0).servers(ours) == []


def test_an_unserved_builtin_asks_for_any_worker():
    exec_command = next(s for s in load_catalog() if s.name == "exec_command")
    assert unserved_message(exec_command, FleetSnapshot((), 0.0)) == (
        "no live worker serves tool `exec_command`: start one with `toolq worker`")


def test_toolq_workers_shows_one_row_per_instance_and_json_keeps_every_tool():
    spec = only(declared())
    records = [worker(spec), worker(hostname="w2@h", draining=True, sandbox="bwrap")]
    table = render_workers(records, now=1090.0).splitlines()
    assert table[0].split() == ["WORKER", "INSTANCE", "STATE", "PID", "HOST", "CONCURRENCY", "UP", "SANDBOX", "TOOLS"]
    assert table[1].split() == ["w1@h", "01234567", "ready", "42", "h", "4", "90s", "-", "1:", "echo"]
    assert table[2].split() == ["w2@h", "01234567", "draining", "42", "h", "4", "90s", "bwrap", "0"]
    rows = [json.loads(line) for line in render_workers(records, now=1090.0, as_json=True).splitlines()]
    assert rows[0]["tools"][0]["digest"] == spec.digest() and rows[1]["state"] == "draining"
    assert render_workers([], now=0.0) == "no live workers in the fleet catalog (start one with `toolq worker`)\n"
