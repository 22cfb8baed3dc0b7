"""`toolq bench chaos --turns N --seed S`: the seeded fault campaign of issue 13, also run (short)
by tests/integration/test_campaign.py.

Each campaign owns its stack (a private Redis, AOF on for odd seeds and off for even ones, a real
prefork worker loading `chaos_tools`) and the fake model. Every turn draws a shape (a few calls, a
32-call step, a 10 MB output, duplicate call_ids), a stream fault (HTTP 500/429, a cut stream, a
malformed frame, a stall longer than the client's idle timeout) and a fleet fault (a cancel of the
turn mid-call, mid-stream before `response.completed` or before any call came, a cancel of one
call as `toolq cancel TURN --call` does, a SIGKILLed pool child or whole worker mid-call, a warm
shutdown mid-call (each followed by a new worker), a Redis restart, or a SIGKILLed orchestrator,
mid-call or mid-stream, followed by `toolq resume`). Nothing raises on a broken contract: each is
counted as a violation and named, so the bench prints the whole table and the test asserts it is
empty.

Checked on every turn: every model request's input is paired, the final history answers every
call exactly once, no call ran more often than it was asked for (the tools' own evidence), a
completed turn ran every call, one terminal event, a cancel ends `cancelled`, the turn ended within
its deadline, the calls' processes are gone, every output is the tool's own or one of toolq's
statements and never an infrastructure exception's text (`toolq/core/honest.py`; the report counts
outputs by form); after the campaign, nothing it started is running.
The call a fault hit is told the truth: a cancelled call `cancelled`, a call on a SIGKILLed worker
`lost` (it may have run), a call on a worker shut down warm `completed` only if it finished; no
call is answered `completed` without having run; a stalled stream is retried after the idle timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from toolq.core import import_path
from toolq.core.honest import INFRASTRUCTURE_TEXT, known_form
from toolq.core.settings import Settings
from toolq.dev.bench.chaos_tools import end_file, pid_file, runs_file
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems

CHAOS_TOOLS = "toolq.dev.bench.chaos_tools"
#: A turn's deadline (TOOLQ_TURN_TIMEOUT); a turn that takes 10 s more has hung.
DEADLINE = 30.0
LATE_BY = 10.0
#: The killed orchestrator's lease: `toolq resume` may take over this long after the kill.
LEASE = 1.0

#: The client's stream idle timeout (TOOLQ_STREAM_IDLE_TIMEOUT); a stalled stream stalls longer.
IDLE_TIMEOUT = 3.0
STALL = IDLE_TIMEOUT + 2
#: How long a warm shutdown may take before the worker is SIGKILLed (the hang call sleeps 6 s).
WARM_GRACE = 15.0

STREAM_FAULTS = ("none", "500", "429", "cut", "malformed", "stall")
FLEET_FAULTS = ("none", "cancel", "cancel_call", "cancel_before_start", "cancel_mid_stream", "kill_child",
                "kill_worker", "warm_shutdown", "redis_restart", "kill_orchestrator", "kill_orchestrator_mid_stream")
#: Fleet faults whose response is held (a gate, a stall before any call): a stream fault at the
#: response's end would never be reached.
HELD = ("kill_orchestrator_mid_stream", "cancel_mid_stream", "cancel_before_start")
#: Fleet faults that cost a worker mid-call: its calls may be answered `lost`, not run.
WORKER_LOST = ("kill_worker", "warm_shutdown")
SHAPES = ("calls", "calls", "wide", "flood")
WIDE = 32
TERMINAL = ("turn.completed", "turn.aborted", "turn.failed")
#: The history items that answer a call.
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")


@dataclass
class TurnPlan:
    turn: int
    script: list
    counts: dict[str, int]
    """How many calls carry each call_id (a duplicate call_id runs, and is answered, twice)."""
    shape: str
    stream: str
    fleet: str

    @property
    def hang_id(self) -> str:
        return f"call_{self.turn}_hang"

    @property
    def calls(self) -> int:
        return sum(self.counts.values())


class Deck:
    """Draws from `choices` so each comes up once per round, in a seeded order: a short campaign
    still meets every fault."""

    def __init__(self, rng: random.Random, choices: tuple[str, ...]) -> None:
        self.rng, self.choices = rng, choices
        self.left: list[str] = []

    def draw(self) -> str:
        if not self.left:
            self.left = list(self.choices)
            self.rng.shuffle(self.left)
        return self.left.pop()


class Planner:
    def __init__(self, seed: int, fleet: tuple[str, ...] = FLEET_FAULTS) -> None:
        self.rng = random.Random(seed)
        self.shapes, self.fleet = Deck(self.rng, SHAPES), Deck(self.rng, fleet)

    def plan(self, turn: int) -> TurnPlan:
        rng = self.rng
        shape, fleet = self.shapes.draw(), self.fleet.draw()
        # mid-stream, the response stops before its end: a cut or malformed end would never be sent
        stream = rng.choice(STREAM_FAULTS[:3] if fleet in HELD else STREAM_FAULTS)
        n = WIDE if shape == "wide" else rng.randint(1, 8)
        ids = [f"call_{turn}_{i}" for i in range(n)]
        if n > 1 and rng.random() < 0.3:
            ids[-1] = ids[0]  # a duplicate call_id: both calls run, both are answered
        calls = [b.function_call("chaos_count", {}, i) for i in ids]
        if shape == "flood":
            ids.append(f"call_{turn}_flood")
            calls.insert(rng.randint(0, len(calls)), b.function_call("chaos_flood", {"mib": 10}, ids[-1]))
        if fleet != "none":  # something running long enough to cancel or kill (or to outlive its orchestrator)
            ids.append(f"call_{turn}_hang")
            seconds = 3 if fleet.startswith("kill_orchestrator") else 6
            calls.append(b.function_call("chaos_hang", {"seconds": seconds}, ids[-1]))
        script: list = []
        if stream == "500":
            script.append([b.http_error(500)])
        elif stream == "429":
            script.append([b.http_error(429, headers={"retry-after-ms": "50"})])
        if fleet in ("kill_orchestrator_mid_stream", "cancel_mid_stream"):
            script.append(b.response(*calls, b.gate()))  # the calls are committed; response.completed never comes
        elif fleet == "cancel_before_start":  # cancelled while the response has sent no call yet
            script.append(b.response(b.stall(IDLE_TIMEOUT / 2), *calls))
        elif stream == "stall":  # the client's idle timeout turns the silence into a retried request
            script.append(b.response(*calls, b.stall(STALL)))
        elif stream == "cut":
            script.append(b.response(*calls, b.cut_after(clean=False)))
        elif stream == "malformed":
            script.append(b.response(*calls, b.malformed_frame()))
        else:
            script.append(calls)
        script.append([b.message(f"turn {turn} done")])
        return TurnPlan(turn, script, dict(Counter(ids)), shape, stream, fleet)


@dataclass
class Tally:
    """What a campaign saw; `violations` names each broken contract."""

    seed: int
    aof: bool
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
    """A seeded campaign on its own Redis and worker, in `workdir` (the workspace and the logs)."""

    def __init__(self, seed: int, workdir: Path, *, concurrency: int = 4) -> None:
        self.seed, self.workdir, self.concurrency = seed, workdir, concurrency
        self.aof = seed % 2 == 1
        self.signing_key = secrets.token_hex(32)
        self.workspace = workdir / "workspace"
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.server: Any = None
        self.worker: Any = None
        self.retired: list[Any] = []
        """Workers shut down warm (stopped for good when the campaign ends)."""
        self.generation = 0
        self.tally = Tally(seed, self.aof)

    def run(self, turns: int, fleet: tuple[str, ...] = FLEET_FAULTS) -> Tally:
        from toolq.local.embedded import RedisServer

        started = time.monotonic()
        args = ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else []
        with counting(logging.getLogger("toolq.stranded"), self.tally), \
                RedisServer(workdir=self._dir("redis"), args=args) as self.server:
            self.worker = self.new_worker(f"chaos{self.seed}-{self.server.port}@campaign").start()
            try:
                planner = Planner(self.seed, fleet)
                for turn in range(turns):
                    self.turn(planner.plan(turn))
            finally:
                for w in (self.worker, *self.retired):
                    w.stop(grace=3)
        self.tally.leftovers += [f"process {pid} still running after the campaign: {cmd}"
                                 for pid, cmd in processes_under(self.workdir)]
        self.tally.seconds = time.monotonic() - started
        return self.tally

    def new_worker(self, name: str) -> Any:
        from toolq.local.embedded import WorkerProcess

        return WorkerProcess(self.server.url, concurrency=self.concurrency, tools=[CHAOS_TOOLS],
                             env={"TOOLQ_SIGNING_KEY": self.signing_key}, logdir=self.workdir, name=name)

    async def replace_worker(self, warm: bool) -> None:
        """SIGKILL the worker's whole process group (a machine dying) and start it again under the
        same name (as systemd would), or SIGTERM its main process (a warm shutdown: its running
        calls may finish) and start a new one meanwhile, so later calls have somewhere to run."""
        old = self.worker
        if warm:
            old.terminate()  # `WorkerProcess`: a SIGTERM to its main process alone
            self.retired.append(old)
            self.generation += 1
            base, _, host = old.name.partition("@")
            name = f"{base.split('-w')[0]}-w{self.generation}@{host}"
            self.worker = self.new_worker(name)
        else:
            os.killpg(old.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(old.proc.wait, 5)
            old.proc = None
            self.generation += 1  # its log is evidence: the restart starts a new one
            old.log.replace(old.log.with_suffix(f".killed-{self.generation}.log"))
        self.worker.start(wait=False)  # from the loop's thread: the parent-death signal is tied to it
        await asyncio.to_thread(self.worker.wait_ready)
        if warm:
            await asyncio.to_thread(old.stop, WARM_GRACE)

    def _dir(self, name: str) -> Path:
        d = self.workdir / name
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def settings(self, fake: FakeModel) -> Settings:
        return Settings(redis_url=self.server.url, openai_base_url=fake.base_url, openai_api_key="chaos",
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
            await self.replace_worker(warm=plan.fleet == "warm_shutdown")
        elif plan.fleet == "redis_restart":
            await asyncio.to_thread(self.server.restart)
        elif plan.fleet == "kill_child":
            os.kill(pid, signal.SIGKILL)

    async def _killed_and_resumed(self, plan: TurnPlan, fake: FakeModel) -> TurnRun:
        """`toolq run` in its own process, SIGKILLed once the hang call runs (mid-call, or mid-stream
        before `response.completed`); `Session.resume` finishes the turn, as `toolq resume` would."""
        from toolq.orchestrator.turn import CannotResume, Runtime, Session

        started = time.monotonic()
        # the user's own toolq settings stay out: this run is the campaign's, like the in-process turns
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TOOLQ_", "OPENAI_", "CELERY_"))},
               "REDIS_URL": self.server.url, "OPENAI_BASE_URL": fake.base_url,
               "OPENAI_API_KEY": "chaos", "TOOLQ_SIGNING_KEY": self.signing_key, "TOOLQ_TOOLS": CHAOS_TOOLS,
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
            elif (ran < asked and run.status == "completed" and plan.fleet not in ("redis_restart", *WORKER_LOST)
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


# --- processes -----------------------------------------------------------------------------------


class _Count(logging.Handler):
    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        self.tally.requeued += 1


@contextmanager
def counting(logger: logging.Logger, tally: Tally) -> Iterator[None]:
    """Count the stranded calls requeued (one warning each), whatever the bench's log level."""
    handler, level = _Count(tally), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)



def output_text(output: Any) -> str:
    """A history output's text: a string, or its content parts' texts."""
    if isinstance(output, list):
        return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
    return "" if output is None else str(output)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


def wait_until(ready: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not ready() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(ready())


def wait_for_pid(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> int | None:
    """The pid the hang call wrote, once it runs; None if it did not within `timeout` (or `proc`,
    the orchestrator, ended first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and (proc is None or proc.poll() is None):
        pid = read_pid(path)
        if pid is not None:
            return pid
        time.sleep(0.02)
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[-1][:1] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


def processes_under(path: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names `path` (the campaign's workers, orchestrators, Redis)."""
    found = []
    marker = str(path)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and not wait_gone(int(entry.name), 5):
            found.append((int(entry.name), cmd.strip()[:200]))
    return found


# --- the bench -----------------------------------------------------------------------------------


def campaign(seed: int, turns: int, workdir: Path | None = None, fleet: tuple[str, ...] = FLEET_FAULTS) -> Tally:
    """Run one seeded campaign of `turns` turns in `workdir`, else in a temporary directory that
    is removed unless a contract broke (then `Tally.kept` names it: workers' and orchestrators' logs)."""
    if workdir is not None:
        return Campaign(seed, workdir).run(turns, fleet)
    tmp = Path(tempfile.mkdtemp(prefix=f"toolq-chaos-{seed}-"))
    tally = Campaign(seed, tmp).run(turns, fleet)
    if tally.violations:
        tally.kept = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return tally


def report(t: Tally) -> list[str]:
    def counts(c: Counter) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"

    rows = [("faults injected", counts(t.faults)), ("turns ended", counts(t.outcomes)),
            ("calls answered", counts(t.answered)), ("pairing violations", len(t.pairing)),
            ("double executions", len(t.double)), ("past their deadline", f"{len(t.late)}   (slowest: {slowest(t)})"),
            ("leftover processes", len(t.leftovers)), ("infrastructure output", len(t.guessed)),
            ("outputs by form", counts(t.forms)), ("other broken contracts", len(t.broken)),
            ("requeued, dead worker", t.requeued)]
    lines = [f"chaos seed {t.seed} (Redis {'with AOF' if t.aof else 'without persistence'}): {t.turns} turns, "
             f"{t.calls} calls in {t.seconds:.0f} s", *(f"  {label:<22} : {value}" for label, value in rows)]
    if t.why:  # what the calls that did not complete were told (the commonest)
        lines += ["  calls not completed, as told:", *(f"    {n:>4} x {why}" for why, n in t.why.most_common(6))]
    lines += [f"  VIOLATION {v}" for v in t.violations]
    return lines + ([f"  logs kept in {t.kept}"] if t.kept else [])


def slowest(t: Tally) -> str:
    if not t.turn_seconds:
        return "none"
    what, took = max(t.turn_seconds.items(), key=lambda kv: kv[1])
    return f"{took:.1f}s, {what.split(' ', 2)[-1]}"


def parse_seeds(text: str) -> list[int]:
    """`3` or a range `1..3`."""
    lo, sep, hi = text.partition("..")
    return list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]


def run(out: IO[str] = sys.stdout, turns: int = 24, seeds: Sequence[int] = (1,)) -> dict[str, Any]:
    # Faults make toolq warn by design (lost results, reconnects); the table says what matters.
    logging.getLogger("toolq").setLevel(logging.ERROR)
    tallies = []
    for seed in seeds:
        tallies.append(campaign(seed, turns))
        print("\n".join(report(tallies[-1])), file=out, flush=True)
    violations = sum(len(t.violations) for t in tallies)
    print(f"chaos: {len(tallies)} campaign(s), {violations} violation(s)", file=out, flush=True)
    return {"turns": sum(t.turns for t in tallies), "calls": sum(t.calls for t in tallies),
            "violations": violations}


if __name__ == "__main__":
    run()
