"""The paths a client names (`file://` URIs of its own machine) ↔ paths in toolq's workspace.

The client works in `root` (Codex's `-C`); a path under it is the workspace-relative path the
fleet's tools take ("" for the root itself). A path elsewhere is not served: Codex probes every
ancestor's `.git` at start, and those are answered "not found" here, with no call. The mapping is
lexical (`..` folded before the prefix test); the worker's confined file operations are what keep
a link inside the workspace from leading out."""

from __future__ import annotations

import posixpath
from urllib.parse import quote, unquote, urlsplit

from toolq.frontdoors.exec_server.protocol import INVALID_PARAMS, RpcError


def local_path(uri: str) -> str:
    """`file:///a/b%20c` → `/a/b c`, normalised; -32602 for anything but an absolute file URI."""
    if not uri.startswith("file:"):
        raise RpcError(INVALID_PARAMS, "invalid URI: relative URL without a base" if "://" not in uri
                       else f"invalid URI: not a file URI: {uri[:200]}")
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise RpcError(INVALID_PARAMS, f"invalid URI: not a local file path: {uri[:200]}")
    path = unquote(parts.path)
    if not path.startswith("/") or "\0" in path:
        raise RpcError(INVALID_PARAMS, f"invalid URI: not an absolute path: {uri[:200]}")
    return posixpath.normpath(path).replace("//", "/", 1) if path != "/" else "/"


def file_uri(path: str) -> str:
    return "file://" + quote(path, safe="/")


class Root:
    """Where the client's workspace is, by the client's own paths."""

    def __init__(self, path: str) -> None:
        if not path.startswith("/"):
            raise ValueError(f"the workspace root must be an absolute path, not {path!r}")
        self.path = posixpath.normpath(path) if path != "/" else "/"

    def relative(self, uri: str) -> str | None:
        """The workspace-relative path of a client URI ("" for the root), None when outside it."""
        path = local_path(uri)
        if path == self.path:
            return ""
        prefix = self.path if self.path.endswith("/") else self.path + "/"
        return path[len(prefix):] if path.startswith(prefix) else None

    @property
    def uri(self) -> str:
        return file_uri(self.path)
