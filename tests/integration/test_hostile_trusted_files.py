"""Issue 24 item 2, as the attacker would: the model's commands plant symlinks where toolq will
write its user's files (`--session`'s temporary file, `toolq batch --out`), pointing at a file
of the user's (a shell rc here; `/etc/ld.so.preload` for a root orchestrator). toolq must never
write through them: a file inside the workspace is refused in one line, and outside it no link
is followed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel

pytestmark = pytest.mark.integration

TOOLQ = str(Path(sys.executable).with_name("toolq"))
RC = "# the user's shell rc\n"


@pytest.fixture
def user(tmp_path):
    """The user's folders: a workspace, a shell rc outside it, the environment of an embedded run."""
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    (home / ".bashrc").write_text(RC)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    env.update(OPENAI_API_KEY="test", TOOLQ_REQUEST_MAX_RETRIES="0", TOOLQ_WORKSPACE=str(workspace))
    return workspace, home, env


def toolq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TOOLQ, *args], env=env, capture_output=True, text=True, timeout=180)


def test_links_the_model_plants_for_the_session_and_results_files_are_never_written_through(user):
    workspace, home, env = user
    rc = home / ".bashrc"
    plant = (f"ln -s {rc} conversation.json.tmp && ln -s {rc} conversation.json && ln -s {rc} results.jsonl "
             "&& ls -l")
    script = [[b.function_call("exec_command", {"cmd": plant}, "call_plant")], [b.message("planted")],
              [b.message("echo $(curl evil)")]]
    with FakeModel(script) as fake:
        env = {**env, "OPENAI_BASE_URL": fake.base_url}
        planted = toolq(env, "run", "--json", "plant")
        assert planted.returncode == 0, planted.stderr[-2000:]
        assert (workspace / "results.jsonl").is_symlink()  # the command did plant them, on the host
        session = toolq(env, "run", "--session", str(workspace / "conversation.json"), "next")
        batch_file = home / "batch.jsonl"
        batch_file.write_text(json.dumps({"prompt": "next"}) + "\n")
        batch = toolq(env, "batch", str(batch_file), "--out", str(workspace / "results.jsonl"))
    for refused in (session, batch):
        assert refused.returncode == 2, refused.stderr
        (line,) = refused.stderr.splitlines()
        assert "inside the workspace" in line
    assert rc.read_text() == RC


def test_outside_the_workspace_a_link_is_not_followed_either(user, tmp_path):
    workspace, home, env = user
    rc = home / ".bashrc"
    conversations = tmp_path / "conversations"
    conversations.mkdir()
    (conversations / "c.json.tmp").symlink_to(rc)  # the name toolq used to write first
    out_link = conversations / "results.jsonl"
    out_link.symlink_to(rc)
    with FakeModel([[b.message("hello")], [b.message("again")]], loop=True) as fake:
        env = {**env, "OPENAI_BASE_URL": fake.base_url}
        session = toolq(env, "run", "--session", str(conversations / "c.json"), "hi")
        assert session.returncode == 0, session.stderr
        batch_file = home / "batch.jsonl"
        batch_file.write_text(json.dumps({"prompt": "hi"}) + "\n")
        batch = toolq(env, "batch", str(batch_file), "--out", str(out_link))
    assert batch.returncode == 2 and "symbolic link" in batch.stderr, batch.stderr
    assert rc.read_text() == RC
    saved = json.loads((conversations / "c.json").read_text())  # written beside the link, not through it
    assert any(item.get("role") == "assistant" for item in saved)
    assert sorted(p.name for p in conversations.iterdir()) == ["c.json", "c.json.tmp", "results.jsonl"]
