"""One seeded campaign: its stack, its turns (driven in process, or by a `toolq run` killed
and resumed), its faults, and the contracts checked after each turn."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolq.core import import_path
from toolq.core.honest import INFRASTRUCTURE_TEXT, known_form
from toolq.core.settings import Settings
from toolq.dev.bench.chaos.plan import (
    CHAOS_TOOLS,
    CUT,
    DEADLINE,
    FLEET_FAULTS,
    IDLE_TIMEOUT,
    LATE_BY,
    LEASE,
    NETWORK_FAULTS,
    OUTPUT_TYPES,
    REDIS_LOST,
    TERMINAL,
    WARM_GRACE,
    WORKER_LOST,
    Planner,
    TurnPlan,
)
from toolq.dev.bench.chaos.procs import (
    alive,
    counting,
    output_text,
    processes_under,
    read_pid,
    wait_for_pid,
    wait_until,
)
from toolq.dev.bench.chaos_tools import end_file, pid_file, runs_file
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems


@dataclass
class Tally:
    """What a campaign saw; `violations` names each broken contract."""

    seed: int
    aof: bool
    hosts: bool = False
    sentinel: bool = False
    turns: int = 0
    calls: int = 0
    faults: Counter = field(default_factory=Counter)
    answered: Counter = field(default_factory=Counter)
    """Calls answered, by the state of their output (`CallState`)."""
    outcomes: Counter = field(default_factory=Counter)
    pairing: list[str] = field(default_factory=list)
    double: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    """Every other broken contract: an unanswered call, a missed run, a wrong end."""
    seconds: float = 0.0
    turn_seconds: dict[str, float] = field(default_factory=dict)
    """How long each turn took, by its description."""
    why: Counter = field(default_factory=Counter)
    """Why calls were not answered `completed` (or `cancelled`): state and reason."""
    requeued: int = 0
    """Calls a dead worker had taken but not started, put back on their queue (`stranded.py`)."""
    forms: Counter = field(default_factory=Counter)
    """Outputs by what they are: the tool's own, or which of toolq's statements (`honest.known_form`)."""
    guessed: list[str] = field(default_factory=list)
    """Outputs where an infrastructure exception's text stands in for the tool's (issue 27 item 1)."""
    kept: Path | None = None
    """Where the logs of a campaign that broke a contract were kept."""

    @property
    def violations(self) -> list[str]:
        return [*self.pairing, *self.double, *self.late, *self.leftovers, *self.guessed, *self.broken]


@dataclass
class TurnRun:
    """One turn as driven: its end, every event, the final history, how long it took."""

    status: str
    events: list[dict[str, Any]]
    history: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    seconds: float
    ended_at: float = field(default_factory=time.time)


class Campaign:
    """A seeded campaign on its own Redis and worker, in `workdir` (the workspace and the logs).

    The stack is this class's seam: `stack()` starts Redis and the workers (`self.workers`, by
    host), `role_of(pid)` names the worker a call runs on, `network_fault` and `after_turn` make
    and check what only separate hosts can (`hosts.HostsCampaign`, the same campaign with
    Redis, the orchestrator and two workers on hosts a network joins). The turns and the checks
    are written once, here."""

    def __init__(self, seed: int, workdir: Path, *, concurrency: int = 4) -> None:
        self.seed, self.workdir, self.concurrency = seed, workdir, concurrency
        self.aof = seed % 2 == 1
        self.signing_key = secrets.token_hex(32)
        self.workspace = workdir / "workspace"
        self.server: Any = None
        self.workers: dict[str, Any] = {}
        """The workers serving now, by the host they run on."""
        self.retired: list[Any] = []
        """Workers shut down warm (stopped for good when the campaign ends)."""
        self.generation = 0
        self.sentinel_master: str | None = None
        """The master's name when `self.server` is a group of sentinels (`sentinel://` URL)."""
        self.tally = Tally(seed, self.aof)

    @property
    def redis_args(self) -> list[str]:
        return ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else []

    def run(self, turns: int, fleet: tuple[str, ...] = FLEET_FAULTS) -> Tally:
        started = time.monotonic()
        with counting(logging.getLogger("toolq.stranded"), self.tally), self.stack():
            planner = Planner(self.seed, fleet)
            for turn in range(turns):
                self.turn(planner.plan(turn))
        self.tally.seconds = time.monotonic() - started
        return self.tally

    @contextmanager
    def stack(self) -> Iterator[None]:
        """Redis and one worker on this machine; what it started is gone at the end (else a violation)."""
        from toolq.local.embedded import RedisServer

        self.workspace.mkdir(parents=True, exist_ok=True)
        with RedisServer(workdir=self._dir("redis"), args=self.redis_args) as self.server:
            self.workers = {"local": self.new_worker("local", f"chaos{self.seed}-{self.server.port}@campaign")}
            self.workers["local"].start()
            try:
                yield
            finally:
                self.stop_workers()
        self.count_leftovers()

    def stop_workers(self) -> None:
        for w in (*self.workers.values(), *self.retired):
            w.stop(grace=3)

    def count_leftovers(self) -> None:
        self.tally.leftovers += [f"process {pid} still running after the campaign: {cmd}"
                                 for pid, cmd in processes_under(self.workdir)]

    def new_worker(self, role: str, name: str) -> Any:
        """A worker (not started) for host `role`."""
        from toolq.local.embedded import WorkerProcess

        return WorkerProcess(self.server.url, concurrency=self.concurrency, tools=[CHAOS_TOOLS],
                             env={"TOOLQ_SIGNING_KEY": self.signing_key}, logdir=self.workdir, name=name)

    def role_of(self, pid: int) -> str:
        """The host of the worker running process `pid` (a call's)."""
        return next(iter(self.workers))

    async def network_fault(self, plan: TurnPlan, pid: int) -> None:
        """A fault of `NETWORK_FAULTS` once the hang call runs as `pid` (hosts only)."""
        raise ValueError(f"{plan.fleet} needs separate hosts (--hosts)")

    def after_turn(self, plan: TurnPlan, what: str) -> None:
        """Checks once a turn is checked (hosts: every worker serving again after a heal)."""

    async def replace_worker(self, warm: bool, pid: int) -> None:
        """SIGKILL the whole process group of the worker running `pid` (a machine dying) and start
        it again under the same name (as systemd would), or SIGTERM its main process (a warm
        shutdown: its running calls may finish) and start a new one on its host meanwhile, so
        later calls have somewhere to run."""
        role = self.role_of(pid)
        old = self.workers[role]
        if warm:
            old.terminate()  # `WorkerProcess`: a SIGTERM to its main process alone
            self.retired.append(old)
            self.generation += 1
            base, _, host = old.name.partition("@")
            name = f"{base.split('-w')[0]}-w{self.generation}@{host}"
            self.workers[role] = self.new_worker(role, name)
        else:
            os.killpg(old.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(old.proc.wait, 5)
            old.proc = None
            self.generation += 1  # its log is evidence: the restart starts a new one
            old.log.replace(old.log.with_suffix(f".killed-{self.generation}.log"))
        self.workers[role].start(wait=False)  # from the loop's thread: the parent-death signal is tied to it
        await asyncio.to_thread(self.workers[role].wait_ready)
        if warm:
            await asyncio.to_thread(old.stop, WARM_GRACE)

    def _dir(self, name: str) -> Path:
        d = self.workdir / name
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def settings(self, fake: FakeModel) -> Settings:
        return Settings(redis_url=self.server.url, sentinel_master=self.sentinel_master,
                        openai_base_url=fake.base_url, openai_api_key="chaos",
                        workspace=self.workspace, tools=[CHAOS_TOOLS], signing_key=self.signing_key,
                        turn_timeout=DEADLINE, turn_lease=LEASE, stream_idle_timeout=IDLE_TIMEOUT)

    # --- one turn ------------------------------------------------------------------------------

    def turn(self, plan: TurnPlan) -> None:
        t = self.tally
        t.turns += 1
        t.calls += plan.calls
        t.faults.update(f for f in (f"stream:{plan.stream}", f"fleet:{plan.fleet}", f"shape:{plan.shape}")
                        if not f.endswith(":none"))
        what = f"seed {self.seed} turn {plan.turn} ({plan.shape}, {plan.stream}, {plan.fleet})"
        with FakeModel(plan.script) as fake:
            try:
                drive = self._killed_and_resumed if plan.fleet.startswith("kill_orchestrator") else self._in_process
                run = asyncio.run(asyncio.wait_for(drive(plan, fake), DEADLINE + 30))
            except TimeoutError:
                t.late.append(f"{what}: hung, no end {DEADLINE + 30:g}s after its start (deadline {DEADLINE:g}s)")
                return
            except Exception as e:  # the campaign goes on; the turn's contracts were not kept
                t.broken.append(f"{what}: the turn raised {type(e).__name__}: {e}")
                return
        self.check(plan, run, what)
        self.after_turn(plan, what)

    async def _in_process(self, plan: TurnPlan, fake: FakeModel) -> TurnRun:
        from toolq.orchestrator.turn import Runtime, Session

        started = time.monotonic()
        events: list[dict[str, Any]] = []
        runtime = await Runtime.create(self.settings(fake))
        session = Session(runtime)
        try:
            turn = asyncio.create_task(session.run_turn("go", lambda e: events.append(e.to_json())))
            await self._fault(plan, session, fake)
            outcome = await turn
        finally:
            await session.close()
            await runtime.aclose()
        return TurnRun(outcome.status, events, [i.to_wire() for i in session.history.items], fake.requests,
                       time.monotonic() - started)

    async def _fault(self, plan: TurnPlan, session: Any, fake: FakeModel) -> None:
        """Once the hang call runs: cancel the turn or the call alone, SIGKILL its pool child or
        its whole worker, shut its worker down warm, or restart Redis. A cancel before start
        comes while the response has sent no call."""
        if plan.fleet == "none":
            return
        if plan.fleet == "cancel_before_start":
            await asyncio.to_thread(wait_until, lambda: fake.requests, 20)
            session.cancel()
            return
        pid = await asyncio.to_thread(wait_for_pid, pid_file(self.workspace, plan.hang_id), 20)
        if pid is None:  # the stream fault ended the turn before the call started
            return
        if plan.fleet in ("cancel", "cancel_mid_stream"):
            session.cancel()
        elif plan.fleet == "cancel_call":  # as `toolq cancel TURN --call CALL_ID` does, from anywhere
            from toolq.cli.cancel import cancel

            await cancel(self.settings(fake), session.turn_id, plan.hang_id)
        elif plan.fleet in WORKER_LOST:
            await self.replace_worker(warm=plan.fleet == "warm_shutdown", pid=pid)
        elif plan.fleet in REDIS_LOST:
            await asyncio.to_thread(self.server.restart)
        elif plan.fleet == "kill_child":
            os.kill(pid, signal.SIGKILL)
        elif plan.fleet in NETWORK_FAULTS:
            await self.network_fault(plan, pid)

    async def _killed_and_resumed(self, plan: TurnPlan, fake: FakeModel) -> TurnRun:
        """`toolq run` in its own process, SIGKILLed once the hang call runs (mid-call, or mid-stream
        before `response.completed`); `Session.resume` finishes the turn, as `toolq resume` would."""
        from toolq.orchestrator.turn import CannotResume, Runtime, Session

        started = time.monotonic()
        # the user's own toolq settings stay out: this run is the campaign's, like the in-process turns
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TOOLQ_", "OPENAI_", "CELERY_"))},
               "REDIS_URL": self.server.url, "OPENAI_BASE_URL": fake.base_url,
               "OPENAI_API_KEY": "chaos", "TOOLQ_SIGNING_KEY": self.signing_key, "TOOLQ_TOOLS": CHAOS_TOOLS,
               **({"TOOLQ_SENTINEL_MASTER": self.sentinel_master} if self.sentinel_master else {}),
               "TOOLQ_TURN_LEASE": f"{LEASE:g}", "TOOLQ_TURN_TIMEOUT": f"{DEADLINE:g}",
               "TOOLQ_STREAM_IDLE_TIMEOUT": f"{IDLE_TIMEOUT:g}"}
        out = self.workdir / f"orchestrator-{plan.turn}.jsonl"
        # A local file and a fork: brief, and the bench's loop has nothing else to do meanwhile.
        with open(out, "w") as stdout, open(out.with_suffix(".log"), "w") as stderr:  # noqa: ASYNC230
            proc = subprocess.Popen(  # noqa: ASYNC220
                [*import_path.python_argv("-m", "toolq.cli.main"), "run", "--json",
                 "--workspace", str(self.workspace), "go"],
                env=env, stdout=stdout, stderr=stderr, cwd=import_path.NEUTRAL_CWD)
            try:
                pid = await asyncio.to_thread(wait_for_pid, pid_file(self.workspace, plan.hang_id), 20, proc)
                if pid is not None:
                    proc.send_signal(signal.SIGKILL)  # no handler runs: only Redis knows the turn now
                await asyncio.to_thread(proc.wait, DEADLINE + 30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        events = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        if pid is None or not events:  # it ended by itself (or never started): nothing to resume
            status = {"turn.completed": "completed", "turn.aborted": "cancelled"}.get(
                events[-1]["type"] if events else "", "failed")
            return TurnRun(status, events, [], fake.requests, time.monotonic() - started)
        turn_id = events[0]["turn_id"]
        # Outputs reach Redis when their step ends, and a campaign turn's calls are one step: the
        # resume answers each again (a finished one from its stored result), so the dead run's
        # answers do not count.
        events = [e for e in events if e["type"] != "item.completed"]
        runtime = await Runtime.create(self.settings(fake))
        session = Session(runtime)
        try:
            give_up = time.monotonic() + LEASE + 10
            while True:
                try:
                    outcome = await session.resume(turn_id, lambda e: events.append(e.to_json()))
                    break
                except CannotResume as e:  # the dead orchestrator's lease has not lapsed yet
                    if "another orchestrator" not in str(e) or time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.1)
        finally:
            await session.close()
            await runtime.aclose()
        return TurnRun(outcome.status, events, [i.to_wire() for i in session.history.items], fake.requests,
                       time.monotonic() - started)

    # --- the contracts -------------------------------------------------------------------------

    def check(self, plan: TurnPlan, run: TurnRun, what: str) -> None:
        t = self.tally
        t.outcomes[run.status] += 1
        t.turn_seconds[what] = run.seconds
        for k, body in enumerate(run.requests):
            t.pairing += [f"{what}: request {k + 1}: {p}" for p in pairing_problems(body["input"])]
        if run.history:
            t.pairing += [f"{what}: final history: {p}" for p in pairing_problems(run.history)]
            outputs = Counter(i.get("call_id") for i in run.history if i.get("type") == "function_call_output")
            calls = Counter(i.get("call_id") for i in run.history if i.get("type") == "function_call")
            t.broken += [f"{what}: {c} has {outputs[c]} output(s) for {n} call(s)" for c, n in calls.items()
                         if outputs[c] != n]
        terminal = [e["type"] for e in run.events if e["type"] in TERMINAL]
        if len(terminal) != 1 or run.events[-1]["type"] not in TERMINAL:
            t.broken.append(f"{what}: terminal events {terminal}, last event {run.events[-1:]}")
        cancelled = plan.fleet in ("cancel", "cancel_mid_stream", "cancel_before_start")
        if cancelled and run.status != "cancelled":
            t.broken.append(f"{what}: cancelled, but the turn ended {run.status}")
        goes_on = plan.fleet.startswith("kill_orchestrator") or plan.fleet in ("cancel_call", *WORKER_LOST)
        if goes_on and run.status != "completed":  # its stream faults are retried; the fleet recovers
            t.broken.append(f"{what}: the turn should go on to its end, but ended {run.status}")
        reconnects = [e.get("message", "") for e in run.events if e["type"] == "error"]
        if (plan.stream == "stall" and run.status == "completed" and not plan.fleet.startswith("kill_orchestrator")
                and not any("idle timeout" in m for m in reconnects)):  # a dead run's events may stop first
            t.broken.append(f"{what}: the stalled stream was not retried after the idle timeout: {reconnects}")
        if run.seconds > DEADLINE + LATE_BY:
            t.late.append(f"{what}: took {run.seconds:.1f}s (deadline {DEADLINE:g}s)")
        answers = [e["item"] for e in run.events if e["type"] == "item.completed"
                   and e.get("item", {}).get("type") == "tool_call"]
        t.answered.update(a["state"] for a in answers)
        t.why.update(f"{a['state']}: {(a.get('reason') or a.get('output') or '')[:90]}" for a in answers
                     if a["state"] not in ("completed", "cancelled"))
        told = {a["id"]: a for a in answers}
        self.check_outputs(run, answers, what)
        for call_id, asked in plan.counts.items():
            path = runs_file(self.workspace, call_id)
            ran = path.read_text().count("\n") if path.exists() else 0
            if ran > asked:
                t.double.append(f"{what}: {call_id} ran {ran} times for {asked} call(s)")
            # after a Redis restart a call may have been stopped before it ran ("may or may not have
            # run"); a worker killed or shut down with calls it had taken loses them
            elif (ran < asked and run.status == "completed" and plan.fleet not in (*REDIS_LOST, *WORKER_LOST, *CUT)
                  and call_id != (plan.hang_id if plan.fleet == "cancel_call" else None)):
                t.broken.append(f"{what}: {call_id} ran {ran} times for {asked} call(s) in a completed turn")
            if call_id in told and told[call_id]["state"] == "completed" and ran == 0:
                t.broken.append(f"{what}: {call_id} is answered completed but never ran")
        if plan.fleet == "cancel_before_start":
            t.broken += [f"{what}: {c} ran although its turn was cancelled before any call came"
                         for c in plan.counts if runs_file(self.workspace, c).exists()]
        self.check_fault_answer(plan, told.get(plan.hang_id), what)
        left = self.left_running(plan.hang_id, run.ended_at)
        if left:
            t.leftovers.append(f"{what}: {left}")

    def check_outputs(self, run: TurnRun, answers: list[dict[str, Any]], what: str) -> None:
        """Each output the model saw is the tool's own or one of toolq's statements, and never an
        infrastructure exception's text (tallied by form, so the report shows what was said)."""
        outputs = [(i.get("call_id"), output_text(i.get("output"))) for i in run.history
                   if i.get("type") in OUTPUT_TYPES]
        if not run.history:  # a run killed before it wrote its history: what its events answered
            outputs = [(a.get("id"), str(a.get("output") or a.get("reason") or "")) for a in answers]
        for call_id, text in outputs:
            form = known_form(text)
            self.tally.forms[form.value if form else "tool's own"] += 1
            if INFRASTRUCTURE_TEXT.search(text):
                self.tally.guessed.append(f"{what}: {call_id}'s output is infrastructure text: {text[:160]!r}")

    def check_fault_answer(self, plan: TurnPlan, answer: dict[str, Any] | None, what: str) -> None:
        """What the call the fault hit was told must be the truth: a cancelled call `cancelled`, a
        call on a SIGKILLed worker `lost` (it may have run), a call on a worker shut down warm
        `completed` only if it finished, else `lost`."""
        if answer is None or plan.fleet not in ("cancel_call", *WORKER_LOST):
            return
        state = answer["state"]
        finished = end_file(self.workspace, plan.hang_id).exists()
        expected = {"cancel_call": ("cancelled",), "kill_worker": ("lost",),
                    "warm_shutdown": ("completed",) if finished else ("lost",)}[plan.fleet]
        if state not in expected:
            t = self.tally
            t.broken.append(f"{what}: {plan.hang_id} answered {state} ({answer.get('reason')}), expected "
                            f"{' or '.join(expected)} (it {'finished' if finished else 'did not finish'})")

    def left_running(self, call_id: str, turn_ended: float) -> str | None:
        """Whether the hang call outlived its turn: still running, or finished after the turn ended."""
        pid = read_pid(pid_file(self.workspace, call_id))
        if pid is None:
            return None
        end = end_file(self.workspace, call_id)
        deadline = time.monotonic() + 8  # past the hang's own length: a call left running ends by then
        while alive(pid) and not end.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if end.exists():
            finished = float(end.read_text() or 0)
            late = finished - turn_ended
            return f"the hang call finished {late:.1f}s after its turn ended" if late > 1.0 else None
        return f"the hang call's process {pid} still runs" if alive(pid) else None
