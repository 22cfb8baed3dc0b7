"""MCP servers' tools on the fleet: each server its own namespace (issue 16).

`config` reads `--mcp` and `TOOLQ_MCP_CONFIG`; `host` holds the sessions (one process per
worker); `worker` puts the tools in the catalog and forwards calls; `specs` turns listed tools
into `ToolSpec`s on both sides; `results` maps `CallToolResult`s; `fleet` is the Celery side.
"""
