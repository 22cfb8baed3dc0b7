"""Environments from the command line, as a user runs them (issue 28): `toolq run --upload DIR
--apply` against a worker host that cannot see DIR, `--patch`, `--git URL@REF` against a `git
daemon` on loopback, `toolq envs` and `toolq envs rm`, and `toolq batch` lines with "from" and
"fork".

The worker runs in a mount namespace of its own where the folder holding the user's files is an
empty tmpfs (root: `unshare -m`), so it truly cannot read them: the files can reach it only
through the workspace store. Without root it runs with its own TOOLQ_ENV_ROOT and is told nothing
of the folder (its commands' sandbox would not show it anyway).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.integration.conftest as c
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import WorkerProcess, free_port

pytestmark = pytest.mark.integration

HOST = "cli-host"
ROOT_USER = os.geteuid() == 0 and shutil.which("unshare") is not None


class HiddenFromWorker(WorkerProcess):
    """A worker whose mount namespace holds an empty tmpfs over `hidden`: the user's side of the
    test lives there, out of its sight."""

    def __init__(self, *args, hidden: Path, **kw) -> None:
        super().__init__(*args, **kw)
        self.hidden = hidden

    def argv(self) -> list[str]:
        if not ROOT_USER:
            return super().argv()
        return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs toolq-hidden "$0" && exec "$@"', str(self.hidden), *super().argv()]


@pytest.fixture(scope="module")
def user_side(tmp_path_factory) -> Path:
    """Where the user's folders live: invisible to the worker."""
    return tmp_path_factory.mktemp("user-side")


@pytest.fixture(scope="module")
def host(redis_env, user_side, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("env-host")
    w = HiddenFromWorker(redis_env.url, name=f"{HOST}@test", queues=None, concurrency=2, tools=[c.TEST_TOOLS],
                         env={**c.WORKER_ENV, "TOOLQ_HOST_ID": HOST, "TOOLQ_ENV_ROOT": str(logdir / "envs")},
                         logdir=logdir, hidden=user_side)
    w.start()
    yield w
    w.stop(grace=3)


def cli_env(redis_url: str, fake: FakeModel | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]
    env = {**base, "REDIS_URL": redis_url, "TOOLQ_SIGNING_KEY": c.SIGNING_KEY, "TOOLQ_TOOLS": c.TEST_TOOLS,
           "OPENAI_API_KEY": "test"}
    if fake is not None:
        env["OPENAI_BASE_URL"] = fake.base_url
    return env


def toolq(*args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], cwd=cwd or c.ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def wait_host(redis_url: str) -> None:
    """Until the host advertises environments (its agent starts with the worker)."""
    import redis

    from toolq.core.environments import host_key

    r = redis.Redis.from_url(redis_url)
    end = time.monotonic() + 30
    while not r.exists(host_key(HOST)):
        assert time.monotonic() < end, "the worker host never advertised environments"
        time.sleep(0.2)
    r.close()


def exec_call(call_id: str, cmd: str):
    return b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 5000}, call_id)


def output_of(body: dict, call_id: str) -> str:
    (out,) = [i["output"] for i in body["input"] if i.get("type") in ("function_call_output", "custom_tool_call_output")
              and i.get("call_id") == call_id]
    return out if isinstance(out, str) else json.dumps(out)


PATCH_NOTES = ("*** Begin Patch\n*** Update File: notes.txt\n@@\n-hello from the user\n+hello from the worker host\n"
               "*** End Patch\n")


def editing_turn(marker: str) -> list:
    """Reads a file of the folder, patches one (apply_patch), creates one (exec_command)."""
    return [[exec_call("c_read", f"cat notes.txt; echo {marker}")],
            [b.custom_tool_call("apply_patch", PATCH_NOTES, "c_patch")],
            [exec_call("c_make", "echo made on the host > made.txt")],
            [b.message("edited")]]


def project(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "notes.txt").write_text("hello from the user\n")
    (folder / "keep.txt").write_text("untouched\n")
    return folder


def events_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_upload_and_apply_bring_the_hosts_changes_back_to_a_folder_the_worker_cannot_see(
        redis_env, host, user_side, tmp_path):
    folder = project(user_side, "apply-ok")
    wait_host(redis_env.url)
    with FakeModel(editing_turn("read-ok")) as fake:
        done = toolq("run", "--upload", str(folder), "--apply", "--json", "edit it", env=cli_env(redis_env.url, fake))
        requests = list(fake.requests)
    assert done.returncode == 0, done.stderr
    assert "hello from the user" in output_of(requests[1], "c_read")  # the upload's file, read on the host
    assert (folder / "notes.txt").read_text() == "hello from the worker host\n"
    assert (folder / "made.txt").read_text() == "made on the host\n"
    assert (folder / "keep.txt").read_text() == "untouched\n"
    completed = [e for e in events_of(done.stdout) if e["type"] == "turn.completed"][-1]
    assert completed["environment"].startswith("env_") and len(completed["checkpoint"]) == 64
    assert "+hello from the worker host" in completed["diff"]["patch"] and "b/made.txt" in completed["diff"]["patch"]
    assert {"turn_id", "usage", "timestamp"} <= set(completed)  # the event's own fields, unchanged
    err = done.stderr.splitlines()
    assert any(line.startswith(f"environment {completed['environment']} on host {HOST}") for line in err), err
    if ROOT_USER:  # the worker's own view of the user's side: an empty tmpfs
        assert any(user_side.iterdir())  # ours is full...
        seen = subprocess.run(["nsenter", "-t", str(host.proc.pid), "-m", "ls", "-A", str(user_side)],
                              capture_output=True, text=True)
        assert seen.returncode == 0 and seen.stdout == "", seen  # ...the worker's is empty
    assert any(line.startswith(f"applied to {folder}: 1 added, 1 changed, 0 deleted") for line in err), err
    assert not [line for line in err if line.startswith("  refused")], err


def test_no_refusal_for_the_sandboxs_git_placeholder(redis_env, host, user_side):
    folder = project(user_side, "placeholder")
    wait_host(redis_env.url)
    with FakeModel([[exec_call("c_make", "echo x > made.txt")], [b.message("made")]]) as fake:
        done = toolq("run", "--upload", str(folder), "--apply", "make it", env=cli_env(redis_env.url, fake))
    assert done.returncode == 0, done.stderr
    assert (folder / "made.txt").exists()
    assert not [line for line in done.stderr.splitlines() if line.startswith("  refused")], done.stderr


def test_a_file_changed_in_the_folder_meanwhile_is_refused_and_listed_the_rest_applied(
        redis_env, host, user_side):
    folder = project(user_side, "apply-refused")
    wait_host(redis_env.url)
    script = editing_turn("read-refused")
    # The user edits notes.txt while the turn runs: between the read and the patch.
    script[0] = [exec_call("c_read", "cat notes.txt")]
    with FakeModel(script) as fake:
        proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "--upload", str(folder), "--apply",
                                 "edit it"], cwd=c.ROOT, env=cli_env(redis_env.url, fake), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        end = time.monotonic() + 60
        while len(fake.requests) < 2:  # the model has seen the read's output: the upload is long done
            assert time.monotonic() < end and proc.poll() is None, "the turn never got past its first call"
            time.sleep(0.05)
        (folder / "notes.txt").write_text("the user's own edit\n")
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr  # the turn's own status: it completed
    assert (folder / "notes.txt").read_text() == "the user's own edit\n"  # never overwritten
    assert (folder / "made.txt").read_text() == "made on the host\n"  # the rest applied
    lines = stderr.splitlines()
    summary = [line for line in lines if line.startswith(f"applied to {folder}:")]
    assert summary and summary[0].endswith(": 1 added, 0 changed, 0 deleted; 1 refused:"), lines
    refused = [line for line in lines if line.startswith("  refused")]
    assert len(refused) == 1 and refused[0].startswith("  refused notes.txt: "), lines


def test_patch_writes_the_turns_unified_diff_and_leaves_the_folder_alone(redis_env, host, user_side, tmp_path):
    folder = project(user_side, "patch-only")
    patch = tmp_path / "turn.diff"
    wait_host(redis_env.url)
    with FakeModel(editing_turn("read-patch")) as fake:
        done = toolq("run", "--upload", str(folder), "--patch", str(patch), "edit it",
                     env=cli_env(redis_env.url, fake))
    assert done.returncode == 0, done.stderr
    text = patch.read_text()
    assert "--- a/notes.txt" in text and "+++ b/notes.txt" in text and "+hello from the worker host" in text
    assert "+++ b/made.txt" in text and "+made on the host" in text
    assert (folder / "notes.txt").read_text() == "hello from the user\n" and not (folder / "made.txt").exists()
    assert f"wrote the turn's diff to {patch}" in done.stderr
    applied = subprocess.run(["git", "apply", "--check", str(patch)], cwd=folder,
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr  # a patch git takes as it is


def test_conflicting_options_are_one_line_and_start_nothing(redis_env, user_side):
    folder = project(user_side, "refused-options")
    done = toolq("run", "--upload", str(folder), "--git", "git://127.0.0.1/x", "hi", env=cli_env(redis_env.url))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "are exclusive" in done.stderr
    done = toolq("run", "--git", "git://127.0.0.1/x", "--apply", "hi", env=cli_env(redis_env.url))
    assert done.returncode == 2 and "--apply needs --upload DIR" in done.stderr


@pytest.fixture(scope="module")
def git_daemon(tmp_path_factory):
    """A `git daemon` on loopback serving one repository with a tag `v1` (and a later commit on main)."""
    base = tmp_path_factory.mktemp("git-daemon")
    work = base / "work"
    work.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=work, check=True)
    (work / "README").write_text("version one\n")
    subprocess.run([*git, "add", "README"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=work, check=True)
    subprocess.run([*git, "tag", "v1"], cwd=work, check=True)
    (work / "README").write_text("version two\n")
    subprocess.run([*git, "commit", "-qam", "two"], cwd=work, check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(base / "repo.git")], check=True)
    port = free_port()
    daemon = subprocess.Popen(["git", "daemon", "--export-all", f"--base-path={base}", f"--port={port}",
                               "--listen=127.0.0.1", "--reuseaddr", str(base)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    end = time.monotonic() + 10
    while subprocess.run(["git", "ls-remote", f"git://127.0.0.1:{port}/repo.git"], capture_output=True).returncode:
        if daemon.poll() is not None or time.monotonic() > end:
            daemon.kill()
            pytest.skip(f"git daemon did not start: {daemon.stderr.read().decode()[:200] if daemon.stderr else ''}")
        time.sleep(0.1)
    yield f"git://127.0.0.1:{port}/repo.git"
    daemon.terminate()
    daemon.wait(5)


def test_git_url_at_ref_is_cloned_on_the_host_at_that_ref(redis_env, host, git_daemon, tmp_path):
    wait_host(redis_env.url)
    script = [[exec_call("c_read", "cat README")], [b.message("read")]]
    with FakeModel(script) as fake:
        done = toolq("run", "--git", f"{git_daemon}@v1", "--json", "read it", env=cli_env(redis_env.url, fake))
        requests = list(fake.requests)
    assert done.returncode == 0, done.stderr
    assert "version one" in output_of(requests[1], "c_read")
    assert f"from {git_daemon}@v1" in done.stderr
    completed = [e for e in events_of(done.stdout) if e["type"] == "turn.completed"][-1]
    assert completed["diff"]["patch"] == ""  # it changed nothing


def test_envs_lists_an_environment_and_rm_destroys_it(redis_env, host, user_side, tmp_path):
    """A turn that hangs holds its environment: `toolq envs` lists it, `toolq envs rm` destroys it
    (and the turn's next call fails: its environment is gone), an unknown id is exit 2."""
    folder = project(user_side, "listed")
    wait_host(redis_env.url)
    env = cli_env(redis_env.url)
    script = [[b.function_call("hang", {"seconds": 50}, "c_wait")], [b.message("slept")]]  # holds the turn
    with FakeModel(script) as fake:
        proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "--upload", str(folder), "hold it"],
                                cwd=c.ROOT, env=cli_env(redis_env.url, fake), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            env_id = None
            end = time.monotonic() + 60
            while env_id is None:
                assert time.monotonic() < end and proc.poll() is None, "the run never made its environment"
                listed = toolq("envs", "--json", env=env)
                assert listed.returncode == 0, listed.stderr
                rows = [json.loads(line) for line in listed.stdout.splitlines()]
                mine = [r for r in rows if r["source"].get("label") == str(folder) and r["state"] == "ready"]
                env_id = mine[0]["id"] if mine else None
                time.sleep(0.2)
            table = toolq("envs", env=env)
            line = next(line for line in table.stdout.splitlines() if line.startswith(env_id))
            assert HOST in line and str(folder) in line and line.split()[-1] == "ready", table.stdout
            assert table.stdout.splitlines()[0].split() == ["ID", "HOST", "SOURCE", "SIZE", "AGE", "OWNER", "STATE"]
            removed = toolq("envs", "rm", env_id, env=env)
            assert removed.returncode == 0 and removed.stdout == f"destroyed {env_id} on {HOST} ({folder})\n", removed
            after = [json.loads(line) for line in toolq("envs", "--json", env=env).stdout.splitlines()]
            assert [r["state"] for r in after if r["id"] == env_id] == ["destroyed"]
        finally:
            proc.send_signal(signal.SIGTERM)  # cancels the turn: its hanging call is revoked, not left running
            proc.communicate(timeout=60)
    unknown = toolq("envs", "rm", "env_nosuchthing", env=env)
    assert unknown.returncode == 2 and unknown.stderr == (
        "toolq envs rm: no environment env_nosuchthing (`toolq envs` lists them)\n")


def test_batch_forks_four_environments_from_one_checkpoint_each_its_own_and_each_destroyed(
        redis_env, host, user_side, tmp_path):
    """A run leaves a checkpoint; a batch line `"from": it, "fork": 4` runs four turns, each in its
    own environment made from it: each sees the checkpoint's files, writes its own file no other
    sees, and gets its own result line (`fork` 0..3, its environment, checkpoint and diff); every
    environment is destroyed when its turn ends. An "upload" line beside it gets its own
    environment and diff, and no fork."""
    folder = project(user_side, "forked")
    wait_host(redis_env.url)
    script = {"by_prompt": {
        "seed": [[exec_call("c_seed", "echo seeded > state.txt")], [b.message("seeded")]],
        "fork it": [[exec_call("c_fork", "cat state.txt; ls; cat /proc/sys/kernel/random/uuid > mine.txt")],
                    [b.message("forked")]],
        "copy it": [[exec_call("c_copy", "cp notes.txt copy.txt")], [b.message("copied")]]}}
    with FakeModel(script) as fake:
        env = cli_env(redis_env.url, fake)
        seeded = toolq("run", "--upload", str(folder), "--json", "seed", env=env)
        assert seeded.returncode == 0, seeded.stderr
        checkpoint = [e for e in events_of(seeded.stdout) if e["type"] == "turn.completed"][-1]["checkpoint"]
        lines = tmp_path / "batch.jsonl"
        lines.write_text(json.dumps({"prompt": "fork it", "from": checkpoint, "fork": 4, "id": "group-1"}) + "\n"
                         + json.dumps({"prompt": "copy it", "upload": str(folder), "id": "uploaded"}) + "\n")
        out = tmp_path / "results.jsonl"
        done = toolq("batch", str(lines), "--out", str(out), "--concurrency", "4", env=env)
        fork_requests = [body for body in fake.requests if any(
            i.get("call_id") == "c_fork" and i.get("type") == "function_call_output" for i in body["input"])]
    assert done.returncode == 0, done.stderr
    everything = [json.loads(line) for line in out.read_text().splitlines()]
    (uploaded,) = [r for r in everything if r["id"] == "uploaded"]  # an "upload" line: no fork, its own diff
    assert uploaded["status"] == "completed" and "fork" not in uploaded and uploaded["line"] == 2
    assert "+++ b/copy.txt" in uploaded["diff"]["patch"] and not (folder / "copy.txt").exists()
    results = sorted((r for r in everything if r["id"] == "group-1"), key=lambda r: r["fork"])
    assert [r["fork"] for r in results] == [0, 1, 2, 3] and all(r["status"] == "completed" for r in results)
    assert all(r["id"] == "group-1" and r["line"] == 1 for r in results)
    assert len({r["environment"] for r in results}) == 4 and len({r["key"] for r in results}) == 4
    mine = []
    for r in results:
        patch = r["diff"]["patch"]
        assert r["checkpoint"] == r["diff"]["checkpoint"] and r["checkpoint"] != checkpoint
        assert "+seeded" in patch and patch.count("+++ b/mine.txt") == 1, patch  # the checkpoint's file, and its own
        mine.append(patch.split("+++ b/mine.txt", 1)[1].split("\n+", 1)[1].split("\n", 1)[0])
    assert len(set(mine)) == 4  # four environments, four different files
    assert len(fork_requests) == 4
    for body in fork_requests:  # each saw the checkpoint's file, and no other fork's
        seen = output_of(body, "c_fork")
        assert "seeded" in seen and "notes.txt" in seen and "mine.txt" not in seen, seen
    listed = [json.loads(line) for line in toolq("envs", "--json", env=cli_env(redis_env.url)).stdout.splitlines()]
    states = {r["id"]: r["state"] for r in listed}
    assert [states.get(r["environment"]) for r in [*results, uploaded]] == ["destroyed"] * 5, states


def test_from_a_checkpoint_a_later_run_goes_on_with_the_earlier_runs_files(redis_env, host, user_side, tmp_path):
    """`--from` the checkpoint a `--json` run printed: the next run sees what the first one wrote
    (and the uploaded files), and its diff holds both turns' changes against the upload."""
    folder = project(user_side, "from-checkpoint")
    wait_host(redis_env.url)
    script = {"by_prompt": {
        "first": [[exec_call("c_one", "echo from the first run > one.txt")], [b.message("one")]],
        "second": [[exec_call("c_two", "cat one.txt notes.txt; echo two > two.txt")], [b.message("two")]]}}
    patch = tmp_path / "second.diff"
    with FakeModel(script) as fake:
        env = cli_env(redis_env.url, fake)
        first = toolq("run", "--upload", str(folder), "--json", "first", env=env)
        assert first.returncode == 0, first.stderr
        checkpoint = [e for e in events_of(first.stdout) if e["type"] == "turn.completed"][-1]["checkpoint"]
        second = toolq("run", "--from", checkpoint, "--patch", str(patch), "second", env=env)
        requests = list(fake.requests)
    assert second.returncode == 0, second.stderr
    (seen,) = [output_of(body, "c_two") for body in requests if any(i.get("call_id") == "c_two" and i.get(
        "type") == "function_call_output" for i in body["input"])]
    assert "from the first run" in seen and "hello from the user" in seen
    assert f"from checkpoint {checkpoint}" in second.stderr
    text = patch.read_text()
    assert "+++ b/one.txt" in text and "+++ b/two.txt" in text
    assert not (folder / "one.txt").exists()  # no --apply: the folder is as it was
