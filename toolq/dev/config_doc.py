"""docs/configuration.md, generated from the settings model so that the two cannot drift.

Each setting's row comes from `toolq.core.settings`: its environment variables from `ENV`,
its default and its allowed values from the pydantic field, whether it is a secret from `SECRETS`,
and its description from the docstring under the field. This module adds only what the model
does not say: which table a setting belongs in (`GROUPS`), a description for a field that has no
docstring and a practical note for some others (`NOTES`), and the command-line flag that
overrides it (`FLAGS`). tests/unit/test_docs.py fails when the file differs from `render()`, or
when a setting has no group or no description. To write the file:

    .venv/bin/python -m toolq.dev.config_doc > docs/configuration.md
"""

from __future__ import annotations

import ast
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from toolq.core import settings as settings_module
from toolq.core.import_path import TOOLS_PATH_ENV
from toolq.core.settings import ENV, SECRETS, Settings
from toolq.core.signing import GENERATE, MIN_KEY_CHARS

HEAD = """\
# Configuration

Every setting, the environment variable that sets it, its default and what it does. This file is
generated from the settings model (`toolq/core/settings.py`) by
`toolq/dev/config_doc.py`; do not edit it by hand.

One settings model reads the environment, on the orchestrator and on the workers alike.
Command-line flags override it. `toolq config` prints the values toolq will use, with secrets
masked. A bad value stops the command with exit status 2 and one line that names the setting,
such as `toolq: invalid setting concurrency (TOOLQ_CONCURRENCY): Input should be a valid
integer, ...`. Where a setting has two variables, the first one set wins. Switches take `1` or
`0` (also `true`/`false`); lists are comma-separated unless said otherwise; times are in seconds.
"""

#: The tables, in order: a title, who reads the settings, and the settings (field names).
GROUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("Redis and the fleet", "Both sides. Every worker and orchestrator of one fleet needs the same values.",
     ("redis_url", "result_url", "sentinel_master", "sentinel_password", "signing_key", "redis_connections")),
    ("The model", "The orchestrator (`toolq run`, `resume`, `batch`, `Session`).",
     ("openai_base_url", "openai_api_key", "model", "instructions", "reasoning_effort", "request_max_retries",
      "stream_max_retries", "stream_idle_timeout", "max_sse_event_bytes")),
    ("Turns", "The orchestrator; workers read `TOOLQ_TOOLS` too.",
     ("workspace", "tools", "max_steps", "turn_timeout", "turn_lease", "turn_store_mb")),
    ("Workers", "`toolq worker`.",
     ("queues", "concurrency", "worker_poll", "log_tool_output")),
    ("Limits across the fleet", "The orchestrator takes the limits; workers hold and renew a call's permit "
     "([operating.md](operating.md#limits-across-the-fleet)).",
     ("max_parallel_calls", "tool_limits", "limit_lease")),
    ("Flower", "`toolq flower`.",
     ("flower_user", "flower_password", "flower_address", "flower_port")),
    ("The sandbox of shell commands", "Workers: each command of `exec_command` (and of a tool that asks for the "
     "sandbox) runs in it ([operating.md](operating.md#the-sandbox-of-exec_command)).",
     ("sandbox", "sandbox_network", "sandbox_env", "sandbox_read", "sandbox_etc", "sandbox_memory_mb",
      "sandbox_processes", "sandbox_cpu_seconds", "sandbox_file_mb", "sandbox_worker_processes",
      "sandbox_worker_memory_mb", "sandbox_worker_cpus", "sandbox_conversation_processes",
      "sandbox_conversation_memory_mb", "sandbox_cells")),
    ("Sessions and live output", "Workers, except `TOOLQ_STREAM_OUTPUT`, which the orchestrator sends with each call "
     "([operating.md](operating.md#long-running-commands-sessions)).",
     ("sessions", "session_limit", "session_idle", "session_lifetime", "stream_output")),
    ("MCP servers", "Workers: the servers each one hosts "
     "([operating.md](operating.md#mcp-servers-tools-on-the-fleet)).",
     ("mcp", "mcp_config")),
    ("Environments", "Workers keep environments (`env_*`, `host_id`); the orchestrator packs uploads; both "
     "read and write the store ([operating.md](operating.md#environments-workspaces-on-the-fleet)).",
     ("store", "store_ttl", "store_max_blob_mb", "host_id", "env_root", "env_disk_mb", "env_idle", "env_lifetime",
      "upload_max_mb", "upload_max_files")),
    ("toolq exec-server", "The exec-server front door ([front-doors.md](front-doors.md)).",
     ("exec_server_resume", "exec_server_token")),
    ("toolq mcp-server", "The MCP front door ([front-doors.md](front-doors.md)).", ("mcp_server_token",)),
    ("Telemetry", "Prometheus metrics and links to traces; traces themselves are turned on by the standard "
     "`OTEL_*` variables ([operating.md](operating.md#traces-and-metrics)).", ("metrics_port", "trace_url")),
]

#: What a field's docstring does not say: its whole description when it has none, else a note
#: that follows the docstring.
NOTES: dict[str, str] = {
    "redis_url": "`redis://`, `rediss://` (add `?ssl_cert_reqs=required`), `unix://`, or Sentinel in Celery's form "
                 "`sentinel://:PASSWORD@host1:26379;sentinel://:PASSWORD@host2:26379/0` (the password is the data "
                 "nodes'; set `TOOLQ_SENTINEL_MASTER`; [operating.md](operating.md#redis-failover-with-sentinel)). "
                 "`toolq worker` needs one: a worker never starts an embedded server.",
    "openai_base_url": "The Responses API endpoint: OpenAI, or a local server such as vLLM or Ollama.",
    "openai_api_key": "The bearer token. Only a loopback base URL may go without one.",
    "model": "The model named in each request.",
    "reasoning_effort": "A reasoning item that comes without its encrypted content is left out of the next "
                        "request (counted, logged once).",
    "workspace": "The directory the tools work in. It is made absolute where toolq starts, and must be visible to "
                 "every worker at the same path. System and shared folders, users' homes and folders on toolq's "
                 "import path are refused.",
    "tools": "Module names, importable from `TOOLQ_TOOLS_PATH`, `PYTHONPATH` or an installed package.",
    "concurrency": "Pool processes per worker: how many calls one worker runs at once.",
    "turn_timeout": "How long a turn may take: past it no new model request is made, and the turn fails with "
                    "one line naming this setting.",
    "max_steps": "Model responses with tool calls per turn.",
    "flower_user": "User of Flower's basic auth. Without a user and a password `toolq flower` refuses to start "
                   "(except `--unauthenticated-api`, on loopback only).",
    "flower_password": "Password of Flower's basic auth.",
    "flower_address": "Where Flower listens. Any address but loopback is warned about.",
    "flower_port": "Flower's port.",
    "signing_key": f"At least {MIN_KEY_CHARS} characters; generate one with `{GENERATE}`.",
    "sandbox": "The worker names its choice in its log and in `toolq config`.",
    "sandbox_network": "`none`: commands have no network, so the broker is out of their reach too; `host`: "
                       "the host's network.",
    "sandbox_etc": "Such as `ssh/ssh_config`. The allowlist is `ETC` in `toolq/workers/isolation/policy.py`.",
    "sandbox_memory_mb": "Memory of one call's command in MiB (a memory cgroup per pool process where the worker may "
                         "create one, else the address space of each process).",
    "sandbox_processes": "Processes of one call's command.",
    "sandbox_cpu_seconds": "CPU time of one call's command.",
    "sandbox_file_mb": "The largest file one call's command may write, in MiB.",
    "sandbox_worker_processes": "Without a cgroup it is one RLIMIT_NPROC ceiling for the worker's uid.",
    "sandbox_conversation_processes": "Past this or the memory bound the conversation's next command is refused "
                                      "and its newest sessions are killed, each with one line.",
    "sandbox_cells": "`TOOLQ_SESSIONS=0` starts bubblewrap per command too.",
    "session_limit": "Past it, a command that would become a session is killed, with an output that says so.",
    "mcp": "Streamable HTTP servers: `NAME=https://host/mcp`.",
    "tool_limits": 'Example: `{"exec_command": {"max_concurrency": 8}, "git.git_log": {"rate_limit": "100/m"}}`; '
                   "`null` removes a declared limit; a plain name no loaded tool has is said in one warning.",
}

#: Flags that override a setting: setting -> (the commands that take it, the flag).
FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "model": (("run", "batch", "config"), "--model"),
    "instructions": (("run", "batch"), "--instructions"),
    "reasoning_effort": (("run", "batch"), "--reasoning-effort"),
    "workspace": (("run", "batch", "demo", "config"), "--workspace"),
    "tools": (("run", "batch", "worker", "config"), "--tools"),
    "queues": (("worker", "config"), "--queues"),
    "concurrency": (("worker", "config"), "--concurrency"),
    "mcp": (("worker",), "--mcp"),
    "flower_address": (("flower",), "--address"),
    "flower_port": (("flower",), "--port"),
    "exec_server_token": (("exec-server",), "--token-file"),
    "mcp_server_token": (("mcp-server",), "--token-file"),
    "metrics_port": (("worker",), "--metrics-port"),
}

#: Variables read outside the settings model, and what reads them.
ELSEWHERE: list[tuple[str, str]] = [
    (TOOLS_PATH_ENV, "Folders the tool modules are imported from, separated by `:` "
                     "(`toolq/core/import_path.py`). Never a workspace: toolq does not import from the "
                     "current directory. Default: none (installed packages and `PYTHONPATH`)."),
    ("TOOLQ_BENCH_CODEX", "The Codex CLI that `toolq bench steps` and `coldstart` run beside toolq "
                          "(`toolq/dev/bench/codex.py`). Default: `codex` on `PATH`, if any."),
]


def field_docstrings() -> dict[str, str]:
    """The docstring under each field of `Settings`, one paragraph each."""
    tree = ast.parse(inspect.getsource(settings_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    out, name = {}, None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif (name and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)):
            out[name] = " ".join(inspect.cleandoc(node.value.value).split())
            name = None
        else:
            name = None
    return out


def undocumented() -> list[str]:
    """Settings that no table holds, that have no description, or whose flag is unknown: a new
    setting needs a group here, and a docstring in settings.py (or a note here)."""
    grouped = [name for _title, _who, names in GROUPS for name in names]
    docs = field_docstrings()
    problems = [f"{n}: in no group" for n in Settings.model_fields if n not in grouped]
    problems += [f"{n}: in more than one group" for n in set(grouped) if grouped.count(n) > 1]
    problems += [f"{n}: not a setting" for n in grouped if n not in Settings.model_fields]
    problems += [f"{n}: no docstring in settings.py and no note" for n in Settings.model_fields
                 if n not in docs and n not in NOTES]
    problems += [f"{n}: no variable in ENV" for n in Settings.model_fields if n not in ENV]
    problems += [f"{n}: a note or flag for no setting" for n in {*NOTES, *FLAGS} if n not in Settings.model_fields]
    return sorted(problems)


def _escape(text: str) -> str:
    """Markdown for a table cell: `|` escaped everywhere, `*`, `<` and `_` outside code spans."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("*", "\\*").replace("<", "&lt;")
    return "`".join(parts)


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default(name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        made = field.default_factory()  # type: ignore[call-arg]  # none of Settings' factories takes the data
        if isinstance(made, Path):
            return "the current directory"
        return "none" if not made else f"`{made}`"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)):
        text = _number(value)
        if name.endswith("_bytes") and value % (1024 * 1024) == 0:
            text += f" ({value // (1024 * 1024)} MiB)"
        return text
    return f"`{value}`"


def _kind(annotation: Any) -> str:
    """What a value may be, from the field's type."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return _kind(inner[0]) if len(inner) == 1 else "text"
    if typing.get_origin(annotation) is Literal:
        return " ".join(f"`{a}`" for a in args)
    if typing.get_origin(annotation) is list:
        return "list"
    if typing.get_origin(annotation) is dict:
        return "JSON object"
    return {bool: "switch", int: "integer", float: "number", str: "text", Path: "path"}.get(annotation, "text")


def _values(name: str, field: FieldInfo) -> str:
    kind = "one per line" if name == "mcp" else _kind(field.annotation)
    low = next((m for m in field.metadata if isinstance(m, (Ge, Gt))), None)
    high = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    if isinstance(low, Ge) and high is not None:
        kind += f", {_number(low.ge)} to {_number(high)}"
    elif isinstance(low, Ge):
        kind += f", at least {_number(low.ge)}"
    elif isinstance(low, Gt):
        kind += f", above {_number(low.gt)}"
    elif high is not None:
        kind += f", at most {_number(high)}"
    return kind + ("; secret, masked" if name in SECRETS else "")


def _variables(name: str) -> str:
    first, *others = ENV[name]
    return f"`{first}`" + (" (or " + ", ".join(f"`{v}`" for v in others) + ")" if others else "")


def _meaning(name: str, docs: dict[str, str]) -> str:
    text = " ".join(t for t in (docs.get(name), NOTES.get(name)) if t)
    # A docstring names other settings by field: the reader sets their variables.
    text = re.sub(r"`([a-z_]+)`", lambda m: f"`{ENV[m[1]][0]}`" if m[1] in ENV and m[1] != name else m[0], text)
    if name in FLAGS:
        commands, flag = FLAGS[name]
        text += f" Flag: `{flag}` ({', '.join(commands)})."
    return _escape(text)


def render() -> str:
    docs = field_docstrings()
    out = [HEAD]
    grouped = {n for _title, _who, names in GROUPS for n in names}
    leftover = tuple(n for n in Settings.model_fields if n not in grouped and n in ENV)
    for title, who, names in [*GROUPS, *([("Other settings", "", leftover)] if leftover else [])]:
        out += [f"## {title}", ""]
        if who:
            out += [who, ""]
        out += ["| variable | default | values | what it does |", "|---|---|---|---|"]
        for name in names:
            field = Settings.model_fields[name]
            out.append(f"| {_variables(name)} | {_default(name, field)} | {_escape(_values(name, field))} "
                       f"| {_meaning(name, docs)} |")
        out.append("")
    out += ["## Read outside the settings model", "", "| variable | what it does |", "|---|---|"]
    out += [f"| `{var}` | {_escape(text)} |" for var, text in ELSEWHERE]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
