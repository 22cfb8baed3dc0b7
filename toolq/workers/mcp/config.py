"""Which MCP servers a worker hosts: `--mcp 'NAME=COMMAND ARGS...'` and `TOOLQ_MCP_CONFIG=FILE`.

The file takes the shapes users already have: JSON `{"mcpServers": {NAME: {...}}}` (Claude
Desktop, Cursor) or TOML `[mcp_servers.NAME]` (Codex's `config.toml`). Every problem is one
`ConfigurationError` line naming the server and the field, raised before the worker starts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toolq.core.calls import FUNCTIONS_NAMESPACE
from toolq.core.errors import ConfigurationError, problems

#: A server name is a Responses API namespace, so it takes the characters a function name does.
SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: What a server inherits from the worker, whatever its config says: enough to find programs
#: and read its own home, never the fleet's secrets (REDIS_URL, TOOLQ_*, OPENAI_API_KEY, FLOWER_*).
BASIC_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR", "TZ")
#: ... nor a tracing vendor's key (the OTLP exporter's headers) or the worker's metrics directory.
_SECRET_ENV = re.compile(r"(REDIS_URL|CELERY_.*|TOOLQ_.*|OPENAI_.*|FLOWER_.*|OTEL_EXPORTER_OTLP.*_HEADERS|"
                         r"PROMETHEUS_MULTIPROC_DIR)")

# Codex's defaults (codex-mcp mcp_connection_manager.rs).
DEFAULT_STARTUP_TIMEOUT = 30.0
DEFAULT_TOOL_TIMEOUT = 120.0


class McpServerConfig(BaseModel):
    """One server, by Codex's field names (Claude Desktop's JSON uses a subset of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    """Set for the server as given (the user's own values)."""
    env_vars: list[str] = Field(default_factory=list)
    """Names passed through from the worker's environment (Codex); the fleet's secrets are refused."""
    cwd: str | None = None
    url: str | None = None
    """Streamable HTTP endpoint, in place of `command`."""
    http_headers: dict[str, str] = Field(default_factory=dict)
    type: Literal["stdio", "http", "streamable-http", "streamable_http"] | None = None
    """Cursor's and VS Code's transport tag; toolq tells the transport from `command` or `url`."""
    startup_timeout_sec: float = Field(default=DEFAULT_STARTUP_TIMEOUT, gt=0)
    tool_timeout_sec: float = Field(default=DEFAULT_TOOL_TIMEOUT, gt=0)
    enabled: bool = True
    enabled_tools: list[str] | None = None
    disabled_tools: list[str] = Field(default_factory=list)
    deferred: bool | None = None
    """Behind tool_search until a search finds them; None: when the server lists many tools."""

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either `command` (stdio) or `url` (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"`url` must be an http:// or https:// URL, not {self.url!r}")
        secret = next((v for v in self.env_vars if _SECRET_ENV.fullmatch(v)), None)
        if secret:
            raise ValueError(f"env_vars: {secret} is the worker's own secret and is never passed to a server")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def describe(self) -> str:
        """How the banner names it: `stdio: mcp-server-git --repository /r`, `http: https://...`."""
        if self.command is None:
            return f"http: {self.url}"
        return "stdio: " + shlex.join([self.command, *self.args])

    def environment(self, worker_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The whole environment the server starts with."""
        env = os.environ if worker_env is None else worker_env
        out = {k: env[k] for k in (*BASIC_ENV, *self.env_vars) if k in env}
        out.update(self.env)
        return out

    def offers(self, tool: str) -> bool:
        if tool in self.disabled_tools:
            return False
        return self.enabled_tools is None or tool in self.enabled_tools


def parse_flag(value: str) -> tuple[str, McpServerConfig]:
    """`NAME=COMMAND ARGS...` (split as a shell would) or `NAME=https://host/mcp`."""
    name, sep, rest = value.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigurationError(f"--mcp {value!r}: expected NAME=COMMAND ARGS... (e.g. --mcp 'git=mcp-server-git')")
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise ConfigurationError(f"--mcp {name}: {e}") from None
    if not words:
        raise ConfigurationError(f"--mcp {name}: no command after {name}=")
    if len(words) == 1 and words[0].startswith(("http://", "https://")):
        raw: dict[str, Any] = {"url": words[0]}
    else:
        raw = {"command": words[0], "args": words[1:]}
    return name, _server(name, raw, f"--mcp {name}")


def load_file(path: Path) -> dict[str, McpServerConfig]:
    """Servers from a JSON (`mcpServers`) or TOML (`mcp_servers`) file; disabled ones left out."""
    where = f"TOOLQ_MCP_CONFIG {path}"
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigurationError(f"{where}: cannot read it: {e.strerror}") from None
    is_json = path.suffix == ".json" or (path.suffix != ".toml" and text.lstrip().startswith("{"))
    key = "mcpServers" if is_json else "mcp_servers"
    try:
        data = json.loads(text) if is_json else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigurationError(f"{where}: not valid {'JSON' if is_json else 'TOML'}: {e}") from None
    servers = data.get(key) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ConfigurationError(f"{where}: no `{key}` table of servers")
    out = {}
    for name, raw in servers.items():
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{where}: server {name}: expected a table of settings")
        config = _server(name, raw, f"{where}: server {name}")
        if config.enabled:
            out[name] = config
    return out


def load_servers(flags: list[str], file: Path | None) -> dict[str, McpServerConfig]:
    """The file's servers, then the flags'; one name given twice is an error."""
    servers = load_file(file) if file is not None else {}
    for value in flags:
        name, config = parse_flag(value)
        if name in servers:
            raise ConfigurationError(f"--mcp {name}: a server named {name} is already configured")
        servers[name] = config
    return servers


def _server(name: str, raw: dict[str, Any], where: str) -> McpServerConfig:
    if not SERVER_NAME.fullmatch(name):
        raise ConfigurationError(f"{where}: a server name is its tools' namespace: letters, digits, _ and - "
                                 "(at most 64)")
    if name == FUNCTIONS_NAMESPACE:
        raise ConfigurationError(f"{where}: `{name}` also names the top-level tools (Codex's namespace for them); "
                                 "choose another server name")
    try:
        return McpServerConfig.model_validate(raw)
    except ValidationError as e:
        field, message, kind = problems(e)[0]
        if kind == "extra_forbidden":
            message = "unknown setting"
        raise ConfigurationError(f"{where}: {field + ': ' if field else ''}{message}") from None
