"""`toolq exec-server`: Codex's exec-server protocol (JSON-RPC over WebSocket or stdio) backed by
the fleet. `protocol` (messages and error codes), `paths` (file:// URIs and the workspace),
`processes` (one process's numbered events), `session` (a client session: its conversation, turn,
environment and processes), `server` (the transports)."""
