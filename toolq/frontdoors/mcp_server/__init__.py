"""`toolq mcp-server`: the fleet's tools (built-ins, `--tools` modules, the MCP servers workers
host) offered to any MCP client over stdio or streamable HTTP, each call a toolq turn (issue 29)."""

from toolq.frontdoors.mcp_server.server import McpFrontDoor
from toolq.frontdoors.mcp_server.transports import MCP_PATH, serve_http, serve_stdio

__all__ = ["MCP_PATH", "McpFrontDoor", "serve_http", "serve_stdio"]
