"""Real parts for integration tests: a private Redis, real prefork workers, the fake model.

Factory fixtures in the arq style: `redis_server`, `worker(queues=...)`, `drive(script)`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.responses_schema import schema_errors
from toolq.core.catalog import Catalog
from toolq.core.settings import Settings
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess, free_port, wait_for
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.turn import Runtime, Session, TurnOutcome
from toolq.workers.loader import load_catalog

ROOT = Path(__file__).resolve().parents[2]
TEST_TOOLS = "tests.integration.testtools"
#: The test fleet's key: every worker and orchestrator of the suite signs and checks with it.
SIGNING_KEY = secrets.token_hex(32)
WORKER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
              "TOOLQ_SIGNING_KEY": SIGNING_KEY}

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def requests_follow_the_official_schema(monkeypatch):
    """Every request body toolq sends to a fake model in a test must be a valid `CreateResponse`
    (the official OpenAPI schema: tests/responses_schema.py), checked when the test ends."""
    fakes: list[FakeModel] = []
    init = FakeModel.__init__

    def recording_init(self: FakeModel, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        fakes.append(self)

    monkeypatch.setattr(FakeModel, "__init__", recording_init)
    yield
    for fake in fakes:
        for k, body in enumerate(fake.requests):
            assert schema_errors(body) == [], f"request {k + 1} is not a valid CreateResponse"


@pytest.fixture(scope="session", autouse=True)
def fleet_signing_key():
    """Every toolq process a test starts itself (`toolq run`, `toolq demo`) inherits the key."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TOOLQ_SIGNING_KEY", SIGNING_KEY)
    yield SIGNING_KEY
    patch.undo()


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def redis_env():
    """A Redis of the test module's own, for the environment tests: no other test's worker is a
    host there that placement could choose."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def r(redis_env) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_env.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def fleet(redis_server, tmp_path_factory):
    """Two worker processes x 2 pool children on the default queue, shared by most tests."""
    with worker_pair(redis_server.url, tmp_path_factory.mktemp("workers"), "fleet") as workers:
        yield workers


@contextmanager
def worker_pair(redis_url: str, logdir: Path, name: str, env: dict[str, str] | None = None
                ) -> Iterator[list[WorkerProcess]]:
    """Two worker processes x 2 pool children on the default queue (`NAME0@test`, `NAME1@test`),
    started together, stopped at the end."""
    workers = [WorkerProcess(redis_url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                             env={**WORKER_ENV, **(env or {})}, logdir=logdir, name=f"{name}{i}@test")
               for i in range(2)]
    for w in workers:
        w.start(wait=False)
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            w.stop()


@pytest.fixture
def worker(redis_server, tmp_path):
    """Factory: extra workers for one test (fault tests kill them)."""
    started: list[WorkerProcess] = []

    def make(queues: list[str], concurrency: int = 1, redis_url: str | None = None, *, tools: Sequence[str] = (),
             env: dict[str, str] | None = None, **kw: Any) -> WorkerProcess:
        w = WorkerProcess(redis_url or redis_server.url, queues=queues, concurrency=concurrency,
                          tools=[TEST_TOOLS, *tools], env={**WORKER_ENV, **(env or {})}, logdir=tmp_path, **kw)
        started.append(w.start())
        return w

    yield make
    for w in started:
        w.stop(grace=3)


JOINING_TOOLS = "tests.integration.joining_tools"


@pytest.fixture
def joining_worker(worker):
    """A third worker, beside the shared fleet, started with a tool module the fleet has not loaded
    (`toolq worker --tools tests.integration.joining_tools`)."""
    return worker(["toolq"], concurrency=2, tools=[JOINING_TOOLS], name="joiner@test")


@dataclass
class Driven:
    outcome: TurnOutcome
    fake: FakeModel
    events: list[dict[str, Any]] = field(default_factory=list)
    session: Session | None = None

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self.fake.requests

    def input_of(self, k: int) -> list[dict[str, Any]]:
        return self.fake.requests[k]["input"]

    def outputs_of(self, k: int) -> list[dict[str, Any]]:
        return [i for i in self.input_of(k) if i.get("type", "").endswith("_output")]


def catalog_of(modules: list[str]) -> Catalog:
    """The built-ins and the tools `modules` declare, and nothing else this test process imported:
    `load_catalog` returns the process-wide catalog, which grows with every test file collected."""
    wanted = ("toolq.workers.tools", *modules)
    return Catalog([s for s in load_catalog(modules)
                    if getattr(s.handler, "__module__", "").startswith(wanted)])


def settings_for(redis_url: str, fake: FakeModel, workspace: Path, **kw: Any) -> Settings:
    kw.setdefault("tools", [TEST_TOOLS])
    kw.setdefault("signing_key", SIGNING_KEY)
    return Settings(redis_url=redis_url, openai_base_url=fake.base_url, openai_api_key="test", workspace=workspace,
                    **kw)


async def run_session(settings: Settings, prompts: list[str], events: list, during=None, *, catalog=None,
                      prepare=None, **session_kw: Any) -> tuple[list[TurnOutcome], Session]:
    """`prepare(runtime)`, when given, runs before the first turn (e.g. feeding the registry)."""
    runtime = await Runtime.create(settings, catalog=catalog if catalog is not None else catalog_of(list(settings.tools)))
    session = None
    try:
        if prepare is not None:
            await prepare(runtime)
        session = Session(runtime, **session_kw)
        outcomes = []
        for prompt in prompts:
            turn = asyncio.create_task(session.run_turn(prompt, lambda e: events.append(e.to_json())))
            if during is not None:
                await during(session, runtime)
            outcomes.append(await turn)
        return outcomes, session
    finally:
        if session is not None:
            await session.close()  # the conversation ends: its exec_command sessions are killed
        await runtime.aclose()


@pytest.fixture
def drive(redis_server, tmp_path):
    """Run one turn of a scripted conversation against the fleet; every request body must pair."""

    def run(script: list, prompt: str = "go", *, redis_url: str | None = None, during=None, timeout: float = 60,
            **settings_kw: Any) -> Driven:
        with FakeModel(script) as fake:
            workspace = settings_kw.pop("workspace", tmp_path)
            settings = settings_for(redis_url or redis_server.url, fake, workspace, **settings_kw)
            events: list[dict[str, Any]] = []
            (outcome,), session = asyncio.run(
                asyncio.wait_for(run_session(settings, [prompt], events, during), timeout))
            for body in fake.requests:
                assert pairing_problems(body["input"]) == [], body["input"]
            return Driven(outcome, fake, events, session)

    return run


# ---- an S3-compatible server on loopback (moto's), for the workspace store ---------------------

BUCKET = "toolq-test"


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory) -> Iterator[str]:
    pytest.importorskip("moto.server", reason="moto is not installed: pip install 'toolq[test]'")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "moto server", log)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def aws(moto_endpoint, monkeypatch, tmp_path) -> str:
    """The standard AWS variables only: boto3 finds moto's endpoint and fake keys as it would a real
    service's (no config file of the machine's is read)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    import boto3

    s3 = boto3.client("s3")  # the bucket a test's store names
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    s3.close()
    return moto_endpoint
