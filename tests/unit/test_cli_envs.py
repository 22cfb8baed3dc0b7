"""Environments on the command line: which options go together, how a source is read, what the
turn's end and `toolq envs` print. Pure: no Redis, no worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolq.cli import main as cli
from toolq.cli.envs import (
    ChoiceError,
    apply_lines,
    choose,
    diff_fields,
    diff_summary,
    parse_git,
    render_envs,
)
from toolq.core.environments import Checkpoint, EnvironmentRecord, EnvSource, GitSource, TurnDiff
from toolq.orchestrator.turn_events import TurnCompleted
from toolq.workers.environments.archive import ApplyReport

CHECKPOINT = "ab" * 32


@pytest.mark.parametrize("given, said", [
    ({"upload": ".", "workspace": "."}, "--upload and --workspace are exclusive"),
    ({"git": "u", "checkpoint": CHECKPOINT}, "--git and --from are exclusive"),
    ({"upload": ".", "git": "u", "checkpoint": CHECKPOINT}, "--upload and --git and --from are exclusive"),
    ({"checkpoint": CHECKPOINT, "workspace": "."}, "--from and --workspace are exclusive"),
    ({"apply": True}, "--apply needs --upload DIR"),
    ({"git": "u", "apply": True}, "--apply needs --upload DIR"),
    ({"patch": "p.diff"}, "--patch needs --upload, --git or --from"),
    ({"workspace": ".", "patch": "p.diff"}, "--patch needs --upload, --git or --from"),
    ({"checkpoint": "nope"}, "--from takes a checkpoint id (64 hex digits"),
    ({"git": "-uhoh"}, "may not start with '-'"),
    ({"git": "https://h/r@-x"}, "may not start with '-'"),
    ({"git": "https://h/r@a..b"}, "is not a ref"),
])
def test_options_that_do_not_go_together_are_one_line(given, said):
    with pytest.raises(ChoiceError) as e:
        choose(**given)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_no_environment_option_keeps_the_shared_workspace():
    assert choose() is None
    assert choose(workspace="/srv/ws") is None


def test_upload_takes_an_existing_folder_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "file").write_text("x")
    choice = choose(upload="proj", apply=True, patch="out.diff")
    assert choice is not None and choice.upload == tmp_path / "proj" and choice.apply
    assert choice.patch == tmp_path / "out.diff" and choice.label == str(tmp_path / "proj")
    for bad in ("missing", "file"):
        with pytest.raises(ChoiceError, match=f"--upload {bad}: not a folder"):
            choose(upload=bad)


def test_from_takes_a_checkpoint_id_and_patch_goes_with_any_source():
    choice = choose(checkpoint=CHECKPOINT.upper(), patch="x.diff")
    assert choice is not None and choice.checkpoint == CHECKPOINT and choice.git is None and choice.upload is None
    assert choose(git="https://example.org/r.git", patch="x.diff") is not None


@pytest.mark.parametrize("spec, url, ref", [
    ("https://example.org/r.git", "https://example.org/r.git", "HEAD"),
    ("https://example.org/r.git@v1.2", "https://example.org/r.git", "v1.2"),
    ("https://example.org/r.git@feature/x", "https://example.org/r.git", "feature/x"),
    ("https://user@example.org/r.git", "https://user@example.org/r.git", "HEAD"),
    ("https://user@example.org/r.git@main", "https://user@example.org/r.git", "main"),
    ("git@github.com:org/r.git", "git@github.com:org/r.git", "HEAD"),
    ("git@github.com:org/r.git@0123abc", "git@github.com:org/r.git", "0123abc"),
    ("git://127.0.0.1:9418/r.git@main", "git://127.0.0.1:9418/r.git", "main"),
    ("/srv/git/r.git@main", "/srv/git/r.git", "main"),
    ("./r@main", "./r", "main"),
])
def test_git_url_and_ref_are_split_at_the_last_at_that_leaves_a_whole_url(spec, url, ref):
    assert parse_git(spec) == GitSource(url=url, ref=ref)


def test_a_wrong_combination_on_the_command_line_exits_2_in_one_line_before_reading_the_prompt(capsys, tmp_path):
    code = cli.main(["run", "--upload", str(tmp_path), "--workspace", str(tmp_path), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("toolq run: --upload and --workspace are exclusive: give one (--workspace keeps the "
                                 "shared folder; the others make an environment on a worker host)\n")
    assert cli.main(["run", "--apply", "hi"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_envs_command_parses_its_list_and_rm():
    p = cli.build_parser()
    listing = p.parse_args(["envs", "--json"])
    assert listing.json and listing.envs_command is None
    rm = p.parse_args(["envs", "rm", "env_0123"])
    assert rm.envs_command == "rm" and rm.env_id == "env_0123"
    run = p.parse_args(["run", "--from", CHECKPOINT, "--patch", "x.diff", "hi"])
    assert run.from_ == CHECKPOINT and run.patch == "x.diff" and not run.apply


def test_envs_without_redis_says_what_to_set(capsys, monkeypatch, tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # no local fleet of ours runs there
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    assert cli.main(["envs"]) == 2 and "set REDIS_URL" in capsys.readouterr().err
    assert cli.main(["envs", "rm", "env_x"]) == 2 and "set REDIS_URL" in capsys.readouterr().err


DIFF = TurnDiff(checkpoint=CHECKPOINT, patch="diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
                "diff --git a/n b/n\nnew file mode 100644\n--- /dev/null\n+++ b/n\n@@ -0,0 +1 @@\n+n\n",
                binary=["logo.png"], deleted=["old.txt"])


def test_the_outcome_fields_name_the_environment_checkpoint_and_diff():
    assert diff_fields(None, None) == {}
    assert diff_fields("env_1", DIFF) == {
        "environment": "env_1", "checkpoint": CHECKPOINT,
        "diff": {"checkpoint": CHECKPOINT, "patch": DIFF.patch, "binary": ["logo.png"], "deleted": ["old.txt"], "truncated": False,
                 "skipped": []}}
    assert diff_fields("env_1", None) == {"environment": "env_1", "checkpoint": None, "diff": None}
    assert diff_summary(DIFF) == f"checkpoint {CHECKPOINT}: 2 text files in the patch, 1 binary, 1 deleted"


def test_apply_says_what_was_applied_in_one_line_and_lists_each_refused_file(tmp_path):
    checkpoint = Checkpoint(base="00" * 32, added=["new.txt"], changed=["a.py", "b.py", "notes.md"], deleted=["old"])
    report = ApplyReport(applied=["new.txt", "a.py", "b.py", "old"],
                         refused=[("notes.md", "changed in the folder since the upload"), ("evil\x1b[2J", "a link")])
    lines = apply_lines(tmp_path, report, checkpoint)
    assert lines[0] == f"applied to {tmp_path}: 1 added, 2 changed, 1 deleted; 2 refused:"
    assert lines[1] == "  refused notes.md: changed in the folder since the upload"
    assert "\x1b" not in lines[2] and lines[2].startswith("  refused evil") and len(lines) == 3
    assert apply_lines(tmp_path, ApplyReport(), Checkpoint(base="e")) == [
        f"applied to {tmp_path}: 0 added, 0 changed, 0 deleted"]


def record(env_id: str, **kw) -> EnvironmentRecord:
    base = {"host": "h1", "source": EnvSource(kind="upload", blob="00" * 32, label="/home/u/proj"),
            "base": "00" * 32, "owner": "toolq:conv:c1", "state": "ready", "created_at": 1000.0, "size": 3 * 1024 ** 2}
    return EnvironmentRecord(id=env_id, **{**base, **kw})


def test_envs_lists_id_host_source_size_age_owner_state():
    records = [record("env_b", host="h2", created_at=900.0, state="destroyed",
                      source=EnvSource(kind="git", git=GitSource(url="git://x/r", ref="main"))),
               record("env_a")]
    table = render_envs(records, now=1090.0)
    lines = table.splitlines()
    assert lines[0].split() == ["ID", "HOST", "SOURCE", "SIZE", "AGE", "OWNER", "STATE"]
    assert lines[1].split() == ["env_a", "h1", "/home/u/proj", "3.0", "MiB", "90s", "toolq:conv:c1", "ready"]
    assert lines[2].split()[:3] == ["env_b", "h2", "git://x/r@main"] and lines[2].split()[-1] == "destroyed"
    rows = [json.loads(line) for line in render_envs(records, now=1090.0, as_json=True).splitlines()]
    assert [r["id"] for r in rows] == ["env_a", "env_b"] and rows[0]["age"] == 90.0 and rows[0]["size"] == 3 * 1024 ** 2
    assert "no environments" in render_envs([], now=0.0)


def test_a_shared_workspace_turns_completed_event_keeps_its_fields():
    event = TurnCompleted(turn_id="turn-1", usage={"input_tokens": 3}).to_json()
    assert sorted(event) == ["timestamp", "turn_id", "type", "usage"]


# ---- `toolq batch` lines with an environment ------------------------------------------------------

def entries_of(*lines: dict | str):
    from toolq.cli.batch import read_entries

    return read_entries([line if isinstance(line, str) else json.dumps(line) for line in lines])


def test_a_batch_line_takes_one_source_and_fork_only_with_from(tmp_path):
    (tmp_path / "f").write_text("x")
    bad = entries_of({"prompt": "p", "upload": str(tmp_path), "workspace": str(tmp_path)},
                     {"prompt": "p", "git": {"url": "git://h/r"}, "from": CHECKPOINT},
                     {"prompt": "p", "fork": 2},
                     {"prompt": "p", "from": "nope"},
                     {"prompt": "p", "from": CHECKPOINT, "fork": 0},
                     {"prompt": "p", "upload": str(tmp_path / "f")},
                     {"prompt": "p", "git": {"url": "-x"}},
                     {"prompt": "p", "environment": "mine"})
    said = [e.problem for e in bad]
    assert all(e.turn is None for e in bad) and said[0] == 'line 1: the line: "workspace" and "upload" are exclusive: give one'
    assert said[1] == 'line 2: the line: "git" and "from" are exclusive: give one'
    assert said[2] == 'line 3: the line: "fork" needs "from" (N environments forked from that checkpoint)'
    assert said[3].startswith('line 4: the line: "from" takes a checkpoint id (64 hex digits')
    assert said[4].startswith("line 5: fork: ") and said[5] == f"line 6: upload {tmp_path / 'f'}: not a folder"
    assert said[6].startswith("line 7: ") and "may not start with '-'" in said[6]
    assert "would overwrite toolq's own in the result" in said[7]


def test_a_forked_line_is_n_turns_each_with_its_own_key_and_the_sources_are_read():
    (one, *forks) = entries_of({"prompt": "p", "git": {"url": "git://h/r", "ref": "v1"}, "id": 7},
                               {"prompt": "q", "from": CHECKPOINT, "fork": 3, "id": 8})
    assert one.turn is not None and one.turn.git == GitSource(url="git://h/r", ref="v1") and one.fork is None
    assert one.extras == {"id": 7} and one.turn.environment.label == "git://h/r@v1"
    assert [e.fork for e in forks] == [0, 1, 2] and len({e.key for e in forks}) == 3
    assert all(e.number == 2 and e.key.endswith(f"#{e.fork}") and e.extras == {"id": 8} for e in forks)
    assert forks[0].turn.from_ == CHECKPOINT and forks[0].turn.environment.checkpoint == CHECKPOINT


def test_a_batch_result_carries_the_environment_only_when_it_has_one():
    from toolq.cli.batch import BatchResult

    plain = json.loads(BatchResult(key="1:a", line=1, status="completed").model_dump_json())
    assert not {"fork", "environment", "checkpoint", "diff"} & set(plain)
    forked = json.loads(BatchResult(key="1:a#2", line=1, status="completed", fork=2,
                                    **diff_fields("env_1", DIFF)).model_dump_json())
    assert forked["fork"] == 2 and forked["environment"] == "env_1" and forked["checkpoint"] == CHECKPOINT
    assert forked["diff"]["binary"] == ["logo.png"] and forked["diff"]["patch"] == DIFF.patch
    assert BatchResult.model_validate_json(json.dumps(forked)).fork == 2  # a re-run reads it back


def test_a_turn_in_an_environment_names_a_workspace_only_where_the_current_folder_could_not_be_one(tmp_path):
    from toolq.cli.envs import named_workspace

    assert named_workspace(tmp_path / "proj") == tmp_path / "proj"
    assert str(named_workspace(Path("/"), "env_1")) == "/toolq-environment/env_1"
    assert str(named_workspace(Path("/home"))) == "/toolq-environment"


def test_a_token_in_a_git_url_reaches_neither_the_model_nor_stderr():
    from toolq.cli.envs import environment_instructions

    choice = choose(git="https://user:s3cret@example.org/r.git@main")
    assert choice is not None and choice.git is not None and "s3cret" in choice.git.url  # the host clones it whole
    assert "s3cret" not in choice.label and "s3cret" not in environment_instructions(choice)
    assert choice.label == "https://***@example.org/r.git@main"


def test_envs_never_shows_a_token_of_a_git_url():
    secret = record("env_s", source=EnvSource(kind="git", git=GitSource(url="https://u:s3cret@h.org/r.git")))
    assert "s3cret" not in render_envs([secret], now=1090.0) and "s3cret" not in render_envs([secret], 1090.0, True)
    assert json.loads(render_envs([secret], 1090.0, True))["source"]["git"]["url"] == "https://***@h.org/r.git"


def test_the_end_of_a_run_names_binary_files_and_what_no_checkpoint_carries(capsys, tmp_path):
    """`--patch` named binaries only by their count, and what stayed on the host was never said
    (newcomer's findings)."""
    import asyncio
    from types import SimpleNamespace

    from toolq.cli.envs import EnvChoice, Placed
    from toolq.cli.view import JsonView

    written: list[str] = []
    patch = SimpleNamespace(path=tmp_path / "x.diff", write=written.append)
    diff = TurnDiff(checkpoint=CHECKPOINT, patch="", binary=["img/logo.png"],
                    skipped=["pw (the symlink leads outside the environment: not carried)"])
    placed = Placed(EnvChoice(checkpoint=CHECKPOINT, patch=patch.path), environments=None,
                    handle=SimpleNamespace(record=SimpleNamespace(id="env_1")))
    outcome = SimpleNamespace(diff=diff, environment="env_1")
    asyncio.run(placed.deliver(outcome, JsonView.__new__(JsonView), patch))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "binary, not in it: img/logo.png" in err
    assert "  not carried: pw (the symlink leads outside" in err
