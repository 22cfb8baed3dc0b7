"""Redis failover through Sentinel (issue 27, item 3): a primary, a replica and three sentinels on
loopback, real prefork workers and orchestrators on `sentinel://` URLs. A turn runs through
Sentinel; then the primary is SIGKILLed while a call runs, the sentinels promote the replica, and
every call still gets exactly one output (the tool's own or toolq's honest statement), the turn
ends, and the next turn completes on the same workers: no process is restarted."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.integration.conftest import TEST_TOOLS, WORKER_ENV, run_session, settings_for
from tests.integration.test_faults import final, wait_for_pid
from toolq.core import keys
from toolq.core.honest import honest
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess, free_port, redis_server_binary, wait_for
from toolq.orchestrator.history import pairing_problems

pytestmark = pytest.mark.integration

MASTER = "toolqmaster"
SENTINEL_ENV = {**WORKER_ENV, "TOOLQ_SENTINEL_MASTER": MASTER}


class SentinelCluster:
    """A primary, a replica (`replicaof`) and three sentinels (quorum 2), with a password on the
    data nodes; everything it started is stopped on exit."""

    def __init__(self, *, synced: bool = True, sentinel_password: str | None = None) -> None:
        """`synced=False`: the replica's first sync never starts (the primary waits a minute before
        it), so a failover promotes a replica that holds nothing: every write is lost.
        `sentinel_password`: the sentinels' own `requirepass` (and what they give each other)."""
        self.synced = synced
        self.sentinel_password = sentinel_password
        self._tmp = tempfile.TemporaryDirectory(prefix="toolq-sentinel-")
        self.dir = Path(self._tmp.name)
        self.password = secrets.token_hex(16)
        # Redis 7 waits 5 s before a diskless full sync (for more replicas to join): not here.
        self.primary = RedisServer(workdir=self._dir("primary"), password=self.password,
                                   args=["--masterauth", self.password, "--repl-diskless-sync-delay",
                                         "0" if synced else "60"])
        self.replica = RedisServer(workdir=self._dir("replica"), password=self.password,
                                   args=["--masterauth", self.password, "--replicaof", "127.0.0.1",
                                         str(self.primary.port)])
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []

    def _dir(self, name: str) -> Path:
        d = self.dir / name
        d.mkdir()
        return d

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://:{self.password}@127.0.0.1:{p}" for p in self.sentinel_ports) + "/0"

    def __enter__(self) -> SentinelCluster:
        try:
            self.primary.start()
            self.replica.start()
            for port in self.sentinel_ports:
                self.sentinels.append(self._start_sentinel(port))
            # A replica still in its first sync has nothing: a failover then would lose every key.
            if self.synced:
                wait_for(self._replica_in_sync, 20, "the replica's first sync")
            wait_for(lambda: all(self._sees_replica(p) for p in self.sentinel_ports), 20, "sentinels see the replica")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_sentinel(self, port: int) -> subprocess.Popen:
        d = self._dir(f"sentinel-{port}")
        conf = d / "sentinel.conf"  # a sentinel rewrites its own config: it must be a file of its own
        conf.write_text("\n".join([
            f"port {port}", "bind 127.0.0.1", f'dir "{d}"', f'logfile "{d / "sentinel.log"}"',
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2",
            f"sentinel auth-pass {MASTER} {self.password}",
            f"sentinel down-after-milliseconds {MASTER} 1000",
            f"sentinel failover-timeout {MASTER} 3000",
            f"sentinel parallel-syncs {MASTER} 1",
            *([f"requirepass {self.sentinel_password}", f"sentinel sentinel-pass {self.sentinel_password}"]
              if self.sentinel_password else []),
        ]) + "\n")
        return subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def _ask(self, port: int, *command: str) -> object:
        client = redis.Redis(port=port, password=self.sentinel_password, socket_connect_timeout=0.5, socket_timeout=0.5,
                             decode_responses=True)
        try:
            return client.execute_command(*command)
        except redis.RedisError:
            return None
        finally:
            client.close()

    def _replica_in_sync(self) -> bool:
        client = redis.Redis(port=self.replica.port, password=self.password, decode_responses=True)
        try:
            return client.info("replication").get("master_link_status") == "up"
        finally:
            client.close()

    def _sees_replica(self, port: int) -> bool:
        replicas = self._ask(port, "SENTINEL", "REPLICAS", MASTER)
        return bool(replicas) and self._ask(port, "SENTINEL", "CKQUORUM", MASTER) is not None

    def master_port(self) -> int | None:
        for port in self.sentinel_ports:
            addr = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
            if isinstance(addr, list) and len(addr) == 2:
                return int(addr[1])
        return None

    def kill_primary_and_wait_for_the_promotion(self, timeout: float = 60) -> None:
        self.primary.kill()
        wait_for(lambda: self.master_port() == self.replica.port, timeout, "the sentinels promote the replica")

    def __exit__(self, *exc: object) -> None:
        for proc in self.sentinels:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)
        for server in (self.replica, self.primary):
            server.stop()
        self._tmp.cleanup()


@pytest.fixture
def cluster():
    with SentinelCluster() as c:
        yield c


@pytest.fixture
def empty_replica_cluster():
    with SentinelCluster(synced=False) as c:
        yield c


def toolq(cluster: SentinelCluster, *args: str) -> subprocess.CompletedProcess:
    """A `toolq` command in a process of its own, on the sentinels, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **SENTINEL_ENV, "REDIS_URL": cluster.url})


def test_a_turn_runs_on_a_sentinel_managed_primary(cluster, worker, drive):
    worker(["toolq"], concurrency=2, redis_url=cluster.url, env=SENTINEL_ENV, name="sentinel@test")
    names: set[str] = set()

    async def connections(session, runtime):
        """The orchestrator's own clients (ledger, results, cancels) reach the primary the sentinels name."""
        def named() -> bool:
            primary = redis.Redis(port=cluster.master_port() or 0, password=cluster.password, decode_responses=True)
            try:
                names.update(c["name"] for c in primary.client_list() if c.get("name"))
            finally:
                primary.close()
            return {"toolq-ledger", "toolq-results", "toolq-cancels", "toolq-presence"} <= names
        await asyncio.to_thread(wait_for, named, 30, "toolq's named connections on the primary")

    run = drive([[b.function_call("sleep_echo", {"ms": 1500, "text": "one"}, "c1"),
                  b.function_call("sleep_echo", {"ms": 50, "text": "two"}, "c2")], final()],
                redis_url=cluster.url, sentinel_master=MASTER, during=connections, timeout=90)
    assert run.outcome.status == "completed", run.outcome
    outputs = run.outputs_of(1)
    assert [json.loads(o["output"])["text"] for o in outputs] == ["one", "two"]
    primary = redis.Redis(port=cluster.master_port() or 0, password=cluster.password)
    assert primary.info("replication")["connected_slaves"] == 1
    primary.close()

    # the CLI's clients too: `toolq workers` (the fleet catalog) and `toolq status` (the ledger)
    workers = toolq(cluster, "workers", "--json")
    assert workers.returncode == 0 and "sentinel@test" in workers.stdout, workers.stderr
    status = toolq(cluster, "status", run.outcome.turn_id, "--json")
    assert status.returncode == 0 and "c1" in status.stdout, status.stderr


def assert_the_failover_turn_told_the_truth(run, show) -> None:
    """The turn with `call_h` (hang) and `call_s` (sleep_echo) through a failover: completed with
    each call's own or honest output, or failed with a one-line reason."""
    if run.outcome.status == "completed":
        outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
        with show():
            print("outputs:", outputs)
        assert set(outputs) == {"call_h", "call_s"}
        assert honest(outputs["call_h"], "woke up"), outputs["call_h"]
        assert honest(outputs["call_s"], "beside"), outputs["call_s"]
    else:
        assert run.outcome.status == "failed" and run.outcome.error and "\n" not in run.outcome.error


@pytest.mark.parametrize("hang", [4.0, 1.0], ids=["the-call-ends-after-the-promotion", "the-call-ends-with-no-primary"])
def test_a_failover_mid_turn_leaves_honest_outputs_and_the_fleet_serving(cluster, worker, drive, tmp_path, capsys,
                                                                         hang):
    """SIGKILL the primary while a call runs: Redis's replication is asynchronous, so what the old
    primary had not passed on is lost; every call still gets one output, the turn ends, and a new
    turn on the same workers (no restart) completes on the promoted replica."""
    worker(["toolq", "faults"], concurrency=2, redis_url=cluster.url, env=SENTINEL_ENV)

    async def fail_over(session, runtime):
        await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_h.pid", 30)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(cluster.kill_primary_and_wait_for_the_promotion)

    run = drive([[b.function_call("hang", {"seconds": hang}, "call_h"),
                  b.function_call("sleep_echo", {"ms": 200, "text": "beside"}, "call_s")], final()],
                redis_url=cluster.url, sentinel_master=MASTER, during=fail_over, timeout=110, turn_timeout=90)
    show = capsys.disabled  # what a failover did, for whoever runs this with -s
    with show():
        print("failover turn:", run.outcome.status, run.outcome.error)
    assert_the_failover_turn_told_the_truth(run, show)
    assert cluster.master_port() == cluster.replica.port
    # the ledger's records of the turn were replicated before the kill: the new primary has them
    done = toolq(cluster, "status", run.outcome.turn_id, "--json")
    assert done.returncode == 0, done.stderr
    status = done.stdout
    with show():
        print("status after the failover:", status)
    assert "call_h" in status and "call_s" in status

    started = time.monotonic()
    after = drive([[b.function_call("sleep_echo", {"ms": 10, "text": "after"}, "c_after")], final()],
                  redis_url=cluster.url, sentinel_master=MASTER, timeout=90)
    with show():
        print(f"next turn: {after.outcome.status} in {time.monotonic() - started:.1f}s")
    assert after.outcome.status == "completed", after.outcome
    (out,) = after.outputs_of(1)
    assert json.loads(out["output"])["text"] == "after"


def test_a_cancel_after_a_failover_reaches_the_turn_and_its_worker(cluster, worker, tmp_path):
    """The turn's cancel subscription and the worker's connections were on the old primary: after
    the promotion, `toolq cancel` (another process, through the sentinels) still stops the call."""
    worker(["faults"], concurrency=1, redis_url=cluster.url, env=SENTINEL_ENV)

    async def fail_over_then_cancel(session, runtime):
        await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_c.pid", 30)
        await asyncio.to_thread(cluster.kill_primary_and_wait_for_the_promotion)
        done = await asyncio.to_thread(toolq, cluster, "cancel", session.turn_id)
        assert done.returncode == 0, done.stderr

    events: list = []
    with FakeModel([[b.function_call("hang", {"seconds": 50}, "call_c")], final()]) as fake:
        settings = settings_for(cluster.url, fake, tmp_path, sentinel_master=MASTER, turn_timeout=100)
        (outcome,), session = asyncio.run(asyncio.wait_for(
            run_session(settings, ["go"], events, fail_over_then_cancel), 110))
    print("cancelled turn:", outcome.status, outcome.error)
    assert outcome.status == "cancelled", outcome
    history = session.history.for_prompt()
    assert pairing_problems(history) == []
    (output,) = [i["output"] for i in history if i["type"] == "function_call_output"]
    print("output:", output)
    assert honest(output, "woke up") and "woke up" not in output, output


def test_a_command_running_through_a_failover_keeps_an_honest_output(cluster, worker, drive, tmp_path):
    """exec_command's session host and its streamed output reach Redis through the sentinels too."""
    worker(["toolq"], concurrency=2, redis_url=cluster.url, env=SENTINEL_ENV)
    pidfile = tmp_path / "cmd.pid"

    async def fail_over(session, runtime):
        await asyncio.to_thread(wait_for_pid, pidfile, 30)
        await asyncio.to_thread(cluster.kill_primary_and_wait_for_the_promotion)

    cmd = f"echo $$ > {pidfile}; sleep 4; echo ran-to-the-end"
    run = drive([[b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 15_000}, "call_x")], final()],
                redis_url=cluster.url, sentinel_master=MASTER, during=fail_over, timeout=110, turn_timeout=90)
    print("command turn:", run.outcome.status, run.outcome.error)
    if run.outcome.status == "completed":
        (out,) = run.outputs_of(1)
        print("output:", out["output"].replace("\n", " | "))
        assert honest(out["output"], "ran-to-the-end"), out["output"]
    else:
        assert run.outcome.status == "failed" and run.outcome.error and "\n" not in run.outcome.error
    after = drive([[b.function_call("exec_command", {"cmd": "echo after-failover"}, "c_after")], final()],
                  redis_url=cluster.url, sentinel_master=MASTER, timeout=90)
    assert after.outcome.status == "completed", after.outcome
    assert "after-failover" in after.outputs_of(1)[0]["output"]


def test_a_failover_to_a_replica_that_holds_nothing_still_ends_every_call(empty_replica_cluster, worker, drive,
                                                                          tmp_path, capsys):
    """The far end of asynchronous replication: the promoted replica never got a write, so the
    turn's records, the queued messages and the workers' adverts are all gone at once."""
    cluster = empty_replica_cluster
    worker(["toolq", "faults"], concurrency=2, redis_url=cluster.url, env=SENTINEL_ENV)

    turn_record: list[int] = []

    async def fail_over(session, runtime):
        await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_h.pid", 30)
        assert not cluster._replica_in_sync(), "the replica was meant never to sync"
        await asyncio.to_thread(cluster.kill_primary_and_wait_for_the_promotion)
        promoted = redis.Redis(port=cluster.replica.port, password=cluster.password)
        turn_record.append(promoted.exists(keys.turn(session.turn_id)))
        promoted.close()

    run = drive([[b.function_call("hang", {"seconds": 4}, "call_h"),
                  b.function_call("sleep_echo", {"ms": 200, "text": "beside"}, "call_s")], final()],
                redis_url=cluster.url, sentinel_master=MASTER, during=fail_over, timeout=110, turn_timeout=90)
    with capsys.disabled():
        print("failover to an empty replica:", run.outcome.status, run.outcome.error,
              "; the turn's record on the new primary just after the promotion:", turn_record)
    assert_the_failover_turn_told_the_truth(run, capsys.disabled)
    after = drive([[b.function_call("sleep_echo", {"ms": 10, "text": "after"}, "c_after")], final()],
                  redis_url=cluster.url, sentinel_master=MASTER, timeout=90)
    assert after.outcome.status == "completed", after.outcome
    assert json.loads(after.outputs_of(1)[0]["output"])["text"] == "after"


def test_a_worker_on_sentinel_with_a_wrong_password_or_no_master_name_exits_at_start_in_one_line(cluster, tmp_path):
    wrong = cluster.url.replace(f":{cluster.password}@", ":wrong-pw@")
    for what, url, env in [("a wrong data-node password", wrong, SENTINEL_ENV),
                           ("no TOOLQ_SENTINEL_MASTER", cluster.url, WORKER_ENV)]:
        w = WorkerProcess(url, queues=["toolq"], concurrency=1, tools=[TEST_TOOLS], env=env, logdir=tmp_path,
                          name="login@test")
        out = subprocess.run(w.argv(), env={**os.environ, **env, "REDIS_URL": url}, capture_output=True, text=True,
                             timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (what, out.returncode, out.stderr[-2000:])
        assert "wrong-pw" not in lines[0] and cluster.password not in lines[0], (what, lines[0])
        assert ("refused the worker's login" if "password" in what else "TOOLQ_SENTINEL_MASTER") in lines[0], lines[0]


def test_sentinels_with_a_password_of_their_own(worker, drive):
    """TOOLQ_SENTINEL_PASSWORD reaches every client's sentinel connections: kombu's and Celery's
    (`sentinel_kwargs`) and toolq's own; the data nodes keep theirs, from the URL."""
    with SentinelCluster(sentinel_password="sentinel-secret-1") as cluster:
        with pytest.raises(redis.AuthenticationError):  # they do ask for it
            redis.Redis(port=cluster.sentinel_ports[0]).execute_command("SENTINEL", "MASTERS")
        env = {**SENTINEL_ENV, "TOOLQ_SENTINEL_PASSWORD": "sentinel-secret-1"}
        worker(["toolq"], concurrency=1, redis_url=cluster.url, env=env)
        run = drive([[b.function_call("sleep_echo", {"ms": 10, "text": "guarded"}, "c1")], final()],
                    redis_url=cluster.url, sentinel_master=MASTER, sentinel_password="sentinel-secret-1", timeout=90)
        assert run.outcome.status == "completed", run.outcome
        assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "guarded"
