"""The `toolq` command line: every subcommand parses; bad input is one clear line."""

import pytest

from toolq.orchestrator import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["decode", "x.sse"],
        ["fake-model", "--port", "0"],
        ["run", "--json", "--model", "m", "--workspace", "/tmp", "--tools", "a", "--tools", "b", "hi"],
        ["worker", "--queues", "toolq,search", "--concurrency", "2", "--name", "w@h"],
        ["demo", "--json"],
        ["cancel", "turn-1", "--call", "call_1"],
        ["bench", "pipeline", "steps"],
    ],
)
def test_subcommands_parse(argv):
    assert cli.build_parser().parse_args(argv).func is not None


def test_bench_runs_all_by_default_and_refuses_unknown_names(capsys):
    assert cli.build_parser().parse_args(["bench"]).which == []
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark nope" in capsys.readouterr().err


def test_cancel_without_redis_says_what_to_set(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no embedded run of ours announced there
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    assert cli.main(["cancel", "turn-1"]) == 2
    assert "set REDIS_URL" in capsys.readouterr().err


def test_a_session_file_round_trips_a_paired_history(tmp_path):
    from toolq.orchestrator.runner import load_session, save_session

    path = tmp_path / "s.json"
    assert load_session(path).items == []  # a new file starts a new conversation
    history = load_session(path)
    history.record({"role": "user", "content": "hi"},
                   {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"})
    save_session(path, history)  # the call has no output yet: saved paired
    again = load_session(path)
    assert [i["type"] for i in again.to_json()] == ["message", "function_call", "function_call_output"]


def test_a_file_that_is_not_a_session_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert cli.main(["run", "--session", str(bad), "--workspace", str(tmp_path), "hi"]) == 2
    assert "is not a toolq session" in capsys.readouterr().err
