"""The environments agent (toolq/workers/environments/agent.py) with a real redis-server: a signed
request is run and answered with a sealed reply and the record's new state; a failing one is
answered ok=False in one line; a forged or late one is not run and gets no reply."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from toolq.core.environments import (
    EMPTY_BASE,
    EnvironmentRecord,
    EnvRequest,
    EnvSource,
    env_key,
    host_envs_key,
    new_environment_id,
    reply_key,
)
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.workers.environments import agent, archive
from toolq.workers.environments.host import EnvHost
from toolq.workers.store.redis_store import RedisStore

SIGNER = Signer(secrets.token_hex(32))


@pytest.fixture
def served(tmp_path: Path, r: redis.Redis) -> Iterator[agent.Agent]:
    store = RedisStore(r, ttl=600, max_bytes=1 << 20)
    envs = EnvHost(tmp_path / "root", "h1", store, 64 << 20, archive.Limits(1 << 20, 100), r=r, mode="copy")
    yield agent.Agent(envs, r, SIGNER)
    for env_id in envs.env_ids():
        envs.destroy(env_id)


def message(op: str, env: EnvironmentRecord, *, signer: Signer = SIGNER, deadline: float | None = None) -> tuple[
        str, str]:
    request = EnvRequest(op=op, env=env, deadline=deadline or time.time() + 30)  # type: ignore[arg-type]
    body = request.model_dump(mode="json")
    return request.id, json.dumps({"request": body, "sig": signer.sign_env_request(body)})


def reply_to(r: redis.Redis, request_id: str) -> dict | None:
    raw = r.lpop(reply_key(request_id))
    if raw is None:
        return None
    sealed = json.loads(raw)
    assert SIGNER.env_reply_genuine(request_id, sealed) and r.ttl(reply_key(request_id)) in (-2, *range(1, 61))
    return sealed["reply"]


def record(r: redis.Redis, base: str = EMPTY_BASE, host: str = "h1") -> EnvironmentRecord:
    env = EnvironmentRecord(id=new_environment_id(), host=host, source=EnvSource(kind="empty"), base=base,
                            owner="owner:a")
    r.set("owner:a", "1")
    r.set(env_key(env.id), env.model_dump_json())
    return env


def test_a_signed_create_checkpoint_and_destroy_are_run_recorded_and_answered(served: agent.Agent,
                                                                              r: redis.Redis) -> None:
    env = record(r)
    request_id, raw = message("create", env)
    served.handle(raw)
    reply = reply_to(r, request_id)
    assert reply is not None and reply["ok"] and reply["mode"] == "copy"
    stored = json.loads(r.get(env_key(env.id)) or b"{}")
    assert stored["state"] == "ready" and stored["mode"] == "copy" and r.sismember(host_envs_key("h1"), env.id)

    (served.envs.path(env.id) / "made.txt").write_text("x\n")
    request_id, raw = message("checkpoint", env)
    served.handle(raw)
    reply = reply_to(r, request_id)
    assert reply is not None and reply["ok"] and reply["diff"]["checkpoint"] == reply["checkpoint"]
    assert json.loads(r.get(env_key(env.id)) or b"{}")["checkpoint"] == reply["checkpoint"]

    request_id, raw = message("destroy", env)
    served.handle(raw)
    assert (reply_to(r, request_id) or {})["ok"]
    assert json.loads(r.get(env_key(env.id)) or b"{}")["state"] == "destroyed" and not served.envs.env_ids()


def test_a_failing_request_is_answered_not_ok_in_one_line(served: agent.Agent, r: redis.Redis) -> None:
    missing = record(r, base="0" * 64)  # a base the store does not hold
    request_id, raw = message("create", missing)
    served.handle(raw)
    reply = reply_to(r, request_id)
    assert reply is not None and not reply["ok"] and "\n" not in reply["error"] and reply["error"]
    assert "Traceback" not in reply["error"]
    assert json.loads(r.get(env_key(missing.id)) or b"{}")["state"] == "failed"
    elsewhere = record(r, host="h2")
    request_id, raw = message("create", elsewhere)
    served.handle(raw)
    assert "placed on host h2, not h1" in (reply_to(r, request_id) or {})["error"]


def test_a_forged_or_late_request_is_not_run_and_gets_no_reply(served: agent.Agent, r: redis.Redis) -> None:
    for signer, deadline in ((Signer(secrets.token_hex(32)), None), (SIGNER, time.time() - 1)):
        env = record(r)
        request_id, raw = message("create", env, signer=signer, deadline=deadline)
        assert served.handle(raw) is None
        assert reply_to(r, request_id) is None and not served.envs.env_ids()


def test_a_worker_whose_root_cannot_be_made_serves_no_environments(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("")
    settings = Settings(redis_url="redis://127.0.0.1:1/0", env_root=tmp_path / "file" / "envs", host_id="my host!")
    assert agent.setup(settings) is None and agent.current() is None
    assert "serves no environments" in caplog.text
    assert agent.host_id(settings) == "my-host-"


def test_a_host_consumes_each_of_its_tools_queues_on_the_host_too() -> None:
    from toolq.core.advert import tool_queue
    from toolq.core.environments import host_queue
    from toolq.workers import presence
    from toolq.workers.loader import load_catalog

    class Queues:
        def __init__(self, names: list[str]) -> None:
            self.consume_from = dict.fromkeys(names)

        def select_add(self, name: str) -> None:
            self.consume_from[name] = None

    catalog = load_catalog([])
    queues = Queues(["toolq"])
    presence.add_tool_queues(queues, catalog)
    added = presence.add_host_queues(queues, catalog, "h1")
    exec_command = next(s for s in catalog if s.name == "exec_command")
    assert host_queue("h1", tool_queue(exec_command)) in added
    assert added and all(q.startswith("toolq.h.h1.") for q in added)
    # Neither the tool queues nor the host queues count as queues the worker was told to consume.
    assert presence.configured_queues(queues.consume_from) == ["toolq"]
