"""Front doors: processes above the orchestrator that hold a `Fleet` and turn another agent's
requests into toolq calls (issue 29): `exec_server` speaks Codex's exec-server protocol, and
`mcp_server` offers the fleet's tools to MCP clients. Every process and file operation they run is
a call of the fleet (ledger, limits, sandbox, `toolq cancel`)."""
