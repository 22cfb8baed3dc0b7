"""One settings model, read from the environment (and overridden by CLI flags).

Both sides read it: the orchestrator for the model endpoint, turn limits and Redis; workers for
Redis and their queues. Bad values give one clear line naming the setting.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from toolq.core import import_path, redis_target
from toolq.core.errors import ConfigurationError, problems
from toolq.core.reasoning import ReasoningSetting
from toolq.core.redis_target import SENTINEL_SCHEME, RedisTarget, parse_redis_url, url_with_db
from toolq.core.tool_limits import ToolLimit, parse_tool_limits

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"

#: A workspace is where the model's commands may write: never in the system the sandbox mounts
#: read-only or the kernel's trees, nor a folder that holds other users' and turns' files.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev", "/proc",
                "/sys", "/run", "/nix/store", "/snap", "/lost+found", "/var/log", "/var/spool", "/var/mail",
                "/var/cache", "/var/backups")
#: Folders too wide to be one (their own files are other users' and turns', or a home's dotfiles,
#: which run outside any sandbox at the next login); what is inside them may be.
TOO_WIDE = ("/", "/home", "/root", "/opt", "/srv", "/tmp", "/var", "/var/lib", "/var/tmp", "/var/www", "/mnt",
            "/media")


#: One SSE event of the model's stream at most, unless `max_sse_event_bytes` says otherwise.
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

#: What `store` may be (besides `redis`): an S3 bucket, its name as S3 allows one, and a key prefix.
S3_STORE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[A-Za-z0-9._/-]*))?$")
#: The largest blob the Redis store takes: a Redis string holds 512 MiB at most (`proto-max-bulk-len`).
REDIS_STORE_MAX_BLOB_MB = 512


def s3_store_location(store: str) -> tuple[str, str] | None:
    """`s3://BUCKET/PREFIX` -> (bucket, prefix without its slashes); `redis` -> None; else ValueError."""
    if store == "redis":
        return None
    found = S3_STORE.match(store)
    if not found:
        raise ValueError("must be redis or s3://BUCKET/PREFIX (a bucket name of 3 to 63 lowercase letters, "
                         "digits, '.' and '-')")
    return found["bucket"], (found["prefix"] or "").strip("/")


def absolute_workspace(path: str | Path) -> Path:
    """The path workers are sent: absolute from where toolq starts (a worker resolves a relative
    one against its own folder), `..` folded, symlinks kept (workers must see the same path,
    which may reach a shared volume through a link only this host has resolved)."""
    return Path(os.path.normpath(Path(path).expanduser().absolute()))


@functools.cache
def _homes() -> tuple[str, ...]:
    """The password database's home directories, as written and with links resolved (`/home` may
    be a link to `/data/home`), read once per process: a directory service can make it slow."""
    homes = {os.path.normpath(entry.pw_dir) for entry in pwd.getpwall() if entry.pw_dir}
    homes |= {os.path.realpath(home) for home in homes}
    return tuple(sorted(homes - {"/"}))


def _home_in(where: str) -> str | None:
    """A home directory of the password database that `where` is or holds (system users' homes
    lie outside /home: /var/lib/postgresql, /var/www...); "/" and homes that are system trees
    (`/bin`, `/dev`) are judged as folders already."""
    for home in _homes():
        if home == where or home.startswith(where.rstrip("/") + "/"):
            return home
    return None


def workspace_problem(path: Path, *, must_exist: bool = True) -> str | None:
    """Why `path` (from `absolute_workspace`) cannot be a turn's workspace, if it cannot. A link
    is judged by where it leads too. A relative one (a forged record's) would be read against the
    reader's own folder."""
    if not path.is_absolute():
        return f"workspace {path} is not an absolute path"
    try:
        leads_to = path.resolve()
    except (OSError, RuntimeError) as e:  # a link loop, a folder we may not read
        return f"workspace {path} cannot be resolved: {e}"
    for where in dict.fromkeys((str(path), str(leads_to))):
        in_home = where.startswith("/home/") and where.count("/") == 2  # a user's home itself
        if in_home or where in TOO_WIDE or any(where == t or where.startswith(t + "/") for t in SYSTEM_TREES):
            return (f"workspace {path} is a system or shared directory, and the model's commands may write in "
                    "their workspace: give a project's folder (--workspace, TOOLQ_WORKSPACE, or Session(workspace=))")
    for where in dict.fromkeys((str(path), str(leads_to))):
        if home := _home_in(where):
            return (f"workspace {path} is or holds a user's home ({home}), whose dotfiles run outside any sandbox at "
                    "that user's next login: give a project's folder (--workspace, TOOLQ_WORKSPACE, or "
                    "Session(workspace=))")
    if entry := import_path.workspace_on_import_path(str(path)):
        return (f"workspace {path} holds or lies on toolq's import path ({entry}): the model's commands could plant "
                f"code there that toolq would run unsandboxed; keep tool modules ({import_path.TOOLS_PATH_ENV}) and "
                "virtualenvs outside the workspace, or give another folder (--workspace)")
    if must_exist and not path.is_dir():
        return f"workspace {path} is not a directory"
    return None

# setting name -> environment variables, first set wins
ENV = {
    "redis_url": ("REDIS_URL", "CELERY_BROKER_URL"),
    "result_url": ("TOOLQ_RESULT_URL", "CELERY_RESULT_BACKEND"),
    # a sentinel:// URL's primary (toolq/core/redis_target.py)
    "sentinel_master": (redis_target.MASTER_ENV,),
    "sentinel_password": (redis_target.PASSWORD_ENV,),
    "openai_base_url": ("OPENAI_BASE_URL",),
    "openai_api_key": ("OPENAI_API_KEY",),
    "model": ("TOOLQ_MODEL",),
    "instructions": ("TOOLQ_INSTRUCTIONS",),
    "reasoning_effort": ("TOOLQ_REASONING_EFFORT",),
    "workspace": ("TOOLQ_WORKSPACE",),
    "tools": ("TOOLQ_TOOLS",),
    "queues": ("TOOLQ_QUEUES",),
    "concurrency": ("TOOLQ_CONCURRENCY",),
    "turn_timeout": ("TOOLQ_TURN_TIMEOUT",),
    "turn_lease": ("TOOLQ_TURN_LEASE",),
    "max_steps": ("TOOLQ_MAX_STEPS",),
    "turn_store_mb": ("TOOLQ_TURN_STORE_MB",),
    "request_max_retries": ("TOOLQ_REQUEST_MAX_RETRIES",),
    "stream_max_retries": ("TOOLQ_STREAM_MAX_RETRIES",),
    "stream_idle_timeout": ("TOOLQ_STREAM_IDLE_TIMEOUT",),
    "max_sse_event_bytes": ("TOOLQ_MAX_SSE_EVENT_BYTES",),
    # limits across the fleet (toolq/orchestrator/limits.py)
    "max_parallel_calls": ("TOOLQ_MAX_PARALLEL_CALLS",),
    "tool_limits": ("TOOLQ_TOOL_LIMITS",),
    "limit_lease": ("TOOLQ_LIMIT_LEASE",),
    "flower_user": ("FLOWER_USER",),
    "flower_password": ("FLOWER_PASSWORD",),
    "flower_port": ("FLOWER_PORT",),
    "flower_address": ("FLOWER_ADDRESS",),
    "signing_key": ("TOOLQ_SIGNING_KEY",),
    "log_tool_output": ("TOOLQ_LOG_TOOL_OUTPUT",),
    # the sandbox every command of a shell tool runs in (toolq/workers/isolation)
    "sandbox": ("TOOLQ_SANDBOX",),
    "sandbox_network": ("TOOLQ_SANDBOX_NETWORK",),
    "sandbox_env": ("TOOLQ_SANDBOX_ENV",),
    "sandbox_read": ("TOOLQ_SANDBOX_READ",),
    "sandbox_etc": ("TOOLQ_SANDBOX_ETC",),
    "sandbox_memory_mb": ("TOOLQ_SANDBOX_MEMORY_MB",),
    "sandbox_processes": ("TOOLQ_SANDBOX_PROCESSES",),
    "sandbox_worker_processes": ("TOOLQ_SANDBOX_WORKER_PROCESSES",),
    "sandbox_worker_memory_mb": ("TOOLQ_SANDBOX_WORKER_MEMORY_MB",),
    "sandbox_worker_cpus": ("TOOLQ_SANDBOX_WORKER_CPUS",),
    "sandbox_conversation_processes": ("TOOLQ_SANDBOX_CONVERSATION_PROCESSES",),
    "sandbox_conversation_memory_mb": ("TOOLQ_SANDBOX_CONVERSATION_MEMORY_MB",),
    "sandbox_cpu_seconds": ("TOOLQ_SANDBOX_CPU_SECONDS",),
    "sandbox_file_mb": ("TOOLQ_SANDBOX_FILE_MB",),
    "sandbox_cells": ("TOOLQ_SANDBOX_CELLS",),
    # exec_command sessions (toolq/workers/sessions)
    "sessions": ("TOOLQ_SESSIONS",),
    "session_limit": ("TOOLQ_SESSION_LIMIT",),
    "session_idle": ("TOOLQ_SESSION_IDLE",),
    "session_lifetime": ("TOOLQ_SESSION_LIFETIME",),
    # a running command's output, streamed to the live view and --json (toolq/workers/streaming.py)
    "stream_output": ("TOOLQ_STREAM_OUTPUT",),
    # MCP servers a worker hosts (toolq/workers/mcp)
    "mcp": ("TOOLQ_MCP",),
    "mcp_config": ("TOOLQ_MCP_CONFIG",),
    # an orchestrator's Redis pool (toolq/orchestrator/transport/redis_pool.py)
    "redis_connections": ("TOOLQ_REDIS_CONNECTIONS",),
    # how often an idle worker polls its queues (toolq/workers/config.py)
    "worker_poll": ("TOOLQ_WORKER_POLL",),
    # environments: workspaces on the fleet (toolq/workers/environments, toolq/workers/store)
    "store": ("TOOLQ_STORE",),
    "store_ttl": ("TOOLQ_STORE_TTL",),
    "store_max_blob_mb": ("TOOLQ_STORE_MAX_BLOB_MB",),
    "host_id": ("TOOLQ_HOST_ID",),
    "env_root": ("TOOLQ_ENV_ROOT",),
    "env_disk_mb": ("TOOLQ_ENV_DISK_MB",),
    "env_idle": ("TOOLQ_ENV_IDLE",),
    "env_lifetime": ("TOOLQ_ENV_LIFETIME",),
    "upload_max_mb": ("TOOLQ_UPLOAD_MAX_MB",),
    "upload_max_files": ("TOOLQ_UPLOAD_MAX_FILES",),
    # toolq exec-server (toolq/frontdoors/exec_server)
    "exec_server_resume": ("TOOLQ_EXEC_SERVER_RESUME",),
    "exec_server_token": ("TOOLQ_EXEC_SERVER_TOKEN",),
    # toolq mcp-server (toolq/frontdoors/mcp_server)
    "mcp_server_token": ("TOOLQ_MCP_SERVER_TOKEN",),
    # Telemetry (toolq/telemetry): traces are turned on by the standard OTEL_* variables
    "metrics_port": ("TOOLQ_METRICS_PORT",),
    "trace_url": ("TOOLQ_TRACE_URL",),
}

SECRETS = {"openai_api_key", "flower_password", "signing_key", "sentinel_password", "exec_server_token",
           "mcp_server_token"}


class Settings(BaseModel):
    """toolq's configuration: each field has an environment variable (`Settings.load()` reads them)."""

    redis_url: str | None = None
    """Broker and ledger. Unset: `toolq run`/`demo` start an embedded Redis-protocol server."""
    result_url: str | None = None
    """Celery result backend; defaults to the broker's server, database 1."""
    sentinel_master: str | None = Field(default=None, validate_default=True)
    """The name the sentinels monitor: needed, and only read, when `REDIS_URL` or `TOOLQ_RESULT_URL`
    is a `sentinel://` URL. Every client then asks the sentinels for the current primary."""
    sentinel_password: str | None = None
    """The sentinels' own password (their `requirepass`), if they have one; the data nodes' is in the URL."""
    openai_base_url: str = DEFAULT_OPENAI_BASE_URL
    openai_api_key: str | None = None
    model: str = "gpt-5.5"
    instructions: str | None = None
    """The request's `instructions`; unset: a short default naming the workspace and the tools."""
    reasoning_effort: ReasoningSetting = "auto"
    """Sent as `reasoning.effort`, with encrypted reasoning asked for so that stateless requests
    can carry it back. `auto`: `medium` for reasoning models (gpt-5*, o*), no `reasoning` field
    for others; `off`: never one (`toolq.core.reasoning`)."""
    workspace: Path = Field(default_factory=Path.cwd)
    tools: list[str] = Field(default_factory=list)
    """Extra modules whose `@tool` declarations both sides load."""
    queues: list[str] = Field(default_factory=list)
    """Queues a worker consumes; empty: every queue of its catalog."""
    concurrency: int = Field(default=4, ge=1, le=256)
    turn_timeout: float = Field(default=3600.0, gt=0)
    turn_lease: float = Field(default=15.0, ge=1.0)
    """Seconds a running turn's lease outlives its orchestrator's last heartbeat; then the turn
    shows as `orphaned` and `toolq resume` may take it over."""
    max_steps: int = Field(default=100, ge=1)
    turn_store_mb: int = Field(default=64, ge=1, le=1_000_000)
    """MiB one turn may make toolq keep in Redis (durable.py's `StoreBudget`): the conversation it
    starts from, the model's items, each call's task message and ledger record, the tools'
    outputs. A model server streaming big or many items must not grow Redis without bound: past it
    the turn stops with one line (an output that does not fit is kept as a line saying so)."""
    request_max_retries: int = Field(default=4, ge=0, le=100)
    """Model HTTP retries (5xx, transport errors) before any SSE byte arrives."""
    stream_max_retries: int = Field(default=5, ge=0, le=100)
    """Whole-request retries after a model stream broke mid-way."""
    stream_idle_timeout: float = Field(default=300.0, gt=0)
    """Seconds without a byte from the model before its stream counts as dead."""
    max_sse_event_bytes: int = Field(default=DEFAULT_MAX_EVENT_BYTES, ge=1024)
    """A bigger SSE event from the model is dropped unread, so memory stays bounded; one that may
    have held a call (`output_item.done`) breaks the stream, which is retried."""
    max_parallel_calls: int = Field(default=16, ge=1, le=10_000)
    """Calls of one turn in flight at once (past this cap they wait as `throttled`, in call order),
    so one response's fan-out cannot fill the queue ahead of other turns."""
    tool_limits: dict[str, ToolLimit] = Field(default_factory=dict)
    """Per tool name (`exec_command`, `git.git_log`): `max_concurrency` and `rate_limit` across the
    fleet, over what the tool declares; JSON in TOOLQ_TOOL_LIMITS (toolq/core/tool_limits.py)."""
    limit_lease: float = Field(default=10.0, ge=1.0, le=3600.0)
    """Seconds a max_concurrency permit outlives its holders' last renewal: a permit held by a
    crashed worker or orchestrator is free again after this."""
    flower_user: str | None = None
    flower_password: str | None = None
    flower_port: int = Field(default=5555, ge=0, le=65535)
    flower_address: str = "127.0.0.1"
    signing_key: str | None = None
    """The fleet's shared HMAC key: the orchestrator signs calls, workers sign results
    (toolq/core/signing.py). Required with REDIS_URL; the embedded default generates one."""
    log_tool_output: bool = False
    """Debugging only: put tool output in the workers' task-succeeded log lines and Flower's
    results (by default they carry status and sizes)."""
    # --- the sandbox of shell tools' commands (toolq/workers/isolation) ---
    sandbox: Literal["auto", "bwrap", "landlock", "none"] = "auto"
    """auto: bubblewrap if it runs here, else Landlock; none runs commands unconfined (warned)."""
    sandbox_network: Literal["none", "host"] = "none"
    # --- exec_command sessions (toolq/workers/sessions) ---
    sessions: bool = True
    """Workers run exec_command through a session host, so a command may outlive its call as a
    session; off: every command runs to completion in its pool child, and write_stdin finds none."""
    session_limit: int = Field(default=64, ge=1, le=1024)
    """Live sessions one conversation may hold across the fleet (Codex's limit is 64)."""
    session_idle: float = Field(default=1800.0, gt=0)
    """Seconds without a write_stdin after which a session is killed."""
    session_lifetime: float = Field(default=4 * 3600.0, gt=0)
    """Seconds after which a session is killed whatever it does."""
    stream_output: bool = True
    """A watched turn asks workers to publish a running exec_command's output as it comes (for the
    live view and `--json`'s `item.updated`); off: a command shows nothing until it ends."""
    sandbox_env: list[str] = Field(default_factory=list)
    """Extra environment variables a command may see (besides PATH, LANG, TERM, the pagers...)."""
    sandbox_read: list[str] = Field(default_factory=list)
    """Extra directories a command may read (besides the system directories and its workspace)."""
    sandbox_etc: list[str] = Field(default_factory=list)
    """Extra entries of /etc a command may read (names under /etc), besides the allowlist."""
    sandbox_memory_mb: int = Field(default=2048, ge=16)
    sandbox_processes: int = Field(default=256, ge=8)
    sandbox_worker_processes: int = Field(default=2048, ge=8)
    """Processes of all of a worker's commands and sessions together: sessions must not multiply the
    per-call limit (64 sessions of 256 processes each would pass the host's pid_max)."""
    sandbox_worker_memory_mb: int = Field(default=8192, ge=16)
    """Memory of all of a worker's commands and sessions together, as `sandbox_worker_processes`."""
    sandbox_worker_cpus: float = Field(default=0.0, ge=0.0)
    """CPUs all of a worker's commands and sessions may use together (a CFS quota; 0: no quota, and
    they still share the CPU as one group beside the worker's own processes, never 64 against 1)."""
    sandbox_conversation_processes: int = Field(default=1024, ge=8)
    """Processes of one conversation's commands and sessions together on a worker, so that one
    conversation cannot hold the whole worker's bound while another's commands wait."""
    sandbox_conversation_memory_mb: int = Field(default=0, ge=0)
    """Memory of one conversation's commands and sessions together on a worker (0: none). Off by
    default: on cgroup v1 a slot's memory count holds page cache that an earlier conversation's
    commands left there, so another conversation could be refused and its sessions killed."""
    sandbox_cpu_seconds: int = Field(default=300, ge=1)
    sandbox_file_mb: int = Field(default=1024, ge=1)
    sandbox_cells: bool = True
    """bubblewrap: a session host's slot keeps one sandbox per workspace and forks each command in
    it, in new namespaces of its own (toolq/workers/isolation/cell.py); off, bwrap starts per command."""
    mcp: list[str] = Field(default_factory=list)
    """MCP servers a worker hosts, each `NAME=COMMAND ARGS...` (`toolq worker --mcp`; toolq/workers/mcp/);
    in `TOOLQ_MCP`, one per line (a command may hold commas)."""
    mcp_config: Path | None = None
    """A JSON (`mcpServers`) or TOML (`[mcp_servers.NAME]`) file of MCP servers a worker hosts."""
    redis_connections: int = Field(default=64, ge=2, le=10_000)
    """Connections an orchestrator process opens for its ledger at most; more commands at once wait
    for one (never fail). Bounds commands in flight, not turns: no turn holds a connection."""
    worker_poll: float | None = Field(default=None, ge=0.05, le=30.0)
    """Seconds a worker's BRPOP on its queues waits for a message before it is sent again (None:
    kombu's 1 s). A warm shutdown waits for the one in flight; the embedded stack's workers poll
    every 0.1 s. Only workers read it: kombu also sleeps this long between a client's empty polls."""
    # --- environments: workspaces that live on the fleet (toolq/workers/environments) ---
    store: str = "redis"
    """The workspace store of uploads and checkpoints: `redis` (the broker's Redis) or
    `s3://BUCKET/PREFIX` (S3-compatible; endpoint and credentials from the standard `AWS_*` variables)."""
    store_ttl: float = Field(default=7 * 86400.0, gt=0)
    """Seconds a blob is kept in the Redis store after its last use."""
    store_max_blob_mb: int = Field(default=256, ge=1, le=4096)
    """The largest blob (an upload's or a checkpoint's tar) the store takes: at most 512 with the
    Redis store (a Redis string's limit); up to 4096 with S3."""
    host_id: str | None = None
    """The name of this worker's machine in placement (default: its hostname). Worker processes with
    one host id must share one `env_root` (the same machine)."""
    env_root: Path | None = None
    """Where a host keeps its base cache and environments (default: /var/lib/toolq/envs as root, else
    $XDG_STATE_HOME/toolq/envs)."""
    env_disk_mb: int = Field(default=20_480, ge=1)
    """Disk the environments of one host may use together: a new one past it is refused."""
    env_idle: float = Field(default=3600.0, gt=0)
    """Seconds an environment may go unused before its host destroys it."""
    env_lifetime: float = Field(default=86_400.0, gt=0)
    """Seconds after which an environment is destroyed whatever it does."""
    upload_max_mb: int = Field(default=256, ge=1)
    """The largest folder `--upload` packs (its files' bytes)."""
    upload_max_files: int = Field(default=100_000, ge=1)
    """The most files `--upload` packs."""
    exec_server_resume: float = Field(default=60.0, ge=0)
    """Seconds `toolq exec-server` keeps a client session whose connection dropped (its processes
    running, their output kept) for the client to resume; then the session is reaped."""
    exec_server_token: str | None = None
    """The bearer token `toolq exec-server` asks of every WebSocket client (`Authorization: Bearer`
    or `?token=` in the URL); needed to listen on an address other than loopback."""
    mcp_server_token: str | None = None
    """The bearer token `toolq mcp-server` asks of every HTTP client (`Authorization: Bearer`);
    needed to listen on an address other than loopback."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus metrics on this port (`/metrics`): a worker's (`toolq worker --metrics-port`
    says the same) or an orchestrator's (`toolq run`, `toolq batch`, a `Fleet`). Unset: none."""
    trace_url: str | None = None
    """A trace viewer's address with `{trace_id}` in it (Jaeger: `http://HOST:16686/trace/{trace_id}`):
    Flower and `toolq run` show each call's and turn's trace there when tracing is on."""

    @field_validator("redis_url", "result_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v and v.startswith(SENTINEL_SCHEME):
            parse_redis_url(v, master="checked-later")  # its form here; the master name in _sentinel_master
            return v
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss://, unix:// or sentinel:// URL")
        if v and v.startswith("rediss://") and "ssl_cert_reqs=" not in v:
            # Celery's Redis result backend refuses a TLS URL without it (at first use, not here).
            raise ValueError("a rediss:// URL needs ?ssl_cert_reqs=required (or optional, none)")
        return v

    @field_validator("sentinel_master")
    @classmethod
    def _sentinel_master(cls, v: str | None, info: ValidationInfo) -> str | None:
        if not v:
            for name in ("redis_url", "result_url"):
                if (info.data.get(name) or "").startswith(SENTINEL_SCHEME):
                    raise ValueError(f"{ENV[name][0]} is a sentinel:// URL: set {redis_target.MASTER_ENV} to the "
                                     "name of the master the sentinels monitor")
        return v or None

    @field_validator("store")
    @classmethod
    def _store_url(cls, v: str) -> str:
        s3_store_location(v)
        return v

    @field_validator("store_max_blob_mb")
    @classmethod
    def _redis_blob_cap(cls, v: int, info: ValidationInfo) -> int:
        # `store` is checked first (declared first): when it failed, it is the error to report.
        if info.data.get("store") == "redis" and v > REDIS_STORE_MAX_BLOB_MB:
            raise ValueError(f"at most {REDIS_STORE_MAX_BLOB_MB} with TOOLQ_STORE=redis (a Redis string's limit); "
                             "use an s3:// store for larger blobs")
        return v

    @field_validator("workspace")
    @classmethod
    def _absolute_workspace(cls, v: Path) -> Path:
        return absolute_workspace(v)

    @field_validator("signing_key")
    @classmethod
    def _key_length(cls, v: str | None) -> str | None:
        from toolq.core.signing import GENERATE, MIN_KEY_CHARS

        if v is not None and len(v) < MIN_KEY_CHARS:
            raise ValueError(f"must have at least {MIN_KEY_CHARS} characters; generate one with {GENERATE}")
        return v

    @field_validator("tools", "queues", "sandbox_env", "sandbox_read", "sandbox_etc", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @field_validator("tool_limits", mode="before")
    @classmethod
    def _tool_limits(cls, v: Any) -> Any:
        return parse_tool_limits(v)

    @field_validator("mcp", mode="before")
    @classmethod
    def _line_list(cls, v: Any) -> Any:
        return [s.strip() for s in v.splitlines() if s.strip()] if isinstance(v, str) else v

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Environment first, then CLI overrides (None means "not given")."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, variables in ENV.items():
            for var in variables:
                if env.get(var):
                    values[name] = env[var]
                    break
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            path, message, _ = problems(e)[0]
            name = path.partition(".")[0] or "settings"
            from_flag = overrides.get(name) is not None
            source = None if from_flag else next((v for v in ENV.get(name, ()) if env.get(v)), None)
            where = f"{name} ({source})" if source else name
            raise ConfigurationError(f"invalid setting {where}: {message}") from None

    def result_backend_url(self) -> str | None:
        """The result backend's URL as Celery is given it (a Sentinel one in `celery_url`'s form)."""
        target = self.result_target()
        return target.celery_url() if target else None

    def redis_target(self) -> RedisTarget | None:
        """The broker's and ledger's Redis, for `toolq.workers.redis_clients`."""
        return self._target(self.redis_url)

    def result_target(self) -> RedisTarget | None:
        """The result backend's Redis: `result_url`, else the broker's server, database 1."""
        if self.result_url or not self.redis_url:
            return self._target(self.result_url)
        target = self._target(self.redis_url)
        return target.with_db(1) if target else None

    def _target(self, url: str | None) -> RedisTarget | None:
        return parse_redis_url(url, self.sentinel_master, self.sentinel_password) if url else None

    def masked(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        for key in SECRETS:
            if out.get(key):
                out[key] = "****" + out[key][-4:] if len(out[key]) > 8 else "****"
        for key in ("redis_url", "result_url"):
            if out.get(key):
                out[key] = mask_url_password(out[key])
        return out


def mask_url_password(url: str) -> str:
    if ";" in url:  # Celery's list form: one URL per Sentinel node
        return ";".join(mask_url_password(part) for part in url.split(";"))
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:****@{host}"


_with_db = url_with_db  # its older name (tests)
