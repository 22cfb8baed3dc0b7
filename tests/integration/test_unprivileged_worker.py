"""The unprivileged worker of `unprivileged.py` is what it claims: a real worker, running as the
user, whose commands run in its sandbox and write its workspace, on both backends."""

from __future__ import annotations

import pwd

import pytest

from tests.integration import unprivileged
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["bwrap", "landlock"])
def user_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    yield from hostile_workers(request.param, locked_redis, tmp_path_factory, user=True)


def test_an_unprivileged_worker_runs_commands_as_its_user(drive, user_worker, tmp_path):
    uid, _ = unprivileged.ids()
    assert user_worker.proc.proc is not None
    with open(f"/proc/{user_worker.proc.proc.pid}/status") as f:
        real = next(line.split()[1] for line in f if line.startswith("Uid:"))
    assert int(real) == uid  # the worker process itself, not only its commands
    ws = user_worker.workspace(tmp_path)
    out = attack(drive, user_worker, ws, {"call_id": "id -u; echo made > made.txt; cat made.txt"})
    code, body = out["call_id"]
    assert code == 0 and "made" in body, body
    assert (ws / "made.txt").stat().st_uid == uid
    assert pwd.getpwuid(uid).pw_name == unprivileged.USER
