"""The host's side of its socket (`host.Connection`): a reply per request line, in order; a client
that goes away mid-call cancels the call. Real Unix sockets; stand-in servers, no MCP SDK session."""

from __future__ import annotations

import asyncio

from toolq.workers.mcp.host import Host, HostConfig
from toolq.workers.mcp.wire import CallReply, CallRequest, Listing, ListRequest, ServerState


class StandInServer:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.broken = False

    def snapshot(self) -> ServerState:
        if self.broken:
            raise RuntimeError("a bug in the listing")
        return ServerState(name="s", transport="stdio", state="ready")

    async def call(self, req: CallRequest) -> CallReply:
        if req.tool == "boom":
            raise RuntimeError("a bug in the host")
        if req.tool == "slow":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return CallReply(refusal=f"ran {req.tool}")


def call(tool: str, server: str = "s") -> bytes:
    return CallRequest(server=server, tool=tool, arguments={}, digest="d", timeout=5).model_dump_json().encode() + b"\n"


async def with_host(path: str, body) -> None:
    host = Host(HostConfig(servers={}, environments={}))
    stand_in = StandInServer()
    host.servers["s"] = stand_in  # type: ignore[assignment]
    server = await asyncio.get_running_loop().create_unix_server(host.connection, path=path)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        await body(reader, writer, stand_in)
    finally:
        server.close()


def test_each_request_line_gets_its_reply_in_order(tmp_path):
    async def body(reader, writer, stand_in):
        # Written at once: the second waits until the first call is answered.
        writer.write(b"not json\n" + call("a") + ListRequest().model_dump_json().encode() + b"\n"
                     + call("x", server="nope") + call("boom"))
        replies = [await asyncio.wait_for(reader.readline(), 5) for _ in range(5)]
        assert "bad request to the MCP host" in CallReply.model_validate_json(replies[0]).refusal
        assert CallReply.model_validate_json(replies[1]).refusal == "ran a"
        assert [s.name for s in Listing.model_validate_json(replies[2]).servers] == ["s"]
        assert CallReply.model_validate_json(replies[3]).refusal == "no MCP server named nope on this worker; not run"
        assert CallReply.model_validate_json(replies[4]).refusal == (
            "the MCP host failed the call: RuntimeError: a bug in the host")
        stand_in.broken = True
        writer.write(ListRequest().model_dump_json().encode() + b"\n")
        assert CallReply.model_validate_json(await asyncio.wait_for(reader.readline(), 5)).refusal == (
            "the MCP host failed the request: RuntimeError: a bug in the listing")
        writer.close()

    asyncio.run(with_host(str(tmp_path / "h.sock"), body))


def test_a_client_that_goes_away_mid_call_cancels_it(tmp_path):
    async def body(reader, writer, stand_in):
        writer.write(call("slow"))
        await asyncio.wait_for(stand_in.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(stand_in.cancelled.wait(), 5)

    asyncio.run(with_host(str(tmp_path / "h.sock"), body))
