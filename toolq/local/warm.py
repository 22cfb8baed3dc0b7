"""A warm local fleet: `toolq up` leaves an embedded stack running for the next runs.

With no `REDIS_URL`, each `toolq run` starts a private server and two workers and stops them at
its end, so a one-call turn pays for the workers' boot. `toolq up` starts one stack that stays:
a later `toolq run` or `toolq batch` of the same user, asking for the same tool modules and no MCP
servers, finds it through the runtime directory (its entry, 0600, holds the URL and the fleet key)
and sends its calls there. The stack stops at `toolq down`, or by itself once no turn has started
or run for `--idle` seconds. Its workers keep the environment `toolq up` was started with (the
sandbox settings, `TOOLQ_TOOLS_PATH`): start it again after changing those.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from toolq.core import import_path, keys
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, mask_url_password
from toolq.local import runtime_dir
from toolq.local.runtime_dir import StackEntry

#: A warm stack with no turn started or running for this long stops by itself.
DEFAULT_IDLE = 1800.0
#: How often the stack checks its server and workers are alive, and looks for turns (how many of the newest).
IDLE_POLL = 1.0
RECENT_TURNS = 64
#: How long `toolq up` waits for the stack's workers to be ready, and `toolq down` for it to stop.
UP_TIMEOUT = 90.0
DOWN_TIMEOUT = 60.0
#: How long `toolq up` waits for the launcher to listen, once the fleet is ready.
LAUNCHER_WAIT = 15.0
#: The launcher's socket in the runtime directory (toolq/cli/launch.py's SOCKET_NAME: this layer
#: starts the launcher by its module name and never imports the command line).
LAUNCHER_SOCKET = "launcher.sock"


#: Settings that are the run's own, not its workers': a run may differ in these and still use a
#: warm fleet. (`result_url` is not one: the run must hear results where the workers store them.)
PER_RUN = frozenset({"redis_url", "signing_key", "workspace", "model", "openai_base_url", "openai_api_key",
                     "instructions", "reasoning_effort", "tools", "mcp", "mcp_config",
                     # read by the orchestrator alone (no worker module reads them)
                     "turn_timeout", "max_steps", "turn_store_mb", "request_max_retries", "stream_max_retries",
                     "stream_idle_timeout", "max_sse_event_bytes", "max_parallel_calls", "tool_limits",
                     "limit_lease", "flower_user", "flower_password", "flower_port", "flower_address",
                     "redis_connections"})


def settings_digest(settings: Settings) -> str:
    """What a warm fleet's workers run with (the sandbox, limits, timeouts...) and where they import
    tools from: a run whose own differ must not have them silently replaced by the fleet's."""
    kept = {k: v for k, v in settings.model_dump(mode="json").items() if k not in PER_RUN}
    kept["tools_path"] = os.environ.get(import_path.TOOLS_PATH_ENV, "")
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find(settings: Settings) -> StackEntry | None:
    """This user's running warm stack for a run with `settings` (same tools, same worker settings),
    or None: the run starts its own. Never one in a runtime directory the workspace holds (what a
    command writes must not be able to plant an entry), nor one from a directory toolq refuses
    (another user's: that costs this run only the warm fleet, never the run)."""
    try:
        root = runtime_dir.runtime_root()
        if root == settings.workspace or settings.workspace in root.parents:
            return None
        stacks = warm_stacks()
    except (ConfigurationError, OSError) as e:
        print(f"toolq: not looking for a warm fleet: {e}", file=sys.stderr)
        return None
    wanted, digest = sorted(settings.tools), settings_digest(settings)
    for entry in stacks:
        assert entry.warm is not None
        if entry.warm.tools == wanted:
            if entry.warm.settings_digest == digest:
                return entry
            print("toolq: your warm fleet runs with other settings (sandbox, limits or tools path) than this "
                  "run's: starting this run's own stack (`toolq down` and `toolq up` to change it)", file=sys.stderr)
    return None


def warm_stacks() -> list[StackEntry]:
    """Entries of warm stacks whose process is a `toolq up --foreground`: nothing else is ever
    signalled by `toolq down` or trusted by a run, whatever an entry says."""
    return [e for e in runtime_dir.running_stacks() if e.warm is not None and _is_warm_server(e.pid)]


def _is_warm_server(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"toolq.cli.main" in argv and b"up" in argv and b"--foreground" in argv


def up(settings: Settings, *, workers: int, concurrency: int, idle: float) -> str:
    """Start a warm stack in a process of its own (a new session: it outlives this shell's job
    control) and return once its workers are ready; what to tell the user."""
    tools = settings.tools
    running = find(settings)
    if running is not None:
        return f"a warm fleet for these tools is already up (pid {running.pid}); `toolq down` stops it"
    root = runtime_dir.private_root()
    assert root is not None
    log = root / f"warm-{os.getpid()}.log"
    argv = [*import_path.python_argv("-m", "toolq.cli.main"), "up", "--foreground", "--workers", str(workers),
            "--concurrency", str(concurrency), "--idle", f"{idle:g}", *(a for t in tools for a in ("--tools", t))]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, cwd=import_path.NEUTRAL_CWD,
                                 start_new_session=True)
    finally:
        os.close(fd)
    end = time.monotonic() + UP_TIMEOUT
    while time.monotonic() < end:
        entry = next((e for e in warm_stacks() if e.pid == child.pid), None)
        if entry is not None:
            _wait_for_launcher(root, end)
            log.unlink(missing_ok=True)
            return (f"a warm fleet is up: {workers} workers, tools {', '.join(sorted(tools)) or '(built-in)'} "
                    f"(pid {child.pid}; stops after {idle:g}s idle, or at `toolq down`)")
        if child.poll() is not None:
            raise ConfigurationError(f"the warm fleet did not start: {_last_line(log)} (log: {log})")
        time.sleep(0.1)
    child.terminate()
    raise ConfigurationError(f"the warm fleet was not ready in {UP_TIMEOUT:.0f}s (log: {log})")


def down() -> str:
    """Stop every warm stack of this user (each warm-shuts its workers down); what to tell the user."""
    stacks = warm_stacks()
    if not stacks:
        return "no warm fleet of yours is running"
    for entry in stacks:
        try:
            os.kill(entry.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + DOWN_TIMEOUT  # until each has stopped its workers and exited
    while time.monotonic() < end and any(runtime_dir.alive(e) for e in stacks):
        time.sleep(0.1)
    left = [e.pid for e in stacks if runtime_dir.alive(e)]
    if left:
        raise ConfigurationError(f"the warm fleet (pid {', '.join(map(str, left))}) did not stop in "
                                 f"{DOWN_TIMEOUT:.0f}s")
    return f"stopped the warm fleet (pid {', '.join(str(e.pid) for e in stacks)})"


def serve(tools: Sequence[str], *, workers: int, concurrency: int, idle: float) -> int:
    """`toolq up --foreground`: run a warm stack until SIGTERM/SIGINT or `idle` seconds idle."""
    from toolq.local.embedded import EmbeddedStack, die_with_parent

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedStack(workers=workers, concurrency=concurrency, tools=list(tools), warm=True,
                       fleet_settings=settings_digest(Settings.load())) as stack:
        print(f"toolq: warm fleet up on {mask_url_password(stack.url)}", file=sys.stderr, flush=True)
        launcher = _start_launcher(die_with_parent())
        client = redis.Redis.from_url(stack.url, socket_timeout=5)
        busy_at = time.time()
        try:
            while not stop.wait(IDLE_POLL):
                # A server or worker gone ends the fleet at once, its entry first: another user
                # could bind a dead server's port and be sent the next run's calls (helper-25).
                if (dead := stack.dead_child()) is not None:
                    print(f"toolq: {dead} exited: stopping the warm fleet", file=sys.stderr, flush=True)
                    return 1
                busy_at = max(busy_at, _last_activity(client))
                if time.time() - busy_at > idle:
                    print(f"toolq: no turn for {idle:g}s: stopping the warm fleet", file=sys.stderr, flush=True)
                    break
        finally:
            client.close()
            if launcher is not None:
                launcher.terminate()
                launcher.wait(timeout=10)
    return 0


def _wait_for_launcher(root: Path, end: float) -> None:
    """The next run forks from the launcher only once it listens (it imports toolq first): wait
    for it a few seconds; a run before it still works, the ordinary way."""
    sock = root / LAUNCHER_SOCKET
    end = min(end, time.monotonic() + LAUNCHER_WAIT)
    while not sock.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _start_launcher(preexec: Any) -> subprocess.Popen | None:
    """The warm fleet's launcher (toolq/cli/launcher.py): later runs fork from it instead of
    importing toolq again. Without it runs still work, only slower: a failure is one line."""
    root = runtime_dir.private_root()
    if root is None:
        return None
    try:
        return subprocess.Popen([*import_path.python_argv("-m", "toolq.cli.launcher"), str(root)],
                                stdin=subprocess.DEVNULL, cwd=import_path.NEUTRAL_CWD, preexec_fn=preexec)
    except OSError as e:
        print(f"toolq: the warm fleet's launcher did not start ({e}); runs import toolq themselves",
              file=sys.stderr, flush=True)
        return None


def _last_activity(client: redis.Redis) -> float:
    """When a turn last started, or now while one runs (its orchestrator holds the turn's lease);
    now too when Redis cannot say (never idle by mistake)."""
    try:
        newest: list[tuple[bytes, float]] = client.zrevrange(  # type: ignore[assignment]
            keys.TURNS, 0, RECENT_TURNS - 1, withscores=True)
        running = any(client.exists(keys.turn_lease(keys.text(turn))) for turn, _ in newest)
    except redis.RedisError:
        return time.time()
    if running:
        return time.time()
    return max((float(score) for _, score in newest), default=0.0)


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "it exited without a word"
