"""The `toolq` command: one subcommand per job, each a thin shell over a module."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import IO, TYPE_CHECKING, Any

from toolq.core import import_path

if TYPE_CHECKING:
    from pathlib import Path

    from toolq.core.settings import Settings


def _cmd_decode(args: argparse.Namespace) -> int:
    from toolq.cli.decode import decode_file

    return decode_file(args.file, sys.stdout, sys.stderr)


def _cmd_fake_model(args: argparse.Namespace) -> int:
    from toolq.dev.fake_model.server import serve_forever

    return serve_forever(port=args.port, script=args.script, loop=args.loop)


def _cmd_flower(args: argparse.Namespace) -> int:
    from toolq.cli.flower import run_flower
    from toolq.core.settings import Settings

    return run_flower(Settings.load(), port=args.port, address=args.address,
                      unauthenticated_api=args.unauthenticated_api)


def _cmd_status(args: argparse.Namespace) -> int:
    from toolq.cli.status import status_cmd
    from toolq.core.settings import Settings

    return status_cmd(Settings.load(), args.turn_id, as_json=args.json)


def _cmd_turns(args: argparse.Namespace) -> int:
    from toolq.cli.status import turns_cmd
    from toolq.core.settings import Settings

    return turns_cmd(Settings.load(), limit=args.limit, as_json=args.json)


def _cmd_queues(args: argparse.Namespace) -> int:
    from toolq.cli.fleet_now import queues_cmd
    from toolq.core.settings import Settings

    return queues_cmd(Settings.load(), as_json=args.json)


def _cmd_calls(args: argparse.Namespace) -> int:
    from toolq.cli.fleet_now import calls_cmd
    from toolq.core.settings import Settings

    return calls_cmd(Settings.load(), as_json=args.json)


def _cmd_workers(args: argparse.Namespace) -> int:
    from toolq.cli.workers import workers_cmd
    from toolq.core.settings import Settings

    return workers_cmd(Settings.load(), as_json=args.json)


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    from toolq.core.settings import Settings

    return Settings.load(
        model=getattr(args, "model", None),
        workspace=getattr(args, "workspace", None),
        tools=getattr(args, "tools", None) or None,
        instructions=getattr(args, "instructions", None),
        reasoning_effort=getattr(args, "reasoning_effort", None),
        **extra,
    )


def _enter_host_namespace(settings: Settings) -> None:
    """An unprivileged worker joins its host's namespace, where its environments' overlays are
    mounted (`workers/environments/namespace.py`). A worker package of an older release under
    this command line (a mixed-version fleet, tests/integration/test_mixed_versions.py) has no
    environments, and nothing to join."""
    try:
        from toolq.workers.environments import agent
    except ModuleNotFoundError:
        return
    agent.enter_namespace(settings)


def _cmd_worker(args: argparse.Namespace) -> int:
    from toolq.core.settings import Settings

    settings = Settings.load(tools=args.tools or None, concurrency=args.concurrency,
                             queues=args.queues.split(",") if args.queues else None, mcp=args.mcp or None)
    if not settings.redis_url:
        print("toolq worker: set REDIS_URL (or CELERY_BROKER_URL) to the broker the orchestrator uses", file=sys.stderr)
        return 2
    if args.max_tasks_per_child is not None and args.max_tasks_per_child < 1:
        print("toolq worker: --max-tasks-per-child must be at least 1", file=sys.stderr)
        return 2
    if args.logfile:
        worker_log(args.logfile, settings.workspace)
    from toolq.core.signing import required_signer
    from toolq.workers import hardening

    required_signer(settings.signing_key, "a worker")
    hardening.harden()  # before any tool runs: its pool children, forked from here, keep it
    _enter_host_namespace(settings)  # while this process has no thread: its children start inside

    os.environ["REDIS_URL"] = settings.redis_url  # pool children and the app read the same settings
    # The key lives on in the app's conf (pool children fork with it); commands get no copy of it.
    os.environ.pop("TOOLQ_SIGNING_KEY", None)
    if settings.tools:
        os.environ["TOOLQ_TOOLS"] = ",".join(settings.tools)
    from toolq.workers.app import app, catalog, configure
    from toolq.workers.mcp.fleet import start_with_worker

    mcp_queues = start_with_worker(settings, catalog(), args.logfile)  # MCP servers start before the pool forks
    configure(settings)
    from toolq.core.errors import ConfigurationError
    from toolq.workers.isolation import worker_started

    queues = list(dict.fromkeys([*(settings.queues or catalog().queues()), *mcp_queues]))
    try:  # probed once here; the pool children inherit the choice
        banner = worker_started([s.name for s in catalog() if s.shell_like and s.queue in queues])
    except ConfigurationError as e:
        print(f"toolq worker: {e}", file=sys.stderr)
        return 2
    if args.logfile:  # else the worker's own log line says it, on stderr too (it was printed twice)
        print(banner, file=sys.stderr, flush=True)
    port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if port is not None:  # before the pool forks: its children record into the directory it makes
        from toolq.core.advert import broker_lists
        from toolq.telemetry import metrics
        from toolq.workers import config, redis_clients
        from toolq.workers.environments.agent import host_id

        target = config.broker_target(app.conf)  # the broker's lists, where the queues wait
        metrics.serve_worker(port, queues=broker_lists(queues, catalog(), host_id(settings)),
                             tools=[str(s.tool_name) for s in catalog()],
                             redis=lambda: redis_clients.sync_client(target, socket_timeout=1.0,
                                                                     socket_connect_timeout=1.0,
                                                                     client_name="toolq-metrics"))
    # No --events: task events start when a monitor asks (workers/config.py, `worker_send_task_events`).
    argv = ["worker", "--pool", "prefork", "--concurrency", str(settings.concurrency), "--queues", ",".join(queues),
            "--without-gossip", "--without-mingle", "--loglevel", args.loglevel]
    if args.name:
        argv += ["--hostname", args.name]
    if args.max_tasks_per_child is not None:  # each pool child exits after N calls (its spans exported first)
        argv += ["--max-tasks-per-child", str(args.max_tasks_per_child)]
    if args.logfile:
        argv += ["--logfile", os.path.abspath(args.logfile)]
    # Celery imports its app and modules with the current directory on sys.path (import_from_cwd),
    # and a worker is often started in the workspace (a container's WORKDIR): start from nowhere.
    os.chdir(import_path.NEUTRAL_CWD)
    app.worker_main(argv)
    return 0


def worker_log(logfile: str, workspace: Path) -> None:
    """Refuse a worker's log file in its workspace (when it names a valid one: the image's, or the
    project the worker was started in), or one that is a link, not a file, not ours; else create it."""
    from pathlib import Path

    from toolq.core import trusted_files
    from toolq.core.settings import workspace_problem

    path, what = Path(os.path.abspath(logfile)), "--logfile"
    if workspace_problem(workspace) is None:
        trusted_files.refuse_inside(path, [workspace], what)
    trusted_files.open_append(path, what).close()


class UsageError(Exception):
    """A command given wrong input: one line on stderr, exit 2."""


def read_prompt(arg: str | None, stdin: IO[str]) -> str:
    """The prompt from the argument, or from stdin when it is `-` or absent (like `codex exec`)."""
    if arg is None or arg == "-":
        if arg is None and stdin.isatty():
            raise UsageError("give a PROMPT, or pipe one on stdin (`echo ... | toolq run`)")
        arg = stdin.read().rstrip("\n")  # `echo`'s newline is not part of the prompt
    if not arg.strip():
        raise UsageError("the prompt is empty")
    return arg


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from toolq.cli.envs import ChoiceError, choose
    from toolq.cli.run import run_prompt
    from toolq.orchestrator.model_client import missing_api_key

    try:  # before the prompt is read from stdin: a wrong option costs nothing
        environment = choose(upload=args.upload, git=args.git, checkpoint=args.from_, workspace=args.workspace,
                             apply=args.apply, patch=args.patch)
    except ChoiceError as e:
        raise UsageError(str(e)) from None
    prompt = read_prompt(args.prompt, sys.stdin)
    settings = _settings(args)
    # Before the embedded stack starts: a run that cannot authenticate should not wait for it.
    problem = missing_api_key(settings.openai_base_url, settings.openai_api_key)
    if problem:
        raise UsageError(problem)
    return run_prompt(settings, prompt, json_events=args.json,
                      session_file=Path(args.session) if args.session else None,
                      last_message_file=Path(args.output_last_message) if args.output_last_message else None,
                      environment=environment)


def _cmd_mcp_server(args: argparse.Namespace) -> int:
    from toolq.cli.envs import ChoiceError, choose
    from toolq.cli.mcp_server import mcp_server_cmd

    try:
        environment = choose(upload=args.upload, git=args.git, checkpoint=args.from_, workspace=args.workspace)
    except ChoiceError as e:
        raise UsageError(str(e)) from None
    return mcp_server_cmd(_settings(args), listen=args.listen, environment=environment, token_file=args.token_file)


def _cmd_exec_server(args: argparse.Namespace) -> int:
    from toolq.cli.exec_server import exec_server_cmd

    return exec_server_cmd(_settings(args), listen=args.listen, upload=args.upload, git=args.git,
                           checkpoint=args.from_, workspace=args.workspace, root=args.root,
                           token_file=args.token_file)


def _cmd_envs(args: argparse.Namespace) -> int:
    from toolq.cli.envs import envs_cmd, envs_rm_cmd
    from toolq.core.settings import Settings

    if args.envs_command == "rm":
        return envs_rm_cmd(Settings.load(), args.env_id)
    return envs_cmd(Settings.load(), as_json=args.json)


def _cmd_resume(args: argparse.Namespace) -> int:
    from pathlib import Path

    from toolq.cli.run import resume_turn

    return resume_turn(_settings(args), args.turn_id, json_events=args.json,
                       session_file=Path(args.session) if args.session else None,
                       last_message_file=Path(args.output_last_message) if args.output_last_message else None)


def _cmd_batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from toolq.cli.batch import run_batch
    from toolq.orchestrator.model_client import missing_api_key

    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    settings = _settings(args)
    problem = missing_api_key(settings.openai_base_url, settings.openai_api_key)
    if problem:
        raise UsageError(problem)
    return run_batch(settings, Path(args.file), None if args.out == "-" else Path(args.out),
                     concurrency=args.concurrency, retry_failed=args.retry_failed,
                     transcripts=Path(args.transcripts) if args.transcripts else None)


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from toolq.cli.run import run_demo

    return run_demo(_settings(args), json_events=args.json,
                    workspace=Path(args.workspace) if args.workspace else None,
                    last_message_file=Path(args.output_last_message) if args.output_last_message else None)


def _cmd_config(args: argparse.Namespace) -> int:
    import json

    from toolq.core.settings import mask_url_password

    settings = _settings(args, concurrency=args.concurrency,
                         queues=args.queues.split(",") if args.queues else None)
    out = settings.masked()
    backend = settings.result_backend_url()
    out["result_url"] = mask_url_password(backend) if backend else None  # the derived default, if unset
    from toolq.workers.isolation import current

    out["sandbox_chosen"] = current(settings).describe()
    print(json.dumps(out, indent=2))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from toolq.local import warm

    if args.workers < 1 or args.concurrency < 1:
        raise UsageError("--workers and --concurrency must be at least 1")
    if args.idle <= 0:
        raise UsageError("--idle must be a positive number of seconds")
    settings = _settings(args)
    if settings.redis_url:
        raise UsageError("toolq up starts a local fleet for runs with no REDIS_URL: unset REDIS_URL (and "
                         "CELERY_BROKER_URL), or start workers on your Redis with `toolq worker`")
    if args.foreground:
        return warm.serve(settings.tools, workers=args.workers, concurrency=args.concurrency, idle=args.idle)
    print(f"toolq: {warm.up(settings, workers=args.workers, concurrency=args.concurrency, idle=args.idle)}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from toolq.local import warm

    print(f"toolq: {warm.down()}")
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    import asyncio

    from toolq.cli.cancel import UnknownTarget, cancel
    from toolq.orchestrator.transport.redis_faults import reaching

    settings = _settings(args)  # no REDIS_URL: cancel() looks in this user's running embedded stacks
    try:
        with reaching(settings.redis_url):
            report = asyncio.run(cancel(settings, args.turn_id, args.call))
    except UnknownTarget as e:
        print(f"toolq cancel: {e}", file=sys.stderr)
        return 1
    what = f"call {report.call_id} of {report.turn_id}" if report.call_id else f"turn {report.turn_id}"
    print(f"cancelled {what}; revoked {len(report.revoked)} task(s)")
    return 0


BENCHMARKS = ("decode", "pipeline", "steps", "cancel", "signing", "sandbox", "sessions", "mcp", "streaming",
              "limits", "throughput", "coldstart", "history", "callcpu", "metadata")
#: Run only when named: not a timing but a fault campaign on a stack of its own (--turns, --seed).
CAMPAIGNS = ("chaos",)
#: Run only when named: a Redis and workers of its own, minutes long (--quick for a smoke run, --json).
OWN_STACK = ("envs", "exec-server")


def _cmd_bench(args: argparse.Namespace) -> int:
    known = (*BENCHMARKS, *CAMPAIGNS, *OWN_STACK)
    unknown = set(args.which) - set(known)
    if unknown:
        print(f"toolq bench: unknown benchmark {', '.join(sorted(unknown))}; choose from {', '.join(known)}",
              file=sys.stderr)
        return 2
    from toolq.dev.bench.chaos import parse_seeds
    from toolq.dev.bench.harness import FleetNotReady

    try:
        seeds = parse_seeds(args.seed)
    except ValueError:
        print(f"toolq bench: --seed takes a number or a range such as 1..3, not {args.seed!r}", file=sys.stderr)
        return 2
    code = 0
    for name in args.which or BENCHMARKS:
        if not args.json:  # --json: stdout is the JSON alone
            print(f"== {name}", flush=True)
        try:
            bench = importlib.import_module(f"toolq.dev.bench.{name.replace('-', '_')}")
            if name in CAMPAIGNS:
                done = bench.run(turns=args.turns, seeds=seeds, hosts=args.hosts, sentinel=args.sentinel)
                code = max(code, 1 if done["violations"] else 0)
            elif name in OWN_STACK:
                done = bench.run(quick=args.quick, as_json=args.json)
                code = max(code, 1 if done.get("failed") else 0)
            else:
                bench.run()
        except FleetNotReady as e:
            print(f"toolq bench {name}: {e}", file=sys.stderr, flush=True)
            code = 1
    return code


class _Version(argparse.Action):
    """`--version`, read from the installed metadata only when asked (importlib.metadata costs
    ~16 ms of every start-up)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        print(f"toolq {metadata.version('toolq')}")  # to stdout, as argparse's own version action
        parser.exit()


def front_door_options(p: argparse.ArgumentParser, listen: tuple[str, str, str], clients: str, token_env: str) -> None:
    """What both front doors (`exec-server`, `mcp-server`) take: where to listen (default, metavar,
    help), the workspace or the environment each client session gets, and the bearer token."""
    p.add_argument("--listen", default=listen[0], metavar=listen[1], help=listen[2])
    p.add_argument("--workspace", help="directory the tools work in (default: the current directory)")
    p.add_argument("--upload", metavar="DIR", help="each client session works in an environment on a worker host "
                   "made from a copy of DIR, destroyed when the session ends")
    p.add_argument("--git", metavar="URL[@REF]", help="each client session works in an environment cloned from "
                   "URL at REF")
    p.add_argument("--from", dest="from_", metavar="CHECKPOINT", help="each client session works in an "
                   "environment made from a checkpoint")
    p.add_argument("--token-file", metavar="FILE", help=f"the bearer token {clients} clients must send (default: "
                   f"{token_env}); required to listen off loopback")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toolq", description="Run an LLM agent's tool calls on a Celery fleet.")
    p.add_argument("--version", action=_Version, nargs=0, help="show toolq's version and exit")
    # Listed in `toolq --help` in the order a user needs them; the development tools last.
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    last_message = ("write the final message to FILE when the turn completes (emptied at the start; outside the "
                    "workspace, never through a link)")
    r = sub.add_parser("run", help="run one turn: the model's tool calls execute on the worker fleet")
    r.add_argument("prompt", nargs="?", metavar="PROMPT",
                   help="what to ask the model; `-` or absent: read it from stdin")
    r.add_argument("--model", help="model name (default gpt-5.5, or TOOLQ_MODEL)")
    r.add_argument("--json", action="store_true", help="one JSON event per line on stdout, like `codex exec --json` "
                   "(without it: the final message alone on stdout, the live view on stderr)")
    r.add_argument("-o", "--output-last-message", metavar="FILE", help=last_message)
    r.add_argument("--workspace", help="directory the tools work in (default: the current directory)")
    r.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    r.add_argument("--instructions", help="the request's instructions (default: a short one naming the workspace)")
    r.add_argument("--reasoning-effort", help="auto (the default: medium for gpt-5*/o* models, no reasoning field "
                   "for others), off (never one), or none|minimal|low|medium|high|xhigh|max")
    r.add_argument("--session", help="JSON file holding the conversation: read before the turn, written after it "
                                     "(cancelled turns included), so the next `toolq run --session` continues it")
    r.add_argument("--upload", metavar="DIR", help="run the turn in an environment on a worker host made from a "
                   "copy of DIR (a git checkout: its tracked and untracked-not-ignored files); no shared folder needed")
    r.add_argument("--git", metavar="URL[@REF]", help="run the turn in an environment cloned from URL at REF "
                   "(default HEAD) on the worker host")
    r.add_argument("--from", dest="from_", metavar="CHECKPOINT", help="run the turn in an environment made from "
                   "an earlier turn's checkpoint (its `checkpoint` in --json or a batch result)")
    r.add_argument("--apply", action="store_true", help="with --upload: apply the turn's changes back to DIR when "
                   "it ends (files changed in DIR meanwhile are refused and listed)")
    r.add_argument("--patch", metavar="FILE", help="with --upload, --git or --from: write the turn's unified diff "
                   "to FILE when it ends")
    r.set_defaults(func=_cmd_run)

    rs = sub.add_parser("resume", help="finish an orphaned turn (its `toolq run` died) from Redis: finished calls "
                                       "are not run again")
    rs.add_argument("turn_id", metavar="TURN_ID", help="the turn, as `toolq turns` lists it (state orphaned)")
    rs.add_argument("--json", action="store_true", help="one JSON event per line, like `toolq run --json`")
    rs.add_argument("-o", "--output-last-message", metavar="FILE", help=last_message)
    rs.add_argument("--session", help="write the whole conversation to this JSON file at the end")
    rs.set_defaults(func=_cmd_resume)

    bt = sub.add_parser("batch", help="run one turn per line of a JSONL file, N at a time from this process; "
                                      "re-run with the same --out to skip the turns already done")
    bt.add_argument("file", metavar="FILE", help='JSON lines: {"prompt": ..., "workspace": ..., "instructions": ...} '
                                                 "(only the prompt is required; other fields, such as id, are copied "
                                                 'into the line\'s result); instead of "workspace", an environment on '
                                                 'a worker host: "upload": DIR, "git": {"url": ..., "ref": ...} or '
                                                 '"from": CHECKPOINT, with "fork": N for N turns each in its own '
                                                 "environment forked from that checkpoint")
    bt.add_argument("--out", required=True, metavar="RESULTS",
                    help="JSONL file of one result line per input line (status, final_message, usage, duration, "
                         "...); a re-run replaces a line's result; `-`: write the results to stdout")
    bt.add_argument("--transcripts", metavar="DIR",
                    help="write each turn's whole history to DIR/TURN_ID.jsonl, one item per line (outside the "
                         "workspace); the result names the file")
    bt.add_argument("--concurrency", type=int, default=8, help="turns running at once (default 8)")
    bt.add_argument("--retry-failed", action="store_true",
                    help="run again the lines whose turn failed (by default only cancelled and unrun ones are)")
    bt.add_argument("--model", help="as for `toolq run`")
    bt.add_argument("--workspace", help="directory the tools work in for lines that name none (default: the "
                                        "current directory)")
    bt.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    bt.add_argument("--instructions", help="the requests' instructions for lines that give none")
    bt.add_argument("--reasoning-effort", help="as for `toolq run`")
    bt.set_defaults(func=_cmd_batch)

    w = sub.add_parser("worker", help="a Celery worker that executes toolq's tools")
    w.add_argument("--queues", help="comma-separated queues (default: every queue of the loaded tools)")
    w.add_argument("--concurrency", type=int, help="pool processes (default 4, or TOOLQ_CONCURRENCY)")
    w.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    w.add_argument("--mcp", action="append", metavar="NAME=COMMAND",
                   help="host an MCP server, its tools in namespace NAME: 'NAME=COMMAND ARGS...' (split as a shell "
                        "would) or NAME=URL (streamable HTTP); repeatable; more in TOOLQ_MCP_CONFIG=FILE")
    w.add_argument("--name", help="worker node name, e.g. gpu1@%%h")
    w.add_argument("--logfile", help="write the worker's log to this file (default: stderr)")
    w.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    w.add_argument("--max-tasks-per-child", type=int, metavar="N",
                   help="replace each pool process after it has run N calls (Celery's option; default: never)")
    w.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port at /metrics (0: a free port, said on stderr); "
                        "default TOOLQ_METRICS_PORT, else none")
    w.set_defaults(func=_cmd_worker)

    up = sub.add_parser("up", help="leave a warm local fleet running (no REDIS_URL): later runs with the same "
                                   "tools use it instead of starting their own")
    up.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    up.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    up.add_argument("--concurrency", type=int, default=4, help="pool processes per worker (default 4)")
    up.add_argument("--idle", type=float, default=1800.0,
                    help="stop after this many seconds with no turn (default 1800)")
    up.add_argument("--foreground", action="store_true", help="run the fleet in this process until SIGTERM")
    up.set_defaults(func=_cmd_up)

    dn = sub.add_parser("down", help="stop your warm local fleet")
    dn.set_defaults(func=_cmd_down)

    c = sub.add_parser("cancel", help="cancel a turn (or one call) from any process or host")
    c.add_argument("turn_id", metavar="TURN_ID", help="the turn, as `toolq run` printed it (turn-...)")
    c.add_argument("--call", metavar="CALL_ID", help="cancel only this call_id; the turn goes on")
    c.set_defaults(func=_cmd_cancel)

    s = sub.add_parser("status", help="a turn's calls from the ledger: tool, call_id, task id, state, worker, duration")
    s.add_argument("turn_id", metavar="TURN_ID", help="the turn, as `toolq run` or `toolq turns` printed it")
    s.add_argument("--json", action="store_true", help="one JSON object per call")
    s.set_defaults(func=_cmd_status)

    t = sub.add_parser("turns", help="recent turns and their states")
    t.add_argument("--limit", type=int, default=20, help="how many turns, newest first (default 20)")
    t.add_argument("--json", action="store_true", help="one JSON object per turn")
    t.set_defaults(func=_cmd_turns)

    wk = sub.add_parser("workers", help="live workers from the fleet catalog: instance, pid, capacity, tools served")
    wk.add_argument("--json", action="store_true", help="one JSON object per worker instance, with every tool")
    wk.set_defaults(func=_cmd_workers)

    ev = sub.add_parser("envs", help="environments on the fleet: id, host, source, size, age, owner, state; "
                                     "`toolq envs rm ID` destroys one")
    ev.add_argument("--json", action="store_true", help="one JSON object per environment")
    ev_sub = ev.add_subparsers(dest="envs_command", metavar="rm", help="`toolq envs rm ID`: destroy one")
    ev_rm = ev_sub.add_parser("rm", help="destroy one environment (its processes, sessions and files)")
    ev_rm.add_argument("env_id", metavar="ID", help="the environment, as `toolq envs` lists it (env_...)")
    ev.set_defaults(func=_cmd_envs)

    mc = sub.add_parser("mcp-server", help="the fleet's tools as an MCP server (stdio, or streamable HTTP): each "
                                          "call runs on the fleet as a toolq turn")
    front_door_options(mc, ("stdio", "stdio|http://HOST:PORT", "stdio (default: the MCP client starts this command) "
                            "or streamable HTTP at http://HOST:PORT/mcp; off loopback it needs a bearer token"),
                       "HTTP", "TOOLQ_MCP_SERVER_TOKEN")
    mc.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    mc.set_defaults(func=_cmd_mcp_server)

    es = sub.add_parser("exec-server", help="Codex's exec-server protocol on the fleet (CODEX_EXEC_SERVER_URL): each "
                                            "command and file operation of a Codex turn is a toolq call")
    front_door_options(es, ("ws://127.0.0.1:0", "ws://HOST:PORT|stdio", "WebSocket address (default "
                            "ws://127.0.0.1:0: a free port, printed as the first line of stdout), or stdio (Codex's "
                            "environments.toml `program`); off loopback it needs a token"),
                       "WebSocket", "TOOLQ_EXEC_SERVER_TOKEN")
    es.add_argument("--root", metavar="PATH", help="the path clients name the workspace by (Codex's -C; default: "
                    "the --workspace or --upload folder; --git and --from need it)")
    es.set_defaults(func=_cmd_exec_server)

    qs = sub.add_parser("queues", help="each tool queue: calls waiting on it and the live workers that consume it")
    qs.add_argument("--json", action="store_true", help="one JSON object per queue")
    qs.set_defaults(func=_cmd_queues)

    cl = sub.add_parser("calls", help="every call not yet answered, of every running turn (what the fleet runs now)")
    cl.add_argument("--json", action="store_true", help="one JSON object per call")
    cl.set_defaults(func=_cmd_calls)

    fl = sub.add_parser("flower", help="Flower on the configured broker (basic auth from FLOWER_USER/FLOWER_PASSWORD)")
    fl.add_argument("--port", type=int, help="default 5555, or FLOWER_PORT")
    fl.add_argument("--address", help="default 127.0.0.1, or FLOWER_ADDRESS")
    fl.add_argument("--unauthenticated-api", action="store_true",
                    help="serve the API without auth when no credentials are set (loopback only)")
    fl.set_defaults(func=_cmd_flower)

    g = sub.add_parser("config", help="print the effective settings as JSON, secrets masked")
    g.add_argument("--model", help="as for `toolq run`")
    g.add_argument("--workspace", help="as for `toolq run`")
    g.add_argument("--tools", action="append", help="module with @tool declarations (repeatable)")
    g.add_argument("--queues", help="comma-separated queues, as for `toolq worker`")
    g.add_argument("--concurrency", type=int, help="as for `toolq worker`")
    g.set_defaults(func=_cmd_config)

    m = sub.add_parser("demo", help="development: the built-in demo end to end against the fake model")
    m.add_argument("--json", action="store_true", help="one JSON event per line, like `codex exec --json`")
    m.add_argument("-o", "--output-last-message", metavar="FILE", help=last_message)
    m.add_argument("--workspace", help="existing directory the demo works in (it writes hello.txt there); "
                                       "default: a fresh temporary directory")
    m.set_defaults(func=_cmd_demo)

    f = sub.add_parser("fake-model", help="development: serve a scripted Responses API over SSE on 127.0.0.1")
    f.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    f.add_argument("--script", help="JSON script file; default: the built-in demo conversation")
    f.add_argument("--loop", action="store_true",
                   help="serve the script again for the next run; without it, requests past the end get "
                        "an HTTP 400 saying the script is exhausted")
    f.set_defaults(func=_cmd_fake_model)

    d = sub.add_parser("decode", help="development: print each committed item of a recorded SSE body as JSON lines")
    d.add_argument("file", metavar="FILE", help="an SSE body as recorded from a Responses API stream")
    d.set_defaults(func=_cmd_decode)

    bn = sub.add_parser("bench", help="development: benchmarks, each against a baseline measured in the same run")
    bn.add_argument("which", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)} (default: all); "
                    "with REDIS_URL set they run on that fleet; chaos (a seeded fault campaign on its own "
                    "Redis and worker, exit 1 on any violation) and envs (environments on a host of its own: "
                    "overlay as root, then copy) and exec-server (a real codex exec turn through toolq "
                    "exec-server against codex exec-server; Codex installed with npm) run only when named")
    bn.add_argument("--turns", type=int, default=24, metavar="N", help="chaos: turns per campaign (default 24)")
    bn.add_argument("--seed", default="1", metavar="S", help="chaos: the campaign's seed, or a range 1..3 "
                    "for one campaign per seed (default 1)")
    bn.add_argument("--hosts", action="store_true", help="chaos: on the hosts harness (Redis, the orchestrator "
                    "and two workers each in a network namespace; root), with partitions and a slow link "
                    "beside the other faults")
    bn.add_argument("--sentinel", action="store_true", help="chaos: --hosts with Redis as a primary, a replica and "
                    "three sentinels; a failover (the primary SIGKILLed mid-call) stands for the Redis restart")
    bn.add_argument("--quick", action="store_true", help="envs, exec-server: small sizes, a smoke run")
    bn.add_argument("--json", action="store_true", help="envs, exec-server: the figures as one JSON object on stdout")
    bn.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from toolq.core.errors import ConfigurationError

    if argv is None:  # the command line's process: nothing is imported from where it was started
        from toolq.cli.launch import try_launch  # the standard library only

        if (launched := try_launch(sys.argv[1:])) is not None:  # a warm fleet's launcher ran it
            exit_now(launched)
        import_path.isolate()
    args = build_parser().parse_args(argv)
    if argv is None and args.command in RUNTIME_MODULES:
        import_quietly(RUNTIME_MODULES[args.command])
    try:
        code = args.func(args)
    except UsageError as e:
        print(f"toolq {args.command}: {e}", file=sys.stderr)
        return 2
    except ConfigurationError as e:
        print(f"toolq: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from toolq.orchestrator.transport.redis_faults import redis_refusal  # only now: its imports are Redis's

        refused = redis_refusal(e)
        if refused is None:
            raise
        print(f"toolq: {refused}", file=sys.stderr)
        return 2
    if argv is None and args.command in ENDS_CLEANLY:
        exit_now(code)
    return code


#: The module whose imports are most of each turn-running command's start-up.
RUNTIME_MODULES = {"run": "toolq.cli.run", "resume": "toolq.cli.run",
                   "demo": "toolq.cli.run", "batch": "toolq.cli.batch", "exec-server": "toolq.cli.exec_server"}


def import_quietly(module: str) -> None:
    """Import a turn-running command's modules with the cyclic GC off, then freeze what they made.
    An import's objects (classes, pydantic schemas) live as long as the process: collecting
    while they are made cost 60 ms of a one-request `toolq run`'s 0.4 s, and frozen, no later
    collection scans them again. httpx's own command line (click and pygments, 11 ms) is kept
    out: toolq never calls it. Only for the command line: a library caller's process is its own."""
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None: `from ._main import main` fails, httpx stubs it
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


#: Commands that have closed everything they opened (servers, workers, files) when they return.
ENDS_CLEANLY = frozenset({"run", "resume", "demo"})


def exit_now(code: int) -> None:
    """Exit without tearing the interpreter down: unloading every module took 0.1 s of CPU at the
    end of each `toolq run`, and nothing is left to close by then. Only for the command line
    (`main()` with no argv), never for a caller of `main` in its own process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`toolq run --json | head`)
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
