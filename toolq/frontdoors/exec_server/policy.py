"""A client's sandbox policy against toolq's cell: never weaker than asked.

toolq runs every command in its cell whatever the client sends: the workspace writable, the rest
of the host out of reach or read-only, no network. A policy that asks for no more (none at all,
full access, workspace-write) is honoured by the cell; one that asks for less, a workspace the
command may not write (Codex's `-s read-only`), is one toolq cannot keep, so it is refused rather
than run weaker than asked. Codex's policy object (reference §6):
`{"permissions": {"file_system": {"type": "restricted", "entries": [{"path": ..., "access": ...}]}, ...}}`."""

from __future__ import annotations

from typing import Any

#: The special paths that cover the workspace, as Codex names them.
WORKSPACE_KINDS = frozenset({"root", "project_roots", "current_working_directory", "cwd", "workspace_roots"})

READ_ONLY = ("toolq runs every command in its cell, where the workspace is writable: it cannot keep the "
             "read-only workspace this sandbox policy asks for (give Codex -s workspace-write)")


def refusal(policy: Any, root: str) -> str | None:
    """Why toolq cannot honour `policy` (one sentence), or None when its cell is as strict or stricter."""
    if not isinstance(policy, dict):
        return None  # null: no policy asked
    permissions = policy.get("permissions")
    if not isinstance(permissions, dict):
        return None
    file_system = permissions.get("file_system", permissions.get("fileSystem"))
    if not isinstance(file_system, dict) or file_system.get("type") != "restricted":
        return None  # unrestricted / disabled: the cell is stricter
    entries = file_system.get("entries")
    if not isinstance(entries, list):
        return READ_ONLY
    return None if any(_grants_workspace_write(e, root) for e in entries) else READ_ONLY


def _grants_workspace_write(entry: Any, root: str) -> bool:
    if not isinstance(entry, dict) or entry.get("access") != "write":
        return False
    path = entry.get("path")
    if not isinstance(path, dict):
        return False
    value = path.get("value")
    if path.get("type") == "special":
        kind = value.get("kind") if isinstance(value, dict) else value
        return kind in WORKSPACE_KINDS
    if isinstance(value, str):  # a plain path: it covers the workspace when it is the root or above it
        value = value.removeprefix("file://").rstrip("/") or "/"
        return root == value or root.startswith(value.rstrip("/") + "/")
    return False
