"""What a call nobody serves is told, and `toolq workers`' rendering (pure; the Redis side is in
tests/integration/test_fleet_catalog.py)."""

from __future__ import annotations

import asyncio
import json

from tests.unit.test_advert import declared, only
from toolq.cli.workers import render_workers
from toolq.core.advert import ToolRef, WorkerAdvert
from toolq.core.catalog import ToolSpec
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.transport import catalog_reader
from toolq.orchestrator.transport.catalog_reader import FleetCatalog, FleetSnapshot, unserved_message
from toolq.workers.loader import load_catalog


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


def test_an_unserved_tool_on_its_own_queue_names_the_queue_to_consume():
    """A new user's worker loaded the module with `--queues toolq`; the hint named the module only."""
    spec = only(declared(queue="gpu"))
    assert unserved_message(spec, FleetSnapshot((), 0.0)) == (
        "no live worker serves tool `echo` (declared in module `tests.unit.test_advert`): "
        "start one with `toolq worker --tools tests.unit.test_advert` (its queue is `gpu`, which a worker started "
        "with --queues must list)")


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


def test_toolq_workers_names_a_workers_environment_host_and_mode():
    spec = only(declared())
    records = [worker(spec, sandbox="bwrap", env_host="h1", env_mode="overlay"),
               worker(spec, hostname="w2@h", sandbox="landlock", env_host="h", env_mode="copy")]
    table = render_workers(records, now=1090.0).splitlines()
    assert table[1].split()[4:10] == ["h1", "(h)", "4", "90s", "bwrap,", "envs"]
    assert "landlock, envs copy" in table[2] and " h " in table[2]


class ScriptedCatalog(FleetCatalog):
    """The fleet catalog with no Redis: empty until `serve_after` reads, then `worker(spec)`."""

    def __init__(self, spec: ToolSpec, serve_after: int | None, **kw) -> None:
        super().__init__(None, **kw)  # type: ignore[arg-type]
        self.spec, self.serve_after, self.reads = spec, serve_after, 0

    async def snapshot(self, max_age=None) -> FleetSnapshot:
        self.reads += 1
        served = self.serve_after is not None and self.reads > self.serve_after
        return FleetSnapshot((worker(self.spec),) if served else (), 0.0)


def test_a_call_waits_past_the_grace_for_workers_still_booting_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(catalog_reader, "NOTICE_AFTER", 0.05)
    spec = only(declared())
    fleet = ScriptedCatalog(spec, serve_after=16, grace=0.01)  # two calls read in turn
    fleet.starting = WorkersStarting()

    async def two_calls():
        return await asyncio.gather(fleet.unserved(spec), fleet.unserved(spec))

    with caplog.at_level("WARNING", logger="toolq.fleet"):
        assert asyncio.run(two_calls()) == [None, None]  # 8 reads each, 50 ms apart: far past the 10 ms grace
    # Once for both calls (the demo said it once per call).
    assert [r.getMessage() for r in caplog.records] == ["waiting for a worker to serve echo (embedded workers starting)"]


def test_a_call_is_told_when_the_workers_started_for_it_failed():
    spec = only(declared())
    fleet = ScriptedCatalog(spec, serve_after=None, grace=5)
    fleet.starting = WorkersStarting()
    fleet.starting.finish("worker embedded0 exited with 1")
    text = asyncio.run(asyncio.wait_for(fleet.unserved(spec), 2))
    assert text == ("no worker could run tool `echo`: the workers toolq started for this run failed to start "
                    "(worker embedded0 exited with 1)")


def test_without_a_boot_the_grace_still_ends_the_wait():
    spec = only(declared())
    assert asyncio.run(ScriptedCatalog(spec, serve_after=None, grace=0.05).unserved(spec)).startswith(
        "no live worker serves tool `echo`")


class RecordsOnly:
    """The two reads `FleetCatalog.read` makes, from a dict of instance -> record."""

    def __init__(self, records: dict[str, WorkerAdvert]) -> None:
        self.records = records

    async def smembers(self, key):
        return {i.encode() for i in self.records}

    async def mget(self, keys):
        by_key = {f"toolq:fleet:worker:{i}": r.model_dump_json() for i, r in self.records.items()}
        return [by_key.get(k) for k in keys]

    async def srem(self, key, *ids):
        pass


def test_a_serving_instance_gone_without_a_clean_exit_is_noted_as_a_death_and_a_draining_one_is_not():
    a, b = worker(instance="a" * 32), worker(instance="b" * 32, hostname="w2@h")
    records = RecordsOnly({a.instance: a, b.instance: b})
    fleet = FleetCatalog(records)  # type: ignore[arg-type]
    asyncio.run(fleet.read())
    records.records = {a.instance: a, b.instance: b.model_copy(update={"draining": True})}
    asyncio.run(fleet.read())
    records.records = {a.instance: a}  # the draining one left: a warm shutdown, not a death
    asyncio.run(fleet.read())
    assert fleet.departed_at == float("-inf")
    records.records = {}  # an empty catalog (Redis restarted empty) says nothing
    asyncio.run(fleet.read())
    assert fleet.departed_at == float("-inf")
    records.records = {b.instance: b}  # a's record expired: SIGKILLed
    asyncio.run(fleet.read())
    assert fleet.departed_at > 0


def test_toolq_workers_groups_an_mcp_servers_tools_so_the_users_own_still_show():
    from toolq.cli.workers import tool_names
    from toolq.core.calls import ToolName

    def ref(name: str, namespace: str | None = None) -> ToolRef:
        return ToolRef(name=name, namespace=namespace, digest="d" * 16, queue="toolq", route="toolq.t.x", kind="function")

    many = [ref(f"t{k}", "git") for k in range(30)] + [ref("now", "time"), ref("my_tool")]
    advert = WorkerAdvert(instance="i" * 32, hostname="w@h", host="h", pid=1, started_at=0.0, concurrency=1,
                          queues=["toolq"], tools=many)
    assert tool_names(advert) == "my_tool, git.* (30), time.* (1)"
    assert advert.tools[-1].tool_name == ToolName.plain("my_tool")
