"""The worker's advertisement following its MCP servers (`Follower`), beat by beat, on a fake clock.

The advertiser, the host's listing and the worker's consumer are stand-ins: what is under test is
which declarations get advertised, as current or retiring, and which queues get consumed."""

from __future__ import annotations

import socket
import time

import pytest

from toolq.core.advert import ToolAdvert, ToolRef, WorkerAdvert, tool_queue
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.mcp_specs import McpToolRecord, tool_spec
from toolq.workers.mcp.follow import GRACE, Follower
from toolq.workers.mcp.wire import Listing, ServerState
from toolq.workers.mcp.worker import HostClient, HostUnavailable

PLAIN = ToolSpec(name="grep", queue="default")
OPEN = {"type": "object", "properties": {"query": {"type": "string"}}}


def record(name: str, schema: dict | None = None) -> McpToolRecord:
    return McpToolRecord(server="s", name=name, input_schema=schema or OPEN, timeout=30)


def listing(generation: int, *tools: McpToolRecord, state: str = "ready") -> Listing:
    server = ServerState(name="s", transport="stdio", state=state, tools=list(tools))  # type: ignore[arg-type]
    return Listing(generation=generation, servers=[server])


class Advertiser:
    def __init__(self, specs: list[ToolSpec]) -> None:
        self.record = WorkerAdvert(instance="i", hostname="w@h", host="h", pid=1, started_at=0, concurrency=1,
                                   queues=["default", "mcp.s"], tools=[ToolRef.of(s) for s in specs])
        self.tools = [ToolAdvert.of(s) for s in specs]
        self.published = 0

    def serve(self, tools: list[ToolRef], adverts: list[ToolAdvert]) -> None:
        self.record = self.record.model_copy(update={"tools": tools})
        self.tools = adverts
        self.published += 1

    def offered(self) -> dict[str, bool]:
        """Advertised MCP tools by name (with the digest's head when two share it): retiring?"""
        return {f"{t.name}.{t.digest[:6]}" if sum(u.name == t.name for u in self.record.tools) > 1 else t.name:
                t.retiring for t in self.record.tools if t.namespace == "s"}


class World:
    def __init__(self, *tools: McpToolRecord) -> None:
        self.catalog = Catalog([PLAIN, *(tool_spec(r) for r in tools)])
        self.now = 0.0
        self.listing: Listing | None = listing(0, *tools)
        self.consumed: list[str] = []
        self.stopped: list[str] = []
        self.confirm = True
        self.advertiser = Advertiser(list(self.catalog))
        self.follower = Follower(self.catalog, {"s"}, read=lambda: self.listing, install=self.install,
                                 consume=self.consume, stop_consuming=self.stopped.append, clock=lambda: self.now)

    def install(self, catalog: Catalog, listing: Listing) -> None:
        catalog.replace_namespace("s", [tool_spec(r) for s in listing.servers for r in s.tools])

    def consume(self, queue: str) -> bool:
        if self.confirm:
            self.consumed.append(queue)
        return self.confirm

    def beat(self, after: float = 2.0) -> None:
        self.now += after
        self.follower(self.advertiser)


def test_nothing_changed_publishes_nothing_and_the_other_tools_stay():
    w = World(record("a"))
    w.beat()
    w.beat()
    assert w.advertiser.published == 0 and w.consumed == []
    assert [t.name for t in w.advertiser.record.tools] == ["grep", "a"]


def test_a_listed_tool_is_consumed_and_advertised_and_a_replaced_one_retires_for_the_grace():
    old = record("a")
    w = World(old)
    new = record("a", {**OPEN, "required": ["query"]})
    w.listing = listing(1, new, record("b"))
    w.beat()
    assert w.advertiser.offered() == {f"a.{tool_spec(new).digest()[:6]}": False,
                                      f"a.{tool_spec(old).digest()[:6]}": True, "b": False}
    assert sorted(w.consumed) == sorted([tool_queue(tool_spec(new)), tool_queue(tool_spec(record("b")))])
    assert "grep" in {t.name for t in w.advertiser.record.tools}
    assert {a.digest for a in w.advertiser.tools} == {t.digest for t in w.advertiser.record.tools}
    w.beat(GRACE)
    assert w.advertiser.offered() == {"a": False, "b": False}
    assert w.stopped == [tool_queue(tool_spec(old))]


def test_a_down_server_stays_advertised_for_the_grace_then_is_withdrawn_and_comes_back_when_ready():
    w = World(record("a"))
    w.listing = listing(1, record("a"), state="down")
    w.beat()
    assert w.advertiser.offered() == {"a": False} and w.advertiser.published == 0  # a restart: calls wait for it
    w.beat(GRACE)
    assert w.advertiser.offered() == {} and w.stopped == [tool_queue(tool_spec(record("a")))]
    w.listing = listing(2, record("a"))
    w.beat()
    assert w.advertiser.offered() == {"a": False} and w.consumed == [tool_queue(tool_spec(record("a")))]


def test_a_host_that_is_gone_counts_as_every_server_down():
    w = World(record("a"))
    w.listing = None
    w.beat()
    assert w.advertiser.offered() == {"a": False}
    w.beat(GRACE)
    assert w.advertiser.offered() == {}


def test_a_queue_the_worker_did_not_confirm_is_not_advertised_until_it_does():
    w = World(record("a"))
    w.confirm = False
    w.listing = listing(1, record("a"), record("b"))
    w.beat()
    assert w.advertiser.offered() == {"a": False}
    w.confirm = True
    w.beat()
    assert w.advertiser.offered() == {"a": False, "b": False}


def test_a_host_that_does_not_answer_is_unavailable_after_the_timeout_so_the_heartbeat_goes_on(tmp_path):
    path = str(tmp_path / "host.sock")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(path)
    silent.listen(1)  # accepts the connection, never answers
    try:
        started = time.monotonic()
        with pytest.raises(HostUnavailable, match="did not answer in 0.3s"):
            HostClient(path).listing(0.3)
        assert time.monotonic() - started < 2
    finally:
        silent.close()
