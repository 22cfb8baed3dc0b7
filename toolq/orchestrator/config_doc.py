"""docs/configuration.md, generated from the settings model (`Settings` and its `ENV` table), so the
two cannot drift: every setting must have a row here, and the variables each row names come from
`ENV`. tests/unit/test_docs.py fails when the file differs from `render()`; to write it:

    .venv/bin/python -m toolq.orchestrator.config_doc > docs/configuration.md
"""

from __future__ import annotations

from dataclasses import dataclass

from toolq.orchestrator.settings import ENV, Settings


@dataclass(frozen=True)
class Row:
    """One line of the table: the settings it documents (their variables come from `ENV`), what
    they do, and their default in words. `variables`: for one read outside `Settings`."""

    settings: tuple[str, ...]
    text: str
    default: str
    variables: tuple[str, ...] = ()


HEAD = ('# Configuration\n\nEvery setting, the environment variable that sets it, and its default.\n\n\nOne '
        'settings model (`toolq/orchestrator/settings.py`) reads the environment. Command-line flags\noverride '
        'it. `toolq config` prints the values that toolq will use, with secrets masked. A bad\nvalue stops the '
        'command with exit status 2 and one line that names the setting, such as\n`toolq: invalid setting '
        'concurrency (TOOLQ_CONCURRENCY): Input should be a valid integer, ...`.\n')

ROWS = [
    Row(('redis_url',),
        'broker and ledger: `redis://`, `rediss://` (add `?ssl_cert_reqs=required`) or `unix://`',
        'unset: embedded server for `run`/`demo`'),
    Row(('result_url',),
        'Celery result backend',
        "the broker's server, database 1"),
    Row(('openai_base_url',),
        'Responses endpoint',
        '`https://api.openai.com/v1`'),
    Row(('openai_api_key',),
        'bearer token (masked in `toolq config`)',
        'unset'),
    Row(('model',),
        'model name (`--model`)',
        '`gpt-5.5`'),
    Row(('instructions',),
        "the request's `instructions` (`--instructions`)",
        'a short one naming the workspace'),
    Row(('reasoning_effort',),
        ('`reasoning.effort` (`--reasoning-effort`): `none`…`xhigh`, `max`; `off` sends no `reasoning` field. '
         'With reasoning on, toolq asks for `include: ["reasoning.encrypted_content"]`, which stateless '
         '(`store: false`) requests need to carry reasoning back; a reasoning item without it is left out of '
         'the next request (counted, logged once)'),
        '`auto`: `medium` for gpt-5\\* and o-series models, no field for others'),
    Row(('workspace',),
        'directory the tools work in (`--workspace`)',
        'the current directory'),
    Row(('tools',),
        'extra tool modules, comma-separated (`--tools`)',
        'none'),
    Row((), 'folders the tool modules are imported from, `:`-separated; never a workspace',
        'none (installed packages and `PYTHONPATH`)', variables=('TOOLQ_TOOLS_PATH',)),
    Row(('queues',),
        'queues a worker consumes (`--queues`)',
        'every queue of its tools'),
    Row(('concurrency',),
        'pool processes per worker (`--concurrency`)',
        '4'),
    Row(('turn_timeout',),
        'seconds a turn may take',
        '3600'),
    Row(('turn_lease',),
        ("seconds a running turn's lease outlives its orchestrator (then `orphaned`, and `toolq resume` may "
         'take it)'),
        '15'),
    Row(('max_steps',),
        'model responses with tool calls per turn',
        '100'),
    Row(('turn_store_mb',),
        ('MiB one turn may make toolq keep in Redis (for `toolq resume`): the conversation it starts from, the '
         "model's items, each call's task message and record, the tools' outputs; past it the turn stops with "
         'one line naming this setting, every call still answered'),
        '64'),
    Row(('request_max_retries',),
        'model HTTP retries before any SSE byte',
        '4'),
    Row(('stream_max_retries',),
        'whole-request retries after a broken stream',
        '5'),
    Row(('stream_idle_timeout',),
        'seconds without a byte before a stream counts as dead',
        '300'),
    Row(('max_sse_event_bytes',),
        ('a bigger SSE event is dropped unread, so memory stays bounded; if it may have held a call, the stream '
         'counts as broken and is retried'),
        '8388608 (8 MiB)'),
    Row(('flower_user', 'flower_password'),
        "Flower's basic auth (password masked)",
        'unset: Flower refuses to start'),
    Row(('flower_address', 'flower_port'),
        'where Flower listens',
        '`127.0.0.1`, 5555'),
    Row(('signing_key',),
        ("the fleet's shared key that signs calls and results (masked); generate with `python3 -c 'import "
         "secrets; print(secrets.token_hex(32))'`"),
        'required with `REDIS_URL`; the embedded default makes one per run'),
    Row(('mcp',),
        "a worker's MCP servers, `NAME=COMMAND ARGS...` one per line (`--mcp`, repeatable)",
        'none'),
    Row(('mcp_config',),
        "a worker's MCP servers from a file: JSON `mcpServers` or TOML `[mcp_servers.NAME]`",
        'none'),
    Row(('log_tool_output',),
        "`1`: tool output in the workers' task-succeeded log lines and Flower's results, for debugging",
        'off: they show status and sizes only'),
    Row(('sandbox',),
        ("sandbox of shell tools' commands: `auto`, `bwrap`, `landlock`, `none` "
         '([operating.md](operating.md#the-sandbox-of-exec_command))'),
        '`auto`'),
    Row(('sandbox_network',),
        '`none` (no network, the broker unreachable) or `host`',
        '`none`'),
    Row(('sandbox_env', 'sandbox_read'),
        'extra variables a command sees; extra directories it may read',
        'none'),
    Row(('sandbox_worker_processes', 'sandbox_worker_memory_mb'),
        ("processes and memory of all of a worker's commands and sessions together (a cgroup above the per-call "
         'ones, where the worker may create one; else the processes alone, as one RLIMIT_NPROC ceiling for the '
         "worker's uid)"),
        '2048, 8192'),
    Row(('sandbox_worker_cpus',),
        ("CPUs all of a worker's commands and sessions may use together (a CFS quota; they always share the CPU "
         'as one group beside the worker itself)'),
        '0 (no quota)'),
    Row(('sandbox_conversation_processes', 'sandbox_conversation_memory_mb'),
        ("processes and memory of one conversation's commands and sessions together on a worker: past them its "
         'next command is refused and its newest sessions are killed, each with one line (the memory bound is '
         'off by default: see docs/security.md)'),
        '1024, 0 (none)'),
    Row(('sandbox_etc',),
        'extra entries of `/etc` a command may read (names under `/etc`, such as `ssh/ssh_config`)',
        'the allowlist (`policy.ETC`)'),
    Row(('sandbox_memory_mb', 'sandbox_processes', 'sandbox_cpu_seconds', 'sandbox_file_mb'),
        'per-call limits: address space, processes, CPU time, file size',
        '2048, 256, 300, 1024'),
    Row(('sandbox_cells',),
        ('`0`: bubblewrap starts once per command instead of once per workspace and spawn slot '
         '([operating.md](operating.md#the-sandbox-of-exec_command))'),
        'on'),
    Row(('sessions',),
        ('`0`: a worker keeps no sessions: every command runs to completion in its pool process, and '
         '`write_stdin` answers `Unknown process id`'),
        'on'),
    Row(('session_limit',),
        'live `exec_command` sessions per conversation, across the fleet',
        '64'),
    Row(('session_idle', 'session_lifetime'),
        'seconds without a `write_stdin`, and in all, after which a session is killed',
        '1800, 14400'),
    Row(('stream_output',),
        ("`0`: a running command's output is not streamed to the live view and `--json` (it shows when the call "
         'ends)'),
        'on'),
    Row(('max_parallel_calls',),
        ('calls of one turn in flight at once; the rest wait `throttled`, in call order '
         '([operating.md](operating.md#limits-across-the-fleet))'),
        '16'),
    Row(('tool_limits',),
        ('fleet-wide limits by tool name, JSON: `{"exec_command": {"max_concurrency": 8}, "git.git_log": '
         '{"rate_limit": "100/m"}}`; overrides what a tool declares (`null` removes a limit); a plain name no '
         'loaded tool has is said in one warning'),
        'none'),
    Row(('limit_lease',),
        ("seconds a `max_concurrency` permit outlives its holder's last renewal (a crashed worker's or "
         "orchestrator's permit is free again after this)"),
        '10'),
    Row(('redis_connections',),
        ('connections an orchestrator process opens for its ledger at most; more commands at once wait for one, '
         'never fail (no turn holds one)'),
        '64'),
    Row(('worker_poll',),
        ("seconds a worker's wait for a message on its queues lasts before it asks again; a warm shutdown waits "
         "for the one in flight (the embedded stack's workers use 0.1)"),
        '1'),
]

TAIL = ''


def _variables(row: Row) -> str:
    if row.variables:
        return ", ".join(f"`{v}`" for v in row.variables)
    cells = []
    for name in row.settings:
        first, *others = ENV[name]
        cells.append(f"`{first}`" + (" (or " + ", ".join(f"`{v}`" for v in others) + ")" if others else ""))
    return ", ".join(cells)


def undocumented() -> list[str]:
    """Settings no row documents (a new setting must be added here)."""
    covered = {name for row in ROWS for name in row.settings}
    return [name for name in Settings.model_fields if name not in covered]


def render() -> str:
    table = ["| variable | setting | default |", "|---|---|---|"]
    table += [f"| {_variables(row)} | {row.text} | {row.default} |" for row in ROWS]
    return HEAD + "\n" + "\n".join(table) + "\n" + TAIL


if __name__ == "__main__":
    print(render(), end="")
